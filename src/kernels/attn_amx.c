/*
 * Decode attention over int8 caches with AMX tiles (kernels.h, amx_*):
 * the dot products run on the tile unit as int8 x int8 -> int32, so the
 * vector units only convert, scale and run the softmax. int4 caches take
 * the same path: K rows unpacked to int8 first (unpack_i4), V rows
 * interleaved by key quads as packed bytes and then split into nibbles.
 * Compiled with -mamx-tile -mamx-int8 plus the AVX-512 flags (and VBMI for
 * vpermb); only called from the "amx" kernel table, which dispatch.c
 * installs after it has checked the CPU, the OS's XCR0 and got Linux's
 * permission to use tile data (arch_prctl ARCH_REQ_XCOMP_PERM).
 *
 * Numerics (float32-level, not bitwise equal to the other ISAs):
 *   - q (per query head, as attn_decode takes it) is rounded to
 *     32-bit fixed point, q ~= sq * qi with |qi| <= 0x7f7f7f00 and
 *     sq = max|q| / 0x7f7f7f00, written as four balanced base-256 digits
 *     qi = 2^24 d3 + 65536 d2 + 256 d1 + d0, each in [-128, 127]. q * (1 /
 *     sq) is a float32 product, so each element keeps float32's rounding of
 *     itself: off by at most |q_i| 2^-24 + max|q| 2^-32. Each digit is an
 *     exact int8 x int8 product sum per (key, group); four digits x four
 *     heads fill the 16 columns of a group's C tile (three digits, 24 bits,
 *     left 4 of them empty: the fourth costs no tile work).
 *   - qbits 16 (float16/bfloat16 queries, whose own precision is 11 or 8
 *     bits) and every head of the set flat (max|q| <= 16 mean|q|): two
 *     digits, |qi| <= 0x7f7f, error at most max|q| / 65278 per element. A
 *     group then takes 8 C columns (digit x head), so one score tile holds
 *     two groups of 16 or 32 (`pair`: column 8 gp + 4t + h, gp
 *     the group's place in the pair): half the tile products, tile stores
 *     and C rows to scale; the kernel takes ~0.9x the time at group 32.
 *     That error grows with the scores: a guard in amx_run bounds what it
 *     can do to the output from each block's K and V scales and widens q
 *     to 32 bits for the rest of the task once a key's bound passes
 *     WIDEN_BOUND (flat float16 queries with scores in the tens were up to
 *     6x the float16 tolerance off in 16 bits); the benchmark's data stays
 *     ~20x below it.
 *   - score(key) = sum_g kscale[key][g] * sum_t 256^(top-t) * C_t[key][g] *
 *     sq in float32 (the group sums are exact integers below 2^21).
 *   - P.V weights p * vscale[key][g] are rounded to 24-bit unsigned fixed
 *     point per (call, group), w = round(p * vs / W * (2^24 - 1)) with W the
 *     largest V scale of the group among the call's keys (p <= 1: the
 *     running max is the raw max times sc rounded up, kvc__mul_up), three
 *     unsigned digits against the int8 V values: each weight is off by at
 *     most W * 2^-25, i.e. float32 rounding of the largest weight.
 *
 * Work of one call (up to 64 keys = 4 blocks of 16, one KV head, up to 4
 * query heads; amx_run):
 *   scores  A = 16 K rows x 64 bytes, read in place from the cache (a tile
 *           load with the row stride) or from a copy when the 16 keys are
 *           not equally spaced; B = the query digits of one 64-element
 *           segment, zero outside one quant group (built once per task in
 *           amx_begin); C = 16 keys x (digit t, head h) in column 4t + h, one
 *           tile per quant group (pair: two), so the group's K scale
 *           applies per key.
 *   softmax online, base 2, per head, over the call's keys.
 *   P.V     A = weight digits, row 4t + h, one column per key; B = V rows
 *           interleaved by key quads (the tile layout wants 4 keys' bytes of
 *           one element adjacent); C = (4t + h) x 16 elements, one group's.
 *           A tile's 16 columns are not always consecutive elements
 *           (pv_pos); the accumulator is kept in that order and put back in
 *           amx_end.
 *   The rows of the call that runs next are prefetched into L2, a key quad
 *   at a time, spread over the score, weight and P.V phases.
 *
 * Where the time goes (BENCHMARKS.md, measured on one core): on the VM
 * measured, tile instructions do not overlap the vector work, and each
 * quant group costs a 16 x 16 C tile per 16 keys that the vector units scale and sum:
 * with group 32 that is more int32 data than the int8 K it came from. Of
 * ~235 ns per 16 keys at group 32 (4 query heads, Dh 128), dropping a phase
 * saves: score post-processing ~58, V interleave ~42, weights ~25, P.V
 * flush ~20, scale gathers ~13, softmax ~10; tile products, stores and
 * set-up the rest (~60). The kernel is about 1.8-2x the float one at group 32
 * and 2.5-2.8x at group 128, not the 4x+ the tile unit's arithmetic would allow.
 * (Those shares predate the paired tiles.) Calls of 128 keys, which halve
 * the P.V tile stores and flushes per key, made the kernel 13-15% slower
 * with K/V in L2 or beyond: the call's scratch and rows outgrow L1.
 */
#define _GNU_SOURCE
#include "kernels.h"

#if defined(__x86_64__) /* tile instructions exist in 64-bit mode only */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "vec_math.h"

#define KVC_INLINE static inline __attribute__((always_inline))

#define QMAX 2139062016.0f /* 0x7f7f7f00: |qi| below 0x7f7f7f7f (4 balanced digits), a float32 */
#define QMAX2 32639.0f    /* 0x7f7f: the same with two digits (16-bit q) */
#define WMAX 16777215.0f  /* 2^24 - 1 */
/* 16-bit q: the largest bound on a key's error in the output (natural
 * units) before q is widened to 32 bits (amx_begin says how it is
 * computed). The errors measured were 1/100-1/150 of such bounds (Dh
 * 128-256, Gaussian q and K), so 0.02 keeps them near 1e-4, a tenth of the
 * float16 tolerance. */
#define WIDEN_BOUND 0.02f
#define KEYS KVC_AMX_KEYS /* keys per amx_run: 4 blocks of 16 */

/* Per-task state of one head set (KVC_AMX_* limits in kernels.h). */
typedef struct amx_state {
    float sqw[16];     /* lane 4t + h: sq_h * 256^(top - t); absent heads 0 */
    float m[4], l[4];  /* online softmax, base 2 */
    float sc;          /* scores to base 2 (kernels.h: attn_decode) */
    float cap;
    float eb;          /* two: the guard's limit per key (amx_begin) */
    int16_t D, group;  /* head dim, quant group */
    int16_t nh, ng;    /* heads in the set (<= 4), groups */
    int16_t piece;     /* V interleave piece bytes (16, 32, 64; int4: 32 elements) */
    int16_t vord;      /* accumulator order (pv_pos): 0 int8, 1 int4 group 32+, 2 int4 group 16 */
    int16_t bits;      /* 8: int8 rows; 4: int4 (nibbles sign-extended before the tiles) */
    int16_t pair;      /* 16-bit q (2 digits): two groups' columns per score C tile */
    int16_t two;       /* q in 16 bits (2 digits), widened to 32 by amx_run's guard */
} __attribute__((aligned(64))) amx_state; /* 128 bytes: acc after it stays 64-byte aligned */
_Static_assert(sizeof(amx_state) == 128, "amx_state header is 128 bytes");

static int seg_per_a(int group) { return group >= 64 ? 1 : 64 / group; }

/* Bytes of the score B tiles without pairs, (D / 64) * gpa tiles of 1 KiB. */
static size_t bs_bytes(int D, int group) {
    return (size_t)(D / 64) * (size_t)seg_per_a(group) * 1024u;
}

/* After the header: acc (4, D) floats, the score B tiles, and while q is in
 * 16 bits a float32 copy of it (4, D) for the guard to widen from: in the
 * half of the tile space that pairs leave free (groups 16, 32), else after
 * the tiles (groups of 64+). */
