/*
 * Suite "quant": float16/bfloat16 conversions and int8/int4 group
 * quantization (SEMANTICS section 1).
 *
 * Three kinds of checks:
 *   - the scalar conversions against references written here from the IEEE
 *     definitions in double precision (exhaustive over 16-bit patterns, every
 *     rounding tie, NaN/Inf/subnormals);
 *   - every ISA the CPU supports (kvc_set_isa) against the scalar ISA, bit
 *     for bit, over grids of sizes, dtypes, group sizes, bits and unaligned
 *     pointers, through the public API (kvc_convert/quantize/dequantize);
 *   - quantization against a reference written here from SEMANTICS section
 *     1 (no library code), plus hand-made cases: zero groups, ties,
 *     extremes, int4 nibble order, NaN/Inf rejection, argument errors.
 * ISA tests restore the ISA that was active when they started.
 */
#include <float.h>
#include <stdlib.h>

#include "test.h"
#include "kernels/kernels.h" /* the two-pass quantize kernels */

/* ---- small helpers ------------------------------------------------------- */

static uint32_t f2u(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float u2f(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static size_t esize(kvc_dtype d) { return d == KVC_F32 ? 4u : 2u; }

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        abort();
    }
    return p;
}

/* Sizes the grids cover: every tail length around 8/16/32 lanes, plus runs
 * of many rows (1024 = 8 heads x 128, 1152 = 9 x 128 has more divisors). */
static const int64_t grid_n[] = {1,  7,  8,   15,  16,  17,  31,   32,   33,  63,
                                 64, 65, 127, 128, 129, 255, 256, 1031, 1024, 1152};
#define GRID_N_COUNT (sizeof grid_n / sizeof grid_n[0])
#define GRID_N_MAX 1152
static const int grid_g[] = {2, 4, 6, 8, 10, 16, 24, 32, 64, 128};
#define GRID_G_COUNT (sizeof grid_g / sizeof grid_g[0])
static const kvc_dtype float_dtypes[] = {KVC_F32, KVC_F16, KVC_BF16};
static const kvc_dtype scale_dtypes[] = {KVC_F32, KVC_F16};

/* Runs a test body, then restores the ISA that was active before, even when
 * an assert returned early. */
#define ISA_TEST(name)                                                                             \
    static int name##_body(void);                                                                  \
    TEST(name) {                                                                                   \
        const kvc_isa isa0_ = kvc_get_isa();                                                       \
        const int r_ = name##_body();                                                              \
        if (kvc_set_isa(isa0_) != KVC_OK) return 1;                                                \
        return r_;                                                                                 \
    }                                                                                              \
    static int name##_body(void)

/* Selects isa if the CPU has it; 0 (skip) otherwise. */
static int use_isa(kvc_isa isa) { return test_isa_usable(isa) && kvc_set_isa(isa) == KVC_OK; }

/* ---- independent references ---------------------------------------------- */

/* round half to even, in double (exact for the values used here). */
static double rhe(double v) {
    const double fl = floor(v), d = v - fl;
    if (d > 0.5) return fl + 1.0;
    if (d < 0.5) return fl;
    return fmod(fl, 2.0) == 0.0 ? fl : fl + 1.0;
}

static int f16_is_nan(uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0; }

/* Value of a non-NaN binary16 pattern, from the definition:
 * (-1)^s * 2^(e-15) * 1.m, or 2^-14 * 0.m for e == 0, Inf for e == 31. */
static double ref_f16_value(uint16_t h) {
    const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    double v;
    if (e == 0) v = ldexp((double)m, -24);
    else if (e == 31) v = HUGE_VAL;
    else v = ldexp(1024.0 + m, e - 25);
    return (h & 0x8000) ? -v : v;
}

/* f32 -> f16 with round to nearest even, from the definition: take the
 * quantum (ulp) of |x|'s binade (2^-24 below 2^-14), round |x| / quantum
 * to an integer (exact in double), then encode. NaN: sign | 0x7c00 | 0x200 |
 * top 10 payload bits (the documented quieting). */
static uint16_t ref_f32_to_f16(float x) {
    const uint32_t u = f2u(x);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    if (isnan(x)) return (uint16_t)(sign | 0x7e00 | ((u & 0x7fffff) >> 13));
    const double a = fabs((double)x);
    /* 65520 is halfway from 65504 (max half) to 65536 (would-be next, odd
     * mantissa 0x3ff + 1 is even): ties and beyond overflow to Inf. */
    if (a >= 65520.0) return (uint16_t)(sign | 0x7c00);
    double quantum = 0x1p-24;
    if (a >= 0x1p-14) {
        int e;
        frexp(a, &e); /* a in [2^(e-1), 2^e): 11 significant bits */
        quantum = ldexp(1.0, e - 11);
    }
    const double v = rhe(a / quantum) * quantum;
    if (v < 0x1p-14) return (uint16_t)(sign | (uint16_t)(v / 0x1p-24));
    int e;
    const double m = frexp(v, &e); /* v = m 2^e, m in [0.5, 1) */
    return (uint16_t)(sign | (uint16_t)((e - 1 + 15) << 10) | (uint16_t)((m * 2.0 - 1.0) * 1024.0));
}

/* f32 -> bf16, nearest even: compare the distances to the two bf16
 * neighbours (truncation and one up, Inf as 2^128) in double. NaN:
 * (u >> 16) | 0x40. Subnormals are kept, like every other value. */
static uint16_t ref_f32_to_bf16(float x) {
    const uint32_t u = f2u(x);
    if (isnan(x)) return (uint16_t)((u >> 16) | 0x40);
    const uint32_t lo = u & 0xffff0000u;
    if (lo == u) return (uint16_t)(u >> 16);
    const uint32_t hi = lo + 0x10000u; /* next magnitude up, same sign */
    const double a = fabs((double)x), dlo = fabs((double)u2f(lo));
    const double dhi = (hi & 0x7fffffffu) == 0x7f800000u ? 0x1p128 : fabs((double)u2f(hi));
    if (a - dlo < dhi - a) return (uint16_t)(lo >> 16);
    if (a - dlo > dhi - a) return (uint16_t)(hi >> 16);
    return (uint16_t)(((lo >> 16) & 1) ? hi >> 16 : lo >> 16);
}

static float ref_bf16_value(uint16_t h) { return u2f((uint32_t)h << 16); }

/* Decodes element i of a float buffer with the references above. */
static float ref_load(const void *x, kvc_dtype d, int64_t i) {
    if (d == KVC_F32) return ((const float *)x)[i];
    const uint16_t h = ((const uint16_t *)x)[i];
    return d == KVC_F16 ? (float)ref_f16_value(h) : ref_bf16_value(h);
}

/*
 * Quantization from SEMANTICS section 1, independent of the library:
 * absmax in float32; scale = max(absmax / qmax, 1e-5) in float32, then
 * rounded to the scale dtype (stored bits in scale_out); q = clamp(
 * round_half_even(x / scale), -qmax, qmax) with the rounded scale.
 */
static void ref_quantize(const float *x, int64_t n, int bits, int g, kvc_dtype sd, int8_t *q,
                         float *scale_used, uint32_t *scale_bits) {
    const float qmax = bits == 8 ? 127.0f : 7.0f;
    for (int64_t g0 = 0; g0 < n; g0 += g) {
        float absmax = 0.0f;
        for (int i = 0; i < g; i++) absmax = fmaxf(absmax, fabsf(x[g0 + i]));
        float s = absmax / qmax;
        if (s < 1e-5f) s = 1e-5f;
        if (sd == KVC_F16) {
            const uint16_t h = ref_f32_to_f16(s);
            scale_bits[g0 / g] = h;
            s = (float)ref_f16_value(h);
        } else {
            scale_bits[g0 / g] = f2u(s);
        }
        scale_used[g0 / g] = s;
        for (int i = 0; i < g; i++) {
            double v = rhe((double)(x[g0 + i] / s));
            if (v > qmax) v = qmax;
            if (v < -qmax) v = -qmax;
            q[g0 + i] = (int8_t)v;
        }
    }
}

/* Element e of a q buffer (int8, or int4 low nibble first), sign-extended. */
static int q_get(const void *q, int bits, int64_t e) {
    if (bits == 8) return ((const int8_t *)q)[e];
    const uint8_t b = ((const uint8_t *)q)[e / 2];
    const int nib = (e & 1) ? b >> 4 : b & 0xf;
    return nib >= 8 ? nib - 16 : nib;
}

/* Fills x (f32) with n values in groups of g, each group of a random kind:
 * zero, tiny (hits the 1e-5 floor), ordinary magnitudes 1e-3..1e4, or big
 * when allowed (4e5: past float16's range, below 65520 * 7, where a float16
 * scale would overflow and the input is refused: quant_f16_scale_overflow). */
static void gen_groups(float *x, int64_t n, int g, int big, uint64_t *rng) {
    for (int64_t g0 = 0; g0 < n; g0 += g) {
        const unsigned kind = (unsigned)(test_rng_next(rng) % 8);
        float mul;
        switch (kind) {
        case 0: mul = 0.0f; break;
        case 1: mul = 1e-7f; break;
        case 7: mul = big ? 4e5f : 3e4f; break;
        default: mul = powf(10.0f, (float)(test_rng_next(rng) % 8) - 3.0f); break;
        }
        for (int i = 0; i < g; i++) x[g0 + i] = test_rng_f32(rng) * mul;
    }
}

/* Stores f32 values as dtype d with the references (exact for f32). */
static void to_dtype(const float *x, int64_t n, void *out, kvc_dtype d) {
    for (int64_t i = 0; i < n; i++) {
        if (d == KVC_F32) ((float *)out)[i] = x[i];
        else if (d == KVC_F16) ((uint16_t *)out)[i] = ref_f32_to_f16(x[i]);
        else ((uint16_t *)out)[i] = ref_f32_to_bf16(x[i]);
    }
}

/* First differing byte, or -1. */
static int64_t mem_diff(const void *a, const void *b, size_t n) {
    const unsigned char *pa = a, *pb = b;
    for (size_t i = 0; i < n; i++)
        if (pa[i] != pb[i]) return (int64_t)i;
    return -1;
}

/* 1 if every byte of p[0..n) is c. */
static int all_bytes(const void *p, size_t n, unsigned char c) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        if (b[i] != c) return 0;
    return 1;
}

/* ---- ISA overview -------------------------------------------------------- */

