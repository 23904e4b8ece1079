/*
 * Attention-state merging (kvc_merge_state, kvc_merge_state_in_place,
 * kvc_merge_states) against a double-precision reference written from
 * SEMANTICS section 5: m = max s_i, w_i = 2^(s_i - m), v = sum w_i v_i /
 * sum w_i, s = m + log2(sum w_i); all-empty -> v 0, s -inf.
 */
#include <stdlib.h>

#include "test.h"
#include "test_elems.h"

const char *test_suite_name = "merge";

static const kvc_dtype V_DTYPES[] = {KVC_F32, KVC_F16, KVC_BF16};

/* Tolerance of an output element of dtype dt around the reference x. */
static double tol_for(kvc_dtype dt, double x) {
    double r = dt == KVC_F32 ? 2e-6 : dt == KVC_F16 ? 1e-3 : 8e-3;
    return r * (1.0 + fabs(x));
}

/* Random s: a mix of finite values in [-8, 8) and, with probability p_inf,
 * -inf. */
static float rand_s(uint64_t *rng, int p_inf_percent) {
    if ((int)(test_rng_next(rng) % 100) < p_inf_percent) return -INFINITY;
    return 8.0f * test_rng_f32(rng);
}

/* Fills n elements of dtype dt with random values in [-2, 2). */
static void fill_v(void *p, kvc_dtype dt, int64_t n, uint64_t *rng) {
    for (int64_t i = 0; i < n; i++) set_f(p, dt, i, 2.0f * test_rng_f32(rng));
}

/* Reference merge of n states of one row: s_k, v_k[d] read from the stored
 * (rounded) values. Writes D doubles to vo, returns s. */
static double ref_merge(int n, const double *s, const double *const *v, int64_t D, double *vo) {
    double m = -INFINITY;
    for (int k = 0; k < n; k++) m = s[k] > m ? s[k] : m;
    if (m == -INFINITY) {
        for (int64_t d = 0; d < D; d++) vo[d] = 0.0;
        return -INFINITY;
    }
    double sum = 0.0;
    for (int k = 0; k < n; k++) sum += exp2(s[k] - m);
    for (int64_t d = 0; d < D; d++) {
        double acc = 0.0;
        for (int k = 0; k < n; k++) {
            double w = exp2(s[k] - m);
            if (w != 0.0) acc += w * v[k][d];
        }
        vo[d] = acc / sum;
    }
    return m + log2(sum);
}

/* Compares one output row/state with the reference. */
#define CHECK_ROW(vout_row, dt, D, sref, vref, sgot)                                               \
    do {                                                                                           \
        if (isinf(sref)) {                                                                         \
            ASSERT_TRUE(isinf(sgot) && (sgot) < 0);                                                \
        } else {                                                                                   \
            ASSERT_NEAR((sgot), (sref), 2e-6 * (1.0 + fabs(sref)));                                \
        }                                                                                          \
        for (int64_t d_ = 0; d_ < (D); d_++) {                                                     \
            float g_ = get_f((vout_row), (dt), d_);                                                \
            ASSERT_TRUE(!isnan(g_));                                                               \
            ASSERT_NEAR(g_, (vref)[d_], tol_for((dt), (vref)[d_]));                                \
        }                                                                                          \
    } while (0)

/* ---- merge_state --------------------------------------------------------- */