KVC_INLINE float *st_acc(amx_state *st) { return (float *)(st + 1); }
KVC_INLINE int8_t *st_bs(amx_state *st) { return (int8_t *)(st_acc(st) + 4 * st->D); }
KVC_INLINE float *st_qcopy(amx_state *st) {
    const size_t tiles = bs_bytes(st->D, st->group);
    return (float *)(void *)(st_bs(st) + (st->group < 64 ? tiles / 2 : tiles));
}

static size_t amx_state_bytes(int D, int group) {
    /* groups below 64 are 16 or 32 here (kvc__amx_decode_ok): half the tiles
     * hold (4, D) floats */
    return sizeof(amx_state) + (size_t)16 * (size_t)D + bs_bytes(D, group) +
           (group >= 64 ? (size_t)16 * (size_t)D : 0u);
}

/*
 * Element order of the accumulator. V rows are interleaved by key quads in
 * pieces of P bytes (P = 64, 32 or 16: the largest whose tiles stay inside
 * one quant group). For P = 16 and 32 a byte permute puts the columns in
 * element order. For P = 64, unpacking bytes then 16-bit pairs of 4 rows
 * gives 4 vectors X_x whose 128-bit lane L holds elements 16L + 4x .. +3 of
 * the piece, 4 keys each; a tile row is such a vector, so column n of tile
 * t of the piece holds element pv_pos(64, 16t + n) (cheaper than permuting
 * four rows of 64 bytes).
 */
static int pv_pos(int P, int ord, int i) {
    const int t = i / 16, n = i % 16;
    if (ord == 1) return 2 * n + t;                  /* int4: tile 0 low nibbles, 1 high */
    if (ord == 2) return 16 * t + 2 * (n % 8) + n / 8; /* int4 group 16: a group per tile */
    if (P <= 32) return i;
    return 16 * (n / 4) + 4 * t + n % 4; /* X_t */
}

/* ---- tiles --------------------------------------------------------------- */

/*
 * Tile loads/stores and the config load as asm with a "memory" clobber:
 * GCC's intrinsics (_tile_loadd, _tile_stored, _tile_loadconfig) do not tell
 * the compiler that they read or write memory, so it may drop the stores
 * that fill a tile's source (it did: the config's rows were never written)
 * or move loads of a stored tile above the store.
 */
#define TLOAD(t, p, stride)                                                                        \
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"((const void *)(p)), "r"((long)(stride)) \
                     : "memory")
#define TSTORE(t, p, stride)                                                                       \
    __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"((void *)(p)), "r"((long)(stride))   \
                     : "memory")

typedef struct tilecfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg;

/* Every tile 16 rows x 64 bytes: any register can hold any operand. */
static const tilecfg g_cfg __attribute__((aligned(64))) = {
    1, 0, {0}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

static void amx_tiles(int on) {
    if (on)
        __asm__ volatile("ldtilecfg %0" ::"m"(g_cfg) : "memory");
    else
        _tile_release();
}

/* ---- begin: query digits -------------------------------------------------- */

/* 16 x 16 int32 transpose: r[i] lane j -> out[j] lane i. */
KVC_INLINE void tr16(__m512i *r) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* u[4b + k] holds rows 4b..4b+3, column k of each 128-bit block */
    for (int b = 0; b < 4; b += 2)
        for (int k = 0; k < 4; k++) {
            t[4 * b + k] = _mm512_shuffle_i32x4(u[4 * b + k], u[4 * (b + 1) + k], 0x88);
            t[4 * (b + 1) + k] = _mm512_shuffle_i32x4(u[4 * b + k], u[4 * (b + 1) + k], 0xdd);
        }
    /* t[4b + k], b in {0,1}: blocks (0,2) of rows 0-7; b in {2,3}: rows 8-15 */
    for (int k = 0; k < 4; k++) {
        r[k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0x88);
        r[8 + k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0xdd);
        r[4 + k] = _mm512_shuffle_i32x4(t[4 + k], t[12 + k], 0x88);
        r[12 + k] = _mm512_shuffle_i32x4(t[4 + k], t[12 + k], 0xdd);
    }
}

static void amx_digits(amx_state *st, const float *q, int Dp, int two, const float *amax);

/* max |x_i| over x[0, D) (D a multiple of 16), and sum |x_i| into *sum. */
KVC_INLINE float abs_max_sum(const float *x, int D, float *sum) {
    __m512 mx = _mm512_setzero_ps(), s = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 16) {
        const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x + d));
        mx = _mm512_max_ps(mx, a);
        s = _mm512_add_ps(s, a);
    }
    *sum = _mm512_reduce_add_ps(s);
    return _mm512_reduce_max_ps(mx);
}

