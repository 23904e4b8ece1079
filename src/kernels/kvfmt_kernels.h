/*
 * SIMD kernels of kvc_kvfmt_attention (src/kvfmt/attend.c plans the work;
 * docs/KV_FORMATS.md sections 3, 5, 6). One job: up to KVC_KVFMT_NV query
 * vectors (query heads of one KV head, of one or more rows of one
 * sequence) against one chunk of that sequence's keys: a run of complete
 * quantized groups and, in the last chunk, the float16 tail. The kernel
 * leaves an online-softmax state in base 2 (scores times sm_scale * log2 e):
 * m (running max), l (sum of 2^(s - m)), o (sum of weights times V, in the
 * stored (rotated) basis, not normalized); attend_simd.c merges a unit's
 * chunks in a fixed order, so results depend neither on the thread count
 * nor on the other rows of the call.
 *
 * kvfmt_body.h is the body; kvfmt_avx2.c and kvfmt_avx512.c supply the
 * vector primitives. The scalar ISA keeps attend.c's generic C.
 */
#ifndef KVC_KERNELS_KVFMT_H
#define KVC_KERNELS_KVFMT_H

#include <stddef.h>
#include <stdint.h>

#include "kvcache/attention.h" /* KVC_ATTN_MAX_HEAD_DIM */

#define KVC_KVFMT_NV 16       /* query vectors per job */
#define KVC_KVFMT_BT_MAX 512  /* tokens per softmax block (G <= 512) */

typedef struct kvc_kvfmt_job {
    int bits, Dh, P, G, gv, nvg, H, h;
    const unsigned char *base; /* the pages tensor's data */
    int64_t page_stride;       /* bytes between pages */
    const int32_t *pages;      /* the sequence's page ids */
    /* page layout (kvfmt_internal.h): byte offsets of the fields */
    size_t k_codes, v_codes, v_scale, v_zero, k_scale, k_zero;
    int64_t k_share;
    /* float16 rows (kvc__kvfmt_win): position t's K at wk + slot * wrs, V at
     * wv + slot * wrs, slot = wmod ? t % wmod : t - w0 */
    const uint16_t *wk, *wv;
    int64_t wrs, w0, wmod;
    /* sink rows: position i < sink's K at sk + i * srs, V at sv + i * srs;
     * read in float16 (and masked in group 0) when fstart > 0 */
    const uint16_t *sk, *sv;
    int64_t srs;
    int sink;
    int64_t fstart; /* every vector reads positions [fstart, pos] in float16 */
    int64_t t0, t1; /* quantized tokens [t0, t1) of this chunk, group aligned, t1 <= fstart */
    int do_tail;    /* this chunk also reads the float16 rows */
    int nv;
    const float *q[KVC_KVFMT_NV]; /* Dh float32 each */
    int64_t pos[KVC_KVFMT_NV];    /* vector i sees positions <= pos[i] */
    float sc;                     /* sm_scale * log2 e */
    float *m, *l, *o;             /* out: (nv), (nv), (nv, Dh) */
    /* the job this thread likely runs next, or NULL: its first block is
     * prefetched during this job's last one (only the page fields and t0,
     * t1 are read) */
    const struct kvc_kvfmt_job *next;
    int first_fetched; /* a previous job likely prefetched this one's first block */
} kvc_kvfmt_job;

typedef void (*kvc_kvfmt_kernel)(const kvc_kvfmt_job *j);

/* The lanes of one vector: 16 (avx512) or 8 (avx2). A format runs on a
 * kernel when bits is 8 or 4, V is asymmetric, Dh % (bits == 4 ? 2 * VL :
 * VL) == 0, and gv, P and G are multiples of VL (attend.c checks). */
void kvc__kvfmt_run_avx2(const kvc_kvfmt_job *j);
void kvc__kvfmt_run_avx512(const kvc_kvfmt_job *j);

#endif