static int run_merge_state(kvc_dtype dt, int64_t N, int64_t H, int64_t D, uint64_t seed) {
    uint64_t rng = seed;
    int64_t nv = N * H * D, ns = N * H;
    size_t vb = dt_bytes(dt, nv) + 1;
    void *va = malloc(vb), *vbb = malloc(vb), *vo = malloc(vb);
    float *sa = malloc(sizeof(float) * (size_t)(ns + 1)), *sb = malloc(sizeof(float) * (size_t)(ns + 1)),
          *so = malloc(sizeof(float) * (size_t)(ns + 1));
    double *ref = malloc(sizeof(double) * (size_t)(D + 1)), *ra = malloc(sizeof(double) * (size_t)(D + 1)),
           *rb = malloc(sizeof(double) * (size_t)(D + 1));
    if (!va || !vbb || !vo || !sa || !sb || !so || !ref || !ra || !rb) SKIP("out of memory");
    fill_v(va, dt, nv, &rng);
    fill_v(vbb, dt, nv, &rng);
    for (int64_t i = 0; i < ns; i++) {
        sa[i] = rand_s(&rng, 25);
        sb[i] = rand_s(&rng, 25);
    }
    if (ns > 0) sa[0] = sb[0] = -INFINITY; /* both empty */
    if (ns > 1) sa[1] = sb[1] = 3.0f;      /* equal */
    if (ns > 2) { sa[2] = 100.0f; sb[2] = -100.0f; } /* b negligible */
    int64_t s3[3] = {N, H, D}, s2[2] = {N, H};
    kvc_tensor ta = kvc_tensor_make(va, dt, 3, s3), tb = kvc_tensor_make(vbb, dt, 3, s3),
               to = kvc_tensor_make(vo, dt, 3, s3);
    kvc_tensor tsa = kvc_tensor_make(sa, KVC_F32, 2, s2), tsb = kvc_tensor_make(sb, KVC_F32, 2, s2),
               tso = kvc_tensor_make(so, KVC_F32, 2, s2);
    int fail = 0;
    FOR_EACH_ISA({
        memset(vo, 0x7f, dt_bytes(dt, nv));
        ASSERT_OK(kvc_merge_state(&ta, &tsa, &tb, &tsb, &to, &tso));
        for (int64_t r = 0; r < ns; r++) {
            for (int64_t d = 0; d < D; d++) {
                ra[d] = get_f(va, dt, r * D + d);
                rb[d] = get_f(vbb, dt, r * D + d);
            }
            const double *vv[2] = {ra, rb};
            double ss[2] = {sa[r], sb[r]};
            double sref = ref_merge(2, ss, vv, D, ref);
            CHECK_ROW((const char *)vo + dt_bytes(dt, r * D), dt, D, sref, ref, (double)so[r]);
        }
    });
    free(va); free(vbb); free(vo); free(sa); free(sb); free(so); free(ref); free(ra); free(rb);
    return fail;
}

TEST(merge_state_all_dtypes) {
    for (size_t t = 0; t < sizeof V_DTYPES / sizeof V_DTYPES[0]; t++) {
        if (run_merge_state(V_DTYPES[t], 7, 3, 64, test_seed + t)) return 1;
        if (run_merge_state(V_DTYPES[t], 2, 2, 1100, test_seed + 10 + t)) return 1; /* chunks */
        if (run_merge_state(V_DTYPES[t], 1, 1, 1, test_seed + 20 + t)) return 1;
        if (run_merge_state(V_DTYPES[t], 3, 5, 7, test_seed + 30 + t)) return 1; /* odd D */
    }
    return 0;
}

TEST(merge_state_empty_shapes) {
    /* N = 0, H = 0, D = 0: valid, nothing to do (data may be NULL). */
    int64_t shapes[3][3] = {{0, 4, 8}, {3, 0, 8}, {2, 2, 0}};
    float s[4] = {1.0f, -INFINITY, 2.0f, -INFINITY}, so[4] = {9, 9, 9, 9};
    for (int c = 0; c < 3; c++) {
        int64_t *s3 = shapes[c], s2[2] = {s3[0], s3[1]};
        kvc_tensor v = kvc_tensor_make(NULL, KVC_F16, 3, s3);
        kvc_tensor sa = kvc_tensor_make(s, KVC_F32, 2, s2), sb = sa;
        kvc_tensor st = kvc_tensor_make(so, KVC_F32, 2, s2);
        ASSERT_OK(kvc_merge_state(&v, &sa, &v, &sb, &v, &st));
        if (c == 2) { /* D = 0: s still merged */
            ASSERT_NEAR(so[0], 2.0, 1e-6);
            ASSERT_TRUE(isinf(so[1]) && so[1] < 0);
            ASSERT_NEAR(so[2], 3.0, 1e-6);
            ASSERT_TRUE(isinf(so[3]) && so[3] < 0);
        }
    }
    return 0;
}