static void amx_begin(void *stv, const float *q, int nh, int D, int Dp, int group, float cap,
                      float sc, int bits, int qbits) {
    amx_state *st = stv;
    memset(st, 0, sizeof *st);
    st->D = (int16_t)D, st->group = (int16_t)group, st->nh = (int16_t)nh, st->cap = cap;
    st->ng = (int16_t)(D / group), st->sc = sc;
    st->piece = bits == 4 ? 32 : group % 64 == 0 ? 64 : group % 32 == 0 ? 32 : 16;
    st->vord = bits != 4 ? 0 : group == 16 ? 2 : 1;
    st->bits = (int16_t)bits;
    /* per head: the largest and the mean magnitude */
    float amax[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int flat = 1;
    for (int h = 0; h < nh; h++) {
        float sum;
        amax[h] = abs_max_sum(q + (int64_t)h * Dp, D, &sum);
        /* 16 bits only where max|q| <= 16 mean|q|: a step of the grid is then at
         * most mean|q| 2^-11, float16's own spacing at the mean element. A head
         * with an outlier channel (one element 30-300x the rest) kept in 16 bits
         * gave errors up to 6x the float16 tolerance against float64. */
        flat &= amax[h] <= 16.0f / (float)D * sum;
    }
    /* two digits: 8 columns per group, so groups 16 and 32 share C tiles */
    const int two = qbits <= 16 && flat;
    for (int h = 0; h < 4; h++) st->m[h] = -INFINITY, st->l[h] = 0.0f;
    memset(st_acc(st), 0, (size_t)16 * (size_t)D);
    amx_digits(st, q, Dp, two, amax);
    if (two) {
        /* The guard (amx_run): a key's score is off by at most sq / 2 *
         * sum|k| (natural units: times the base-2 factor and ln 2), with
         * sum|k| <= kq * group * sum_g kscale_g; its share of the output by
         * at most twice that times |v| + |o|, |v| <= kq * max_g vscale_g
         * (attention.h). A key whose bound passes WIDEN_BOUND, i.e. sum_g
         * kscale_g * (kq * max_g vscale_g + 1) > eb, widens q to 32 bits. */
        static const float ln2 = 0.6931471805599453f, log2e = 1.4426950408889634f;
        float am = 0.0f;
        for (int h = 0; h < nh; h++) am = amax[h] > am ? amax[h] : am;
        const float kq = bits == 4 ? 7.0f : 127.0f, esc = sc * (cap > 0.0f ? log2e : 1.0f);
        st->eb = WIDEN_BOUND / (am / QMAX2 * 0.5f * kq * (float)group * esc * ln2 * 2.0f);
        float *qc = st_qcopy(st);
        for (int h = 0; h < nh; h++)
            memcpy(qc + (int64_t)h * D, q + (int64_t)h * Dp, 4u * (size_t)D);
    }
}

/*
 * The query digits: sqw and the score B tiles of st's nh heads from q (nh,
 * Dp) with max|q| amax (nh), in two digits (pairs for groups 16 and 32)
 * or four.
 */
static void amx_digits(amx_state *st, const float *q, int Dp, int two, const float *amax) {
    const int nh = st->nh, D = st->D, group = st->group, gpa = seg_per_a(group);
    const int pair = two && group < 64;
    st->two = (int16_t)two;
    st->pair = (int16_t)pair;
    const float qmax = two ? QMAX2 : QMAX;
    memset(st->sqw, 0, sizeof st->sqw);
    /* per head: q ~= sq * qi, |qi| <= qmax */
    float inv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int h = 0; h < nh; h++) {
        /* max 0 (or a NaN/Inf q, garbage in): all digits 0 */
        const int ok = amax[h] > 0.0f && amax[h] <= FLT_MAX;
        const float sq = ok ? amax[h] / qmax : 0.0f;
        inv[h] = ok ? qmax / amax[h] : 0.0f;
        if (two) { /* lanes 8 gp + 4 t + h, gp the group's parity in a pair */
            st->sqw[h] = sq * 256.0f, st->sqw[4 + h] = sq;
            if (pair) st->sqw[8 + h] = sq * 256.0f, st->sqw[12 + h] = sq;
        } else {
            st->sqw[h] = sq * 16777216.0f, st->sqw[4 + h] = sq * 65536.0f;
            st->sqw[8 + h] = sq * 256.0f, st->sqw[12 + h] = sq;
        }
    }
    /* B tile of segment (a, gi): row r, column c = the 4 digits of digit row c
     * (4t + h, t = 0 the high digit; absent heads zero, and with two
     * digits rows 8-15 unless paired) at
     * elements 64a + 4r .. +3, zero outside group gi of the segment. The
     * digit rows are built in registers and transposed (16 x 16 int32): a
     * row stored in 16-byte pieces and reloaded whole waited for the stores
     * (amx_begin 0.68-0.73x the time at Dh 64 and 128, measured).
     * Two digits (pair): B tile (a, pi) holds groups 2 pi and 2 pi + 1 of the
     * segment, column 8 gp + 4t + h (t = 0 high) nonzero only in the rows of
     * group 2 pi + gp, so one score tile serves two groups. */
    int8_t *bs = st_bs(st);
    const int rows_per_group = group / 4; /* for group < 64 */
    const __m512 lim = _mm512_set1_ps(qmax), nlim = _mm512_set1_ps(-qmax);
    for (int a = 0; a < D / 64; a++) {
        __m512i r[16];
        for (int c = 0; c < 16; c++) r[c] = _mm512_setzero_si512();
        for (int h = 0; h < nh; h++) {
            const float *qh = q + (int64_t)h * Dp + 64 * a;
            const __m512 vi = _mm512_set1_ps(inv[h]);
            __m128i p[4][4]; /* digit t (3 high, 0 low) of elements 16u .. +15 */
            for (int u = 0; u < 4; u++) {
                __m512 x = _mm512_mul_ps(_mm512_loadu_ps(qh + 16 * u), vi);
                x = _mm512_min_ps(_mm512_max_ps(x, nlim), lim);
                const __m512i xi =
                    _mm512_cvt_roundps_epi32(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                const __m512i d0 = _mm512_srai_epi32(_mm512_slli_epi32(xi, 24), 24);
                const __m512i r1 = _mm512_srai_epi32(_mm512_sub_epi32(xi, d0), 8);
                const __m512i d1 = _mm512_srai_epi32(_mm512_slli_epi32(r1, 24), 24);
                const __m512i r2 = _mm512_srai_epi32(_mm512_sub_epi32(r1, d1), 8);
                const __m512i d2 = _mm512_srai_epi32(_mm512_slli_epi32(r2, 24), 24);
                const __m512i d3 = _mm512_srai_epi32(_mm512_sub_epi32(r2, d2), 8);
                p[3][u] = _mm512_cvtepi32_epi8(d3);
                p[2][u] = _mm512_cvtepi32_epi8(d2);
                p[1][u] = _mm512_cvtepi32_epi8(d1);
                p[0][u] = _mm512_cvtepi32_epi8(d0);
            }
            const int nd = two ? 2 : 4, top = nd - 1;
            for (int t = 0; t < nd; t++) { /* row 4t + h: digit top - t */
                __m512i v = _mm512_castsi128_si512(p[top - t][0]);
                v = _mm512_inserti32x4(v, p[top - t][1], 1);
                v = _mm512_inserti32x4(v, p[top - t][2], 2);
                r[4 * t + h] = _mm512_inserti32x4(v, p[top - t][3], 3);
                if (pair && t < 2) r[8 + 4 * t + h] = r[4 * t + h];
            }
        }
        tr16(r);
        if (st->pair) {
            for (int pi = 0; pi < gpa / 2; pi++) {
                int8_t *tile = bs + (size_t)(a * (gpa / 2) + pi) * 1024;
                for (int k = 0; k < 16; k++) {
                    const int gp = k / rows_per_group - 2 * pi; /* 0, 1: in the pair */
                    const __mmask16 cols = gp == 0 ? 0x00ff : gp == 1 ? 0xff00 : 0;
                    _mm512_store_si512(tile + 64 * k, _mm512_maskz_mov_epi32(cols, r[k]));
                }
            }
            continue;
        }
        for (int gi = 0; gi < gpa; gi++) {
            int8_t *tile = bs + (size_t)(a * gpa + gi) * 1024;
            for (int k = 0; k < 16; k++) {
                const int in = gpa == 1 || k / rows_per_group == gi;
                _mm512_store_si512(tile + 64 * k, in ? r[k] : _mm512_setzero_si512());
            }
        }
    }
}

/* The guard's widening (amx_run): q from the task's copy to four digits. */
static __attribute__((noinline)) void amx_widen(amx_state *st) {
    const int nh = st->nh, D = st->D;
    float qw[4 * KVC_AMX_MAX_DIM] __attribute__((aligned(64))), am[4];
    memcpy(qw, st_qcopy(st), 4u * (size_t)(nh * D)); /* the tiles overwrite it */
    float sum; /* unused */
    for (int h = 0; h < nh; h++) am[h] = abs_max_sum(qw + h * D, D, &sum);
    amx_digits(st, qw, D, 0, am);
}

/* ---- run ------------------------------------------------------------------- */

/* Byte permutes of the V interleave, set in kvc__amx_init: byte 4n + k of a
 * tile row = element n of key k, from 16 bytes per key (piece 16), or from
 * 32 per key with keys 0,1 in one source and 2,3 in the other (piece 32,
 * columns 0-15 and 16-31). */
static int8_t g_pi16[64] __attribute__((aligned(64)));
static int8_t g_pi32[64] __attribute__((aligned(64)));
static int8_t g_pi32h[64] __attribute__((aligned(64)));

/* Byte permutes of the int4 unpack (kvc__amx_init): byte 2i of the result
 * = low nibble of packed byte i, 2i + 1 = its high nibble, for i in
 * [0, 32) (g_un0) and [32, 64) (g_un1); low nibbles from one source,
 * high from the other. */
static int8_t g_un0[64] __attribute__((aligned(64)));
static int8_t g_un1[64] __attribute__((aligned(64)));

/* Byte permutes of the int4 V interleave (kvc__amx_init): g_v4[c] takes the
 * 16 packed bytes of chunk c (bytes 16c .. 16c + 15 of a 64-byte load) of
 * two rows to byte 4j + k of the result, j the byte, k = 0, 2 from the
 * first source and 1, 3 from the second. */
static int8_t g_v4[4][64] __attribute__((aligned(64)));
/* Dh 64 (32-byte rows): rows 0, 1 in one source and 2, 3 in the other;
 * g_v4p[c] gathers chunk c of the four (byte 4j + k = byte 16c + j of key k) */
static int8_t g_v4p[2][64] __attribute__((aligned(64)));

static void permutes_init(void) {
    for (int b = 0; b < 64; b++) {
        g_un0[b] = (int8_t)((b & 1) * 64 + b / 2);
        g_un1[b] = (int8_t)((b & 1) * 64 + 32 + b / 2);
    }
    for (int c = 0; c < 4; c++)
        for (int j = 0; j < 16; j++)
            for (int k = 0; k < 4; k++) {
                g_v4[c][4 * j + k] = (int8_t)(64 * (k % 2) + 16 * c + j);
                if (c < 2) g_v4p[c][4 * j + k] = (int8_t)(32 * k + 16 * c + j);
            }
    for (int e = 0; e < 16; e++)
        for (int k = 0; k < 4; k++) {
            g_pi16[4 * e + k] = (int8_t)(16 * k + e);
            g_pi32[4 * e + k] = (int8_t)(64 * (k / 2) + 32 * (k % 2) + e);
            g_pi32h[4 * e + k] = (int8_t)(64 * (k / 2) + 32 * (k % 2) + 16 + e);
        }
}

/* Scratch of one call (stack). */
typedef struct amx_scratch {
    int32_t cs[KVC_AMX_MAX_DIM / 16][16][16];      /* score C tiles of one block, per group */
    uint8_t ap[KVC_AMX_MAX_DIM / 16][16][KEYS];    /* P.V weight digits (A tile), per group */
    int8_t bp[KVC_AMX_MAX_DIM / 16][KEYS / 4][64]; /* V by key quads (B tile), per 16 columns */
    int32_t cp[2][16][16];                         /* P.V C tiles (alternating) */
    int8_t kcopy[16][KVC_AMX_MAX_DIM];             /* K rows of a block not in one run, or int4 */
    float ksc[KVC_AMX_MAX_DIM / 16][KEYS];         /* K scales [group][key] */
    float vsc[KVC_AMX_MAX_DIM / 16][KEYS];         /* V scales [group][key] */
    float s[4][KEYS];                              /* scores, then p */
} amx_scratch;

/*
 * The ng scales of 16 keys as float32 columns: dst[g][k0 + i] = scale g of
 * key i's row for i < nb, 0 for nb <= i < 16; the rows are row[i], or
 * base + i * stride when row is NULL (a block of one run: the addresses
 * are then two vector ops, not 16 pointer computations). Gathers with the
 * rows' addresses (64-bit lanes): float16 scales two groups per 32-bit
 * element when ng is even, float32 one; an odd number of float16 scales (a
 * row of 2 bytes when ng is 1, where a 32-bit read could leave the tensor)
 * goes element by element. Gathers per 32 bits of row instead of a load,
 * convert and store per row and a transpose: the kernel ran 5-7% faster at
 * group 32.
 */
KVC_INLINE void scales_block(const char *const *row, const char *base, int64_t stride,
                             kvc_dtype sd, int ng, int nb, float (*dst)[KEYS], int k0) {
    const __mmask16 live = (__mmask16)((1u << nb) - 1u);
    if (sd == KVC_F16 && ng % 2 != 0) {
        for (int g = 0; g < ng; g++) {
            uint16_t x[16];
            for (int i = 0; i < 16; i++) {
                x[i] = 0;
                if (i < nb) memcpy(&x[i], (row ? row[i] : base + i * stride) + 2 * g, 2);
            }
            /* inserts, not a store and a reload (a failed store forward) */
            __m128i lo = _mm_cvtsi32_si128(x[0]), hi = _mm_cvtsi32_si128(x[8]);
#define INS(j)                                \
    lo = _mm_insert_epi16(lo, x[j], j);       \
    hi = _mm_insert_epi16(hi, x[8 + j], j);
            INS(1) INS(2) INS(3) INS(4) INS(5) INS(6) INS(7)
#undef INS
            _mm512_storeu_ps(&dst[g][k0], _mm512_cvtph_ps(_mm256_set_m128i(hi, lo)));
        }
        return;
    }
    __m512i a0, a1;
    if (row) {
        a0 = _mm512_loadu_si512(row), a1 = _mm512_loadu_si512(row + 8);
    } else {
        const __m512i st = _mm512_set1_epi64(stride);
        a0 = _mm512_add_epi64(_mm512_set1_epi64((long long)(intptr_t)base),
                              _mm512_mullo_epi64(st, _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7)));
        a1 = _mm512_add_epi64(a0, _mm512_slli_epi64(st, 3));
    }
    const __m512i four = _mm512_set1_epi64(4);
    const int words = sd == KVC_F16 ? ng / 2 : ng; /* 32-bit elements per row */
    const __m256i z = _mm256_setzero_si256();
    for (int w = 0; w < words; w++) {
        /* base 0: the lanes hold whole addresses */
        const __m256i lo = _mm512_mask_i64gather_epi32(z, (__mmask8)live, a0, (const void *)0, 1);
        const __m256i hi =
            _mm512_mask_i64gather_epi32(z, (__mmask8)(live >> 8), a1, (const void *)0, 1);
        a0 = _mm512_add_epi64(a0, four);
        a1 = _mm512_add_epi64(a1, four);
        const __m512i x = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        if (sd == KVC_F16) {
            _mm512_storeu_ps(&dst[2 * w][k0], _mm512_cvtph_ps(_mm512_cvtepi32_epi16(x)));
            _mm512_storeu_ps(&dst[2 * w + 1][k0],
                             _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(x, 16))));
        } else {
            _mm512_storeu_ps(&dst[w][k0], _mm512_castsi512_ps(x));
        }
    }
}