TEST(isa_support) {
    for (int i = 0; i < KVC_ISA_COUNT; i++) {
        if (kvc_isa_supported((kvc_isa)i)) continue;
        printf("note: ISA %s not supported on this CPU; its kernels are not tested\n",
               kvc_isa_name((kvc_isa)i));
    }
    ASSERT_TRUE(kvc_isa_supported(KVC_ISA_SCALAR));
    ASSERT_TRUE(kvc_isa_supported(kvc_best_isa()));
    return 0;
}

/* ---- scalar conversions vs references ------------------------------------ */

/* All 65536 f16 patterns: f16 -> f32 is exact (NaN keeps sign and payload,
 * as kvc_f16_to_f32 documents in code), and f32 -> f16 gives the pattern
 * back (NaN: quieted, bit 9 set). */
TEST(f16_roundtrip_exhaustive) {
    for (uint32_t h = 0; h < 65536; h++) {
        const float f = kvc_f16_to_f32((uint16_t)h);
        const uint16_t back = kvc_f32_to_f16(f);
        if (f16_is_nan((uint16_t)h)) {
            const uint32_t want = ((h & 0x8000u) << 16) | 0x7f800000u | ((h & 0x3ffu) << 13);
            if (!isnan(f) || f2u(f) != want)
                TEST_FAIL_("f16 NaN 0x%04x -> f32 0x%08x, want 0x%08x", (unsigned)h, f2u(f), want);
            if (back != (h | 0x200u))
                TEST_FAIL_("f16 NaN 0x%04x round trip -> 0x%04x", (unsigned)h, (unsigned)back);
            continue;
        }
        const double want = ref_f16_value((uint16_t)h);
        if ((double)f != want || (f2u(f) >> 31) != (h >> 15))
            TEST_FAIL_("f16 0x%04x -> %.9g, want %.9g", (unsigned)h, (double)f, want);
        if (back != h) TEST_FAIL_("f16 0x%04x round trip -> 0x%04x", (unsigned)h, (unsigned)back);
    }
    return 0;
}

/* Every tie between adjacent halves (both signs, subnormals included, and
 * 65520 between the max half and Inf), one f32 ulp either side of it, and
 * named edge cases, against the double reference and the expected
 * neighbour. */
TEST(f32_to_f16_ties_and_edges) {
    for (uint16_t h = 0; h < 0x7c00; h++) {
        const double a = ref_f16_value(h);
        const double b = h == 0x7bff ? 65536.0 : ref_f16_value((uint16_t)(h + 1));
        const float mid = (float)((a + b) / 2); /* 12 significant bits: exact */
        ASSERT_TRUE((double)mid == (a + b) / 2);
        const uint16_t even = (h & 1) ? (uint16_t)(h + 1) : h;
        for (int s = 0; s < 2; s++) {
            const uint16_t sg = s ? 0x8000 : 0;
            const float m = s ? -mid : mid;
            const float below = nextafterf(m, 0.0f), above = nextafterf(m, s ? -INFINITY : INFINITY);
            const uint16_t got = kvc_f32_to_f16(m), got_lo = kvc_f32_to_f16(below),
                           got_hi = kvc_f32_to_f16(above);
            if (got != (sg | even) || got != ref_f32_to_f16(m))
                TEST_FAIL_("tie %.9g -> 0x%04x, want 0x%04x", (double)m, got, sg | even);
            if (got_lo != (sg | h) || got_lo != ref_f32_to_f16(below))
                TEST_FAIL_("below tie %.9g -> 0x%04x, want 0x%04x", (double)below, got_lo, sg | h);
            if (got_hi != (sg | (h + 1)) || got_hi != ref_f32_to_f16(above))
                TEST_FAIL_("above tie %.9g -> 0x%04x", (double)above, got_hi);
        }
    }
    static const struct {
        float x;
        uint16_t want;
    } cases[] = {
        {65504.0f, 0x7bff},         {65519.99609375f, 0x7bff}, {65520.0f, 0x7c00},
        {-65520.0f, 0xfc00},        {1e9f, 0x7c00},            {FLT_MAX, 0x7c00},
        {0x1p-24f, 0x0001},         {0x1p-25f, 0x0000},        {-0x1p-25f, 0x8000},
        {0x1.8p-25f, 0x0001},       {0x1.8p-24f, 0x0002},      {0x1p-14f, 0x0400},
        {0x1.ffcp-15f, 0x0400},     {1e-40f, 0x0000},          {-0.0f, 0x8000},
        {1.0f, 0x3c00},             {1.00048828125f, 0x3c00},  {1.00146484375f, 0x3c02},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const uint16_t got = kvc_f32_to_f16(cases[i].x);
        if (got != cases[i].want || got != ref_f32_to_f16(cases[i].x))
            TEST_FAIL_("f16(%a) = 0x%04x, want 0x%04x", (double)cases[i].x, got, cases[i].want);
    }
    ASSERT_EQ_I64(kvc_f32_to_f16(INFINITY), 0x7c00);
    ASSERT_EQ_I64(kvc_f32_to_f16(-INFINITY), 0xfc00);
    ASSERT_EQ_I64(kvc_f32_to_f16(u2f(0x7fc00000u)), 0x7e00);
    ASSERT_EQ_I64(kvc_f32_to_f16(u2f(0x7f800001u)), 0x7e00);  /* sNaN, low payload lost */
    ASSERT_EQ_I64(kvc_f32_to_f16(u2f(0xffa02000u)), 0xff01);  /* sNaN quieted, payload kept */
    ASSERT_EQ_I64(kvc_f32_to_f16(u2f(0x7fffffffu)), 0x7fff);
    /* Random bit patterns: every class of input. */
    uint64_t rng = test_seed;
    for (int i = 0; i < 2000000; i++) {
        const float x = u2f((uint32_t)test_rng_next(&rng));
        const uint16_t got = kvc_f32_to_f16(x), want = ref_f32_to_f16(x);
        if (got != want) TEST_FAIL_("f16(0x%08x) = 0x%04x, want 0x%04x", f2u(x), got, want);
    }
    return 0;
}

/* bf16: exhaustive round trip, every tie (u = h << 16 | 0x8000) and its
 * neighbours, NaN, Inf, denormals kept (not flushed). */
TEST(bf16_exhaustive_and_ties) {
    for (uint32_t h = 0; h < 65536; h++) {
        const float f = kvc_bf16_to_f32((uint16_t)h);
        ASSERT_EQ_I64(f2u(f), h << 16);
        const int nan = (h & 0x7f80) == 0x7f80 && (h & 0x7f);
        ASSERT_EQ_I64(kvc_f32_to_bf16(f), nan ? (h | 0x40) : h);
        if ((h & 0x7f80) == 0x7f80) continue; /* no tie above Inf/NaN */
        const uint32_t tie = (h << 16) | 0x8000u;
        const uint16_t up = (uint16_t)(h + 1), even = (h & 1) ? up : (uint16_t)h;
        const uint32_t probes[3] = {tie, tie - 1, tie + 1};
        const uint16_t wants[3] = {even, (uint16_t)h, up};
        for (int k = 0; k < 3; k++) {
            const float x = u2f(probes[k]);
            const uint16_t got = kvc_f32_to_bf16(x);
            if (got != wants[k] || got != ref_f32_to_bf16(x))
                TEST_FAIL_("bf16(0x%08x) = 0x%04x, want 0x%04x", probes[k], got, wants[k]);
        }
    }
    ASSERT_EQ_I64(kvc_f32_to_bf16(INFINITY), 0x7f80);
    ASSERT_EQ_I64(kvc_f32_to_bf16(-INFINITY), 0xff80);
    ASSERT_EQ_I64(kvc_f32_to_bf16(FLT_MAX), 0x7f80);           /* rounds up into Inf */
    ASSERT_EQ_I64(kvc_f32_to_bf16(u2f(0x7f7f7fffu)), 0x7f7f);  /* just below the tie */
    ASSERT_EQ_I64(kvc_f32_to_bf16(u2f(0x7f800001u)), 0x7fc0);  /* sNaN quieted */
    ASSERT_EQ_I64(kvc_f32_to_bf16(u2f(0xffffffffu)), 0xffff);
    ASSERT_EQ_I64(kvc_f32_to_bf16(u2f(0x00018000u)), 0x0002);  /* denormal tie, to even */
    ASSERT_EQ_I64(kvc_f32_to_bf16(u2f(0x00008000u)), 0x0000);
    ASSERT_EQ_I64(kvc_f32_to_bf16(u2f(0x00008001u)), 0x0001);
    ASSERT_EQ_I64(kvc_f32_to_bf16(1e-40f), ref_f32_to_bf16(1e-40f));
    ASSERT_TRUE(kvc_f32_to_bf16(1e-40f) != 0); /* denormal kept */
    uint64_t rng = test_seed ^ 0x5bf16;
    for (int i = 0; i < 2000000; i++) {
        const float x = u2f((uint32_t)test_rng_next(&rng));
        const uint16_t got = kvc_f32_to_bf16(x), want = ref_f32_to_bf16(x);
        if (got != want) TEST_FAIL_("bf16(0x%08x) = 0x%04x, want 0x%04x", f2u(x), got, want);
    }
    return 0;
}

/* ---- every ISA: conversions ---------------------------------------------- */

/* f32 inputs that exercise every rounding decision: all f16 and bf16 ties
 * and their neighbours (both signs), NaN payloads, Inf, denormals. */
static size_t build_f32_specials(float *out) {
    size_t k = 0;
    for (uint16_t h = 0; h < 0x7c00; h++) {
        const double a = ref_f16_value(h);
        const double b = h == 0x7bff ? 65536.0 : ref_f16_value((uint16_t)(h + 1));
        const float mid = (float)((a + b) / 2);
        const float v[3] = {mid, nextafterf(mid, 0.0f), nextafterf(mid, INFINITY)};
        for (int i = 0; i < 3; i++) {
            out[k++] = v[i];
            out[k++] = -v[i];
        }
    }
    for (uint32_t h = 0; h < 0x7f80; h++) {
        const uint32_t tie = (h << 16) | 0x8000u;
        const uint32_t v[3] = {tie, tie - 1, tie + 1};
        for (int i = 0; i < 3; i++) {
            out[k++] = u2f(v[i]);
            out[k++] = u2f(v[i] | 0x80000000u);
        }
    }
    static const uint32_t specials[] = {
        0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00000u,
        0x7f800001u, 0x7fa00000u, 0xffa02000u, 0x7fbfffffu, 0x7fffffffu, 0xffffffffu,
        0x00000001u, 0x007fffffu, 0x80400000u, 0x7f7fffffu, 0x477fe000u, 0x477ff000u,
    };
    for (size_t i = 0; i < sizeof specials / sizeof specials[0]; i++) out[k++] = u2f(specials[i]);
    return k;
}
#define F32_SPECIALS_MAX (6u * 0x7c00u + 6u * 0x7f80u + 64u)