TEST(merge_state_empty_state_ignores_its_v) {
    /* An empty state's v (garbage, Inf, NaN) never leaks into the result. */
    float va[4] = {NAN, INFINITY, -INFINITY, 5.0f}, vb[4] = {1, 2, 3, 4}, vo[4];
    float sa = -INFINITY, sb = 0.5f, so;
    int64_t s3[3] = {1, 1, 4}, s2[2] = {1, 1};
    kvc_tensor ta = kvc_tensor_make(va, KVC_F32, 3, s3), tb = kvc_tensor_make(vb, KVC_F32, 3, s3),
               to = kvc_tensor_make(vo, KVC_F32, 3, s3);
    kvc_tensor tsa = kvc_tensor_make(&sa, KVC_F32, 2, s2), tsb = kvc_tensor_make(&sb, KVC_F32, 2, s2),
               tso = kvc_tensor_make(&so, KVC_F32, 2, s2);
    FOR_EACH_ISA({
        ASSERT_OK(kvc_merge_state(&ta, &tsa, &tb, &tsb, &to, &tso));
        for (int d = 0; d < 4; d++) ASSERT_TRUE(vo[d] == vb[d]);
        ASSERT_TRUE(so == 0.5f);
        /* both empty: zeros and -inf, whatever the v's hold */
        sb = -INFINITY;
        ASSERT_OK(kvc_merge_state(&ta, &tsa, &ta, &tsb, &to, &tso));
        for (int d = 0; d < 4; d++) ASSERT_TRUE(vo[d] == 0.0f && !signbit(vo[d]));
        ASSERT_TRUE(isinf(so) && so < 0);
        sb = 0.5f;
    });
    return 0;
}

TEST(merge_state_strided_and_aliased) {
    /* v rows padded (head stride D + 3), s transposed (strides (1, N)), and
     * v_out = v_a, s_out = s_a. */
    enum { N = 4, H = 3, D = 10, HS = D + 3 };
    uint64_t rng = test_seed * 7 + 1;
    float va[N * H * HS], vb[N * H * D], sa[H * N], sb[N * H], va0[N * H * HS], sa0[H * N];
    fill_v(va, KVC_F32, N * H * HS, &rng);
    fill_v(vb, KVC_F32, N * H * D, &rng);
    for (int i = 0; i < N * H; i++) {
        sa[i] = rand_s(&rng, 20);
        sb[i] = rand_s(&rng, 20);
    }
    memcpy(va0, va, sizeof va);
    memcpy(sa0, sa, sizeof sa);
    kvc_tensor ta = {va, KVC_F32, 3, {N, H, D}, {H * HS, HS, 1}};
    kvc_tensor tsa = {sa, KVC_F32, 2, {N, H}, {1, N}};
    int64_t s3[3] = {N, H, D}, s2[2] = {N, H};
    kvc_tensor tb = kvc_tensor_make(vb, KVC_F32, 3, s3), tsb = kvc_tensor_make(sb, KVC_F32, 2, s2);
    ASSERT_OK(kvc_merge_state(&ta, &tsa, &tb, &tsb, &ta, &tsa));
    double ra[D], rb[D], ref[D];
    for (int i = 0; i < N; i++)
        for (int h = 0; h < H; h++) {
            for (int d = 0; d < D; d++) {
                ra[d] = va0[i * H * HS + h * HS + d];
                rb[d] = vb[(i * H + h) * D + d];
            }
            const double *vv[2] = {ra, rb};
            double ss[2] = {sa0[h * N + i], sb[i * H + h]};
            double sref = ref_merge(2, ss, vv, D, ref);
            CHECK_ROW(va + i * H * HS + h * HS, KVC_F32, D, sref, ref, (double)sa[h * N + i]);
            for (int d = D; d < HS; d++) /* padding untouched */
                ASSERT_TRUE(memcmp(&va[i * H * HS + h * HS + d], &va0[i * H * HS + h * HS + d],
                                   4) == 0);
        }
    return 0;
}

/* ---- merge_state_in_place ------------------------------------------------ */