/* The 64 bytes of x as int4 pairs (two's complement): *lo = the low nibbles,
 * *hi = the high ones, each sign-extended to int8 by a 16-entry table
 * lookup (vpshufb). */
KVC_INLINE void i4_split(__m512i x, __m512i *lo, __m512i *hi) {
    const __m512i lut = _mm512_broadcast_i32x4(
        _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1));
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    *lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(x, m4));
    *hi = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(x, 4), m4));
}

/*
 * An int4 row of D elements (D / 2 bytes, element 2i in the low nibble of
 * byte i) as D int8 values: i4_split, then low and high nibbles interleaved
 * by one byte permute per 64 elements. Reads exactly the row's bytes.
 */
KVC_INLINE void unpack_i4(const char *src, int8_t *dst, int D) {
    const __m512i u0 = _mm512_load_si512(g_un0), u1 = _mm512_load_si512(g_un1);
    for (int o = 0; o < D / 2; o += 64) {
        const int nb = D / 2 - o < 64 ? D / 2 - o : 64;
        const __m512i x = _mm512_maskz_loadu_epi8(
            nb == 64 ? ~(__mmask64)0 : (((__mmask64)1 << nb) - 1), src + o);
        __m512i lo, hi;
        i4_split(x, &lo, &hi);
        _mm512_storeu_si512(dst + 2 * o, _mm512_permutex2var_epi8(lo, u0, hi));
        if (nb > 32) _mm512_storeu_si512(dst + 2 * o + 64, _mm512_permutex2var_epi8(lo, u1, hi));
    }
}

/* unpack_i4 of two rows of 64 elements (32 bytes each) in one register: one
 * i4_split serves both rows. With the Dh 64 V interleave below (two rows per
 * register, one byte permute per chunk): the int4 kernel at Dh 64 took
 * 0.83-0.91x the time, Hq 9 / H 3 decode steps 0.80-0.88x. */
KVC_INLINE void unpack_i4_pair(const char *s0, const char *s1, int8_t *d0, int8_t *d1) {
    const __m512i x = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)s0)),
        _mm256_loadu_si256((const __m256i *)s1), 1);
    __m512i lo, hi;
    i4_split(x, &lo, &hi);
    _mm512_storeu_si512(d0, _mm512_permutex2var_epi8(lo, _mm512_load_si512(g_un0), hi));
    _mm512_storeu_si512(d1, _mm512_permutex2var_epi8(lo, _mm512_load_si512(g_un1), hi));
}

/* Prefetch into L2 one key's K and V rows (rowb bytes each) and, unless the
 * call's scale lines come in anyway (pf_scales 0), its scale rows. */
KVC_INLINE void prefetch_key(const kvc_amx_keys *ks, int rowb, const char *k, const char *v,
                             const char *ksr, const char *vsr) {
    for (int o = 0; o < rowb; o += 64) {
        _mm_prefetch(k + o, _MM_HINT_T1);
        _mm_prefetch(v + o, _MM_HINT_T1);
    }
    if (ks->pf_scales) {
        _mm_prefetch(ksr, _MM_HINT_T1);
        _mm_prefetch(vsr, _MM_HINT_T1);
    }
}

/* Prefetch the rows of the next call's keys [i0, i1) (nn of them): the call
 * that runs next reads other rows (the next KV head, or the next keys), so
 * they arrive while this call computes. */
KVC_INLINE void prefetch_next(const kvc_amx_keys *ks, int rowb, const int *nrun_key,
                              const int *nrun_idx, int nn, int i0, int i1) {
    for (int i = i0; i < i1 && i < nn; i++) {
        const kvc_amx_run *r = &ks->next[nrun_key[i]];
        const int64_t j = nrun_idx[i];
        prefetch_key(ks, rowb, (const char *)r->k + j * ks->k_stride,
                     (const char *)r->v + j * ks->v_stride, (const char *)r->ks + j * ks->ks_stride,
                     (const char *)r->vs + j * ks->vs_stride);
    }
}

