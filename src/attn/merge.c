/*
 * Attention-state merging by log-sum-exp (SEMANTICS section 5, FlashInfer's
 * cascade merge_state / merge_state_in_place / merge_states).
 *
 * A state is (v, s): v the softmax-weighted sum of values over some keys, s
 * the base-2 log-sum-exp of their scores. Merging states over disjoint key
 * sets gives the state over their union:
 *
 *   m = max_i s_i,  w_i = 2^(s_i - m),  v = sum_i w_i v_i / sum_i w_i,
 *   s = m + log2(sum_i w_i)
 *
 * All math is float32 whatever v's dtype (v rows are converted to float32 in
 * chunks with the ISA's convert kernel, which is bit-identical on every ISA,
 * so results do not depend on the ISA). When every state is empty (s = -inf)
 * the result is v = 0, s = -inf, never NaN.
 *
 * s values must be finite or -inf: NaN and +inf have no meaning as a
 * log-sum-exp and are rejected (rows with mask 0 in merge_state_in_place are
 * not read, so they may hold anything). v values are not checked.
 *
 * Every call validates all its arguments before writing anything. Outputs may
 * alias the inputs element for element (v_out == v_a is fine): each output
 * element is written after its inputs are read.
 */
#include <math.h>
#include <stdio.h>
#include <stddef.h>
#include <stdint.h>

#include "../core/internal.h"
#include "../kernels/kernels.h"
#include "kvcache/attention.h"

/* D is processed in chunks of this many elements (float32 scratch on the
 * stack, so no allocation and no KVC_ERR_NOMEM). */
#define MERGE_CHUNK 512

/* ---- validation ---------------------------------------------------------- */

static int is_float_dtype(kvc_dtype dt) { return dt == KVC_F32 || dt == KVC_F16 || dt == KVC_BF16; }

/* v: (dims...) float tensor with the given ndim and contiguous last dim. */
static kvc_status check_v(const char *fn, const kvc_tensor *t, const char *name, int ndim) {
    char b[96];
    KVC_CHECK(t != NULL, "%s: %s is NULL", fn, name);
    KVC_TRY(kvc__check_tensor(t, name, 1));
    KVC_CHECK(is_float_dtype(t->dtype), "%s: %s must be float32, float16 or bfloat16, got %s", fn,
              name, kvc_dtype_name(t->dtype));
    KVC_CHECK(t->ndim == ndim, "%s: %s must be %d-D, got shape %s", fn, name, ndim,
              kvc__shape_str(t, b, sizeof b));
    return KVC_OK;
}

/* s: float32 tensor with the given ndim (any strides). */
static kvc_status check_s(const char *fn, const kvc_tensor *t, const char *name, int ndim) {
    char b[96];
    KVC_CHECK(t != NULL, "%s: %s is NULL", fn, name);
    KVC_TRY(kvc__check_tensor(t, name, 0));
    KVC_CHECK(t->dtype == KVC_F32, "%s: %s must be float32, got %s", fn, name,
              kvc_dtype_name(t->dtype));
    KVC_CHECK(t->ndim == ndim, "%s: %s must be %d-D, got shape %s", fn, name, ndim,
              kvc__shape_str(t, b, sizeof b));
    return KVC_OK;
}

/* Checks that t has exactly the first ndim sizes of shape. */
static kvc_status check_shape(const char *fn, const kvc_tensor *t, const char *name,
                              const int64_t *shape, int ndim, const char *want) {
    char b[96];
    for (int i = 0; i < ndim; i++)
        KVC_CHECK(t->shape[i] == shape[i], "%s: %s has shape %s, expected %s", fn, name,
                  kvc__shape_str(t, b, sizeof b), want);
    return KVC_OK;
}

static inline float s_at2(const kvc_tensor *s, int64_t i, int64_t h) {
    return ((const float *)s->data)[i * s->stride[0] + h * s->stride[1]];
}

/* s values of a 2-D (N, H) tensor must be finite or -inf (mask: rows to
 * check, NULL for all). */
static kvc_status check_s_values(const char *fn, const kvc_tensor *s, const char *name,
                                 const kvc_tensor *mask) {
    for (int64_t i = 0; i < s->shape[0]; i++) {
        if (mask && !((const uint8_t *)mask->data)[i * mask->stride[0]]) continue;
        for (int64_t h = 0; h < s->shape[1]; h++) {
            float x = s_at2(s, i, h);
            KVC_CHECK(!isnan(x) && !(isinf(x) && x > 0),
                      "%s: %s[%lld, %lld] = %g; a log-sum-exp must be finite or -inf", fn, name,
                      (long long)i, (long long)h, (double)x);
        }
    }
    return KVC_OK;
}

