/*
 * Body of the kvfmt attention kernels (kvfmt_kernels.h), included by
 * kvfmt_avx2.c and kvfmt_avx512.c after they define the vector primitives:
 *
 *   KV_VL lanes; kv_vec; KV_LOAD/KV_STORE (float32), KV_ZERO, KV_SET1,
 *   KV_ADD, KV_SUB, KV_MUL, KV_FMA(a, b, c) = a * b + c, KV_MAX, KV_HSUM, KV_HMAX,
 *   KV_EXP2 (2^x, 0 below -126), KV_F16(p) (KV_VL float16 -> float32),
 *   KV_KC4(p0, p1, x0, x1) (VL / 2 bytes at p0 and at p1, 4-bit codes of VL
 *   tokens each, to float32: the even tokens' codes, then the odd ones'),
 *   KV_UNPERM4(v) (that order back to token order), KV_NVB (query vectors
 *   per K pass), KV_REDUCE(t) (t: VL vectors of VL floats; lane i = sum of
 *   vector i), KV_KEEP_LE(v, x, y) (lanes where
 *   x <= y, else -inf); integer: kv_ivec (2 VL int16 or VL int32), KV_IZERO,
 *   KV_ILOAD/KV_ISTORE, KV_IADD (int32), KV_DPWSSD(acc, a, b) (acc + the
 *   int16 pair products of a and b, summed per int32 lane), KV_CVTI (float
 *   to int32, nearest), KV_I2F, KV_C8X2(p0, p1) (VL bytes at each, to 2 VL
 *   int16), KV_C4X4(p0 .. p3) (VL / 2 bytes at each, to 2 VL int16),
 *   KV_LO4/KV_HI4 (int16 lanes & 15, >> 4), KV_F16_HALF(p, hi) (VL float16
 *   from the low (hi 0) or high halves of VL 32-bit words at p), KV_ABS,
 *   KV_PAIR(p) (2 VL bytes to 2 VL int16), KV_ISET1(x) (int32 broadcast).
 *
 * Work per job (per softmax block of up to 256 tokens, whole groups):
 *   K: per group, the K scale is folded into the query vectors (qs = q *
 *      scale, bias = q . zero); q . k = qs . code + bias, vectorized over
 *      VL tokens of a page, no reduction. 8-bit codes come in channel pairs
 *      (token by token): qs is rounded to int16 per group and query vector
 *      (scale 2^15 / max |qs|), each pair's 2 VL codes are widened once and
 *      serve every query vector, one vpdpwssd (2 channels) per pair and
 *      query vector with the vector's int16 pair broadcast. 4-bit codes are
 *      channel-major: each channel's codes are converted to float once, one
 *      FMA per channel and query vector with qs broadcast.
 *   V: channel-major codes: o_c += sum_t (p_t * vscale_t) code[c, t] +
 *      sum_t p_t * vzero_t, vectorized over tokens: the weights p_t *
 *      vscale_t are rounded to int16 per block and query vector (scale
 *      2^15 / max), the codes widened to int16, and vpdpwssd takes 2 VL
 *      tokens per instruction (twice an FMA's, with no float conversion);
 *      with KV_WK (AVX-512) the weights of KV_WK code vectors and KV_WV query
 *      vectors stay in registers while VL channels' codes stream past them
 *      (each widened once per tile); without (AVX2), per channel, its codes
 *      are widened once and serve every query vector, the weights read from
 *      L1; VL channels' sums are reduced together, once per block.
 *   4-bit codes: lanes follow the nibbles (even tokens, then odd); the K
 *   scores are permuted back, the V weights permuted to match.
 */
#include <math.h>
#include <string.h>

#define KV_BT 256
#define KV_WI (KVC_KVFMT_BT_MAX + 4 * KV_VL) /* int16 V weights of a block, padded */

#if defined(__GNUC__)
#define KV_INLINE static inline __attribute__((always_inline))
#else
#define KV_INLINE static inline
#endif

typedef struct kv_state {
    float m[KVC_KVFMT_NV], l[KVC_KVFMT_NV];
    _Alignas(64) float o[KVC_KVFMT_NV][KVC_ATTN_MAX_HEAD_DIM];
} kv_state;

static inline const unsigned char *kv_opaque(const unsigned char *p) {
    __asm__("" : "+r"(p));
    return p;
}

/* One channel's V codes, widened to int16: code vector k (< n) from the
 * VL-token chunks cb[2k], cb[2k + 1] at offset off (8-bit), or (4-bit, k
 * even) vectors k, k + 1 = the low and high nibbles of chunks cb[2k ..
 * 2k + 3]. */
KV_INLINE void kv_v_codes(const unsigned char *const *cb, int64_t off, const int n, const int bits,
                          kv_ivec *c) {
    /* the barrier keeps each address a scalar add in the load (GCC would
     * otherwise add off to the pointers in vectors and move them out) */
#define KV_CB(k) (kv_opaque(cb[k]) + off)
    if (bits == 8) {
#pragma GCC unroll 8
        for (int k = 0; k < n; k++) c[k] = KV_C8X2(KV_CB(2 * k), KV_CB(2 * k + 1));
    } else {
#pragma GCC unroll 4
        for (int k = 0; k < n; k += 2) {
            const kv_ivec x = KV_C4X4(KV_CB(2 * k), KV_CB(2 * k + 1), KV_CB(2 * k + 2), KV_CB(2 * k + 3));
            c[k] = KV_LO4(x);
            c[k + 1] = KV_HI4(x);
        }
    }
#undef KV_CB
}

#ifndef KV_WK
/* Without P . V tiles (AVX2: with 16 registers its tiles spilled and ran
 * 5-10% slower): per channel, its codes against every weight row, the
 * weights read from L1. */
#define KV_SEG 8 /* code vectors held in registers at a time */

/* nk int16 code vectors against nv int16 weight rows: tmp[v * VL + i] (a
 * float vector) = (or +=) the int32 lanes of sum_k w[v * ws + k * 2 VL] . c[k]
 * (pairs of products per lane: 2 VL tokens per instruction). */