/* Lines [s0 / 16, s1 / 16) of every byte range of ks->row (contiguous token
 * rows: K, V and their scales), slots s0..s1 of the 16 a call spreads its
 * prefetches over. */
static void prefetch_rows(const kvc_amx_keys *ks, int s0, int s1) {
    for (int r = 0; r < ks->nrow; r++) {
        const kvc_amx_run *w = &ks->row[r];
        const char *base[4] = {w->k, w->v, w->ks, w->vs};
        const int64_t bytes[4] = {w->n * ks->k_stride, w->n * ks->v_stride, w->n * ks->ks_stride,
                                  w->n * ks->vs_stride};
        for (int t = 0; t < 4; t++) {
            const uintptr_t a0 = (uintptr_t)base[t] & ~(uintptr_t)63;
            const int64_t nl = (int64_t)(((uintptr_t)base[t] + (uintptr_t)bytes[t] - a0 + 63) / 64);
            /* asm: GCC deletes a loop whose only effect is __builtin_prefetch */
            for (int64_t i = s0 * nl / 16; i < s1 * nl / 16; i++)
                __asm__ volatile("prefetcht1 %0" ::"m"(*(const char *)(a0 + 64 * (uintptr_t)i)));
        }
    }
}

/* Rows of a block of 16 keys (k0 = 16 b) that lie in one run (uni): key
 * k0 + i at k + i * k_stride, and likewise v, ks, vs. Pointer arithmetic
 * per block instead of per key: the per-key (run, index) lookups and
 * multiplies were measurable next to the kernel's vector work. */
typedef struct amx_blk {
    const char *k, *v, *ks, *vs;
    int uni;
} amx_blk;

/* The blocks of the keys in runs[0, nrun) (at most KEYS): their count of
 * keys is returned; bl[b].uni set for the blocks inside one run. When some
 * block is not, rk/ri are filled too (key i is index ri[i] of run rk[i]). */
static int amx_blocks(const kvc_amx_keys *ks, const kvc_amx_run *runs, int nrun, amx_blk *bl,
                      int *rk, int *ri) {
    int n = 0, all = 1;
    for (int b = 0; b < KEYS / 16; b++) bl[b].uni = 0;
    for (int r = 0; r < nrun && n < KEYS; r++) {
        const int m = runs[r].n < KEYS - n ? runs[r].n : KEYS - n;
        for (int k0 = (n + 15) / 16 * 16; k0 + 16 <= n + m; k0 += 16) {
            amx_blk *b = &bl[k0 / 16];
            const int64_t j = k0 - n;
            b->uni = 1;
            b->k = (const char *)runs[r].k + j * ks->k_stride;
            b->v = (const char *)runs[r].v + j * ks->v_stride;
            b->ks = (const char *)runs[r].ks + j * ks->ks_stride;
            b->vs = (const char *)runs[r].vs + j * ks->vs_stride;
        }
        n += m;
    }
    for (int k0 = 0; k0 < n; k0 += 16) all &= bl[k0 / 16].uni;
    if (!all) {
        int i = 0;
        for (int r = 0; r < nrun && i < KEYS; r++)
            for (int j = 0; j < runs[r].n && i < KEYS; j++) rk[i] = r, ri[i] = j, i++;
    }
    return n;
}

/* prefetch_next for keys [i0, i1) of a block of one run (i relative to it) */
KVC_INLINE void prefetch_blk(const kvc_amx_keys *ks, int rowb, const amx_blk *b, int i0, int i1) {
    const char *k = b->k + i0 * ks->k_stride, *v = b->v + i0 * ks->v_stride;
    const char *kr = b->ks + i0 * ks->ks_stride, *vr = b->vs + i0 * ks->vs_stride;
    for (int i = i0; i < i1; i++, k += ks->k_stride, v += ks->v_stride, kr += ks->ks_stride,
             vr += ks->vs_stride)
        prefetch_key(ks, rowb, k, v, kr, vr);
}