/* Converts src (n of sd) under every ISA and checks each against the
 * scalar ISA; want, if not NULL, is the expected output as well. */
static int convert_all_isas(const void *src, kvc_dtype sd, kvc_dtype dd, int64_t n,
                            const void *want, void *ref, void *out) {
    const size_t bytes = (size_t)n * esize(dd);
    ASSERT_TRUE(use_isa(KVC_ISA_SCALAR));
    ASSERT_OK(kvc_convert(src, sd, ref, dd, n));
    if (want) {
        const int64_t d = mem_diff(ref, want, bytes);
        if (d >= 0)
            TEST_FAIL_("scalar %s -> %s differs from the reference at byte %lld",
                       kvc_dtype_name(sd), kvc_dtype_name(dd), (long long)d);
    }
    for (int i = KVC_ISA_SCALAR + 1; i < KVC_ISA_COUNT; i++) {
        if (!use_isa((kvc_isa)i)) continue;
        memset(out, 0xcd, bytes);
        ASSERT_OK(kvc_convert(src, sd, out, dd, n));
        const int64_t d = mem_diff(ref, out, bytes);
        if (d >= 0) {
            const int64_t e = d / (int64_t)esize(dd);
            TEST_FAIL_("%s %s -> %s differs from scalar at element %lld", kvc_isa_name((kvc_isa)i),
                       kvc_dtype_name(sd), kvc_dtype_name(dd), (long long)e);
        }
    }
    return 0;
}

/* Every 16-bit pattern through every 16-bit -> other conversion, and all
 * the f32 rounding cases to f16/bf16, on every ISA (vs scalar and vs the
 * references where they apply). */
ISA_TEST(isa_convert_exhaustive) {
    uint16_t *h = xmalloc(65536 * 2);
    float *f = xmalloc(F32_SPECIALS_MAX * 4);
    uint16_t *want16 = xmalloc(F32_SPECIALS_MAX * 2);
    void *ref = xmalloc(F32_SPECIALS_MAX * 4), *out = xmalloc(F32_SPECIALS_MAX * 4);
    int r = 0;
    for (uint32_t i = 0; i < 65536; i++) h[i] = (uint16_t)i;
    const size_t nf = build_f32_specials(f);
    for (int sdi = 1; sdi < 3 && !r; sdi++)
        for (int ddi = 0; ddi < 3 && !r; ddi++)
            if (sdi != ddi)
                r = convert_all_isas(h, float_dtypes[sdi], float_dtypes[ddi], 65536, NULL, ref, out);
    if (!r) {
        for (size_t i = 0; i < nf; i++) want16[i] = ref_f32_to_f16(f[i]);
        r = convert_all_isas(f, KVC_F32, KVC_F16, (int64_t)nf, want16, ref, out);
    }
    if (!r) {
        for (size_t i = 0; i < nf; i++) want16[i] = ref_f32_to_bf16(f[i]);
        r = convert_all_isas(f, KVC_F32, KVC_BF16, (int64_t)nf, want16, ref, out);
    }
    free(h);
    free(f);
    free(want16);
    free(ref);
    free(out);
    return r;
}

/* Sizes x dtype pairs x unaligned pointers: every ISA equals scalar, and
 * nothing past the n outputs is written. */
ISA_TEST(isa_convert_grid) {
    enum { PAD = 16 };
    const size_t cap = (GRID_N_MAX + 8 + PAD) * 4;
    unsigned char *src[3], *ref = xmalloc(cap), *out = xmalloc(cap);
    uint64_t rng = test_seed ^ 0xc0de;
    float *f = xmalloc(F32_SPECIALS_MAX * 4);
    const size_t nf = build_f32_specials(f);
    for (int d = 0; d < 3; d++) src[d] = xmalloc(cap);
    for (size_t i = 0; i < cap / 4; i++) {
        /* f32 source: ordinary values, random bit patterns and special cases mixed. */
        const uint64_t r = test_rng_next(&rng);
        float v;
        if (r % 4 == 0) v = u2f((uint32_t)(r >> 32));
        else if (r % 4 == 1) v = f[(r >> 32) % nf];
        else v = test_rng_f32(&rng) * 100.0f;
        memcpy(src[0] + 4 * i, &v, 4);
    }
    for (size_t i = 0; i < cap / 2; i++) { /* 16-bit sources: any pattern */
        const uint16_t a = (uint16_t)test_rng_next(&rng), b = (uint16_t)test_rng_next(&rng);
        memcpy(src[1] + 2 * i, &a, 2);
        memcpy(src[2] + 2 * i, &b, 2);
    }
    free(f);
    int fail = 0;
    for (size_t ni = 0; ni < GRID_N_COUNT && !fail; ni++) {
        const int64_t n = grid_n[ni];
        for (int o = 0; o < 4 && !fail; o++) {
            const int od = (o + 1) % 4; /* src and dst misaligned differently */
            for (int si = 0; si < 3 && !fail; si++) {
                for (int di = 0; di < 3 && !fail; di++) {
                    const kvc_dtype sd = float_dtypes[si], dd = float_dtypes[di];
                    const void *s = src[si] + (size_t)o * esize(sd);
                    const size_t span = (size_t)(n + od + PAD) * esize(dd);
                    ASSERT_TRUE(use_isa(KVC_ISA_SCALAR));
                    memset(ref, 0xcd, span);
                    ASSERT_OK(kvc_convert(s, sd, ref + (size_t)od * esize(dd), dd, n));
                    ASSERT_TRUE(all_bytes(ref, (size_t)od * esize(dd), 0xcd));
                    ASSERT_TRUE(all_bytes(ref + (size_t)(n + od) * esize(dd), PAD * esize(dd), 0xcd));
                    for (int isa = 1; isa < KVC_ISA_COUNT; isa++) {
                        if (!use_isa((kvc_isa)isa)) continue;
                        memset(out, 0xcd, span);
                        ASSERT_OK(kvc_convert(s, sd, out + (size_t)od * esize(dd), dd, n));
                        const int64_t d = mem_diff(ref, out, span);
                        if (d >= 0) {
                            fprintf(stderr, "  %s n=%lld %s->%s offsets %d/%d: byte %lld\n",
                                    kvc_isa_name((kvc_isa)isa), (long long)n, kvc_dtype_name(sd),
                                    kvc_dtype_name(dd), o, od, (long long)d);
                            fail = 1;
                        }
                    }
                }
            }
        }
    }
    for (int d = 0; d < 3; d++) free(src[d]);
    free(ref);
    free(out);
    ASSERT_TRUE(!fail);
    return 0;
}

/* ---- every ISA: quantize / dequantize vs scalar -------------------------- */

typedef struct qbufs {
    unsigned char *x, *q, *s, *y; /* each with room for offsets and a canary */
} qbufs;

enum { QPAD = 16 };

/*
 * One configuration under every ISA against the scalar ISA: quantize x
 * (unaligned by o elements) into q/scale (unaligned by o), then dequantize
 * that to every output dtype. Compares whole buffers, so writes past the
 * end (canary 0xcd) are caught too.
 */
static int quant_config(const void *x, kvc_dtype xd, int64_t n, int bits, int g, kvc_dtype sd,
                        int o, qbufs *ref, qbufs *out) {
    const size_t qspan = (size_t)(bits == 8 ? n : n / 2) + (size_t)o + QPAD;
    const size_t sspan = ((size_t)(n / g) + (size_t)o + QPAD) * esize(sd);
    ASSERT_TRUE(use_isa(KVC_ISA_SCALAR));
    memset(ref->q, 0xcd, qspan);
    memset(ref->s, 0xcd, sspan);
    ASSERT_OK(kvc_quantize(x, xd, n, bits, g, ref->q + o, ref->s + (size_t)o * esize(sd), sd));
    for (int isa = 1; isa < KVC_ISA_COUNT; isa++) {
        if (!use_isa((kvc_isa)isa)) continue;
        memset(out->q, 0xcd, qspan);
        memset(out->s, 0xcd, sspan);
        ASSERT_OK(kvc_quantize(x, xd, n, bits, g, out->q + o, out->s + (size_t)o * esize(sd), sd));
        const int64_t dq = mem_diff(ref->q, out->q, qspan), ds = mem_diff(ref->s, out->s, sspan);
        if (dq >= 0 || ds >= 0)
            TEST_FAIL_("%s quantize n=%lld g=%d bits=%d x=%s scale=%s off=%d: q byte %lld, "
                       "scale byte %lld differ",
                       kvc_isa_name((kvc_isa)isa), (long long)n, g, bits, kvc_dtype_name(xd),
                       kvc_dtype_name(sd), o, (long long)dq, (long long)ds);
    }
    for (int yi = 0; yi < 3; yi++) {
        const kvc_dtype yd = float_dtypes[yi];
        const size_t yspan = (size_t)(n + o + QPAD) * esize(yd);
        const void *q = ref->q + o, *s = ref->s + (size_t)o * esize(sd);
        ASSERT_TRUE(use_isa(KVC_ISA_SCALAR));
        memset(ref->y, 0xcd, yspan);
        ASSERT_OK(kvc_dequantize(q, bits, s, sd, n, g, ref->y + (size_t)o * esize(yd), yd));
        for (int isa = 1; isa < KVC_ISA_COUNT; isa++) {
            if (!use_isa((kvc_isa)isa)) continue;
            memset(out->y, 0xcd, yspan);
            ASSERT_OK(kvc_dequantize(q, bits, s, sd, n, g, out->y + (size_t)o * esize(yd), yd));
            const int64_t d = mem_diff(ref->y, out->y, yspan);
            if (d >= 0)
                TEST_FAIL_("%s dequantize n=%lld g=%d bits=%d scale=%s y=%s off=%d: byte %lld",
                           kvc_isa_name((kvc_isa)isa), (long long)n, g, bits, kvc_dtype_name(sd),
                           kvc_dtype_name(yd), o, (long long)d);
        }
    }
    return 0;
}