KV_INLINE void kv_idots(const kv_ivec *c, const int nk, const int16_t *w, int64_t ws, int nv,
                        float *tmp, int i, int add) {
    for (int v = 0; v < nv; v++) {
        const int16_t *wv = w + v * ws;
        kv_ivec a0 = KV_DPWSSD(KV_IZERO(), KV_ILOAD(wv), c[0]);
        kv_ivec a1 = KV_IZERO();
#pragma GCC unroll 8
        for (int k = 1; k < nk; k++) {
            if (k & 1)
                a1 = KV_DPWSSD(a1, KV_ILOAD(wv + k * 2 * KV_VL), c[k]);
            else
                a0 = KV_DPWSSD(a0, KV_ILOAD(wv + k * 2 * KV_VL), c[k]);
        }
        kv_vec r = KV_I2F(KV_IADD(a0, a1));
        float *t = tmp + ((int64_t)v * KV_VL + i) * KV_VL;
        if (add) r = KV_ADD(r, KV_LOAD(t));
        KV_STORE(t, r);
    }
}

/* One channel's V codes for part of a block (kv_v_codes) against the weights. */
KV_INLINE void kv_v_seg(const unsigned char *const *cb, int64_t off, const int nk, int bits,
                        const int16_t *w, int64_t ws, int nv, float *tmp, int i, int add) {
    kv_ivec c[KV_SEG];
    kv_v_codes(cb, off, nk, bits, c);
    kv_idots(c, nk, w, ws, nv, tmp, i, add);
}

static void kv_v_channel(const unsigned char *const *cb, int64_t off, int nk, int bits,
                         const int16_t *w, int64_t ws, int nv, float *tmp, int i) {
    for (int s = 0; s < nk; s += KV_SEG) {
        const int n = nk - s < KV_SEG ? nk - s : KV_SEG;
        const unsigned char *const *c = cb + 2 * s;
        const int16_t *ww = w + s * 2 * KV_VL;
        switch (n) {
        case 8: kv_v_seg(c, off, 8, bits, ww, ws, nv, tmp, i, s > 0); break;
        case 4: kv_v_seg(c, off, 4, bits, ww, ws, nv, tmp, i, s > 0); break;
        case 2: kv_v_seg(c, off, 2, bits, ww, ws, nv, tmp, i, s > 0); break;
        case 7: kv_v_seg(c, off, 7, bits, ww, ws, nv, tmp, i, s > 0); break;
        case 6: kv_v_seg(c, off, 6, bits, ww, ws, nv, tmp, i, s > 0); break;
        case 5: kv_v_seg(c, off, 5, bits, ww, ws, nv, tmp, i, s > 0); break;
        case 3: kv_v_seg(c, off, 3, bits, ww, ws, nv, tmp, i, s > 0); break;
        default: kv_v_seg(c, off, 1, bits, ww, ws, nv, tmp, i, s > 0); break;
        }
    }
}

#endif

/* V weights w[0 .. n) (>= 0, zero up to nw) to int16 for vpdpwssd, scaled
 * so the largest is 32767 (relative error 2^-16 of the block's largest
 * weight, below float16's), in the order the P . V loops read codes: 8-bit, token
 * order; 4-bit, per 4 VL tokens the even tokens, then the odd ones. out: nw
 * words; returns the scale back to float, and in *err the rounding errors'
 * sum, sum_t (wi_t * scale - w_t): their cost at the codes' centre Lq / 2,
 * the same in every channel of the group, is what the caller takes back out
 * (undone by a rotation of V, a common error of all channels lands on
 * channel 0, sqrt(gv) times larger). */
static float kv_wquant(const float *w, int64_t n, int bits, int16_t *out, int64_t nw,
                       float *err) {
    kv_vec mx = KV_ZERO();
    for (int64_t t = 0; t < n; t += KV_VL) mx = KV_MAX(mx, KV_LOAD(w + t));
    const float m = KV_HMAX(mx);
    const kv_vec inv = KV_SET1(m > 0 ? 32767.0f / m : 0.0f);
    const kv_vec back = KV_SET1(m > 0 ? m / 32767.0f : 0.0f);
    kv_vec e = KV_ZERO(); /* (the weights past n are 0: no error) */
#define KV_WQ(t, h)                                                                              \
    const kv_ivec h = KV_CVTI(KV_MUL(KV_LOAD(w + (t)), inv));                                    \
    e = KV_SUB(KV_FMA(KV_I2F(h), back, e), KV_LOAD(w + (t)))
    if (bits == 8) {
        for (int64_t t = 0; t < nw; t += 2 * KV_VL) {
            KV_WQ(t, h0);
            KV_WQ(t + KV_VL, h1);
            KV_ISTORE(out + t, KV_PACK16(h0, h1));
        }
    } else {
        for (int64_t t = 0; t < nw; t += 4 * KV_VL) {
            kv_ivec e0, o0, e1, o1;
            KV_WQ(t, h0);
            KV_WQ(t + KV_VL, h1);
            KV_WQ(t + 2 * KV_VL, h2);
            KV_WQ(t + 3 * KV_VL, h3);
            KV_EVOD(h0, h1, e0, o0);
            KV_EVOD(h2, h3, e1, o1);
            KV_ISTORE(out + t, KV_PACK16(e0, e1));
            KV_ISTORE(out + t + 2 * KV_VL, KV_PACK16(o0, o1));
        }
    }
#undef KV_WQ
    *err = KV_HSUM(e);
    return m > 0 ? m / 32767.0f : 0.0f;
}

/* Folds scores s[v][0 .. n) (base 2, n a multiple of VL, masked lanes
 * -inf) into the state; leaves the weights in s. */