static void amx_run(void *stv, const kvc_amx_keys *ks) {
    static const float log2e = 1.4426950408889634f;
    amx_state *st = stv;
    const int D = st->D, group = st->group, ng = st->ng, gpa = seg_per_a(group), nh = st->nh;
    amx_scratch sc_ __attribute__((aligned(64)));
    amx_scratch *sc = &sc_;
    /* blocks of 16 keys of this call (cb) and the next (nbk); for blocks
     * not in one run, key i is index ri[i] of run rk[i] (nrk, nri: next) */
    int rk[KEYS], ri[KEYS], nrk[KEYS], nri[KEYS];
    amx_blk cb[KEYS / 16], nbk[KEYS / 16];
    const int n = amx_blocks(ks, ks->run, ks->nrun, cb, rk, ri);
    const int nn = ks->pf_next ? amx_blocks(ks, ks->next, ks->nnext, nbk, nrk, nri) : 0;
    if (n == 0) return;
#define KROW(i) ((const int8_t *)ks->run[rk[i]].k + (int64_t)ri[i] * ks->k_stride)
#define VROW(i) ((const int8_t *)ks->run[rk[i]].v + (int64_t)ri[i] * ks->v_stride)
#define KSROW(i) ((const char *)ks->run[rk[i]].ks + (int64_t)ri[i] * ks->ks_stride)
#define VSROW(i) ((const char *)ks->run[rk[i]].vs + (int64_t)ri[i] * ks->vs_stride)
    const int nblk = (n + 15) / 16;
    const int i4 = st->bits == 4, rowb = i4 ? D / 2 : D; /* bytes per K/V row */
    /* Prefetch of the next call's key quads [q0, q1) into L2. Spread
     * through the call (quads 0-3 in the score blocks, 4-7 in the weights,
     * 8-15 in the P.V tiles), not issued with the score blocks alone: the
     * DRAM-bound steps took 0.82x the time (B 16, kv 4096). Those requests
     * hold fill buffers until memory answers, and the score and V phases
     * need them for their own L2 reads. */
#define PF_QUADS(q0, q1)                                                                  \
    do {                                                                                  \
        for (int q_ = (q0); q_ < (q1) && 4 * q_ < nn; q_++) {                             \
            if (nbk[q_ / 4].uni)                                                          \
                prefetch_blk(ks, rowb, &nbk[q_ / 4], 4 * (q_ % 4), 4 * (q_ % 4) + 4);     \
            else                                                                          \
                prefetch_next(ks, rowb, nrk, nri, nn, 4 * q_, 4 * q_ + 4);                \
        }                                                                                 \
        if (ks->nrow) prefetch_rows(ks, (q0), (q1));                                      \
    } while (0)
    const int8_t *bs = st_bs(st);
    /* The query's B tiles stay in tmm4-7 for the call's score tiles when
     * there are at most 4 (Dh 128 with group 32, or groups of 64+ up to Dh
     * 256; P.V reuses those registers), instead of a tile load per group
     * and block: ~2% of the kernel at group 32. Set again when the guard
     * widens q. */
    __m512 sqw;
    int gpc, nct, resident; /* groups and C tiles per block; B tiles in registers */
    int blk4;               /* C columns 12-15 in use: pairs, or four digits */
#define QUERY_TILES()                                    \
    do {                                                 \
        sqw = _mm512_load_ps(st->sqw);                   \
        gpc = st->pair ? 2 : 1, nct = ng / gpc;          \
        blk4 = st->pair || !st->two;                     \
        const int nbt_ = group >= 64 ? D / 64 : nct;     \
        resident = nbt_ <= 4;                            \
        if (resident) {                                  \
            TLOAD(4, bs, 64);                            \
            if (nbt_ > 1) TLOAD(5, bs + 1024, 64);       \
            if (nbt_ > 2) TLOAD(6, bs + 2048, 64);       \
            if (nbt_ > 3) TLOAD(7, bs + 3072, 64);       \
        }                                                \
    } while (0)
    QUERY_TILES();
    /* scores, block by block (the C tiles of a block are read back at once) */
    for (int b = 0; b < nblk; b++) {
        const int k0 = 16 * b, nb = n - k0 < 16 ? n - k0 : 16;
        /* A rows: in place when the block's 16 keys are one run */
        const int8_t *abase;
        int64_t astride;
        if (i4) { /* int4: unpacked to int8 rows first (one loop with the copy
                   * below measured 3% slower int4 steps) */
#define K4ROW(i) (cb[b].uni ? cb[b].k + (i) * ks->k_stride : (const char *)KROW(k0 + (i)))
            if (D == 64) {
                for (int i = 0; i < 16; i += 2) {
                    if (i + 1 < nb) {
                        unpack_i4_pair(K4ROW(i), K4ROW(i + 1), sc->kcopy[i], sc->kcopy[i + 1]);
                        continue;
                    }
                    if (i < nb)
                        unpack_i4(K4ROW(i), sc->kcopy[i], D);
                    else
                        memset(sc->kcopy[i], 0, (size_t)D);
                    memset(sc->kcopy[i + 1], 0, (size_t)D);
                }
            } else {
                for (int i = 0; i < 16; i++) {
                    if (i < nb)
                        unpack_i4(K4ROW(i), sc->kcopy[i], D);
                    else
                        memset(sc->kcopy[i], 0, (size_t)D);
                }
            }
#undef K4ROW
            abase = &sc->kcopy[0][0], astride = KVC_AMX_MAX_DIM;
        } else if (cb[b].uni) {
            abase = (const int8_t *)cb[b].k, astride = ks->k_stride;
        } else {
            for (int i = 0; i < 16; i++) {
                if (i < nb)
                    memcpy(sc->kcopy[i], KROW(k0 + i), (size_t)D);
                else
                    memset(sc->kcopy[i], 0, (size_t)D);
            }
            abase = &sc->kcopy[0][0], astride = KVC_AMX_MAX_DIM;
        }
        /* scales as [group][key] columns (absent keys: 0) */
        if (cb[b].uni) {
            scales_block(NULL, cb[b].ks, ks->ks_stride, ks->ksd, ng, 16, sc->ksc, k0);
            scales_block(NULL, cb[b].vs, ks->vs_stride, ks->vsd, ng, 16, sc->vsc, k0);
        } else {
            const char *kr[16], *vr[16];
            for (int i = 0; i < 16; i++) {
                kr[i] = KSROW(k0 + (i < nb ? i : 0));
                vr[i] = VSROW(k0 + (i < nb ? i : 0));
            }
            scales_block(kr, NULL, 0, ks->ksd, ng, nb, sc->ksc, k0);
            scales_block(vr, NULL, 0, ks->vsd, ng, nb, sc->vsc, k0);
        }
        if (st->two) { /* the guard: per key, sum_g kscale_g * (kq * max_g vscale_g + 1) */
            __m512 ksum = _mm512_load_ps(&sc->ksc[0][k0]), vmx = _mm512_load_ps(&sc->vsc[0][k0]);
            for (int g = 1; g < ng; g++) {
                ksum = _mm512_add_ps(ksum, _mm512_load_ps(&sc->ksc[g][k0]));
                vmx = _mm512_max_ps(vmx, _mm512_load_ps(&sc->vsc[g][k0]));
            }
            const __m512 kq = _mm512_set1_ps(i4 ? 7.0f : 127.0f), one = _mm512_set1_ps(1.0f);
            const __m512 e = _mm512_mul_ps(ksum, _mm512_fmadd_ps(vmx, kq, one));
            /* not e <= eb: a NaN widens too */
            if (_mm512_cmp_ps_mask(e, _mm512_set1_ps(st->eb), _CMP_NLE_UQ)) {
                amx_widen(st);
                QUERY_TILES();
            }
        }
        /* C tile per group (alternating registers: a group's products need not
         * wait for the previous group's tile store) */
        int lasta = -1;
        for (int g = 0; g < nct; g++) { /* C tile g: group g, or groups 2g, 2g + 1 (pair) */
            const int a0 = group >= 64 ? g * (group / 64) : g * gpc / gpa;
            const int a1 = group >= 64 ? a0 + group / 64 : a0 + 1;
            if (g & 1)
                _tile_zero(3);
            else
                _tile_zero(2);
            for (int a = a0; a < a1; a++) {
                if (a != lasta) {
                    TLOAD(0, abase + 64 * a, astride);
                    lasta = a;
                }
                const int bi = group >= 64 ? a : g; /* B tiles in C tile order */
                if (resident) {
#define DP(c, r)                   \
    case r:                        \
        _tile_dpbssd(c, 0, r);     \
        break;
                    if (g & 1) {
                        switch (bi + 4) { DP(3, 4) DP(3, 5) DP(3, 6) DP(3, 7) }
                    } else {
                        switch (bi + 4) { DP(2, 4) DP(2, 5) DP(2, 6) DP(2, 7) }
                    }
#undef DP
                    continue;
                }
                const int8_t *bt = bs + (size_t)bi * 1024;
                if (g & 1) {
                    TLOAD(4, bt, 64);
                    _tile_dpbssd(3, 0, 4);
                } else {
                    TLOAD(1, bt, 64);
                    _tile_dpbssd(2, 0, 1);
                }
            }
            if (g & 1)
                TSTORE(3, sc->cs[g], 64);
            else
                TSTORE(2, sc->cs[g], 64);
        }
        /* per key x = sum_g C_g[key] * kscale[key][g] * sqw (lanes 4t + h),
         * then the three digit blocks summed and keys x heads transposed */
        __m512 R[4];
        for (int k4 = 0; k4 < 4; k4++) {
            if (k4 == 0) PF_QUADS(b, b + 1 < nblk ? b + 1 : 4);
            __m512 X[4];
            for (int kk = 0; kk < 4; kk++) {
                const int i = 4 * k4 + kk;
                /* C tile g's K scales: group g's, or (pair) lanes 8 gp + 4t + h
                 * group 2g + gp's */
#define KSC(g)                                                                 \
    (st->pair ? _mm512_mask_blend_ps((__mmask16)0xff00,                        \
                                     _mm512_set1_ps(sc->ksc[2 * (g)][k0 + i]), \
                                     _mm512_set1_ps(sc->ksc[2 * (g) + 1][k0 + i])) \
              : _mm512_set1_ps(sc->ksc[g][k0 + i]))
                __m512 x = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sc->cs[0][i])),
                                         KSC(0));
                for (int g = 1; g < nct; g++)
                    x = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sc->cs[g][i])),
                                        KSC(g), x);