/* ---- row kernels --------------------------------------------------------- */

/* dst[0..n) = src (dtype dt) as float32. */
static inline void load_f32(const kvc_kernels *kr, const void *src, kvc_dtype dt, float *dst,
                            int64_t n) {
    kr->convert(src, dt, dst, KVC_F32, n);
}

/* Merges two rows of D elements: out = (wa * a + wb * b) * inv. out may be a
 * or b (chunks are read before they are written). A state whose weight is 0
 * (empty, or negligible) is not read, so Inf/NaN there cannot leak in. */
static void merge_row(const kvc_kernels *kr, kvc_dtype dt, const void *a, const void *b,
                      void *out, int64_t d, float wa, float wb, float inv) {
    float fa[MERGE_CHUNK], fb[MERGE_CHUNK];
    for (int64_t c = 0; c < d; c += MERGE_CHUNK) {
        int64_t n = d - c < MERGE_CHUNK ? d - c : MERGE_CHUNK;
        if (wa == 0.0f || wb == 0.0f) { /* one state only: its weight is 1 and inv 1 */
            load_f32(kr, (const char *)(wa == 0.0f ? b : a) + kvc__bytes(dt, c), dt, fa, n);
        } else {
            load_f32(kr, (const char *)a + kvc__bytes(dt, c), dt, fa, n);
            load_f32(kr, (const char *)b + kvc__bytes(dt, c), dt, fb, n);
            for (int64_t j = 0; j < n; j++) fa[j] = (wa * fa[j] + wb * fb[j]) * inv;
        }
        kr->convert(fa, KVC_F32, (char *)out + kvc__bytes(dt, c), dt, n);
    }
}

/* Writes d zeros of dtype dt (all-zero bits are 0.0 in every float dtype). */
static void zero_row(void *out, kvc_dtype dt, int64_t d) {
    unsigned char *p = (unsigned char *)out;
    int64_t n = kvc__bytes(dt, d);
    for (int64_t j = 0; j < n; j++) p[j] = 0;
}

/* Weights of a two-state merge. Returns 0 when both are empty. */
static inline int merge_weights(float sa, float sb, float *wa, float *wb, float *inv,
                                float *s_out) {
    float m = sa > sb ? sa : sb;
    if (m == -INFINITY) return 0;
    *wa = exp2f(sa - m); /* exp2f(-inf) = 0 */
    *wb = exp2f(sb - m);
    float sum = *wa + *wb; /* >= 1: the larger weight is exactly 1 */
    *inv = 1.0f / sum;
    *s_out = m + log2f(sum);
    return 1;
}

static inline void *row3(const kvc_tensor *t, int64_t i, int64_t h) {
    return kvc__at(t, i * t->stride[0] + h * t->stride[1]);
}

static inline float *s_ptr2(const kvc_tensor *s, int64_t i, int64_t h) {
    return (float *)s->data + i * s->stride[0] + h * s->stride[1];
}

/* ---- merge_state --------------------------------------------------------- */

static kvc_status check_pair(const char *fn, const kvc_tensor *v_a, const kvc_tensor *s_a,
                             const char *va_name, const char *sa_name, const kvc_tensor *v_b,
                             const kvc_tensor *s_b, const char *vb_name, const char *sb_name) {
    char want[96];
    KVC_TRY(check_v(fn, v_a, va_name, 3));
    KVC_TRY(check_s(fn, s_a, sa_name, 2));
    KVC_TRY(check_v(fn, v_b, vb_name, 3));
    KVC_TRY(check_s(fn, s_b, sb_name, 2));
    kvc__shape_str(v_a, want, sizeof want);
    KVC_TRY(check_shape(fn, v_b, vb_name, v_a->shape, 3, want));
    KVC_CHECK(v_b->dtype == v_a->dtype, "%s: %s is %s but %s is %s (they must match)", fn,
              vb_name, kvc_dtype_name(v_b->dtype), va_name, kvc_dtype_name(v_a->dtype));
    int64_t nh[2] = {v_a->shape[0], v_a->shape[1]};
    char wnh[64];
    snprintf(wnh, sizeof wnh, "(%lld, %lld) (N, H of %s)", (long long)nh[0], (long long)nh[1],
             va_name);
    KVC_TRY(check_shape(fn, s_a, sa_name, nh, 2, wnh));
    KVC_TRY(check_shape(fn, s_b, sb_name, nh, 2, wnh));
    return KVC_OK;
}