static void kv_softmax(kv_state *st, int nv, float (*s)[KVC_KVFMT_BT_MAX], int64_t n, int Dh) {
    for (int v = 0; v < nv; v++) {
        kv_vec mx = KV_SET1(st->m[v]);
        for (int64_t t = 0; t < n; t += KV_VL) mx = KV_MAX(mx, KV_LOAD(s[v] + t));
        const float m = KV_HMAX(mx);
        if (m == -INFINITY) { /* nothing visible yet */
            for (int64_t t = 0; t < n; t += KV_VL) KV_STORE(s[v] + t, KV_ZERO());
            continue;
        }
        const kv_vec nm = KV_SET1(-m);
        kv_vec sum = KV_ZERO();
        for (int64_t t = 0; t < n; t += KV_VL) {
            const kv_vec e = KV_EXP2(KV_ADD(KV_LOAD(s[v] + t), nm));
            KV_STORE(s[v] + t, e);
            sum = KV_ADD(sum, e);
        }
        if (m != st->m[v]) {
            const float corr = st->m[v] == -INFINITY ? 0.0f : exp2f(st->m[v] - m);
            st->l[v] *= corr;
            const kv_vec cv = KV_SET1(corr);
            for (int c = 0; c < Dh; c += KV_VL) KV_STORE(st->o[v] + c, KV_MUL(KV_LOAD(st->o[v] + c), cv));
            st->m[v] = m;
        }
        st->l[v] += KV_HSUM(sum);
    }
}

/* Converts n float16 values (n a multiple of VL) to float32. */
static void kv_f16_row(const uint16_t *src, float *dst, int64_t n) {
    for (int64_t i = 0; i < n; i += KV_VL) KV_STORE(dst + i, KV_F16(src + i));
}

static inline const unsigned char *kv_page(const kvc_kvfmt_job *j, int64_t t) {
    return j->base + (int64_t)j->pages[t / j->P] * j->page_stride;
}

/* K scale and zero of group g, head h, into ks/kz (Dh floats, natural order). */
static void kv_kparams(const kvc_kvfmt_job *j, int64_t g, float *ks, float *kz) {
    const int64_t Dh = j->Dh, HD = (int64_t)j->H * Dh, e0 = (int64_t)j->h * Dh;
    _Alignas(64) uint16_t bs[KVC_ATTN_MAX_HEAD_DIM], bz[KVC_ATTN_MAX_HEAD_DIM];
    if (j->G <= j->P) {
        const int64_t t0 = g * j->G;
        const unsigned char *pg = kv_page(j, t0);
        const int64_t idx = ((g % (j->P / j->G)) * HD + e0) * 2;
        memcpy(bs, pg + j->k_scale + idx, (size_t)Dh * 2);
        memcpy(bz, pg + j->k_zero + idx, (size_t)Dh * 2);
    } else { /* entries spread over the group's G / P pages, by runs */
        for (int64_t e = e0; e < e0 + Dh;) {
            const int64_t r = e / j->k_share, end0 = (r + 1) * j->k_share;
            const int64_t end = end0 < e0 + Dh ? end0 : e0 + Dh;
            const unsigned char *pg = kv_page(j, g * j->G + r * j->P);
            const int64_t idx = (e % j->k_share) * 2;
            memcpy(bs + (e - e0), pg + j->k_scale + idx, (size_t)(end - e) * 2);
            memcpy(bz + (e - e0), pg + j->k_zero + idx, (size_t)(end - e) * 2);
            e = end;
        }
    }
    kv_f16_row(bs, ks, Dh);
    kv_f16_row(bz, kz, Dh);
}

/* Software prefetch of the next block's bytes into L2 while this block
 * runs: pages are scattered, so the hardware prefetchers lose the stream at
 * every page; a block's ranges are queued and issued a few lines per token. */
#define KV_PF_MAX (KVC_KVFMT_BT_MAX / 8 * 4 + 4 * KVC_ATTN_MAX_HEAD_DIM)
typedef struct kv_pf {
    const unsigned char *p[KV_PF_MAX];
    int64_t n[KV_PF_MAX]; /* lines */
    int nr, ri;
    int64_t li, total, done; /* lines: next in range ri, queued, issued */
} kv_pf;

static void kv_pf_add(kv_pf *pf, const unsigned char *p, int64_t bytes) {
    if (pf->nr == KV_PF_MAX || bytes <= 0) return;
    const uintptr_t a = (uintptr_t)p & ~(uintptr_t)63, e = (uintptr_t)p + (uintptr_t)bytes;
    pf->p[pf->nr] = (const unsigned char *)a;
    pf->n[pf->nr] = (int64_t)((e - a + 63) / 64);
    pf->total += pf->n[pf->nr++];
}

/* The ranges of tokens [t0, t1) (whole pages' head-h regions). */
static void kv_pf_block(kv_pf *pf, const kvc_kvfmt_job *j, int64_t t0, int64_t t1) {
    pf->nr = pf->ri = 0;
    pf->li = pf->total = pf->done = 0;
    const int64_t P = j->P, Pb = P * j->bits / 8;
    for (int64_t t = t0; t < t1;) {
        const int64_t pe0 = (t / P + 1) * P, pe = pe0 < t1 ? pe0 : t1, o = t % P, n = pe - t;
        const unsigned char *pg = kv_page(j, t);
        const int64_t hb = (int64_t)j->h * j->Dh * Pb; /* the head's K (and V) codes */
        if (n == P) {
            kv_pf_add(pf, pg + j->k_codes + hb, j->Dh * Pb);
            kv_pf_add(pf, pg + j->v_codes + hb, j->Dh * Pb);
        } else { /* part of each channel's run (8-bit K: each channel pair's) */
            const int64_t kstep = j->bits == 8 ? 2 : 1;
            for (int64_t c = 0; c < j->Dh; c += kstep)
                kv_pf_add(pf, pg + j->k_codes + hb + c * Pb + o * kstep * j->bits / 8,
                          n * kstep * j->bits / 8);
            for (int64_t c = 0; c < j->Dh; c++)
                kv_pf_add(pf, pg + j->v_codes + hb + c * Pb + o * j->bits / 8, n * j->bits / 8);
        }
        const int64_t vo = ((int64_t)j->h * P + o) * j->nvg * 2;
        kv_pf_add(pf, pg + j->v_scale + vo, n * j->nvg * 2);
        kv_pf_add(pf, pg + j->v_zero + vo, n * j->nvg * 2);
        t = pe;
    }
}