static void qbufs_alloc(qbufs *b) {
    const size_t cap = (GRID_N_MAX + 8 + QPAD) * 4;
    b->x = xmalloc(cap);
    b->q = xmalloc(cap);
    b->s = xmalloc(cap);
    b->y = xmalloc(cap);
}

static void qbufs_free(qbufs *b) {
    free(b->x);
    free(b->q);
    free(b->s);
    free(b->y);
}

/* n x g x bits x scale dtype x input dtype x offsets 0..3. */
ISA_TEST(isa_quant_grid) {
    qbufs ref, out, in;
    qbufs_alloc(&ref);
    qbufs_alloc(&out);
    qbufs_alloc(&in);
    float *xf = xmalloc((GRID_N_MAX + 8) * 4);
    uint64_t rng = test_seed ^ 0x9a4;
    int r = 0, configs = 0;
    for (size_t ni = 0; ni < GRID_N_COUNT && !r; ni++) {
        const int64_t n = grid_n[ni];
        for (size_t gi = 0; gi < GRID_G_COUNT && !r; gi++) {
            const int g = grid_g[gi];
            if (n % g) continue;
            for (int xi = 0; xi < 3 && !r; xi++) {
                const kvc_dtype xd = float_dtypes[xi];
                for (int o = 0; o < 4 && !r; o++) {
                    gen_groups(xf, n, g, xd != KVC_F16, &rng);
                    unsigned char *x = in.x + (size_t)o * esize(xd);
                    to_dtype(xf, n, x, xd);
                    for (int bits = 8; bits >= 4 && !r; bits -= 4)
                        for (int si = 0; si < 2 && !r; si++, configs++)
                            r = quant_config(x, xd, n, bits, g, scale_dtypes[si], o, &ref, &out);
                }
            }
        }
    }
    qbufs_free(&ref);
    qbufs_free(&out);
    qbufs_free(&in);
    free(xf);
    if (!r) ASSERT_TRUE(configs > 1000);
    return r;
}

/* Dequantize of arbitrary bytes: every int8/int4 code (incl. -128 and -8,
 * which quantize never writes) and arbitrary scale bit patterns (negative,
 * zero, subnormal, Inf, NaN), on every ISA vs scalar. */
ISA_TEST(isa_dequant_random_codes) {
    const size_t cap = (GRID_N_MAX + 8 + QPAD) * 4;
    unsigned char *q = xmalloc(cap), *s = xmalloc(cap), *ref = xmalloc(cap), *out = xmalloc(cap);
    uint64_t rng = test_seed ^ 0xde9;
    for (size_t i = 0; i < cap; i++) q[i] = (unsigned char)test_rng_next(&rng);
    for (size_t i = 0; i < cap / 4; i++) {
        const uint64_t r = test_rng_next(&rng);
        /* Mostly ordinary scales, some arbitrary bit patterns. */
        const float v = r % 8 == 0 ? u2f((uint32_t)(r >> 32)) : test_rng_f32(&rng) * 0.1f;
        memcpy(s + 4 * i, &v, 4);
    }
    int fail = 0;
    for (size_t ni = 0; ni < GRID_N_COUNT && !fail; ni++) {
        const int64_t n = grid_n[ni];
        for (size_t gi = 0; gi < GRID_G_COUNT && !fail; gi++) {
            const int g = grid_g[gi];
            if (n % g) continue;
            for (int bits = 8; bits >= 4; bits -= 4)
                for (int si = 0; si < 2; si++)
                    for (int yi = 0; yi < 3; yi++)
                        for (int o = 0; o < 4; o++) {
                            const kvc_dtype sd = scale_dtypes[si], yd = float_dtypes[yi];
                            const void *qp = q + o, *sp = s + (size_t)o * esize(sd);
                            const size_t span = (size_t)(n + o + QPAD) * esize(yd);
                            ASSERT_TRUE(use_isa(KVC_ISA_SCALAR));
                            memset(ref, 0xcd, span);
                            ASSERT_OK(kvc_dequantize(qp, bits, sp, sd, n, g,
                                                     ref + (size_t)o * esize(yd), yd));
                            for (int isa = 1; isa < KVC_ISA_COUNT; isa++) {
                                if (!use_isa((kvc_isa)isa)) continue;
                                memset(out, 0xcd, span);
                                ASSERT_OK(kvc_dequantize(qp, bits, sp, sd, n, g,
                                                         out + (size_t)o * esize(yd), yd));
                                const int64_t d = mem_diff(ref, out, span);
                                if (d >= 0) {
                                    fprintf(stderr,
                                            "  %s n=%lld g=%d bits=%d scale=%s y=%s off=%d: "
                                            "byte %lld\n",
                                            kvc_isa_name((kvc_isa)isa), (long long)n, g, bits,
                                            kvc_dtype_name(sd), kvc_dtype_name(yd), o,
                                            (long long)d);
                                    fail = 1;
                                }
                            }
                        }
        }
    }
    free(q);
    free(s);
    free(ref);
    free(out);
    ASSERT_TRUE(!fail);
    return 0;
}

/* ---- every ISA: quantization vs the SEMANTICS reference ------------------ */

/* Random groups (all kinds, incl. zero, tiny, f16-scale overflow) on every
 * ISA against ref_quantize, and dequantization against (float)q * scale
 * converted with the reference conversions. */
ISA_TEST(isa_quant_vs_reference) {
    enum { N = 1920 }; /* divisible by every g below */
    static const int gs[] = {6, 8, 10, 16, 24, 32, 64, 128};
    float *xf = xmalloc(N * 4), *xv = xmalloc(N * 4), *su = xmalloc(N * 4);
    unsigned char *x = xmalloc(N * 4), *q = xmalloc(N), *s = xmalloc(N * 4), *y = xmalloc(N * 4);
    int8_t *qr = xmalloc(N);
    uint32_t *sb = xmalloc(N * 4);
    uint64_t rng = test_seed ^ 0x5e3;
    int r = 0;
    for (int isa = 0; isa < KVC_ISA_COUNT && !r; isa++) {
        if (!use_isa((kvc_isa)isa)) continue;
        for (size_t gi = 0; gi < sizeof gs / sizeof gs[0] && !r; gi++) {
            const int g = gs[gi];
            for (int xi = 0; xi < 3 && !r; xi++) {
                const kvc_dtype xd = float_dtypes[xi];
                gen_groups(xf, N, g, xd != KVC_F16, &rng);
                to_dtype(xf, N, x, xd);
                for (int i = 0; i < N; i++) xv[i] = ref_load(x, xd, i); /* what the library sees */
                for (int bits = 8; bits >= 4 && !r; bits -= 4) {
                    for (int si = 0; si < 2 && !r; si++) {
                        const kvc_dtype sd = scale_dtypes[si];
                        ref_quantize(xv, N, bits, g, sd, qr, su, sb);
                        ASSERT_OK(kvc_quantize(x, xd, N, bits, g, q, s, sd));
                        for (int k = 0; k < N / g; k++) {
                            const uint32_t got = sd == KVC_F32 ? f2u(((float *)s)[k])
                                                               : ((uint16_t *)s)[k];
                            if (got != sb[k])
                                TEST_FAIL_("%s g=%d bits=%d x=%s scale=%s: scale %d = 0x%x, "
                                           "want 0x%x",
                                           kvc_isa_name((kvc_isa)isa), g, bits, kvc_dtype_name(xd),
                                           kvc_dtype_name(sd), k, got, sb[k]);
                        }
                        for (int e = 0; e < N; e++)
                            if (q_get(q, bits, e) != qr[e])
                                TEST_FAIL_("%s g=%d bits=%d x=%s scale=%s: q[%d] = %d, want %d "
                                           "(x %.9g, scale %.9g)",
                                           kvc_isa_name((kvc_isa)isa), g, bits, kvc_dtype_name(xd),
                                           kvc_dtype_name(sd), e, q_get(q, bits, e), qr[e],
                                           (double)xv[e], (double)su[e / g]);
                        for (int yi = 0; yi < 3; yi++) {
                            const kvc_dtype yd = float_dtypes[yi];
                            ASSERT_OK(kvc_dequantize(q, bits, s, sd, N, g, y, yd));
                            for (int e = 0; e < N; e++) {
                                const float v = (float)qr[e] * su[e / g];
                                uint32_t want, got;
                                if (yd == KVC_F32) {
                                    want = f2u(v);
                                    got = f2u(((float *)y)[e]);
                                } else {
                                    want = yd == KVC_F16 ? ref_f32_to_f16(v) : ref_f32_to_bf16(v);
                                    got = ((uint16_t *)y)[e];
                                }
                                if (got != want)
                                    TEST_FAIL_("%s dequant g=%d bits=%d y=%s: y[%d] = 0x%x, want "
                                               "0x%x",
                                               kvc_isa_name((kvc_isa)isa), g, bits,
                                               kvc_dtype_name(yd), e, got, want);
                            }
                        }
                    }
                }
            }
        }
    }
    free(xf);
    free(xv);
    free(su);
    free(x);
    free(q);
    free(s);
    free(y);
    free(qr);
    free(sb);
    return r;
}

/* ---- hand-made cases, every ISA ------------------------------------------ */

/* Quantizes n f32 values (converted to xd first) on the current ISA and
 * unpacks q and the stored scales as f32. */
static kvc_status quant_simple(const float *xf, kvc_dtype xd, int64_t n, int bits, int g,
                               kvc_dtype sd, int *q, float *scale) {
    unsigned char x[512 * 4], qb[512], sb[512 * 4];
    to_dtype(xf, n, x, xd);
    const kvc_status st = kvc_quantize(x, xd, n, bits, g, qb, sb, sd);
    if (st != KVC_OK) return st;
    for (int64_t e = 0; e < n; e++) q[e] = q_get(qb, bits, e);
    for (int64_t k = 0; k < n / g; k++)
        scale[k] = sd == KVC_F32 ? ((float *)sb)[k] : kvc_f16_to_f32(((uint16_t *)sb)[k]);
    return KVC_OK;
}

/* All-zero groups: scale exactly float(1e-5) (f16: its rounding, 168 *
 * 2^-24, bits 0x00a8) and every q 0; the next group is unaffected. */