kvc_status kvc_merge_state(const kvc_tensor *v_a, const kvc_tensor *s_a, const kvc_tensor *v_b,
                           const kvc_tensor *s_b, kvc_tensor *v_out, kvc_tensor *s_out) {
    static const char fn[] = "kvc_merge_state";
    char want[96];
    KVC_TRY(check_pair(fn, v_a, s_a, "v_a", "s_a", v_b, s_b, "v_b", "s_b"));
    KVC_TRY(check_v(fn, v_out, "v_out", 3));
    KVC_TRY(check_s(fn, s_out, "s_out", 2));
    KVC_TRY(kvc__check_writable(v_out, "v_out"));
    KVC_TRY(kvc__check_writable(s_out, "s_out"));
    kvc__shape_str(v_a, want, sizeof want);
    KVC_TRY(check_shape(fn, v_out, "v_out", v_a->shape, 3, want));
    KVC_CHECK(v_out->dtype == v_a->dtype, "%s: v_out is %s but v_a is %s (they must match)", fn,
              kvc_dtype_name(v_out->dtype), kvc_dtype_name(v_a->dtype));
    kvc__shape_str(s_a, want, sizeof want);
    KVC_TRY(check_shape(fn, s_out, "s_out", s_a->shape, 2, want));
    KVC_TRY(check_s_values(fn, s_a, "s_a", NULL));
    KVC_TRY(check_s_values(fn, s_b, "s_b", NULL));

    const kvc_kernels *kr = kvc__kernels();
    const int64_t N = v_a->shape[0], H = v_a->shape[1], D = v_a->shape[2];
    const kvc_dtype dt = v_a->dtype;
    for (int64_t i = 0; i < N; i++) {
        for (int64_t h = 0; h < H; h++) {
            float wa, wb, inv, s;
            if (merge_weights(s_at2(s_a, i, h), s_at2(s_b, i, h), &wa, &wb, &inv, &s)) {
                merge_row(kr, dt, row3(v_a, i, h), row3(v_b, i, h), row3(v_out, i, h), D, wa, wb,
                          inv);
            } else {
                zero_row(row3(v_out, i, h), dt, D);
                s = -INFINITY;
            }
            *s_ptr2(s_out, i, h) = s;
        }
    }
    return KVC_OK;
}

/* ---- merge_state_in_place ------------------------------------------------ */

kvc_status kvc_merge_state_in_place(kvc_tensor *v, kvc_tensor *s, const kvc_tensor *v_other,
                                    const kvc_tensor *s_other, const kvc_tensor *mask) {
    static const char fn[] = "kvc_merge_state_in_place";
    char b[96];
    KVC_TRY(check_pair(fn, v, s, "v", "s", v_other, s_other, "v_other", "s_other"));
    KVC_TRY(kvc__check_writable(v, "v"));
    KVC_TRY(kvc__check_writable(s, "s"));
    const int64_t N = v->shape[0], H = v->shape[1], D = v->shape[2];
    if (mask) {
        KVC_TRY(kvc__check_tensor(mask, "mask", 0));
        KVC_CHECK(mask->dtype == KVC_U8, "%s: mask must be uint8 (0: keep the row), got %s", fn,
                  kvc_dtype_name(mask->dtype));
        KVC_CHECK(mask->ndim == 1 && mask->shape[0] == N,
                  "%s: mask must have shape (%lld,) (N of v), got %s", fn, (long long)N,
                  kvc__shape_str(mask, b, sizeof b));
    }
    KVC_TRY(check_s_values(fn, s, "s", mask));
    KVC_TRY(check_s_values(fn, s_other, "s_other", mask));

    const kvc_kernels *kr = kvc__kernels();
    const kvc_dtype dt = v->dtype;
    for (int64_t i = 0; i < N; i++) {
        if (mask && !((const uint8_t *)mask->data)[i * mask->stride[0]]) continue;
        for (int64_t h = 0; h < H; h++) {
            float wa, wb, inv, sm;
            float *sp = s_ptr2(s, i, h);
            if (merge_weights(*sp, s_at2(s_other, i, h), &wa, &wb, &inv, &sm)) {
                merge_row(kr, dt, row3(v, i, h), row3(v_other, i, h), row3(v, i, h), D, wa, wb,
                          inv);
            } else {
                zero_row(row3(v, i, h), dt, D);
                sm = -INFINITY;
            }
            *sp = sm;
        }
    }
    return KVC_OK;
}