/* Issues the next k queued lines: a run of a range at a time, the state in
 * registers (the loop is most of the bookkeeping of a chunk's K pass). */
static void kv_pf_step(kv_pf *pf, int k) {
    int ri = pf->ri;
    int64_t li = pf->li, left = k;
    while (left > 0 && ri < pf->nr) {
        const int64_t rest = pf->n[ri] - li, m = left < rest ? left : rest;
        const char *p = (const char *)pf->p[ri] + li * 64;
        for (int64_t x = 0; x < m; x++) _mm_prefetch(p + x * 64, _MM_HINT_T1);
        left -= m;
        li += m;
        if (li == pf->n[ri]) li = 0, ri++;
    }
    pf->done += k - left;
    pf->ri = ri;
    pf->li = li;
}

#ifdef KV_WK /* P . V tiles of KV_WK code vectors by KV_WV weight rows */
/* P . V of one tile: n (<= KV_WK) int16 code vectors of each of VL channels
 * c0 + i against nb (<= KV_WV) weight rows held in registers while the
 * channels' codes stream past them (the weights are the same for every
 * channel): acc[v * VL + i] (VL int32 lanes) = (or +=) sum_k w[v * ws + k *
 * 2 VL] . code_k(channel c0 + i), the codes as kv_v_codes reads them,
 * channel c0 + i at offset (c0 + i) * Pb in each chunk. pf: prefetch steps,
 * pfc per channel (NULL: none). */
KV_INLINE void kv_v_tile(const unsigned char *const *cb, int64_t off0, int64_t Pb, const int n,
                         const int bits, const int16_t *w, int64_t ws, const int nb, kv_ivec *acc,
                         int first, kv_pf *pf, int pfc) {
    kv_ivec W[KV_WV][KV_WK];
    for (int v = 0; v < nb; v++)
        for (int k = 0; k < n; k++) W[v][k] = KV_ILOAD(w + v * ws + k * 2 * KV_VL);
    for (int i = 0; i < KV_VL; i++) {
        if (pf) kv_pf_step(pf, pfc);
        kv_ivec c[KV_WK];
        kv_v_codes(cb, off0 + i * Pb, n, bits, c);
        for (int v = 0; v < nb; v++) {
            kv_ivec a = KV_DPWSSD(KV_IZERO(), W[v][0], c[0]);
            for (int k = 1; k < n; k++) a = KV_DPWSSD(a, W[v][k], c[k]);
            kv_ivec *t = acc + v * KV_VL + i;
            *t = first ? a : KV_IADD(*t, a);
        }
    }
}

/* P . V for the VL channels c0 + i (codes at offset off0 + i * Pb of the
 * chunks cb) against nv weight rows (stride ws) of nk code vectors each:
 * acc[v * VL + i] = the int32 lanes of the dot products (<= 32 vectors of
 * 2 * 255 * 32767 per lane: below 2^31). */
static void kv_v_rows(const unsigned char *const *cb, int64_t off0, int64_t Pb, int nk, int bits,
                      const int16_t *w, int64_t ws, int nv, kv_ivec *acc, kv_pf *pf, int pfc) {
    for (int s = 0; s < nk; s += KV_WK) {
        const int n = nk - s < KV_WK ? nk - s : KV_WK; /* even at 4 bits: nk is */
        for (int v0 = 0; v0 < nv; v0 += KV_WV) {
            const int nb = nv - v0 < KV_WV ? nv - v0 : KV_WV;
            const unsigned char *const *c = cb + 2 * s;
            const int16_t *ww = w + v0 * ws + s * 2 * KV_VL;
            kv_ivec *a = acc + v0 * KV_VL;
            kv_pf *p = s == 0 && v0 == 0 ? pf : NULL;
            switch ((n - 1) * KV_WV + nb - 1 + (bits == 8 ? 0 : KV_WK * KV_WV)) {
#define KV_VT(N, B)                                                                            \
    case (N - 1) * KV_WV + B - 1: kv_v_tile(c, off0, Pb, N, 8, ww, ws, B, a, s == 0, p, pfc); break; \
    case (N - 1) * KV_WV + B - 1 + KV_WK * KV_WV:                                                \
        kv_v_tile(c, off0, Pb, N, 4, ww, ws, B, a, s == 0, p, pfc);                              \
        break;
                KV_VTILES
#undef KV_VT
            default: break;
            }
        }
    }
}
#endif

/* Rows of the scaled query vectors: float (4-bit) and int16 (8-bit). Fixed
 * strides keep each vector's operand at a constant offset from one pointer
 * (a runtime stride made GCC hold a pointer per vector and spill them: two
 * loads per FMA). */
#define KV_QS KVC_ATTN_MAX_HEAD_DIM
#define KV_QIS (KVC_ATTN_MAX_HEAD_DIM + 2 * KV_VL)

/* q . k for VL tokens of one page and nb query vectors: out[v] lane i =
 * sum_c qs[v][c] * code[c][i]. 8-bit: channels c, c + 1's codes for them
 * at kc + c * Pb (2 VL bytes, token by token), qs as int16 (rows of qi,
 * stride KV_QIS; out in units of the vector's int16 scale); each of the
 * two int32 accumulators sums Dh / 4 pairs, <= 128 * 2 * 255 * 32767 <
 * 2^31 at Dh 512. 4-bit: channel c's codes at kc + c * Pb, qs as float
 * (rows of qs, stride KV_QS), lanes the even tokens, then the odd ones
 * (KV_UNPERM4 restores token order). Two accumulators per vector cover the
 * latency: the even channels and the odd ones (8-bit: the pairs starting at
 * 4k and at 4k + 2). */