ISA_TEST(quant_zero_groups) {
    float x[64] = {0};
    for (int i = 32; i < 64; i++) x[i] = (float)(i - 48) / 4.0f;
    int q[64];
    float s[8];
    for (int isa = 0; isa < KVC_ISA_COUNT; isa++) {
        if (!use_isa((kvc_isa)isa)) continue;
        for (int bits = 8; bits >= 4; bits -= 4) {
            for (int gi = 0; gi < 2; gi++) {
                const int g = gi ? 8 : 32; /* g = 8: the two-groups-per-vector path */
                for (int xi = 0; xi < 3; xi++) {
                    ASSERT_OK(quant_simple(x, float_dtypes[xi], 64, bits, g, KVC_F32, q, s));
                    ASSERT_EQ_I64(f2u(s[0]), f2u(1e-5f));
                    for (int i = 0; i < 32; i++) ASSERT_EQ_I64(q[i], 0);
                    unsigned char qb[64];
                    uint16_t sh[8];
                    ASSERT_OK(kvc_quantize(x, KVC_F32, 64, bits, g, qb, sh, KVC_F16));
                    ASSERT_EQ_I64(sh[0], ref_f32_to_f16(1e-5f));
                    ASSERT_EQ_I64(sh[0], 0x00a8);
                    for (int i = 0; i < 32 * bits / 8; i++) ASSERT_EQ_I64(qb[i], 0);
                }
            }
        }
    }
    return 0;
}

/* Ties of x / scale round half to even: with scale exactly 1 (absmax =
 * qmax) and 0.5 (absmax 63.5 for int8), in every input dtype, for group
 * sizes taking each code path (scalar g = 6 through 16-lane groups). */
ISA_TEST(quant_ties) {
    static const float x8[8] = {127.0f, 2.5f, 3.5f, -2.5f, -3.5f, 0.5f, 1.5f, -0.5f};
    static const int q8[8] = {127, 2, 4, -2, -4, 0, 2, 0};
    static const float x4[8] = {7.0f, 2.5f, -2.5f, 3.5f, -3.5f, 6.5f, -6.5f, 0.5f};
    static const int q4[8] = {7, 2, -2, 4, -4, 6, -6, 0};
    static const float xh[8] = {63.5f, 1.25f, 1.75f, -1.25f, -1.75f, 0.25f, -63.5f, 0.75f};
    static const int qh[8] = {127, 2, 4, -2, -4, 0, -127, 2};
    static const int gs[] = {6, 8, 16, 32};
    for (int isa = 0; isa < KVC_ISA_COUNT; isa++) {
        if (!use_isa((kvc_isa)isa)) continue;
        for (size_t gi = 0; gi < sizeof gs / sizeof gs[0]; gi++) {
            const int g = gs[gi];
            for (int c = 0; c < 3; c++) {
                const float *src = c == 0 ? x8 : c == 1 ? x4 : xh;
                const int *want = c == 0 ? q8 : c == 1 ? q4 : qh;
                const int bits = c == 1 ? 4 : 8;
                const float want_scale = c == 2 ? 0.5f : 1.0f;
                /* 256 elements (so the 128-element block paths run too): the 8 values, then zeros, repeated per group of g (g = 6
                 * sees the first 6 values, whose absmax sets the same scale). */
                float x[256];
                int wq[256];
                for (int i = 0; i < 256; i++) {
                    const int k = i % g;
                    x[i] = k < 8 ? src[k] : 0.0f;
                    wq[i] = k < 8 ? want[k] : 0;
                }
                const int n = 256 - 256 % g;
                for (int xi = 0; xi < 3; xi++) {
                    for (int si = 0; si < 2; si++) {
                        int q[256];
                        float s[256];
                        ASSERT_OK(quant_simple(x, float_dtypes[xi], n, bits, g, scale_dtypes[si], q, s));
                        for (int k = 0; k < n / g; k++) ASSERT_EQ_I64(f2u(s[k]), f2u(want_scale));
                        for (int i = 0; i < n; i++)
                            if (q[i] != wq[i])
                                TEST_FAIL_("%s g=%d case %d x=%s: q[%d] = %d, want %d (x %g)",
                                           kvc_isa_name((kvc_isa)isa), g, c,
                                           kvc_dtype_name(float_dtypes[xi]), i, q[i], wq[i],
                                           (double)x[i]);
                    }
                }
            }
        }
    }
    return 0;
}

/*
 * Exact ties and their neighbours at scale: every group gets absmax
 * 127 * m * 2^e (or 7 * m * 2^e), so the scale is exactly m * 2^e in every
 * dtype, and the other values are (k + 1/2) * m * 2^e, one ulp either side of
 * it, or random. Each ISA
 * must match the scalar kernel bit for bit: fast paths that multiply by a
 * reciprocal have to notice these and divide.
 */
ISA_TEST(isa_quant_ties_random) {
    enum { N = 1024 };
    static float xf[N];
    static unsigned char xs[N * 4], ref_q[N], out_q[N], ref_s[N * 4], out_s[N * 4];
    uint64_t rng = test_seed ^ 0x71e5;
    static const int gs[] = {8, 16, 32, 128};
    for (int bits = 8; bits >= 4; bits -= 4) {
        const int qmax = bits == 8 ? 127 : 7;
        for (size_t gi = 0; gi < sizeof gs / sizeof gs[0]; gi++) {
            const int g = gs[gi];
            for (int xi = 0; xi < 3; xi++) {
                const kvc_dtype xd = float_dtypes[xi];
                /* Scale m * 2^e with m odd, as many bits as the input dtype leaves
                 * for exact ties (8 go to 2k + 1): any m for float32 (capped so a
                 * float16 scale holds it), m <= 7 for float16, 1 for bfloat16. A
                 * power-of-two scale alone would hide reciprocal errors. */
                const uint64_t m_max = xd == KVC_F32 ? 2047 : xd == KVC_F16 ? 7 : 1;
                for (int i = 0; i < N; i += g) {
                    const int e = (int)(test_rng_next(&rng) % 15) - 10; /* f16-safe range */
                    const float m = (float)(2 * (test_rng_next(&rng) % ((m_max + 1) / 2)) + 1);
                    const float unit = m * ldexpf(1.0f, e);
                    for (int k = 0; k < g; k++) {
                        const uint64_t r = test_rng_next(&rng);
                        const int kq = (int)(r % (uint64_t)(2 * qmax)) - qmax; /* -qmax..qmax-1 */
                        float v = ((float)kq + 0.5f) * unit;
                        if (r % 5 == 1) v = nextafterf(v, INFINITY);
                        if (r % 5 == 2) v = nextafterf(v, -INFINITY);
                        if (r % 5 == 3) v = test_rng_f32(&rng) * (float)qmax * unit;
                        xf[i + k] = v;
                    }
                    xf[i + (int)(test_rng_next(&rng) % (uint64_t)g)] = (float)qmax * unit;
                }
                /* In the input dtype: exact for the ties (<= 8 significant bits). */
                ASSERT_TRUE(use_isa(KVC_ISA_SCALAR));
                ASSERT_OK(kvc_convert(xf, KVC_F32, xs, xd, N));
                for (int si = 0; si < 2; si++) {
                    const kvc_dtype sd = scale_dtypes[si];
                    ASSERT_TRUE(use_isa(KVC_ISA_SCALAR));
                    ASSERT_OK(kvc_quantize(xs, xd, N, bits, g, ref_q, ref_s, sd));
                    for (int isa = 1; isa < KVC_ISA_COUNT; isa++) {
                        if (!use_isa((kvc_isa)isa)) continue;
                        memset(out_q, 0xcd, sizeof out_q);
                        ASSERT_OK(kvc_quantize(xs, xd, N, bits, g, out_q, out_s, sd));
                        const size_t qb = bits == 8 ? N : N / 2;
                        for (size_t b = 0; b < qb; b++)
                            if (out_q[b] != ref_q[b])
                                TEST_FAIL_("%s bits %d g %d x %s scale %s: q byte %zu = 0x%02x, "
                                           "scalar 0x%02x", kvc_isa_name((kvc_isa)isa), bits, g,
                                           kvc_dtype_name(xd), kvc_dtype_name(sd), b, out_q[b],
                                           ref_q[b]);
                        ASSERT_MEM_EQ(out_s, ref_s, (size_t)(N / g) * esize(sd));
                    }
                }
            }
        }
    }
    return 0;
}

/*
 * 16-bit inputs with g = 8 (the AVX-512 block path: absmax on raw bits,
 * saturating packs instead of a float clamp) at magnitudes where scale
 * rounding matters most: groups at the 1e-5 floor and in the float16
 * subnormal scale range, bfloat16 groups up to 3e38 with float32 scales and
 * up to the largest value whose float16 scale stays finite with float16
 * scales (larger ones are refused by every ISA), -0.0, and signed extremes;
 * n covers whole 128-element blocks, one leftover vector and an odd last
 * group. Every ISA against scalar.
 */