#undef KSC
                X[kk] = _mm512_mul_ps(x, sqw);
            }
            /* T_t = [X0.t | X1.t | X2.t | X3.t] (128-bit blocks) */
            const __m512 u0 = _mm512_shuffle_f32x4(X[0], X[1], 0x44);
            const __m512 u1 = _mm512_shuffle_f32x4(X[0], X[1], 0xee);
            const __m512 u2 = _mm512_shuffle_f32x4(X[2], X[3], 0x44);
            const __m512 u3 = _mm512_shuffle_f32x4(X[2], X[3], 0xee);
            const __m512 t0 = _mm512_shuffle_f32x4(u0, u2, 0x88);
            const __m512 t1 = _mm512_shuffle_f32x4(u0, u2, 0xdd);
            const __m512 t2 = _mm512_shuffle_f32x4(u1, u3, 0x88);
            R[k4] = _mm512_add_ps(_mm512_add_ps(t0, t1), t2); /* lane 4k + h: key 4k4 + k */
            if (blk4) R[k4] = _mm512_add_ps(R[k4], _mm512_shuffle_f32x4(u1, u3, 0xdd));
        }
        const __m512i i0 =
            _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
        const __m512i i1 = _mm512_add_epi32(i0, _mm512_set1_epi32(2));
        const __m512 a0 = _mm512_permutex2var_ps(R[0], i0, R[1]),
                     a1 = _mm512_permutex2var_ps(R[0], i1, R[1]);
        const __m512 b0 = _mm512_permutex2var_ps(R[2], i0, R[3]),
                     b1 = _mm512_permutex2var_ps(R[2], i1, R[3]);
        const __mmask16 valid = (__mmask16)((1u << nb) - 1u);
        const __m512 ninf = _mm512_set1_ps(-INFINITY);
        _mm512_store_ps(&sc->s[0][k0],
                        _mm512_mask_mov_ps(ninf, valid, _mm512_shuffle_f32x4(a0, b0, 0x44)));
        _mm512_store_ps(&sc->s[1][k0],
                        _mm512_mask_mov_ps(ninf, valid, _mm512_shuffle_f32x4(a0, b0, 0xee)));
        _mm512_store_ps(&sc->s[2][k0],
                        _mm512_mask_mov_ps(ninf, valid, _mm512_shuffle_f32x4(a1, b1, 0x44)));
        _mm512_store_ps(&sc->s[3][k0],
                        _mm512_mask_mov_ps(ninf, valid, _mm512_shuffle_f32x4(a1, b1, 0xee)));
    }
    /* V interleaved by key quads (the last partial quad repeats its last key,
     * whose weight is 0 there) */
    const __m512i perm16 = _mm512_load_si512(g_pi16), perm32 = _mm512_load_si512(g_pi32),
                  perm32h = _mm512_load_si512(g_pi32h);
    for (int q4 = 0; q4 < nblk * 4; q4++) {
        const int8_t *r[4];
        if (cb[q4 / 4].uni) {
            const char *v0 = cb[q4 / 4].v + (int64_t)(4 * (q4 % 4)) * ks->v_stride;
            for (int i = 0; i < 4; i++) r[i] = (const int8_t *)(v0 + i * ks->v_stride);
        } else {
            for (int i = 0; i < 4; i++) r[i] = VROW(4 * q4 + i < n ? 4 * q4 + i : n - 1);
        }
        if (i4) {
            /* int4: the 4 rows' packed bytes interleaved first (byte 4j + k =
             * byte j of key k, 16 bytes = 32 elements per chunk), then each
             * nibble sign-extended: the low nibbles are the chunk's even
             * elements, the high ones its odd elements (vord 1); with group 16
             * a tile takes one group's even and odd halves (vord 2). Half the
             * bytes to interleave and no unpacked copy of the rows to store and
             * read back: the kernel alone took 0.87-0.93x the time (groups
             * 16-128, Dh 64-256), int4 decode steps 0.83-0.92x. */
#define V4STORE(c, x)                                                                         \
    do {                                                                                      \
        __m512i lo, hi;                                                                       \
        i4_split((x), &lo, &hi);                                                              \
        if (st->vord == 2) {                                                                  \
            _mm512_store_si512(sc->bp[2 * (c)][q4], _mm512_shuffle_i64x2(lo, hi, 0x44));      \
            _mm512_store_si512(sc->bp[2 * (c) + 1][q4], _mm512_shuffle_i64x2(lo, hi, 0xee));  \
        } else {                                                                              \
            _mm512_store_si512(sc->bp[2 * (c)][q4], lo);                                      \
            _mm512_store_si512(sc->bp[2 * (c) + 1][q4], hi);                                  \
        }                                                                                     \
    } while (0)
            if (D == 64) { /* 32-byte rows: two per register, one byte permute per chunk */
                const __m512i x01 = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)r[0])),
                    _mm256_loadu_si256((const __m256i *)r[1]), 1);
                const __m512i x23 = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)r[2])),
                    _mm256_loadu_si256((const __m256i *)r[3]), 1);
                for (int c = 0; c < 2; c++) {
                    V4STORE(c, _mm512_permutex2var_epi8(x01, _mm512_load_si512(g_v4p[c]), x23));
                }
                continue;
            }
            __m512i x0 = _mm512_setzero_si512(), x1 = x0, x2 = x0, x3 = x0;
            for (int c = 0; c < D / 32; c++) {
                if (c % 4 == 0) {
                    const int o = 16 * c, nb = rowb - o < 64 ? rowb - o : 64;
                    const __mmask64 lm = nb == 64 ? ~(__mmask64)0 : (((__mmask64)1 << nb) - 1);
                    x0 = _mm512_maskz_loadu_epi8(lm, r[0] + o);
                    x1 = _mm512_maskz_loadu_epi8(lm, r[1] + o);
                    x2 = _mm512_maskz_loadu_epi8(lm, r[2] + o);
                    x3 = _mm512_maskz_loadu_epi8(lm, r[3] + o);
                }
                const __m512i idx = _mm512_load_si512(g_v4[c % 4]);
                const __m512i x = _mm512_mask_blend_epi8((__mmask64)0xccccccccccccccccull,
                                                         _mm512_permutex2var_epi8(x0, idx, x1),
                                                         _mm512_permutex2var_epi8(x2, idx, x3));
                V4STORE(c, x);
            }