TEST(merge_state_in_place_mask) {
    enum { N = 6, H = 2, D = 33 };
    for (size_t t = 0; t < sizeof V_DTYPES / sizeof V_DTYPES[0]; t++) {
        kvc_dtype dt = V_DTYPES[t];
        uint64_t rng = test_seed + 100 + t;
        unsigned char v0[N * H * D * 4], v[N * H * D * 4], vo[N * H * D * 4];
        float s0[N * H], s[N * H], so[N * H];
        uint8_t mask[N] = {1, 0, 1, 1, 0, 7}; /* any nonzero merges */
        fill_v(v0, dt, N * H * D, &rng);
        fill_v(vo, dt, N * H * D, &rng);
        for (int i = 0; i < N * H; i++) {
            s0[i] = rand_s(&rng, 30);
            so[i] = rand_s(&rng, 30);
        }
        s0[2 * H] = so[2 * H] = -INFINITY;      /* row 2 head 0: both empty */
        s0[1 * H] = NAN;                        /* masked-off rows are not read */
        so[4 * H + 1] = INFINITY;
        int64_t s3[3] = {N, H, D}, s2[2] = {N, H}, s1[1] = {N};
        kvc_tensor tv = kvc_tensor_make(v, dt, 3, s3), tvo = kvc_tensor_make(vo, dt, 3, s3);
        kvc_tensor ts = kvc_tensor_make(s, KVC_F32, 2, s2), tso = kvc_tensor_make(so, KVC_F32, 2, s2);
        kvc_tensor tm = kvc_tensor_make(mask, KVC_U8, 1, s1);
        FOR_EACH_ISA({
            memcpy(v, v0, sizeof v);
            memcpy(s, s0, sizeof s);
            ASSERT_OK(kvc_merge_state_in_place(&tv, &ts, &tvo, &tso, &tm));
            double ra[D], rb[D], ref[D];
            for (int i = 0; i < N; i++)
                for (int h = 0; h < H; h++) {
                    int64_t r = i * H + h;
                    const void *row = v + dt_bytes(dt, r * D);
                    if (!mask[i]) {
                        ASSERT_MEM_EQ(row, v0 + dt_bytes(dt, r * D), dt_bytes(dt, D));
                        ASSERT_MEM_EQ(&s[r], &s0[r], 4);
                        continue;
                    }
                    for (int d = 0; d < D; d++) {
                        ra[d] = get_f(v0, dt, r * D + d);
                        rb[d] = get_f(vo, dt, r * D + d);
                    }
                    const double *vv[2] = {ra, rb};
                    double ss[2] = {s0[r], so[r]};
                    double sref = ref_merge(2, ss, vv, D, ref);
                    CHECK_ROW(row, dt, D, sref, ref, (double)s[r]);
                }
            /* no mask: every row merges (NaN/+inf rows now fail, so clean them) */
            memcpy(v, v0, sizeof v);
            memcpy(s, s0, sizeof s);
            s[1 * H] = 0.0f;
            float keep = so[4 * H + 1];
            so[4 * H + 1] = 1.0f;
            ASSERT_OK(kvc_merge_state_in_place(&tv, &ts, &tvo, &tso, NULL));
            for (int r = 0; r < N * H; r++) {
                for (int d = 0; d < D; d++) {
                    ra[d] = get_f(v0, dt, r * D + d);
                    rb[d] = get_f(vo, dt, r * D + d);
                }
                const double *vv[2] = {ra, rb};
                double ss[2] = {r == H ? 0.0 : s0[r], so[r]};
                double sref = ref_merge(2, ss, vv, D, ref);
                CHECK_ROW(v + dt_bytes(dt, r * D), dt, D, sref, ref, (double)s[r]);
            }
            so[4 * H + 1] = keep;
        });
    }
    return 0;
}

/* ---- merge_states -------------------------------------------------------- */