ISA_TEST(isa_quant_g8_16bit_ranges) {
    enum { N = 3 * 128 + 16 + 8 };
    static float xf[N];
    static unsigned char xs[N * 2], ref_q[N + 1], out_q[N + 1], ref_s[N * 4], out_s[N * 4];
    uint64_t rng = test_seed ^ 0x9b16;
    static const float mags[] = {1e-7f, 1e-5f, 3e-4f, 5e-3f, 1.0f, 6e4f, 1e7f, 3e38f};
    for (int xi = 1; xi < 3; xi++) {
        const kvc_dtype xd = float_dtypes[xi];
        for (int bits = 8; bits >= 4; bits -= 4)
            for (int si = 0; si < 2; si++) {
                const kvc_dtype sd = scale_dtypes[si];
                /* cap: F16 input's range; float16 scales: the largest value of
                 * xd below 65520 * qmax (a float16 scale of 65504 or just under) */
                float cap = xd == KVC_F16 ? 6e4f : 3e38f;
                if (sd == KVC_F16) {
                    const float lim = 65520.0f * (bits == 8 ? 127.0f : 7.0f);
                    uint32_t lb;
                    memcpy(&lb, &lim, 4);
                    uint16_t b = (uint16_t)(lb >> 16); /* bfloat16 at or below lim */
                    if (kvc_bf16_to_f32(b) >= lim) b--;
                    cap = xd == KVC_F16 ? cap : kvc_bf16_to_f32(b);
                }
                for (int i = 0; i < N; i += 8) {
                    float mag = mags[test_rng_next(&rng) % 8];
                    if (mag > cap) mag = cap;
                    for (int k = 0; k < 8; k++) xf[i + k] = test_rng_f32(&rng) * mag;
                    const int pick = (int)(test_rng_next(&rng) % 8);
                    xf[i + pick] = (test_rng_next(&rng) & 1) ? mag : -mag;
                    if (test_rng_next(&rng) % 4 == 0) xf[i + (pick + 1) % 8] = -0.0f;
                }
                ASSERT_TRUE(use_isa(KVC_ISA_SCALAR));
                ASSERT_OK(kvc_convert(xf, KVC_F32, xs, xd, N));
                for (int64_t n = N; n >= N - 24; n -= 8) {
                    const size_t qb = (size_t)(bits == 8 ? n : n / 2);
                    ASSERT_TRUE(use_isa(KVC_ISA_SCALAR));
                    ASSERT_OK(kvc_quantize(xs, xd, n, bits, 8, ref_q, ref_s, sd));
                    for (int isa = 1; isa < KVC_ISA_COUNT; isa++) {
                        if (!use_isa((kvc_isa)isa)) continue;
                        memset(out_q, 0xcd, sizeof out_q);
                        ASSERT_OK(kvc_quantize(xs, xd, n, bits, 8, out_q, out_s, sd));
                        for (size_t b = 0; b < qb; b++)
                            if (out_q[b] != ref_q[b])
                                TEST_FAIL_("%s n %lld bits %d x %s scale %s: q byte %zu = 0x%02x, "
                                           "scalar 0x%02x", kvc_isa_name((kvc_isa)isa),
                                           (long long)n, bits, kvc_dtype_name(xd),
                                           kvc_dtype_name(sd), b, out_q[b], ref_q[b]);
                        ASSERT_EQ_I64(out_q[qb], 0xcd); /* nothing past the row */
                        ASSERT_MEM_EQ(out_s, ref_s, (size_t)(n / 8) * esize(sd));
                    }
                }
                if (xd == KVC_F16 || sd != KVC_F16) continue;
                /* one bfloat16 1e7 in the middle block: refused everywhere */
                const float big = 1e7f;
                ASSERT_OK(kvc_convert(&big, KVC_F32, xs + 2 * 200, xd, 1));
                for (int isa = 0; isa < KVC_ISA_COUNT; isa++)
                    if (use_isa((kvc_isa)isa))
                        ASSERT_EQ_I64(kvc_quantize(xs, xd, N, bits, 8, out_q, out_s, sd),
                                      KVC_ERR_INVALID_ARG);
            }
    }
    return 0;
}

/*
 * Every finite 16-bit input value against 48 scales, g = 8: each group is
 * the scale-setting absmax then 7 enumerated values (|x| <= absmax). The
 * AVX-512 path divides by multiplying with the reciprocal and redoes a block
 * whose products lie near a half-integer; with float32 scales (24-bit) on
 * bfloat16 inputs some products round across the half-integer that the
 * exact quotient does not, so a too-narrow "near" band shows up here.
 */
ISA_TEST(isa_quant_g8_16bit_all_values) {
    enum { MAXV = 65536, MAXN = (MAXV / 7 + 1) * 8 };
    static uint16_t vals[MAXV], xs[MAXN];
    static unsigned char ref_q[MAXN], out_q[MAXN], ref_s[MAXN / 8 * 4], out_s[MAXN / 8 * 4];
    uint64_t rng = test_seed ^ 0xa11;
    for (int xi = 1; xi < 3; xi++) {
        const kvc_dtype xd = float_dtypes[xi];
        for (int sc = 0; sc < 48; sc++) {
            /* absmax: a random finite positive value, kept where a float16
             * scale stays finite for int4 too (absmax / 7 < 65504) */
            uint16_t amax;
            float af;
            do {
                amax = (uint16_t)(test_rng_next(&rng) & 0x7fff);
                ASSERT_TRUE(use_isa(KVC_ISA_SCALAR));
                ASSERT_OK(kvc_convert(&amax, xd, &af, KVC_F32, 1));
            } while (!(af > 1e-4f && af < 4.5e5f));
            int nv = 0;
            for (uint32_t b = 0; b < 65536; b++) {
                float f;
                const uint16_t h = (uint16_t)b;
                ASSERT_OK(kvc_convert(&h, xd, &f, KVC_F32, 1));
                if (isfinite(f) && fabsf(f) <= af) vals[nv++] = h;
            }
            int64_t n = 0;
            for (int i = 0; i < nv; i += 7) {
                xs[n++] = (test_rng_next(&rng) & 1) ? amax : (uint16_t)(amax | 0x8000);
                for (int k = 0; k < 7; k++) xs[n++] = vals[(i + k) % nv];
            }
            for (int si = 0; si < 2; si++) {
                const kvc_dtype sd = scale_dtypes[si];
                for (int bits = 8; bits >= 4; bits -= 4) {
                    const size_t qb = (size_t)(bits == 8 ? n : n / 2);
                    ASSERT_TRUE(use_isa(KVC_ISA_SCALAR));
                    ASSERT_OK(kvc_quantize(xs, xd, n, bits, 8, ref_q, ref_s, sd));
                    for (int isa = 1; isa < KVC_ISA_COUNT; isa++) {
                        if (!use_isa((kvc_isa)isa)) continue;
                        ASSERT_OK(kvc_quantize(xs, xd, n, bits, 8, out_q, out_s, sd));
                        for (size_t b = 0; b < qb; b++)
                            if (out_q[b] != ref_q[b])
                                TEST_FAIL_("%s bits %d x %s scale %s absmax %g: q byte %zu = "
                                           "0x%02x, scalar 0x%02x", kvc_isa_name((kvc_isa)isa),
                                           bits, kvc_dtype_name(xd), kvc_dtype_name(sd),
                                           (double)af, b, out_q[b], ref_q[b]);
                        ASSERT_MEM_EQ(out_s, ref_s, (size_t)(n / 8) * esize(sd));
                    }
                }
            }
        }
    }
    return 0;
}

/*
 * The two-pass kernels (kernels.h quant_scales / quant_values, which the
 * paged append uses): scales, then values from those scales, equal
 * kvc_quantize on the scalar ISA bit for bit, on every ISA, over the grid of
 * n x g x input dtype x bits x scale dtype, streaming on and off, q and
 * scales 64-byte aligned (the streaming path) and not; nothing is written
 * past either row. quant_scales returns 0 for a NaN or Inf anywhere: in a
 * 128-element block, in the tail, first or last.
 */
ISA_TEST(isa_quant_split) {
    enum { CAP = (GRID_N_MAX + 128) * 4 };
    unsigned char *x = aligned_alloc(64, CAP), *tmp = aligned_alloc(64, CAP);
    unsigned char *ref_q = aligned_alloc(64, CAP), *ref_s = aligned_alloc(64, CAP);
    unsigned char *out_q = aligned_alloc(64, CAP), *out_s = aligned_alloc(64, CAP);
    float *xf = xmalloc(CAP);
    ASSERT_TRUE(x && tmp && ref_q && ref_s && out_q && out_s);
    uint64_t rng = test_seed ^ 0x5b1;
    int r = 0, configs = 0;
    for (size_t ni = 0; ni < GRID_N_COUNT && !r; ni++) {
        const int64_t n = grid_n[ni];
        for (size_t gi = 0; gi < GRID_G_COUNT && !r; gi++) {
            const int g = grid_g[gi];
            if (n % g) continue;
            for (int xi = 0; xi < 3 && !r; xi++) {
                const kvc_dtype xd = float_dtypes[xi];
                gen_groups(xf, n, g, xd != KVC_F16, &rng);
                to_dtype(xf, n, x, xd);
                for (int bits = 8; bits >= 4 && !r; bits -= 4)
                    for (int si = 0; si < 2 && !r; si++) {
                        const kvc_dtype sd = scale_dtypes[si];
                        const size_t qb = (size_t)(bits == 8 ? n : n / 2);
                        const size_t sb = (size_t)(n / g) * esize(sd);
                        ASSERT_TRUE(use_isa(KVC_ISA_SCALAR));
                        ASSERT_OK(kvc_quantize(x, xd, n, bits, g, ref_q, ref_s, sd));
                        for (int isa = 0; isa < KVC_ISA_COUNT && !r; isa++) {
                            if (!use_isa((kvc_isa)isa)) continue;
                            const kvc_kernels *k = kvc__kernels();
                            memset(tmp, 0xcd, sb + 64);
                            const int fin = k->quant_scales(x, xd, n, bits, g, tmp, sd);
                            if (!fin || mem_diff(tmp, ref_s, sb) >= 0) r = 1;
                            for (int v = 0; v < 4 && !r; v++, configs++) {
                                const int stream = v & 1, off = (v >> 1) * (int)esize(sd);
                                memset(out_q, 0xcd, qb + 64 + 1);
                                memset(out_s, 0xcd, sb + 64 + off);
                                k->quant_values(x, xd, n, bits, g, tmp, out_q + off, out_s + off,
                                                sd, stream);
                                if (mem_diff(out_q + off, ref_q, qb) >= 0 ||
                                    mem_diff(out_s + off, ref_s, sb) >= 0 ||
                                    !all_bytes(out_q + off + qb, 32, 0xcd) ||
                                    !all_bytes(out_s + off + sb, 32, 0xcd) ||
                                    !all_bytes(out_q, (size_t)off, 0xcd))
                                    r = 1;
                            }
                            if (r)
                                TEST_FAIL_("%s n %lld g %d x %s bits %d scale %s: two-pass bytes "
                                           "differ from quantize (finite flag %d)",
                                           kvc_isa_name((kvc_isa)isa), (long long)n, g,
                                           kvc_dtype_name(xd), bits, kvc_dtype_name(sd), fin);
                        }
                    }
            }
        }
    }
    /* NaN / Inf: quant_scales says so wherever the value sits */
    static const int64_t bad_n[] = {8, 24, 136, 1152};
    static const uint32_t bad32[] = {0x7fc00000u, 0x7f800000u, 0xff800000u, 0x7f800001u};
    static const uint16_t bad16[] = {0x7e00, 0x7c00, 0xfc00, 0x7c01};
    static const uint16_t badb16[] = {0x7fc0, 0x7f80, 0xff80, 0x7f81};
    for (size_t ni = 0; ni < sizeof bad_n / sizeof bad_n[0] && !r; ni++) {
        const int64_t n = bad_n[ni], pos[4] = {0, n / 2 + 1, n - 9 > 0 ? n - 9 : 1, n - 1};
        for (int i = 0; i < n; i++) xf[i] = test_rng_f32(&rng) * 100.0f;
        for (int xi = 0; xi < 3 && !r; xi++) {
            const kvc_dtype xd = float_dtypes[xi];
            for (int p = 0; p < 4; p++)
                for (int b = 0; b < 4; b++) {
                    to_dtype(xf, n, x, xd);
                    if (xd == KVC_F32) memcpy(x + 4 * pos[p], &bad32[b], 4);
                    else memcpy(x + 2 * pos[p], xd == KVC_F16 ? &bad16[b] : &badb16[b], 2);
                    for (int isa = 0; isa < KVC_ISA_COUNT; isa++) {
                        if (!use_isa((kvc_isa)isa)) continue;
                        for (int si = 0; si < 2; si++)
                            if (kvc__kernels()->quant_scales(x, xd, n, 8, 8, tmp, scale_dtypes[si]))
                                TEST_FAIL_("%s n %lld x %s: value %d at %lld not reported",
                                           kvc_isa_name((kvc_isa)isa), (long long)n,
                                           kvc_dtype_name(xd), b, (long long)pos[p]);
                    }
                }
        }
    }
    free(x);
    free(tmp);
    free(ref_q);
    free(ref_s);
    free(out_q);
    free(out_s);
    free(xf);
    if (!r) ASSERT_TRUE(configs > 2000);
    return r;
}