KV_INLINE void kv_k_chunk(const unsigned char *kc, int64_t Pb, int Dh, const int bits,
                          const float *qs, const int16_t *qi, const int nb, kv_vec *out,
                          kv_pf *pf, int pfr) {
    if (bits == 8) {
        kv_ivec ia[KV_NVB], ib[KV_NVB];
        for (int v = 0; v < nb; v++) ia[v] = ib[v] = KV_IZERO();
        const unsigned char *p = kc;
        const int64_t P2 = 2 * Pb;
        for (int c0 = 0; c0 < Dh; c0 += 8, p += 4 * P2) { /* Dh % 8 == 0 */
            if ((c0 & 31) == 0) kv_pf_step(pf, pfr); /* spread: a burst stalls the loads */
            for (int c = c0; c < c0 + 8; c += 4) {
                const unsigned char *pc = c == c0 ? p : p + 2 * P2;
                const kv_ivec x0 = KV_PAIR(pc), x1 = KV_PAIR(pc + P2);
                for (int v = 0; v < nb; v++) {
                    int32_t w0, w1; /* the int16 pairs (c, c + 1) and (c + 2, c + 3) */
                    memcpy(&w0, qi + v * KV_QIS + c, 4);
                    memcpy(&w1, qi + v * KV_QIS + c + 2, 4);
                    ia[v] = KV_DPWSSD(ia[v], x0, KV_ISET1(w0));
                    ib[v] = KV_DPWSSD(ib[v], x1, KV_ISET1(w1));
                }
            }
        }
        for (int v = 0; v < nb; v++) out[v] = KV_ADD(KV_I2F(ia[v]), KV_I2F(ib[v]));
        return;
    }
    kv_vec a[KV_NVB], b[KV_NVB];
    for (int v = 0; v < nb; v++) a[v] = b[v] = KV_ZERO();
    const unsigned char *p = kc;
#pragma GCC unroll 4
    for (int c = 0; c < Dh; c += 2, p += 2 * Pb) { /* Dh % 8 == 0 */
        if ((c & 31) == 0) kv_pf_step(pf, pfr); /* spread: a burst stalls the loads */
        kv_vec x0, x1;
        KV_KC4(p, p + Pb, x0, x1);
        for (int v = 0; v < nb; v++) {
            a[v] = KV_FMA(KV_SET1(qs[v * KV_QS + c]), x0, a[v]);
            b[v] = KV_FMA(KV_SET1(qs[v * KV_QS + c + 1]), x1, b[v]);
        }
    }
    for (int v = 0; v < nb; v++) out[v] = KV_ADD(a[v], b[v]);
}

static void kv_k_chunks(const unsigned char *kc, int64_t Pb, int Dh, int bits, const float *qs,
                        const int16_t *qi, int nb, kv_vec *out, kv_pf *pf, int pfr) {
    switch (nb * 2 + (bits == 8)) {
#define KV_KC_CASE(n)                                                          \
    case 2 * n: kv_k_chunk(kc, Pb, Dh, 4, qs, qi, n, out, pf, pfr); break;   \
    case 2 * n + 1: kv_k_chunk(kc, Pb, Dh, 8, qs, qi, n, out, pf, pfr); break;
    KV_KC_CASE(1) KV_KC_CASE(2) KV_KC_CASE(3) KV_KC_CASE(4)
#if KV_NVB > 4
    KV_KC_CASE(5) KV_KC_CASE(6) KV_KC_CASE(7) KV_KC_CASE(8)
#endif
#undef KV_KC_CASE
    default: break;
    }
}