static int run_merge_states(kvc_dtype dt, int64_t N, int64_t n, int64_t H, int64_t D,
                            uint64_t seed) {
    uint64_t rng = seed;
    int64_t nv = N * n * H * D, ns = N * n * H;
    void *v = malloc(dt_bytes(dt, nv) + 1), *vo = malloc(dt_bytes(dt, N * H * D) + 1);
    float *s = malloc(sizeof(float) * (size_t)(ns + 1)), *so = malloc(sizeof(float) * (size_t)(N * H + 1));
    double *rv = malloc(sizeof(double) * (size_t)(n * D + 1)), *ref = malloc(sizeof(double) * (size_t)(D + 1));
    if (!v || !vo || !s || !so || !rv || !ref) SKIP("out of memory");
    fill_v(v, dt, nv, &rng);
    for (int64_t i = 0; i < ns; i++) s[i] = rand_s(&rng, 30);
    if (N > 0 && H > 0) /* request 0, head 0: every state empty */
        for (int64_t k = 0; k < n; k++) s[k * H] = -INFINITY;
    int64_t s4[4] = {N, n, H, D}, s3[3] = {N, n, H}, o3[3] = {N, H, D}, o2[2] = {N, H};
    kvc_tensor tv = kvc_tensor_make(v, dt, 4, s4), ts = kvc_tensor_make(s, KVC_F32, 3, s3);
    kvc_tensor tvo = kvc_tensor_make(vo, dt, 3, o3), tso = kvc_tensor_make(so, KVC_F32, 2, o2);
    int fail = 0;
    FOR_EACH_ISA({
        memset(vo, 0x7f, dt_bytes(dt, N * H * D));
        ASSERT_OK(kvc_merge_states(&tv, &ts, &tvo, &tso));
        for (int64_t i = 0; i < N; i++)
            for (int64_t h = 0; h < H; h++) {
                double ss[8];
                const double *vv[8];
                for (int64_t k = 0; k < n; k++) {
                    ss[k] = s[(i * n + k) * H + h];
                    for (int64_t d = 0; d < D; d++)
                        rv[k * D + d] = get_f(v, dt, ((i * n + k) * H + h) * D + d);
                    vv[k] = rv + k * D;
                }
                double sref = ref_merge((int)n, ss, vv, D, ref);
                CHECK_ROW((const char *)vo + dt_bytes(dt, (i * H + h) * D), dt, D, sref, ref,
                          (double)so[i * H + h]);
            }
    });
    free(v); free(vo); free(s); free(so); free(rv); free(ref);
    return fail;
}

TEST(merge_states_1_to_5) {
    for (size_t t = 0; t < sizeof V_DTYPES / sizeof V_DTYPES[0]; t++)
        for (int64_t n = 0; n <= 5; n++) {
            if (run_merge_states(V_DTYPES[t], 4, n, 3, 40, test_seed + 7 * (uint64_t)n + t))
                return 1;
        }
    if (run_merge_states(KVC_F32, 2, 3, 2, 1300, test_seed + 99)) return 1; /* chunks */
    return 0;
}

TEST(merge_states_matches_pairwise) {
    /* Folding 2 states with merge_states == merge_state (same math). */
    enum { N = 3, H = 2, D = 17 };
    uint64_t rng = test_seed + 555;
    float v[N * 2 * H * D], s[N * 2 * H], va[N * H * D], vb[N * H * D], sa[N * H], sb[N * H];
    fill_v(v, KVC_F32, N * 2 * H * D, &rng);
    for (int i = 0; i < N * 2 * H; i++) s[i] = rand_s(&rng, 20);
    for (int i = 0; i < N; i++)
        for (int h = 0; h < H; h++) {
            sa[i * H + h] = s[(i * 2 + 0) * H + h];
            sb[i * H + h] = s[(i * 2 + 1) * H + h];
            memcpy(&va[(i * H + h) * D], &v[((i * 2 + 0) * H + h) * D], D * 4);
            memcpy(&vb[(i * H + h) * D], &v[((i * 2 + 1) * H + h) * D], D * 4);
        }
    float o1[N * H * D], o2[N * H * D], so1[N * H], so2[N * H];
    int64_t s4[4] = {N, 2, H, D}, s3[3] = {N, 2, H}, o3[3] = {N, H, D}, ss2[2] = {N, H};
    kvc_tensor tv = kvc_tensor_make(v, KVC_F32, 4, s4), ts = kvc_tensor_make(s, KVC_F32, 3, s3);
    kvc_tensor t1 = kvc_tensor_make(o1, KVC_F32, 3, o3), ts1 = kvc_tensor_make(so1, KVC_F32, 2, ss2);
    kvc_tensor ta = kvc_tensor_make(va, KVC_F32, 3, o3), tsa = kvc_tensor_make(sa, KVC_F32, 2, ss2);
    kvc_tensor tb = kvc_tensor_make(vb, KVC_F32, 3, o3), tsb = kvc_tensor_make(sb, KVC_F32, 2, ss2);
    kvc_tensor t2 = kvc_tensor_make(o2, KVC_F32, 3, o3), ts2 = kvc_tensor_make(so2, KVC_F32, 2, ss2);
    ASSERT_OK(kvc_merge_states(&tv, &ts, &t1, &ts1));
    ASSERT_OK(kvc_merge_state(&ta, &tsa, &tb, &tsb, &t2, &ts2));
    for (int i = 0; i < N * H * D; i++) ASSERT_NEAR(o1[i], o2[i], 1e-6 * (1 + fabs(o2[i])));
    for (int i = 0; i < N * H; i++) {
        if (isinf(so2[i])) ASSERT_TRUE(so1[i] == so2[i]);
        else ASSERT_NEAR(so1[i], so2[i], 1e-6 * (1 + fabs(so2[i])));
    }
    return 0;
}