/* ±qmax reached at both signs; dequantized extremes are ±qmax * scale. */
ISA_TEST(quant_extremes) {
    uint64_t rng = test_seed ^ 0xe7;
    float x[256];
    for (int isa = 0; isa < KVC_ISA_COUNT; isa++) {
        if (!use_isa((kvc_isa)isa)) continue;
        for (int bits = 8; bits >= 4; bits -= 4) {
            const int qmax = bits == 8 ? 127 : 7;
            for (int g = 8; g <= 64; g *= 2) {
                for (int i = 0; i < 256; i++) x[i] = test_rng_f32(&rng) * 3.0f;
                for (int g0 = 0; g0 < 256; g0 += g) {
                    x[g0 + 1] = 3.25f; /* the group's absmax, both signs */
                    x[g0 + g - 2] = -3.25f;
                }
                int q[256];
                float s[64];
                ASSERT_OK(quant_simple(x, KVC_F32, 256, bits, g, KVC_F32, q, s));
                for (int g0 = 0; g0 < 256; g0 += g) {
                    ASSERT_EQ_I64(q[g0 + 1], qmax);
                    ASSERT_EQ_I64(q[g0 + g - 2], -qmax);
                    for (int i = 0; i < g; i++) ASSERT_TRUE(q[g0 + i] >= -qmax && q[g0 + i] <= qmax);
                }
                unsigned char qb[256];
                float sb[64], y[256];
                ASSERT_OK(kvc_quantize(x, KVC_F32, 256, bits, g, qb, sb, KVC_F32));
                ASSERT_OK(kvc_dequantize(qb, bits, sb, KVC_F32, 256, g, y, KVC_F32));
                ASSERT_EQ_I64(f2u(y[1]), f2u((float)qmax * sb[0]));
                ASSERT_EQ_I64(f2u(y[g - 2]), f2u((float)-qmax * sb[0]));
            }
        }
    }
    return 0;
}

/* int4 layout on raw bytes: element 2i in the low nibble of byte i, 2i+1
 * in the high nibble, 4-bit two's complement; dequantize reads it back,
 * including -8 which quantize never writes. */
ISA_TEST(int4_nibble_order) {
    static const float x[16] = {1, -1, 7, -7, 0, 3, -2, 5, 1, -1, 7, -7, 0, 3, -2, 5};
    static const unsigned char want[8] = {0xf1, 0x97, 0x30, 0x5e, 0xf1, 0x97, 0x30, 0x5e};
    static const unsigned char raw[8] = {0x88, 0x7f, 0x10, 0xe2, 0x08, 0x80, 0x21, 0x43};
    static const float raw_vals[16] = {-8, -8, -1, 7, 0, 1, 2, -2, -8, 0, 0, -8, 1, 2, 3, 4};
    for (int isa = 0; isa < KVC_ISA_COUNT; isa++) {
        if (!use_isa((kvc_isa)isa)) continue;
        for (int g = 8; g <= 16; g += 8) {
            unsigned char q[8];
            float s[2], y[16];
            ASSERT_OK(kvc_quantize(x, KVC_F32, 16, 4, g, q, s, KVC_F32));
            ASSERT_MEM_EQ(q, want, 8);
            for (int k = 0; k < 16 / g; k++) ASSERT_EQ_I64(f2u(s[k]), f2u(1.0f));
            ASSERT_OK(kvc_dequantize(q, 4, s, KVC_F32, 16, g, y, KVC_F32));
            for (int i = 0; i < 16; i++) ASSERT_EQ_I64(f2u(y[i]), f2u(x[i]));
            const float ones[2] = {1.0f, 1.0f};
            ASSERT_OK(kvc_dequantize(raw, 4, ones, KVC_F32, 16, g, y, KVC_F32));
            for (int i = 0; i < 16; i++) ASSERT_EQ_I64(f2u(y[i]), f2u(raw_vals[i]));
        }
    }
    return 0;
}

/* NaN or Inf anywhere (first, middle, last element, in vector bodies and
 * tails) is rejected with KVC_ERR_INVALID_ARG and q/scale stay as they
 * were (canary 0xab). */
ISA_TEST(quant_rejects_nonfinite) {
    static const int64_t ns[] = {2, 16, 34, 64, 1030};
    static const uint32_t bad32[] = {0x7fc00000u, 0x7f800000u, 0xff800000u, 0x7f800001u};
    static const uint16_t bad16[] = {0x7e00, 0x7c00, 0xfc00, 0x7c01};
    static const uint16_t badb16[] = {0x7fc0, 0x7f80, 0xff80, 0x7f81};
    float *xf = xmalloc(1030 * 4);
    unsigned char *x = xmalloc(1030 * 4), *q = xmalloc(1030), *s = xmalloc(1030 * 4);
    uint64_t rng = test_seed ^ 0xbad;
    for (int i = 0; i < 1030; i++) xf[i] = test_rng_f32(&rng);
    int r = 0;
    for (int isa = 0; isa < KVC_ISA_COUNT && !r; isa++) {
        if (!use_isa((kvc_isa)isa)) continue;
        for (size_t ni = 0; ni < sizeof ns / sizeof ns[0] && !r; ni++) {
            const int64_t n = ns[ni];
            const int64_t pos[3] = {0, n / 2 + (n > 2), n - 1};
            for (int xi = 0; xi < 3 && !r; xi++) {
                const kvc_dtype xd = float_dtypes[xi];
                for (int p = 0; p < 3 && !r; p++) {
                    for (int b = 0; b < 4 && !r; b++) {
                        to_dtype(xf, n, x, xd);
                        if (xd == KVC_F32) memcpy(x + 4 * pos[p], &bad32[b], 4);
                        else memcpy(x + 2 * pos[p], xd == KVC_F16 ? &bad16[b] : &badb16[b], 2);
                        for (int bits = 8; bits >= 4; bits -= 4) {
                            memset(q, 0xab, 1030);
                            memset(s, 0xab, 1030 * 4);
                            kvc_clear_error();
                            const kvc_status st = kvc_quantize(x, xd, n, bits, 2, q, s, KVC_F32);
                            if (st != KVC_ERR_INVALID_ARG || !kvc_last_error()[0] ||
                                !all_bytes(q, 1030, 0xab) || !all_bytes(s, 1030 * 4, 0xab)) {
                                fprintf(stderr, "  %s n=%lld x=%s pos=%lld bad=%d bits=%d: %s\n",
                                        kvc_isa_name((kvc_isa)isa), (long long)n,
                                        kvc_dtype_name(xd), (long long)pos[p], b, bits,
                                        kvc_status_str(st));
                                r = 1;
                            }
                            /* The finite prefix before the bad value quantizes fine. */
                            if (pos[p] >= 2 && pos[p] % 2 == 0)
                                ASSERT_OK(kvc_quantize(x, xd, pos[p], bits, 2, q, s, KVC_F32));
                        }
                    }
                }
            }
        }
    }
    free(xf);
    free(x);
    free(q);
    free(s);
    return r;
}

/* Argument errors: KVC_ERR_INVALID_ARG, a message, and no write. */
/* With float16 scales, a group whose absmax / qmax (float32) reaches 65520
 * would store a scale of +inf (and dequantize to NaN): such input is
 * rejected like NaN, nothing written, while the value just below stores the
 * largest float16 scale, 65504. The limit, 65520 * qmax, is checked to be
 * the smallest such float32 here (not taken from the library); bfloat16
 * input is checked at the bfloat16 values on either side of it. Float32
 * scales take any finite input. Sizes cover vector bodies and tails, group 8
 * on 16-bit input runs the SIMD quant_scales path. */