void KV_NAME(const kvc_kvfmt_job *j) {
    const int nv = j->nv, Dh = j->Dh, bits = j->bits, P = j->P, G = j->G;
    const int64_t Pb = (int64_t)P * bits / 8;       /* V code bytes of one channel in a page */
    const int64_t BT = G <= KV_BT ? (KV_BT / G) * G : G; /* tokens per softmax block */
    _Alignas(64) float qs[KVC_KVFMT_NV][KV_QS];
    _Alignas(64) int16_t qi[KVC_KVFMT_NV][KV_QIS]; /* 8-bit: qs */
    float qinv[KVC_KVFMT_NV]; /* 8-bit: qs = qi * qinv (+ qi2 * qinv2) */
    float qinv2[KVC_KVFMT_NV];
    _Alignas(64) float s[KVC_KVFMT_NV][KVC_KVFMT_BT_MAX];
    /* the V weights (wi, the P . V of a block) and, in the scores before
     * them, the second int16 term of 8-bit queries (qi2) share their rows:
     * the stack stays within core.h's 256 KiB */
    _Static_assert(KV_QIS <= KV_WI, "qi2 rows fit in wi's");
    _Alignas(64) int16_t wbuf[KVC_KVFMT_NV * KV_WI];
    int16_t (*const wi)[KV_WI] = (int16_t (*)[KV_WI])wbuf;
    int16_t (*const qi2)[KV_QIS] = (int16_t (*)[KV_QIS])wbuf; /* what qi missed, when it counts */
    _Alignas(64) float wf[KV_WI];
    _Alignas(64) float tmp[KVC_KVFMT_NV * KV_VL * KV_VL];
#ifdef KV_WK
    kv_ivec iacc[KVC_KVFMT_NV * KV_VL];
#endif
    _Alignas(64) float ks[KVC_ATTN_MAX_HEAD_DIM], kz[KVC_ATTN_MAX_HEAD_DIM];
    _Alignas(64) float vsb[KVC_KVFMT_BT_MAX], vzb[KVC_KVFMT_BT_MAX];
    _Alignas(64) uint16_t hb[KVC_KVFMT_BT_MAX * 2];
    const unsigned char *cb[KVC_KVFMT_BT_MAX / KV_VL + 4];
    float bias[KVC_KVFMT_NV];
    kv_state st;
    int64_t maxpos = 0;
    for (int v = 0; v < nv; v++) {
        st.m[v] = -INFINITY;
        st.l[v] = 0;
        memset(st.o[v], 0, (size_t)Dh * sizeof(float));
        if (j->pos[v] > maxpos) maxpos = j->pos[v];
    }
    const kv_vec iota = KV_IOTA();
    kv_pf pf;
    pf.nr = pf.ri = 0;
    pf.li = pf.total = pf.done = 0;
    int pf_rate = 0;
    /* ---- quantized groups, in blocks of BT tokens ---- */
    for (int64_t b0 = j->t0; b0 < j->t1 && b0 <= maxpos; b0 += BT) {
        const int64_t b1 = b0 + BT < j->t1 ? b0 + BT : j->t1;
        int64_t te = b0 + ((maxpos + 1 - b0 + KV_VL - 1) / KV_VL) * KV_VL;
        if (te > b1) te = b1;
        const int64_t n = te - b0; /* a multiple of VL */
        if (b0 == j->t0 && !j->first_fetched) { /* all its lines at once (many misses in flight) */
            kv_pf_block(&pf, j, b0, te);
            kv_pf_step(&pf, (int)pf.total);
        }
        { /* queue the next block */
            const int64_t nb1 = b1 + BT < j->t1 ? b1 + BT : j->t1;
            int64_t ne = b1 + ((maxpos + 1 - b1 + KV_VL - 1) / KV_VL) * KV_VL;
            if (ne > nb1) ne = nb1;
            const kvc_kvfmt_job *nx = j->next;
            if (ne > b1) {
                kv_pf_block(&pf, j, b1, ne);
            } else if (nx && nx->t1 > nx->t0) { /* the last block: the next job's first */
                const int64_t nbt = nx->G <= KV_BT ? (KV_BT / nx->G) * nx->G : nx->G;
                kv_pf_block(&pf, nx, nx->t0, nx->t0 + nbt < nx->t1 ? nx->t0 + nbt : nx->t1);
            } else {
                pf.nr = pf.ri = 0;
                pf.total = pf.done = 0;
            }
            pf_rate = (int)((pf.total + 2 * n - 1) / (2 * n)); /* half over K, half over V */
        }
        /* scores, group by group */
        for (int64_t g0 = b0; g0 < te; g0 += G) {
            const int64_t ge = g0 + G < te ? g0 + G : te;
            kv_kparams(j, g0 / G, ks, kz);
            int two = 0; /* some vector of this group takes a second int16 term */
            for (int v = 0; v < nv; v++) {
                kv_vec bz = KV_ZERO(), mx = KV_ZERO();
                for (int c = 0; c < Dh; c += KV_VL) {
                    const kv_vec qv = KV_LOAD(j->q[v] + c), x = KV_MUL(qv, KV_LOAD(ks + c));
                    KV_STORE(qs[v] + c, x);
                    bz = KV_FMA(qv, KV_LOAD(kz + c), bz);
                    mx = KV_MAX(mx, KV_ABS(x));
                }
                bias[v] = KV_HSUM(bz);
                if (bits == 8) { /* qs to int16, the largest magnitude 32767 */
                    const float m = KV_HMAX(mx);
                    const kv_vec inv = KV_SET1(m > 0 ? 32767.0f / m : 0.0f);
                    qinv[v] = m > 0 ? m / 32767.0f : 0.0f;
                    /* the rounding error e_c = qi_c * qinv - qs_c costs sum_c e_c *
                     * code_c; its part at the codes' centre 128 goes to the bias,
                     * leaving sum_c e_c * (code_c - 128) */
                    kv_vec err = KV_ZERO(), eabs = KV_ZERO(), rmx = KV_ZERO();
                    const kv_vec qv = KV_SET1(qinv[v]);
                    for (int c = 0; c < Dh; c += 2 * KV_VL) { /* a zero half past Dh */
                        kv_ivec h[2] = {KV_IZERO(), KV_IZERO()};
                        for (int u = 0; u < 2 && c + u * KV_VL < Dh; u++) {
                            const kv_vec x = KV_LOAD(qs[v] + c + u * KV_VL);
                            h[u] = KV_CVTI(KV_MUL(x, inv));
                            const kv_vec e = KV_FMA(KV_I2F(h[u]), qv, KV_SUB(KV_ZERO(), x));
                            err = KV_ADD(err, e);
                            eabs = KV_ADD(eabs, KV_ABS(e));
                        }
                        KV_ISTORE(qi[v] + c, KV_PACK16(h[0], h[1]));
                    }
                    /* The error left, sum_c e_c * (code_c - 128), is at most 128 *
                     * sum |e_c| (times the score scale): below 2^-8 it is noise next
                     * to float16 (a query's channels of comparable K ranges); above,
                     * one channel's range dwarfs the others' (an outlier channel),
                     * and the rounding errors r_c = qs_c - qi_c * qinv are rounded
                     * to int16 in turn, a second dot product with 2^-15 of the error */
                    qinv2[v] = 0.0f;
                    if (128.0f * KV_HSUM(eabs) * fabsf(j->sc) > 0x1p-8f) {
                        two = 1;
                        for (int c = 0; c < Dh; c += KV_VL) {
                            const kv_vec x = KV_LOAD(qs[v] + c);
                            const kv_vec r = /* x - qi * qinv, rounded once */
                                KV_FMA(KV_I2F(KV_CVTI(KV_MUL(x, inv))), KV_SET1(-qinv[v]), x);
                            KV_STORE(qs[v] + c, r); /* qs is not read again at 8 bits */
                            rmx = KV_MAX(rmx, KV_ABS(r));
                        }
                        const float m2 = KV_HMAX(rmx);
                        const kv_vec inv2 = KV_SET1(m2 > 0 ? 32767.0f / m2 : 0.0f);
                        qinv2[v] = m2 > 0 ? m2 / 32767.0f : 0.0f;
                        const kv_vec qv2 = KV_SET1(qinv2[v]);
                        err = KV_ZERO();
                        for (int c = 0; c < Dh; c += 2 * KV_VL) {
                            kv_ivec h[2] = {KV_IZERO(), KV_IZERO()};
                            for (int u = 0; u < 2 && c + u * KV_VL < Dh; u++) {
                                const kv_vec r = KV_LOAD(qs[v] + c + u * KV_VL);
                                h[u] = KV_CVTI(KV_MUL(r, inv2));
                                err = KV_SUB(KV_FMA(KV_I2F(h[u]), qv2, err), r);
                            }
                            KV_ISTORE(qi2[v] + c, KV_PACK16(h[0], h[1]));
                        }
                    }
                    bias[v] -= 128.0f * KV_HSUM(err);
                }
            }
            for (int v = 0; v < nv && two; v++) /* no second term: zeros */
                if (qinv2[v] == 0.0f) memset(qi2[v], 0, sizeof qi2[v]);
            for (int64_t tb = g0; tb < ge; tb += KV_VL) {
                /* VL tokens inside one page (P % VL == 0) */
                const unsigned char *kc = kv_page(j, tb) + j->k_codes + (int64_t)j->h * Dh * Pb +
                                          (bits == 8 ? (tb % P) * 2 : (tb % P) / 2);
                const kv_vec rel = KV_ADD(iota, KV_SET1((float)(tb - b0)));
                for (int v0 = 0; v0 < nv; v0 += KV_NVB) {
                    const int nb = nv - v0 < KV_NVB ? nv - v0 : KV_NVB;
                    kv_vec acc[KV_NVB];
                    kv_k_chunks(kc, Pb, Dh, bits, qs[v0], qi[v0], nb, acc, &pf,
                                v0 ? 0 : (pf_rate * KV_VL * 32 + Dh - 1) / Dh);
                    kv_vec acc2[KV_NVB];
                    if (two) kv_k_chunks(kc, Pb, Dh, bits, qs[v0], qi2[v0], nb, acc2, &pf, 0);
                    for (int v = v0; v < v0 + nb; v++) {
                        kv_vec r0 = bits == 4 ? KV_UNPERM4(acc[v - v0])
                                              : KV_MUL(acc[v - v0], KV_SET1(qinv[v]));
                        if (two) r0 = KV_FMA(acc2[v - v0], KV_SET1(qinv2[v]), r0);
                        kv_vec r = KV_MUL(KV_ADD(r0, KV_SET1(bias[v])), KV_SET1(j->sc));
                        const int64_t lim = j->pos[v] - b0;
                        r = KV_KEEP_LE(r, rel, KV_SET1((float)(lim < (int64_t)n ? lim : n)));
                        if (tb < j->sink) /* the sink positions: read in float16 below */
                            r = KV_KEEP_LE(r, KV_SET1((float)(j->sink - b0)), rel);
                        KV_STORE(s[v] + (tb - b0), r);
                    }
                }
            }
        }
        kv_softmax(&st, nv, s, n, Dh);
        /* V: chunk bases (VL tokens each, inside one page); code vectors take
         * 2 (8-bit) or 4 (4-bit) chunks, the missing ones repeat the last
         * chunk (their weights are 0) */
        const int nch = (int)(n / KV_VL), cpv = bits == 8 ? 2 : 4;
        const int nchp = (nch + cpv - 1) / cpv * cpv;
        const int nk = nchp / 2;        /* int16 code vectors per channel */
        const int64_t nw = (int64_t)nk * 2 * KV_VL;
        for (int k = 0; k < nchp; k++) {
            const int64_t t = b0 + (int64_t)(k < nch ? k : nch - 1) * KV_VL;
            cb[k] = kv_page(j, t) + j->v_codes + (int64_t)j->h * Dh * Pb + (t % P) * bits / 8;
        }
        for (int jg = 0; jg < j->nvg; jg++) {
            /* this channel group's V scale and zero of each token */
            for (int64_t t = b0; t < te;) {
                const int64_t pe0 = (t / P + 1) * P, pe = pe0 < te ? pe0 : te;
                const unsigned char *pg = kv_page(j, t);
                const int64_t base = ((int64_t)j->h * P + t % P) * j->nvg;
                const int64_t cnt = pe - t;
                if (j->nvg == 1) {
                    kv_f16_row((const uint16_t *)(const void *)(pg + j->v_scale) + base,
                               vsb + (t - b0), cnt);
                    kv_f16_row((const uint16_t *)(const void *)(pg + j->v_zero) + base,
                               vzb + (t - b0), cnt);
                } else if (j->nvg == 2) { /* (scale, scale) pairs: one half of each */
                    const unsigned char *ps = pg + j->v_scale + base * 2, *pz = pg + j->v_zero + base * 2;
                    for (int64_t u = 0; u < cnt; u += KV_VL) {
                        KV_STORE(vsb + (t - b0) + u, KV_F16_HALF(ps + u * 4, jg));
                        KV_STORE(vzb + (t - b0) + u, KV_F16_HALF(pz + u * 4, jg));
                    }
                } else {
                    const uint16_t *ps = (const uint16_t *)(const void *)(pg + j->v_scale) + base;
                    const uint16_t *pz = (const uint16_t *)(const void *)(pg + j->v_zero) + base;
                    for (int64_t u = 0; u < cnt; u++) hb[u] = ps[u * j->nvg + jg];
                    for (int64_t u = 0; u < cnt; u++) hb[KVC_KVFMT_BT_MAX + u] = pz[u * j->nvg + jg];
                    kv_f16_row(hb, vsb + (t - b0), cnt);
                    kv_f16_row(hb + KVC_KVFMT_BT_MAX, vzb + (t - b0), cnt);
                }
                t = pe;
            }
            float zsum[KVC_KVFMT_NV], wsc[KVC_KVFMT_NV];
            const float centre = bits == 8 ? 127.5f : 7.5f; /* Lq / 2 */
            for (int v = 0; v < nv; v++) {
                kv_vec z = KV_ZERO();
                for (int64_t t = 0; t < n; t += KV_VL) {
                    const kv_vec p = KV_LOAD(s[v] + t);
                    z = KV_FMA(p, KV_LOAD(vzb + t), z);
                    KV_STORE(wf + t, KV_MUL(p, KV_LOAD(vsb + t)));
                }
                for (int64_t t = n; t < nw; t += KV_VL) KV_STORE(wf + t, KV_ZERO());
                float werr;
                wsc[v] = kv_wquant(wf, n, bits, wi[v], nw, &werr);
                zsum[v] = KV_HSUM(z) - centre * werr;
            }
            for (int c0 = jg * j->gv; c0 < (jg + 1) * j->gv; c0 += KV_VL) {
                /* the rest of the next block's lines, spread over the channels
                 * (a burst would fill the fill buffers and stall the loads) */
                const int pfc = (int)((pf.total - pf.done + Dh - c0 - 1) / (Dh - c0));
#ifdef KV_WK
                kv_v_rows(cb, (int64_t)c0 * Pb, Pb, nk, bits, wi[0], KV_WI, nv, iacc, &pf, pfc);
                for (int v = 0; v < nv; v++)
                    for (int i = 0; i < KV_VL; i++)
                        KV_STORE(tmp + ((int64_t)v * KV_VL + i) * KV_VL, KV_I2F(iacc[v * KV_VL + i]));
#else
                for (int i = 0; i < KV_VL; i++) {
                    kv_pf_step(&pf, pfc);
                    kv_v_channel(cb, (int64_t)(c0 + i) * Pb, nk, bits, wi[0], KV_WI, nv, tmp, i);
                }
#endif
                for (int v = 0; v < nv; v++) {
                    const kv_vec r = KV_REDUCE(tmp + (int64_t)v * KV_VL * KV_VL);
                    KV_STORE(st.o[v] + c0, KV_ADD(KV_LOAD(st.o[v] + c0),
                                                  KV_FMA(r, KV_SET1(wsc[v]), KV_SET1(zsum[v]))));
                }
            }
        }
    }
    /* ---- float16 rows: the sink rows when group 0 was read quantized, then
     * positions fstart .. maxpos from the window ---- */
    const int64_t ns = j->fstart > 0 ? j->sink : 0;
    const int64_t nwin = maxpos >= j->fstart ? maxpos + 1 - j->fstart : 0;
    if (j->do_tail && ns + nwin > 0) {
        const int64_t n = ns + nwin, np = (n + KV_VL - 1) / KV_VL * KV_VL;
/* head h of float16 row t: sink row t < ns, else position fstart + t - ns */
#define KV_F16_ROW(kv, t)                                                                    \
    (((t) < ns ? (kv ? j->sv : j->sk) + (t) * j->srs                                         \
               : (kv ? j->wv : j->wk) + (j->wmod ? (j->fstart + (t) - ns) % j->wmod          \
                                                 : j->fstart + (t) - ns - j->w0) * j->wrs) + \
     (int64_t)j->h * Dh)
        /* VL rows at a time, converted once into rw (qs is free here): a
         * vector's VL scores come out of one KV_REDUCE, and its output row
         * is loaded and stored once per VL tokens */
        _Static_assert(KVC_KVFMT_NV >= KV_VL, "qs holds VL rows");
        float(*rw)[KVC_ATTN_MAX_HEAD_DIM] = qs;
        for (int64_t t0 = 0; t0 < np; t0 += KV_VL) {
            const int nt = (int)(n - t0 < KV_VL ? n - t0 : KV_VL);
            /* lane i: the window row's index past fstart, compared with pos -
             * fstart (>= -1: a unit's rows share fstart = f16_from(pos));
             * sink rows (read only when fstart >= G > sink, so pos >= fstart
             * - 1 >= sink) -1: always visible; missing rows +inf */
            _Alignas(64) float rel[KV_VL];
            for (int i = 0; i < KV_VL; i++) {
                const int64_t t = t0 + i;
                rel[i] = i >= nt ? INFINITY : t < ns ? -1.0f : (float)(t - ns);
                if (i < nt)
                    kv_f16_row(KV_F16_ROW(0, t), rw[i], Dh);
            }
            const kv_vec rv = KV_LOAD(rel);
            for (int v = 0; v < nv; v++) {
                for (int i = 0; i < KV_VL; i++) {
                    kv_vec a = KV_ZERO();
                    if (i < nt)
                        for (int c = 0; c < Dh; c += KV_VL)
                            a = KV_FMA(KV_LOAD(j->q[v] + c), KV_LOAD(rw[i] + c), a);
                    KV_STORE(tmp + (int64_t)i * KV_VL, a);
                }
                const int64_t lim = j->pos[v] - j->fstart;
                const kv_vec r = KV_MUL(KV_REDUCE(tmp), KV_SET1(j->sc));
                KV_STORE(s[v] + t0, KV_KEEP_LE(r, rv, KV_SET1((float)(lim < n ? lim : n))));
            }
        }
        kv_softmax(&st, nv, s, np, Dh);
        for (int64_t t0 = 0; t0 < n; t0 += KV_VL) {
            const int nt = (int)(n - t0 < KV_VL ? n - t0 : KV_VL);
            for (int i = 0; i < nt; i++) kv_f16_row(KV_F16_ROW(1, t0 + i), rw[i], Dh);
            for (int v = 0; v < nv; v++)
                for (int c = 0; c < Dh; c += KV_VL) {
                    kv_vec o = KV_LOAD(st.o[v] + c);
                    for (int i = 0; i < nt; i++)
                        o = KV_FMA(KV_SET1(s[v][t0 + i]), KV_LOAD(rw[i] + c), o);
                    KV_STORE(st.o[v] + c, o);
                }
        }
#undef KV_F16_ROW
    }
    for (int v = 0; v < nv; v++) {
        j->m[v] = st.m[v];
        j->l[v] = st.l[v];
        memcpy(j->o + (int64_t)v * Dh, st.o[v], (size_t)Dh * sizeof(float));
    }
}