TEST(merge_isa_bitwise_identical) {
    enum { N = 5, n = 3, H = 2, D = 70 };
    for (size_t t = 0; t < sizeof V_DTYPES / sizeof V_DTYPES[0]; t++) {
        kvc_dtype dt = V_DTYPES[t];
        uint64_t rng = test_seed + 900 + t;
        unsigned char v[N * n * H * D * 4], o[KVC_ISA_COUNT][N * H * D * 4];
        float s[N * n * H], so[KVC_ISA_COUNT][N * H];
        fill_v(v, dt, N * n * H * D, &rng);
        for (int i = 0; i < N * n * H; i++) s[i] = rand_s(&rng, 20);
        int64_t s4[4] = {N, n, H, D}, s3[3] = {N, n, H}, o3[3] = {N, H, D}, o2[2] = {N, H};
        kvc_tensor tv = kvc_tensor_make(v, dt, 4, s4), ts = kvc_tensor_make(s, KVC_F32, 3, s3);
        int last = -1;
        FOR_EACH_ISA({
            kvc_tensor to = kvc_tensor_make(o[isa_], dt, 3, o3);
            kvc_tensor tso = kvc_tensor_make(so[isa_], KVC_F32, 2, o2);
            ASSERT_OK(kvc_merge_states(&tv, &ts, &to, &tso));
            if (last >= 0) {
                ASSERT_MEM_EQ(o[isa_], o[last], dt_bytes(dt, N * H * D));
                ASSERT_MEM_EQ(so[isa_], so[last], sizeof so[0]);
            }
            last = isa_;
        });
    }
    return 0;
}

/* ---- errors -------------------------------------------------------------- */