#undef V4STORE
            continue;
        }
        if (st->piece == 64) {
            for (int p = 0; p < D / 64; p++) {
                const __m512i x0 = _mm512_loadu_si512(r[0] + 64 * p);
                const __m512i x1 = _mm512_loadu_si512(r[1] + 64 * p);
                const __m512i x2 = _mm512_loadu_si512(r[2] + 64 * p);
                const __m512i x3 = _mm512_loadu_si512(r[3] + 64 * p);
                const __m512i l01 = _mm512_unpacklo_epi8(x0, x1),
                              h01 = _mm512_unpackhi_epi8(x0, x1);
                const __m512i l23 = _mm512_unpacklo_epi8(x2, x3),
                              h23 = _mm512_unpackhi_epi8(x2, x3);
                _mm512_store_si512(sc->bp[4 * p][q4], _mm512_unpacklo_epi16(l01, l23));
                _mm512_store_si512(sc->bp[4 * p + 1][q4], _mm512_unpackhi_epi16(l01, l23));
                _mm512_store_si512(sc->bp[4 * p + 2][q4], _mm512_unpacklo_epi16(h01, h23));
                _mm512_store_si512(sc->bp[4 * p + 3][q4], _mm512_unpackhi_epi16(h01, h23));
            }
        } else if (st->piece == 32) {
            /* rows 0,1 and 2,3 of a 32-byte piece in two registers; one
             * two-source byte permute per 16 columns (natural order) */
            for (int p = 0; p < D / 32; p++) {
                const __m512i x01 = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(r[0] + 32 * p))),
                    _mm256_loadu_si256((const __m256i *)(r[1] + 32 * p)), 1);
                const __m512i x23 = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(r[2] + 32 * p))),
                    _mm256_loadu_si256((const __m256i *)(r[3] + 32 * p)), 1);
                _mm512_store_si512(sc->bp[2 * p][q4], _mm512_permutex2var_epi8(x01, perm32, x23));
                _mm512_store_si512(sc->bp[2 * p + 1][q4],
                                   _mm512_permutex2var_epi8(x01, perm32h, x23));
            }
        } else {
            /* the 4 rows' 16-byte pieces in one register, one byte permute */
            for (int p = 0; p < D / 16; p++) {
                __m512i x =
                    _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(r[0] + 16 * p)));
                x = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i *)(r[1] + 16 * p)), 1);
                x = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i *)(r[2] + 16 * p)), 2);
                x = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i *)(r[3] + 16 * p)), 3);
                _mm512_store_si512(sc->bp[p][q4], _mm512_permutexvar_epi8(perm16, x));
            }
        }
    }
    /* soft cap, then the online softmax per head: s becomes p (0 past n and
     * for absent heads) */
    float *acc = st_acc(st);
    for (int h = 0; h < 4; h++) {
        float *sh = sc->s[h];
        if (h >= nh) {
            for (int j = 0; j < KEYS; j += 16) _mm512_store_ps(sh + j, _mm512_setzero_ps());
            continue;
        }
        if (st->cap > 0.0f) {
            kvc__softcap_row(sh, n, st->cap, log2e);
            for (int j = n; j < nblk * 16; j++) sh[j] = -INFINITY;
        }
        __m512 mx = _mm512_load_ps(sh);
        for (int j = 16; j < nblk * 16; j += 16) mx = _mm512_max_ps(mx, _mm512_load_ps(sh + j));
        const float bm = kvc__mul_up(_mm512_reduce_max_ps(mx), st->sc); /* base 2, up: p <= 1 */
        const float mn = bm > st->m[h] ? bm : st->m[h];
        if (!(mn > -INFINITY)) { /* no finite score yet (NaN/Inf in the inputs): nothing to add */
            for (int j = 0; j < KEYS; j += 16) _mm512_store_ps(sh + j, _mm512_setzero_ps());
            continue;
        }
        const __m512 vm = _mm512_set1_ps(-mn), vsc = _mm512_set1_ps(st->sc);
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < nblk * 16; j += 16) {
            const __m512 p = kvc__exp2_16(_mm512_fmadd_ps(_mm512_load_ps(sh + j), vsc, vm));
            _mm512_store_ps(sh + j, p);
            sum = _mm512_add_ps(sum, p);
        }
        for (int j = nblk * 16; j < KEYS; j += 16) _mm512_store_ps(sh + j, _mm512_setzero_ps());
        if (mn > st->m[h]) {
            const float al = st->m[h] == -INFINITY ? 0.0f : exp2f(st->m[h] - mn);
            const __m512 va = _mm512_set1_ps(al);
            float *ah = acc + (int64_t)h * D;
            for (int d = 0; d < D; d += 16)
                _mm512_store_ps(ah + d, _mm512_mul_ps(_mm512_load_ps(ah + d), va));
            st->l[h] *= al;
            st->m[h] = mn;
        }
        st->l[h] += _mm512_reduce_add_ps(sum);
    }
    /* weights per group: digits of round(p * vs / W * WMAX), row 4t + h */
    float wf[KVC_AMX_MAX_DIM / 16];
    const __m512i bidx =
        _mm512_set_epi8(63, 59, 55, 51, 47, 43, 39, 35, 31, 27, 23, 19, 15, 11, 7, 3, 62, 58, 54,
                        50, 46, 42, 38, 34, 30, 26, 22, 18, 14, 10, 6, 2, 61, 57, 53, 49, 45, 41,
                        37, 33, 29, 25, 21, 17, 13, 9, 5, 1, 60, 56, 52, 48, 44, 40, 36, 32, 28, 24,
                        20, 16, 12, 8, 4, 0); /* 16t + l <- byte t of lane l */
    for (int g = 0; g < ng; g++) {
        PF_QUADS(4 + 4 * g / ng, 4 + 4 * (g + 1) / ng);
        __m512 mx = _mm512_setzero_ps();
        for (int j = 0; j < nblk * 16; j += 16)
            mx = _mm512_max_ps(mx, _mm512_load_ps(&sc->vsc[g][j]));
        const float W = _mm512_reduce_max_ps(mx);
        const int ok = W > 0.0f && W <= FLT_MAX; /* all zero (or garbage): no V */
        wf[g] = ok ? W / WMAX : 0.0f;
        const __m512 inv = _mm512_set1_ps(ok ? WMAX / W : 0.0f), wmax = _mm512_set1_ps(WMAX);
        __m512 vs[4];
        for (int j = 0; j < 4; j++)
            vs[j] = j < nblk ? _mm512_mul_ps(_mm512_load_ps(&sc->vsc[g][16 * j]), inv)
                             : _mm512_setzero_ps();
        for (int h = 0; h < 4; h++) {
            /* bb[j]: bytes 16t + l = digit t of key 16j + l; row t of the A
             * tile is then the 128-bit blocks t of bb[0..3] (a 4 x 4 block
             * transpose), written as whole aligned rows (masked stores at
             * offsets that split cache lines made the kernel 9-26% slower) */
            __m512i bb[4];
            for (int j = 0; j < 4; j++) {
                const __m512 w =
                    _mm512_min_ps(_mm512_mul_ps(_mm512_load_ps(&sc->s[h][16 * j]), vs[j]), wmax);
                bb[j] = _mm512_permutexvar_epi8(
                    bidx,
                    _mm512_cvt_roundps_epu32(w, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            }
            const __m512i u0 = _mm512_shuffle_i32x4(bb[0], bb[1], 0x44); /* b0.0 b0.1 b1.0 b1.1 */
            const __m512i u1 = _mm512_shuffle_i32x4(bb[0], bb[1], 0xee); /* b0.2 b0.3 b1.2 b1.3 */
            const __m512i u2 = _mm512_shuffle_i32x4(bb[2], bb[3], 0x44);
            const __m512i u3 = _mm512_shuffle_i32x4(bb[2], bb[3], 0xee);
            /* digit t = 2 is the high one: row h gets t = 2, row 4 + h t = 1, row 8 + h t = 0 */
            _mm512_store_si512(sc->ap[g][h], _mm512_shuffle_i32x4(u1, u3, 0x88));
            _mm512_store_si512(sc->ap[g][4 + h], _mm512_shuffle_i32x4(u0, u2, 0xdd));
            _mm512_store_si512(sc->ap[g][8 + h], _mm512_shuffle_i32x4(u0, u2, 0x88));
        }
    }
    /* P.V: per 16-column tile, A = the group's weights (tmm4), B = its V
     * columns (tmm6), C alternating (tmm1, tmm5); a tile is flushed into acc
     * after the next tile's products and store are issued, so its store has
     * drained when the vector loads read it (4-8% faster than flushing at
     * once, measured) */
    const int tiles = D / 16, tpg = group / 16;
    for (int jt = 0; jt <= tiles; jt++) {
        if (jt < tiles) {
            PF_QUADS(8 + 8 * jt / tiles, 8 + 8 * (jt + 1) / tiles);
            const int g = jt / tpg;
            if (jt % tpg == 0) TLOAD(4, sc->ap[g], KEYS);
            TLOAD(6, sc->bp[jt], 64);
            if (jt & 1) {
                _tile_zero(5);
                _tile_dpbusd(5, 4, 6);
                TSTORE(5, sc->cp[1], 64);
            } else {
                _tile_zero(1);
                _tile_dpbusd(1, 4, 6);
                TSTORE(1, sc->cp[0], 64);
            }
        }
        if (jt == 0) continue;
        /* flush the previous tile */
        const int jp = jt - 1, g = jp / tpg;
        const __m512 f2 = _mm512_set1_ps(wf[g] * 65536.0f), f1 = _mm512_set1_ps(wf[g] * 256.0f),
                     f0 = _mm512_set1_ps(wf[g]);
        int32_t(*cp)[16] = sc->cp[jp & 1];
        for (int h = 0; h < nh; h++) {
            float *a = acc + (int64_t)h * D + 16 * jp;
            __m512 x = _mm512_load_ps(a);
            x = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cp[h])), f2, x);
            x = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cp[4 + h])), f1, x);
            x = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cp[8 + h])), f0, x);
            _mm512_store_ps(a, x);
        }
    }
#undef PF_QUADS
#undef QUERY_TILES
#undef KROW
#undef VROW
#undef KSROW
#undef VSROW
}

static void amx_end(const void *stv, float *m, float *l, float *acc, int Dp) {
    const amx_state *st = stv;
    const float *a = (const float *)(st + 1);
    const int D = st->D;
    for (int h = 0; h < st->nh; h++) {
        m[h] = st->m[h];
        l[h] = st->l[h];
        float *o = acc + (int64_t)h * Dp;
        const float *ah = a + (int64_t)h * D;
        const int P = st->piece;
        for (int p = 0; p < D; p += P)
            for (int e = 0; e < P; e++) o[p + pv_pos(P, st->vord, e)] = ah[p + e];
        for (int d = D; d < Dp; d++) o[d] = 0.0f;
    }
}

/* ---- the table ------------------------------------------------------------- */

static kvc_kernels g_table;

int kvc__amx_init(void) {
#if defined(__linux__) && defined(SYS_arch_prctl)
    /* Linux hands out tile data state per process on request (5.16+). */
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0)
        return 0;
    permutes_init();
    g_table = *kvc__kernels_avx512();
    g_table.isa = KVC_ISA_AMX;
    g_table.amx_tiles = amx_tiles;
    g_table.amx_state_bytes = amx_state_bytes;
    g_table.amx_begin = amx_begin;
    g_table.amx_run = amx_run;
    g_table.amx_end = amx_end;
    return 1;
#else
    return 0;
#endif
}

const kvc_kernels *kvc__kernels_amx(void) { return &g_table; }

#else /* 32-bit x86: no AMX */

int kvc__amx_init(void) { return 0; }
const kvc_kernels *kvc__kernels_amx(void) { return kvc__kernels_avx512(); }

#endif
