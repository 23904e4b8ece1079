/* Compressed paged KV formats: page layout (docs/KV_FORMATS.md section 5)
 * and the pieces shared by format.c, store.c and attend.c. */
#ifndef KVC_KVFMT_INTERNAL_H
#define KVC_KVFMT_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "../core/internal.h"
#include "kvcache/kvfmt.h"

/* Byte offsets of a page's fields, in the document's order. */
typedef struct kvc__kvfmt_layout {
    size_t k_codes;  /* (H, Dh, P) codes: channel pairs (8-bit) or channel-major
                        (4-bit, packed along P); kvc__kvfmt_kidx */
    size_t v_codes;  /* (H, Dh, P) codes, int4 packed along P */
    size_t v_scale;  /* (H, P, Dh / gv) float16 */
    size_t v_zero;   /* same, asym only (== k_scale when sym) */
    size_t k_scale;  /* H * Dh * P / G float16 */
    size_t k_zero;   /* same */
    size_t page;     /* total bytes */
    int64_t k_share; /* H * Dh * P / G: K parameter entries per page */
} kvc__kvfmt_layout;

kvc__kvfmt_layout kvc__kvfmt_layout_of(const kvc_kvfmt *f);

/* Index of the K code of head h, channel ch, page slot o among a page's K
 * codes (a byte at 8 bits, a nibble at 4; section 5). 8-bit: channels
 * 2i and 2i + 1 share a run of 2P bytes, token by token (a code vector then
 * feeds integer pair dot products); an odd head_dim's last channel is a run
 * of P. 4-bit: channel-major, a channel's P codes contiguous. */
static inline int64_t kvc__kvfmt_kidx(int bits, int64_t Dh, int64_t P, int64_t h, int64_t ch,
                                      int64_t o) {
    const int64_t c0 = ch & ~(int64_t)1;
    if (bits == 4 || c0 + 1 >= Dh) return (h * Dh + ch) * P + o;
    return (h * Dh + c0) * P + 2 * o + (ch & 1);
}

/* Stored form of one V row (Dh float32 values): rotated when the format
 * says so (float32 butterfly, section 4), in place. */
void kvc__kvfmt_rotate(float *x, int32_t n);

/* The float16 rows a sequence's queries read: positions [w0, n) of one
 * layer, K row of position t at k + slot(t) * rs and V row at v + slot(t) *
 * rs (elements), slot(t) = mod ? t % mod : t - w0. The tail (mod = G + W)
 * or an append's staging buffer (mod = 0). */
typedef struct kvc__kvfmt_win {
    const uint16_t *k, *v;
    int64_t rs, w0, mod;
} kvc__kvfmt_win;

static inline int64_t kvc__kvfmt_slot(const kvc__kvfmt_win *w, int64_t t) {
    return w->mod ? t % w->mod : t - w->w0;
}

/* First position a query at p reads in float16: max(0, floor((p + 1) / G)
 * * G - W). */
static inline int64_t kvc__kvfmt_f16_from(const kvc_kvfmt *f, int64_t p) {
    const int64_t s = (p + 1) / f->group * f->group - f->window;
    return s > 0 ? s : 0;
}

/* The tail of a sequence of n tokens as a window. */
kvc__kvfmt_win kvc__kvfmt_tail_win(const kvc_kvfmt *f, const kvc_kvfmt_seq *s);

/* Checks attention's arguments (q, q_seq, q_pos in [lo_b, n_kv) per
 * sequence b: lo may be NULL for 0, out, lse, params); *sm gets the
 * softmax scale. */
kvc_status kvc__kvfmt_attn_check(const char *fn, const kvc_kvfmt *f, const kvc_tensor *pages,
                                 const kvc_kvfmt_seq *seqs, int64_t n_seqs, const int64_t *lo,
                                 const kvc_tensor *q, const int32_t *q_seq, const int32_t *q_pos,
                                 const kvc_attn_params *params, const kvc_tensor *out,
                                 const kvc_tensor *lse, float *sm);

/* The attention of checked arguments, queries reading float16 rows from
 * wins (one per sequence); mem: kvc__kvfmt_simd_bytes for the SIMD
 * kernels (NULL: the generic C). */
void kvc__kvfmt_attend(const kvc_kvfmt *f, const kvc_tensor *pages, const kvc_kvfmt_seq *seqs,
                       const kvc__kvfmt_win *wins, const kvc_tensor *q, const int32_t *q_seq,
                       const int32_t *q_pos, float sm, kvc_tensor *out, kvc_tensor *lse,
                       kvc_threadpool *pool, void *mem);

/* attend_simd.c: the memory the SIMD kernels need for these queries (0 when
 * no kernel takes the format on this ISA), and the run (0: not run). */
size_t kvc__kvfmt_simd_bytes(const kvc_kvfmt *f, int64_t nq, int64_t Hq, const int32_t *q_seq,
                             const int32_t *q_pos);
int kvc__kvfmt_attend_simd(const kvc_kvfmt *f, const kvc_tensor *pages,
                           const kvc_kvfmt_seq *seqs, const kvc__kvfmt_win *wins,
                           const kvc_tensor *q, const int32_t *q_seq, const int32_t *q_pos,
                           float sm, kvc_tensor *out, kvc_tensor *lse, kvc_threadpool *pool,
                           void *mem);

/* Copies of the index inputs the kernels read while they write pages,
 * tails, sinks, out and lse: an output laid over one of them (core.h:
 * undefined) must not send later reads out of bounds. Taken into the
 * call's scratch after the checks and before the first write; every read
 * after that uses them. */
typedef struct kvc__kvfmt_idx {
    kvc_kvfmt_seq *seqs;  /* pages pointing at the copied ids */
    int64_t *row_indptr;  /* NULL for attention alone */
    int32_t *q_seq, *q_pos;
} kvc__kvfmt_idx;

/* Bytes of the copies of checked arguments (row_indptr NULL: attention
 * alone): the sequences, row_indptr, q_seq, q_pos, and the page ids read:
 * ceil(n_kv / P) of a sequence with rows, those of its queries' quantized
 * groups otherwise. A multiple of 64, O(n_seqs + nq + pages). */
size_t kvc__kvfmt_idx_bytes(const kvc_kvfmt *f, const kvc_kvfmt_seq *seqs, int64_t n_seqs,
                            const int64_t *row_indptr, int64_t nq, const int32_t *q_seq,
                            const int32_t *q_pos);
/* Takes the copies into mem (kvc__kvfmt_idx_bytes, 8-byte aligned). */
void kvc__kvfmt_idx_copy(const kvc_kvfmt *f, const kvc_kvfmt_seq *seqs, int64_t n_seqs,
                         const int64_t *row_indptr, int64_t nq, const int32_t *q_seq,
                         const int32_t *q_pos, void *mem, kvc__kvfmt_idx *out);

/* The pool scratch kvc_kvfmt_append_attention takes (a caller that must not
 * fail half way reserves it first): rows row_indptr of sequences of
 * lengths seqs[b].n_kv, queries (nq, Hq) at q_seq/q_pos (nq 0: a store). */
size_t kvc__kvfmt_step_scratch_bytes(const kvc_kvfmt *f, const kvc_kvfmt_seq *seqs,
                                     int64_t n_seqs, const int64_t *row_indptr, int64_t nq,
                                     int64_t Hq, const int32_t *q_seq, const int32_t *q_pos);

#endif