TEST(merge_errors_write_nothing) {
    enum { N = 2, H = 2, D = 8 };
    float va[N * H * D], vb[N * H * D], vo[N * H * D], sa[N * H], sb[N * H], so[N * H];
    uint16_t vh[N * H * D];
    uint8_t mask[N] = {1, 1};
    int32_t mask32[N] = {1, 1};
    for (int i = 0; i < N * H * D; i++) va[i] = vb[i] = (float)i, vh[i] = 0;
    for (int i = 0; i < N * H; i++) sa[i] = sb[i] = 1.0f;
    int64_t s3[3] = {N, H, D}, s2[2] = {N, H}, s1[1] = {N}, bad3[3] = {N, H, D - 1},
            bad2[2] = {N, H + 1}, s2n[2] = {N + 1, H};
    kvc_tensor ta = kvc_tensor_make(va, KVC_F32, 3, s3), tb = kvc_tensor_make(vb, KVC_F32, 3, s3),
               to = kvc_tensor_make(vo, KVC_F32, 3, s3), th = kvc_tensor_make(vh, KVC_F16, 3, s3),
               tbad = kvc_tensor_make(vb, KVC_F32, 3, bad3);
    kvc_tensor tsa = kvc_tensor_make(sa, KVC_F32, 2, s2), tsb = kvc_tensor_make(sb, KVC_F32, 2, s2),
               tso = kvc_tensor_make(so, KVC_F32, 2, s2),
               tsbad = kvc_tensor_make(sb, KVC_F32, 2, bad2),
               tsn = kvc_tensor_make(sb, KVC_F32, 2, s2n);
    kvc_tensor ts16 = kvc_tensor_make(vh, KVC_F16, 2, s2);
    kvc_tensor tm = kvc_tensor_make(mask, KVC_U8, 1, s1), tm32 = kvc_tensor_make(mask32, KVC_I32, 1, s1);
    kvc_tensor tmbad = kvc_tensor_make(mask, KVC_U8, 1, (int64_t[1]){N - 1});
    kvc_tensor ti8 = kvc_tensor_make(va, KVC_I8, 3, s3);
    kvc_tensor tnc = ta; /* last dim not contiguous */
    tnc.stride[2] = 2;
    tnc.shape[2] = D / 2;
    float vo0[N * H * D], so0[N * H], va0[N * H * D], sa0[N * H];
    memset(vo, 0x5a, sizeof vo);
    memset(so, 0x5a, sizeof so);
    memcpy(vo0, vo, sizeof vo);
    memcpy(so0, so, sizeof so);
    memcpy(va0, va, sizeof va);
    memcpy(sa0, sa, sizeof sa);
#define UNTOUCHED()                                                                                \
    do {                                                                                           \
        ASSERT_MEM_EQ(vo, vo0, sizeof vo);                                                         \
        ASSERT_MEM_EQ(so, so0, sizeof so);                                                         \
        ASSERT_MEM_EQ(va, va0, sizeof va);                                                         \
        ASSERT_MEM_EQ(sa, sa0, sizeof sa);                                                         \
    } while (0)
    const kvc_status E = KVC_ERR_INVALID_ARG;
    ASSERT_STATUS(kvc_merge_state(NULL, &tsa, &tb, &tsb, &to, &tso), E);
    ASSERT_STATUS(kvc_merge_state(&ta, &tsa, &tb, &tsb, NULL, &tso), E);
    ASSERT_STATUS(kvc_merge_state(&ta, &tsa, &tb, &tsb, &to, NULL), E);
    ASSERT_STATUS(kvc_merge_state(&ta, &tsa, &th, &tsb, &to, &tso), E); /* dtype mismatch */
    ASSERT_STR_CONTAINS(kvc_last_error(), "v_b");
    ASSERT_STATUS(kvc_merge_state(&ta, &tsa, &tb, &tsb, &th, &tso), E); /* out dtype */
    ASSERT_STATUS(kvc_merge_state(&ti8, &tsa, &ti8, &tsb, &to, &tso), E); /* int8 v */
    ASSERT_STATUS(kvc_merge_state(&ta, &tsa, &tbad, &tsb, &to, &tso), E); /* shape */
    ASSERT_STATUS(kvc_merge_state(&ta, &tsa, &tb, &tsbad, &to, &tso), E);
    ASSERT_STATUS(kvc_merge_state(&ta, &tsa, &tb, &tsn, &to, &tso), E);
    ASSERT_STATUS(kvc_merge_state(&ta, &tsa, &tb, &ts16, &to, &tso), E); /* s dtype */
    ASSERT_STATUS(kvc_merge_state(&tnc, &tsa, &tb, &tsb, &to, &tso), E);
    kvc_tensor t2d = ta;
    t2d.ndim = 2;
    ASSERT_STATUS(kvc_merge_state(&t2d, &tsa, &tb, &tsb, &to, &tso), E);
    UNTOUCHED();
    sb[3] = NAN;
    ASSERT_STATUS(kvc_merge_state(&ta, &tsa, &tb, &tsb, &to, &tso), E);
    ASSERT_STR_CONTAINS(kvc_last_error(), "s_b[1, 1]");
    sb[3] = INFINITY;
    ASSERT_STATUS(kvc_merge_state(&ta, &tsa, &tb, &tsb, &to, &tso), E);
    UNTOUCHED();
    /* in place: v/s untouched on error */
    ASSERT_STATUS(kvc_merge_state_in_place(&ta, &tsa, &tb, &tsb, &tm), E); /* +inf in s_b */
    sb[3] = 1.0f;
    ASSERT_STATUS(kvc_merge_state_in_place(&ta, &tsa, &tb, &tsb, &tm32), E);
    ASSERT_STATUS(kvc_merge_state_in_place(&ta, &tsa, &tb, &tsb, &tmbad), E);
    ASSERT_STATUS(kvc_merge_state_in_place(&ta, &tsa, &th, &tsb, NULL), E);
    ASSERT_STATUS(kvc_merge_state_in_place(&ta, &tsa, &tb, &tsbad, NULL), E);
    ASSERT_STATUS(kvc_merge_state_in_place(&ta, NULL, &tb, &tsb, NULL), E);
    /* written tensors whose rows share memory (stride 0) */
    kvc_tensor taz = ta, tsaz = tsa, toz = to, tsoz = tso;
    taz.stride[0] = tsaz.stride[0] = toz.stride[0] = tsoz.stride[1] = 0;
    ASSERT_STATUS(kvc_merge_state_in_place(&taz, &tsa, &tb, &tsb, NULL), E);
    ASSERT_STR_CONTAINS(kvc_last_error(), "stride 0");
    ASSERT_STATUS(kvc_merge_state_in_place(&ta, &tsaz, &tb, &tsb, NULL), E);
    ASSERT_STATUS(kvc_merge_state(&ta, &tsa, &tb, &tsb, &toz, &tso), E);
    ASSERT_STR_CONTAINS(kvc_last_error(), "stride 0");
    ASSERT_STATUS(kvc_merge_state(&ta, &tsa, &tb, &tsb, &to, &tsoz), E);
    UNTOUCHED();
    /* merge_states */
    float v4[N * 3 * H * D], s4v[N * 3 * H];
    for (int i = 0; i < N * 3 * H * D; i++) v4[i] = 1.0f;
    for (int i = 0; i < N * 3 * H; i++) s4v[i] = 0.0f;
    int64_t sh4[4] = {N, 3, H, D}, sh3[3] = {N, 3, H}, sh3b[3] = {N, 2, H};
    kvc_tensor tv4 = kvc_tensor_make(v4, KVC_F32, 4, sh4), ts3 = kvc_tensor_make(s4v, KVC_F32, 3, sh3),
               ts3b = kvc_tensor_make(s4v, KVC_F32, 3, sh3b);
    ASSERT_STATUS(kvc_merge_states(&tv4, &ts3b, &to, &tso), E);
    ASSERT_STATUS(kvc_merge_states(&tv4, &ts3, &th, &tso), E);
    ASSERT_STATUS(kvc_merge_states(&tv4, &ts3, &tbad, &tso), E);
    ASSERT_STATUS(kvc_merge_states(&tv4, &ts3, &to, &tsbad), E);
    ASSERT_STATUS(kvc_merge_states(&ta, &tsa, &to, &tso), E); /* 3-D v */
    ASSERT_STATUS(kvc_merge_states(&tv4, &ts3, NULL, &tso), E);
    s4v[5] = NAN;
    ASSERT_STATUS(kvc_merge_states(&tv4, &ts3, &to, &tso), E);
    UNTOUCHED();
    s4v[5] = 0.0f;
    ASSERT_OK(kvc_merge_states(&tv4, &ts3, &to, &tso));
    for (int i = 0; i < N * H * D; i++) ASSERT_NEAR(vo[i], 1.0, 1e-6);
    for (int i = 0; i < N * H; i++) ASSERT_NEAR(so[i], log2(3.0), 1e-6);
#undef UNTOUCHED
    return 0;
}

const test_case test_suite[] = {
    TEST_ENTRY(merge_state_all_dtypes),
    TEST_ENTRY(merge_state_empty_shapes),
    TEST_ENTRY(merge_state_empty_state_ignores_its_v),
    TEST_ENTRY(merge_state_strided_and_aliased),
    TEST_ENTRY(merge_state_in_place_mask),
    TEST_ENTRY(merge_states_1_to_5),
    TEST_ENTRY(merge_states_matches_pairwise),
    TEST_ENTRY(merge_isa_bitwise_identical),
    TEST_ENTRY(merge_errors_write_nothing),
    {0, 0},
};