ISA_TEST(quant_f16_scale_overflow) {
    static const int64_t ns[] = {8, 40, 136, 1152};
    enum { NMAX = 1152 };
    float *xf = xmalloc(NMAX * 4), *y = xmalloc(NMAX * 4);
    unsigned char *x = xmalloc(NMAX * 4), *q = xmalloc(NMAX), *s = xmalloc(NMAX * 4);
    uint64_t rng = test_seed ^ 0xf16;
    for (int bits = 8; bits >= 4; bits -= 4) {
        const float qmax = bits == 8 ? 127.0f : 7.0f, lim = 65520.0f * qmax;
        volatile float below = nextafterf(lim, 0.0f);
        ASSERT_TRUE(lim / qmax == 65520.0f && below / qmax < 65520.0f);
        ASSERT_EQ_I64(kvc_f32_to_f16(lim / qmax), 0x7c00);
        ASSERT_EQ_I64(kvc_f32_to_f16(below / qmax), 0x7bff);
        /* bfloat16 neighbours: lo the largest below lim, hi = lo + 1 ulp */
        uint32_t lb;
        memcpy(&lb, (const float *)&lim, 4);
        uint16_t hi16 = (uint16_t)(lb >> 16);
        if (kvc_bf16_to_f32(hi16) < lim) hi16++;
        const uint16_t lo16 = (uint16_t)(hi16 - 1);
        ASSERT_TRUE(kvc_bf16_to_f32(lo16) < lim && kvc_bf16_to_f32(hi16) >= lim);
        for (int isa = 0; isa < KVC_ISA_COUNT; isa++) {
            if (!use_isa((kvc_isa)isa)) continue;
            for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
                const int64_t n = ns[ni], pos[3] = {0, n / 2 + 3, n - 1};
                for (int i = 0; i < n; i++) xf[i] = test_rng_f32(&rng) * 1000.0f;
                for (int xi = 0; xi < 3; xi += 2) { /* float32, bfloat16 */
                    const kvc_dtype xd = float_dtypes[xi];
                    for (int p = 0; p < 3; p++)
                        for (int over = 0; over < 2; over++) {
                            to_dtype(xf, n, x, xd);
                            const float sign = p == 1 ? -1.0f : 1.0f;
                            if (xd == KVC_F32) {
                                const float v = sign * (over ? lim : below);
                                memcpy(x + 4 * pos[p], &v, 4);
                            } else {
                                const uint16_t v = (uint16_t)((over ? hi16 : lo16) |
                                                              (sign < 0 ? 0x8000 : 0));
                                memcpy(x + 2 * pos[p], &v, 2);
                            }
                            for (int si = 0; si < 2; si++) {
                                const kvc_dtype sd = scale_dtypes[si];
                                const int bad = over && sd == KVC_F16;
                                memset(q, 0xab, NMAX);
                                memset(s, 0xab, NMAX * 4);
                                kvc_clear_error();
                                const kvc_status st = kvc_quantize(x, xd, n, bits, 8, q, s, sd);
                                const int fin = kvc__kernels()->quant_scales(x, xd, n, bits, 8,
                                                                              y, sd);
                                if (bad ? st != KVC_ERR_INVALID_ARG ||
                                              !strstr(kvc_last_error(), "float16 scale") ||
                                              !all_bytes(q, NMAX, 0xab) ||
                                              !all_bytes(s, NMAX * 4, 0xab) || fin
                                        : st != KVC_OK || !fin)
                                    TEST_FAIL_("%s bits %d n %lld x %s at %lld over %d scale %s: "
                                               "%s, quant_scales %d (%s)",
                                               kvc_isa_name((kvc_isa)isa), bits, (long long)n,
                                               kvc_dtype_name(xd), (long long)pos[p], over,
                                               kvc_dtype_name(sd), kvc_status_str(st), fin,
                                               kvc_last_error());
                                if (bad || sd != KVC_F16) continue;
                                /* stored: a finite scale (float32 input: the largest),
                                 * values dequantize finite */
                                const uint16_t sc = ((const uint16_t *)s)[pos[p] / 8];
                                ASSERT_TRUE(xd == KVC_F32 ? sc == 0x7bff : sc < 0x7c00);
                                ASSERT_OK(kvc_dequantize(q, bits, s, sd, n, 8, y, KVC_F32));
                                for (int i = 0; i < n; i++) ASSERT_TRUE(isfinite(y[i]));
                            }
                        }
                }
            }
        }
    }
    free(xf);
    free(y);
    free(x);
    free(q);
    free(s);
    return 0;
}

TEST(quant_argument_errors) {
    float x[64] = {0}, y[64];
    _Alignas(8) unsigned char q[64], s[64 * 4]; /* s + 2 is then misaligned for float32 */
    memset(q, 0xab, sizeof q);
    memset(s, 0xab, sizeof s);
    memset(y, 0xab, sizeof y);
#define EXPECT_BAD(call)                                                                           \
    do {                                                                                           \
        kvc_clear_error();                                                                         \
        ASSERT_STATUS(call, KVC_ERR_INVALID_ARG);                                                  \
        ASSERT_TRUE(kvc_last_error()[0] != '\0');                                                  \
    } while (0)
    /* bits not 4/8 */
    EXPECT_BAD(kvc_quantize(x, KVC_F32, 64, 3, 8, q, s, KVC_F32));
    EXPECT_BAD(kvc_quantize(x, KVC_F32, 64, 16, 8, q, s, KVC_F32));
    EXPECT_BAD(kvc_quantize(x, KVC_F32, 64, 0, 8, q, s, KVC_F32));
    EXPECT_BAD(kvc_dequantize(q, 2, s, KVC_F32, 64, 8, y, KVC_F32));
    /* n % g != 0, g < 1 */
    EXPECT_BAD(kvc_quantize(x, KVC_F32, 60, 8, 16, q, s, KVC_F32));
    EXPECT_BAD(kvc_quantize(x, KVC_F32, 64, 8, 0, q, s, KVC_F32));
    EXPECT_BAD(kvc_quantize(x, KVC_F32, 64, 8, -8, q, s, KVC_F32));
    EXPECT_BAD(kvc_dequantize(q, 8, s, KVC_F32, 63, 8, y, KVC_F32));
    /* odd g for int4 */
    EXPECT_BAD(kvc_quantize(x, KVC_F32, 63, 4, 3, q, s, KVC_F32));
    EXPECT_BAD(kvc_quantize(x, KVC_F32, 63, 4, 1, q, s, KVC_F32));
    EXPECT_BAD(kvc_dequantize(q, 4, s, KVC_F32, 63, 7, y, KVC_F32));
    /* bad dtypes */
    EXPECT_BAD(kvc_quantize(x, KVC_I8, 64, 8, 8, q, s, KVC_F32));
    EXPECT_BAD(kvc_quantize(x, KVC_I32, 64, 8, 8, q, s, KVC_F32));
    EXPECT_BAD(kvc_quantize(x, KVC_F32, 64, 8, 8, q, s, KVC_BF16));
    EXPECT_BAD(kvc_quantize(x, KVC_F32, 64, 8, 8, q, s, KVC_I8));
    EXPECT_BAD(kvc_quantize(x, (kvc_dtype)99, 64, 8, 8, q, s, KVC_F32));
    EXPECT_BAD(kvc_dequantize(q, 8, s, KVC_BF16, 64, 8, y, KVC_F32));
    EXPECT_BAD(kvc_dequantize(q, 8, s, KVC_F32, 64, 8, y, KVC_I8));
    EXPECT_BAD(kvc_dequantize(q, 8, s, KVC_F32, 64, 8, y, KVC_I4));
    EXPECT_BAD(kvc_convert(x, KVC_I8, y, KVC_F32, 64));
    EXPECT_BAD(kvc_convert(x, KVC_F32, y, KVC_FP8_E4M3, 64));
    EXPECT_BAD(kvc_convert(x, KVC_F32, y, (kvc_dtype)-1, 64));
    /* negative n, NULL buffers */
    EXPECT_BAD(kvc_convert(x, KVC_F32, y, KVC_F16, -1));
    EXPECT_BAD(kvc_quantize(x, KVC_F32, -8, 8, 8, q, s, KVC_F32));
    EXPECT_BAD(kvc_quantize(NULL, KVC_F32, 64, 8, 8, q, s, KVC_F32));
    EXPECT_BAD(kvc_dequantize(q, 8, NULL, KVC_F32, 64, 8, y, KVC_F32));
    EXPECT_BAD(kvc_convert(x, KVC_F32, NULL, KVC_F16, 64));
    /* float buffers not aligned to their elements (the kernels' typed loads
     * need it); int8/int4 codes may sit anywhere */
    unsigned char *xb = (unsigned char *)x, *yb = (unsigned char *)y;
    EXPECT_BAD(kvc_convert(xb + 1, KVC_F32, y, KVC_F16, 8));
    EXPECT_BAD(kvc_convert(xb + 2, KVC_F32, y, KVC_F16, 8));
    EXPECT_BAD(kvc_convert(x, KVC_F32, yb + 1, KVC_BF16, 8));
    EXPECT_BAD(kvc_convert(xb + 1, KVC_F16, y, KVC_F16, 8));
    EXPECT_BAD(kvc_quantize(xb + 2, KVC_F32, 8, 8, 8, q, s, KVC_F32));
    EXPECT_BAD(kvc_quantize(x, KVC_F32, 8, 8, 8, q, s + 1, KVC_F16));
    EXPECT_BAD(kvc_dequantize(q, 8, s + 2, KVC_F32, 8, 8, y, KVC_F32));
    EXPECT_BAD(kvc_dequantize(q, 8, s, KVC_F32, 8, 8, yb + 1, KVC_F16));
#undef EXPECT_BAD
    ASSERT_TRUE(all_bytes(q, sizeof q, 0xab));
    ASSERT_TRUE(all_bytes(s, sizeof s, 0xab));
    ASSERT_TRUE(all_bytes(y, sizeof y, 0xab));
    /* n == 0 is a valid no-op. */
    ASSERT_OK(kvc_quantize(x, KVC_F32, 0, 8, 8, q, s, KVC_F32));
    ASSERT_OK(kvc_dequantize(q, 4, s, KVC_F16, 0, 8, y, KVC_F32));
    ASSERT_OK(kvc_convert(x, KVC_F32, y, KVC_F16, 0));
    ASSERT_TRUE(all_bytes(y, sizeof y, 0xab));
    /* unaligned codes, and 16-bit data at an odd 2-byte offset, are fine */
    ASSERT_OK(kvc_quantize(xb + 2, KVC_F16, 8, 8, 8, q + 1, s + 2, KVC_F16));
    ASSERT_OK(kvc_dequantize(q + 1, 8, s + 2, KVC_F16, 8, 8, yb + 2, KVC_BF16));
    return 0;
}

const char *test_suite_name = "quant";
const test_case test_suite[] = {
    TEST_ENTRY(isa_support),
    TEST_ENTRY(f16_roundtrip_exhaustive),
    TEST_ENTRY(f32_to_f16_ties_and_edges),
    TEST_ENTRY(bf16_exhaustive_and_ties),
    TEST_ENTRY(isa_convert_exhaustive),
    TEST_ENTRY(isa_convert_grid),
    TEST_ENTRY(isa_quant_grid),
    TEST_ENTRY(isa_dequant_random_codes),
    TEST_ENTRY(isa_quant_vs_reference),
    TEST_ENTRY(quant_zero_groups),
    TEST_ENTRY(quant_ties),
    TEST_ENTRY(isa_quant_ties_random),
    TEST_ENTRY(isa_quant_g8_16bit_ranges),
    TEST_ENTRY(isa_quant_g8_16bit_all_values),
    TEST_ENTRY(isa_quant_split),
    TEST_ENTRY(quant_extremes),
    TEST_ENTRY(int4_nibble_order),
    TEST_ENTRY(quant_rejects_nonfinite),
    TEST_ENTRY(quant_f16_scale_overflow),
    TEST_ENTRY(quant_argument_errors),
    {0, 0},
};