/* ---- merge_states -------------------------------------------------------- */

kvc_status kvc_merge_states(const kvc_tensor *v, const kvc_tensor *s, kvc_tensor *v_out,
                            kvc_tensor *s_out) {
    static const char fn[] = "kvc_merge_states";
    char want[96];
    KVC_TRY(check_v(fn, v, "v", 4));
    KVC_TRY(check_s(fn, s, "s", 3));
    KVC_TRY(check_v(fn, v_out, "v_out", 3));
    KVC_TRY(check_s(fn, s_out, "s_out", 2));
    KVC_TRY(kvc__check_writable(v_out, "v_out"));
    KVC_TRY(kvc__check_writable(s_out, "s_out"));
    const int64_t N = v->shape[0], n = v->shape[1], H = v->shape[2], D = v->shape[3];
    snprintf(want, sizeof want, "(%lld, %lld, %lld) (N, n, H of v)", (long long)N, (long long)n,
             (long long)H);
    KVC_TRY(check_shape(fn, s, "s", v->shape, 3, want));
    const int64_t out_shape[3] = {N, H, D};
    snprintf(want, sizeof want, "(%lld, %lld, %lld) (N, H, D of v)", (long long)N, (long long)H,
             (long long)D);
    KVC_TRY(check_shape(fn, v_out, "v_out", out_shape, 3, want));
    KVC_CHECK(v_out->dtype == v->dtype, "%s: v_out is %s but v is %s (they must match)", fn,
              kvc_dtype_name(v_out->dtype), kvc_dtype_name(v->dtype));
    snprintf(want, sizeof want, "(%lld, %lld) (N, H of v)", (long long)N, (long long)H);
    KVC_TRY(check_shape(fn, s_out, "s_out", out_shape, 2, want));
    const float *sd = (const float *)s->data;
    for (int64_t i = 0; i < N; i++)
        for (int64_t k = 0; k < n; k++)
            for (int64_t h = 0; h < H; h++) {
                float x = sd[i * s->stride[0] + k * s->stride[1] + h * s->stride[2]];
                KVC_CHECK(!isnan(x) && !(isinf(x) && x > 0),
                          "%s: s[%lld, %lld, %lld] = %g; a log-sum-exp must be finite or -inf",
                          fn, (long long)i, (long long)k, (long long)h, (double)x);
            }

    const kvc_kernels *kr = kvc__kernels();
    const kvc_dtype dt = v->dtype;
    float acc[MERGE_CHUNK], tmp[MERGE_CHUNK];
    for (int64_t i = 0; i < N; i++) {
        for (int64_t h = 0; h < H; h++) {
            const float *srow = sd + i * s->stride[0] + h * s->stride[2];
            float m = -INFINITY;
            for (int64_t k = 0; k < n; k++) {
                float x = srow[k * s->stride[1]];
                m = x > m ? x : m;
            }
            void *orow = row3(v_out, i, h);
            if (m == -INFINITY) { /* no state, or all empty */
                zero_row(orow, dt, D);
                *s_ptr2(s_out, i, h) = -INFINITY;
                continue;
            }
            float sum = 0.0f;
            for (int64_t k = 0; k < n; k++) sum += exp2f(srow[k * s->stride[1]] - m);
            const float inv = 1.0f / sum;
            for (int64_t c = 0; c < D; c += MERGE_CHUNK) {
                int64_t len = D - c < MERGE_CHUNK ? D - c : MERGE_CHUNK;
                for (int64_t j = 0; j < len; j++) acc[j] = 0.0f;
                for (int64_t k = 0; k < n; k++) {
                    float w = exp2f(srow[k * s->stride[1]] - m);
                    if (w == 0.0f) continue; /* empty state: its v may be anything */
                    const char *vrow = (const char *)kvc__at(
                        v, i * v->stride[0] + k * v->stride[1] + h * v->stride[2]);
                    load_f32(kr, vrow + kvc__bytes(dt, c), dt, tmp, len);
                    for (int64_t j = 0; j < len; j++) acc[j] += w * tmp[j];
                }
                for (int64_t j = 0; j < len; j++) acc[j] *= inv;
                kr->convert(acc, KVC_F32, (char *)orow + kvc__bytes(dt, c), dt, len);
            }
            *s_ptr2(s_out, i, h) = m + log2f(sum);
        }
    }
    return KVC_OK;
}
