/*
 * kvc_kvfmt_attention (docs/KV_FORMATS.md section 6) on every ISA the host
 * runs (scalar: the generic C; avx2/avx512: src/kernels/kvfmt_*.c) against
 * a float64 reference computed here from the page bytes as section 5 lays
 * them out (x' = q * scale + zero, float16 tail, V rotated back by an
 * explicit Hadamard matrix), independent of the library's kernels; and 1 vs
 * 2 threads bitwise equal. Grid: kivi8/kivi4, H 1..3, GQA 1..8, Dh 64/128
 * (and a Dh the kernels leave to the generic C), P 16/32/64/128, decode
 * rows and prefill runs of consecutive positions, partial tails, sequences
 * long enough for the kernels' key chunks.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "test.h"

typedef struct lay {
    size_t kc, vc, vs, vz, ks, kz, page;
    int64_t share;
} lay;

/* Section 5's field order, from the format's parameters alone. */
static lay layout_of(const kvc_kvfmt *f) {
    const int64_t H = f->num_kv_heads, D = f->head_dim, P = f->page_size, G = f->group;
    lay l;
    l.kc = 0;
    l.vc = l.kc + (size_t)(H * P * D * f->bits / 8);
    l.vs = l.vc + (size_t)(H * D * P * f->bits / 8);
    l.vz = l.vs + (size_t)(H * P * (D / f->v_group) * 2);
    l.ks = l.vz + (f->v_asym ? (size_t)(H * P * (D / f->v_group) * 2) : 0);
    l.share = H * D * P / G;
    l.kz = l.ks + (size_t)l.share * 2;
    l.page = l.kz + (size_t)l.share * 2;
    return l;
}

static double f16at(const unsigned char *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return (double)kvc_f16_to_f32(h);
}

static int code_at(const unsigned char *row, int64_t i, int bits) {
    return bits == 8 ? row[i] : (row[i / 2] >> ((i & 1) * 4)) & 15;
}

/* Dequantized K and V (rotated basis) of position t, head h, into k, v. */
static void deq(const kvc_kvfmt *f, const lay *l, const unsigned char *pages, size_t pstride,
                const kvc_kvfmt_seq *s, int64_t t, int64_t h, double *k, double *v) {
    const int64_t H = f->num_kv_heads, D = f->head_dim, P = f->page_size, G = f->group;
    const int64_t nq = (s->n_kv / G) * G, T = G + f->window, S = f->sink;
    if (t < S && nq > 0) { /* the sink rows (K left out of group 0's codes) */
        for (int64_t c = 0; c < D; c++) {
            k[c] = kvc_f16_to_f32(s->sink[(t * H + h) * D + c]);
            v[c] = kvc_f16_to_f32(s->sink[((S + t) * H + h) * D + c]);
        }
        return;
    }
    if (t >= nq) { /* float16 tail (W = 0: the queries below all read it from nq) */
        for (int64_t c = 0; c < D; c++) {
            k[c] = kvc_f16_to_f32(s->tail[((t % T) * H + h) * D + c]);
            v[c] = kvc_f16_to_f32(s->tail[((T + t % T) * H + h) * D + c]);
        }
        return;
    }
    const unsigned char *pg = pages + (size_t)s->pages[t / P] * pstride;
    const int64_t o = t % P, g = t / G, nvg = D / f->v_group;
    for (int64_t c = 0; c < D; c++) {
        const int64_t e = h * D + c;
        const unsigned char *kp;
        int64_t idx;
        if (G <= P) {
            kp = pages + (size_t)s->pages[(g * G) / P] * pstride;
            idx = (g % (P / G)) * H * D + e;
        } else {
            kp = pages + (size_t)s->pages[(g * G + (e / l->share) * P) / P] * pstride;
            idx = e % l->share;
        }
        const double ks = f16at(kp + l->ks + idx * 2), kz = f16at(kp + l->kz + idx * 2);
        /* K codes: 8-bit channels 2i, 2i + 1 token by token in a run of 2P
         * bytes (an odd D's last channel alone), 4-bit a channel's P codes */
        const int64_t kpair = f->bits == 8 && (c | 1) < D;
        const unsigned char *krow = pg + l->kc + (h * D + (kpair ? c & ~1 : c)) * P * f->bits / 8;
        const int64_t ki = kpair ? 2 * o + (c & 1) : o;
        k[c] = (double)(float)(code_at(krow, ki, f->bits) * ks + kz);
        const int64_t vi = ((h * P + o) * nvg + c / f->v_group) * 2;
        const double vs = f16at(pg + l->vs + vi), vz = f16at(pg + l->vz + vi);
        v[c] = (double)(float)(code_at(pg + l->vc + (h * D + c) * P * f->bits / 8, o, f->bits) * vs + vz);
    }
}

/* out (Hq, D) and lse (Hq, base 2) of one query row in float64. */
static void reference(const kvc_kvfmt *f, const lay *l, const unsigned char *pages, size_t pstride,
                      const kvc_kvfmt_seq *s, const float *q, int64_t Hq, int64_t pos,
                      double *out, double *lse) {
    const int64_t H = f->num_kv_heads, D = f->head_dim, grp = Hq / H;
    double *sc = malloc((size_t)(pos + 1) * 8);
    double *kk = malloc((size_t)((pos + 1) * D) * 8), *vv = malloc((size_t)((pos + 1) * D) * 8);
    const double sm = 1.0 / sqrt((double)D);
    for (int64_t h = 0; h < H; h++) {
        for (int64_t t = 0; t <= pos; t++) deq(f, l, pages, pstride, s, t, h, kk + t * D, vv + t * D);
        for (int64_t g = 0; g < grp; g++) {
            const int64_t qh = h * grp + g;
            double mx = -INFINITY;
            for (int64_t t = 0; t <= pos; t++) {
                double d = 0;
                for (int64_t c = 0; c < D; c++) d += (double)q[qh * D + c] * kk[t * D + c];
                sc[t] = d * sm;
                mx = sc[t] > mx ? sc[t] : mx;
            }
            double sum = 0;
            double *o = out + qh * D;
            for (int64_t c = 0; c < D; c++) o[c] = 0;
            for (int64_t t = 0; t <= pos; t++) {
                const double p = exp(sc[t] - mx);
                sum += p;
                for (int64_t c = 0; c < D; c++) o[c] += p * vv[t * D + c];
            }
            for (int64_t c = 0; c < D; c++) o[c] /= sum;
            if (f->rotate_v) { /* o = H o, H the normalized Sylvester Hadamard matrix */
                double *r = malloc((size_t)D * 8);
                for (int64_t i = 0; i < D; i++) {
                    double a = 0;
                    for (int64_t j = 0; j < D; j++)
                        a += (__builtin_popcountll((unsigned long long)(i & j)) & 1 ? -1.0 : 1.0) * o[j];
                    r[i] = a / sqrt((double)D);
                }
                memcpy(o, r, (size_t)D * 8);
                free(r);
            }
            lse[qh] = (mx + log(sum)) / log(2.0);
        }
    }
    free(sc), free(kk), free(vv);
}

typedef struct grid_case {
    kvc_kv_format id;
    int32_t H, grp, D, P;
    int32_t sink; /* -1: the member's; else S of a custom tuple */
} grid_case;

/* n_seqs sequences of the given lengths (appended in random chunks), rows:
 * the last position of each (decode), a prefill run of consecutive
 * positions at the end of the longest, and scattered positions. */
static int run_case(const grid_case *gc, const int64_t *lens, int n_seqs, uint64_t seed) {
    kvc_kvfmt f;
    ASSERT_OK(kvc_kvfmt_make(gc->id, gc->H, gc->D, gc->P, &f));
    if (gc->sink >= 0) {
        f.id = KVC_KVFMT_NONE;
        f.sink = gc->sink;
        ASSERT_OK(kvc_kvfmt_check(&f));
    }
    const lay l = layout_of(&f);
    ASSERT_EQ_I64(l.page, kvc_kvfmt_page_bytes(&f));
    const int64_t H = gc->H, D = gc->D, P = gc->P, Hq = H * gc->grp, row = H * D;
    uint64_t rng = seed;
    int64_t npages = 0, longest = 0;
    for (int b = 0; b < n_seqs; b++) {
        npages += (lens[b] + P - 1) / P;
        if (lens[b] > lens[longest]) longest = b;
    }
    const size_t pb = l.page, tb = kvc_kvfmt_tail_bytes(&f);
    unsigned char *pages = calloc((size_t)(npages + 2), pb);
    int32_t *ids = malloc((size_t)(npages + 2) * 4);
    const size_t sb = kvc_kvfmt_sink_bytes(&f);
    ASSERT_EQ_I64(sb, 2 * f.sink * H * D * 2);
    uint16_t *tails = calloc((size_t)n_seqs, tb);
    uint16_t *sinks = calloc((size_t)n_seqs, sb + 2);
    float sink_in[8][2][16 * 3 * 128]; /* K and V rows of positions < S, as given */
    kvc_kvfmt_seq seqs[8];
    ASSERT_TRUE(pages && ids && tails && sinks && n_seqs <= 8 && f.sink * H * D <= 16 * 3 * 128);
    for (int64_t i = 0; i < npages + 2; i++) ids[i] = (int32_t)i;
    for (int64_t i = npages + 1; i > 0; i--) { /* shuffled page ids */
        const int64_t j = (int64_t)(test_rng_next(&rng) % (uint64_t)(i + 1));
        const int32_t t = ids[i];
        ids[i] = ids[j];
        ids[j] = t;
    }
    /* K channels with their own offsets and spreads, V around 0 */
    float *off = malloc((size_t)row * 4), *spr = malloc((size_t)row * 4);
    for (int64_t e = 0; e < row; e++) {
        off[e] = test_rng_f32(&rng) * 6.0f;
        spr[e] = 0.2f + 2.0f * fabsf(test_rng_f32(&rng));
    }
    int64_t p0 = 0;
    for (int b = 0; b < n_seqs; b++) {
        seqs[b].pages = ids + p0;
        seqs[b].tail = (uint16_t *)(void *)((unsigned char *)tails + (size_t)b * tb);
        seqs[b].sink = f.sink ? sinks + (size_t)b * (sb / 2) : NULL;
        seqs[b].n_kv = 0;
        p0 += (lens[b] + P - 1) / P;
        while (seqs[b].n_kv < lens[b]) {
            int64_t n = 1 + (int64_t)(test_rng_next(&rng) % 150);
            if (n > lens[b] - seqs[b].n_kv) n = lens[b] - seqs[b].n_kv;
            float *k = malloc((size_t)(n * row) * 4), *v = malloc((size_t)(n * row) * 4);
            for (int64_t i = 0; i < n * row; i++) {
                k[i] = off[i % row] + spr[i % row] * test_rng_f32(&rng);
                v[i] = test_rng_f32(&rng) * 2.0f;
            }
            for (int64_t t = seqs[b].n_kv; t < f.sink && t < seqs[b].n_kv + n; t++) {
                memcpy(sink_in[b][0] + t * row, k + (t - seqs[b].n_kv) * row, (size_t)row * 4);
                memcpy(sink_in[b][1] + t * row, v + (t - seqs[b].n_kv) * row, (size_t)row * 4);
            }
            seqs[b].n_kv += n;
            int64_t ip[2] = {0, n}, sh[3] = {n, H, D}, psh[2] = {npages + 2, (int64_t)pb};
            kvc_tensor tk = kvc_tensor_make(k, KVC_F32, 3, sh), tv = kvc_tensor_make(v, KVC_F32, 3, sh);
            kvc_tensor tp = kvc_tensor_make(pages, KVC_U8, 2, psh);
            if (f.sink) { /* a sink format refuses a sequence without sink rows */
                kvc_kvfmt_seq nos = seqs[b];
                nos.sink = NULL;
                ASSERT_TRUE(kvc_kvfmt_append(&f, &tp, &nos, 1, ip, &tk, &tv, NULL) ==
                            KVC_ERR_INVALID_ARG);
                ASSERT_TRUE(strstr(kvc_last_error(), "NULL sink") != NULL);
            }
            const kvc_status st = kvc_kvfmt_append(&f, &tp, &seqs[b], 1, ip, &tk, &tv, NULL);
            free(k), free(v);
            ASSERT_OK(st);
        }
    }
    /* the sink rows hold positions [0, S) as float16: K as given, V rotated
     * (an explicit Hadamard matrix in float64; the library's float32
     * butterfly may round the last float16 bit differently) */
    for (int b = 0; b < n_seqs; b++)
        for (int64_t t = 0; t < f.sink && t < lens[b]; t++)
            for (int64_t h = 0; h < H; h++)
                for (int64_t i = 0; i < D; i++) {
                    const int64_t e = h * D + i;
                    ASSERT_TRUE(seqs[b].sink[t * row + e] == kvc_f32_to_f16(sink_in[b][0][t * row + e]));
                    double a = sink_in[b][1][t * row + e];
                    if (f.rotate_v) {
                        a = 0;
                        for (int64_t jj = 0; jj < D; jj++)
                            a += (__builtin_popcountll((unsigned long long)(i & jj)) & 1 ? -1.0 : 1.0) *
                                 sink_in[b][1][t * row + h * D + jj];
                        a /= sqrt((double)D);
                    }
                    const double got = kvc_f16_to_f32(seqs[b].sink[(f.sink + t) * row + e]);
                    ASSERT_TRUE(fabs(got - a) <= 1e-3 * fabs(a) + 1e-6);
                }
    /* rows: positions whose float16 values the tail still holds, from
     * floor(n / G) * G - 1 on (older ones are refused: test_refused) */
    int32_t qseq[64], qpos[64];
    int64_t lo[8];
    int nq = 0;
    for (int b = 0; b < n_seqs; b++) {
        lo[b] = lens[b] / f.group * f.group - 1;
        if (lo[b] < 0) lo[b] = 0;
        qseq[nq] = b, qpos[nq++] = (int32_t)(lens[b] - 1);
    }
    int64_t run = lens[longest] - lo[longest]; /* prefill run */
    if (run > 9) run = 9;
    for (int64_t i = 0; i < run; i++)
        qseq[nq] = (int32_t)longest, qpos[nq++] = (int32_t)(lens[longest] - run + i);
    for (int i = 0; i < 4; i++) {
        const int b = (int)(test_rng_next(&rng) % (uint64_t)n_seqs);
        qseq[nq] = b;
        qpos[nq++] = (int32_t)(lo[b] + (int64_t)(test_rng_next(&rng) % (uint64_t)(lens[b] - lo[b])));
    }
    if (lo[longest] > 0) { /* a position before the tail's reach is refused, nothing written */
        int64_t sh1[3] = {1, Hq, D}, psh1[2] = {npages + 2, (int64_t)pb}, osh[3] = {1, Hq, D};
        float qq[KVC_ATTN_MAX_HEAD_DIM * 16] = {0}, oo[KVC_ATTN_MAX_HEAD_DIM * 16];
        int32_t s1 = (int32_t)longest, p1 = (int32_t)(lo[longest] - 1);
        kvc_tensor tq1 = kvc_tensor_make(qq, KVC_F32, 3, sh1), to1 = kvc_tensor_make(oo, KVC_F32, 3, osh);
        kvc_tensor tp1 = kvc_tensor_make(pages, KVC_U8, 2, psh1);
        if (Hq <= 16)
            ASSERT_TRUE(kvc_kvfmt_attention(&f, &tp1, seqs, n_seqs, &tq1, &s1, &p1, NULL, &to1,
                                            NULL, NULL) == KVC_ERR_INVALID_ARG);
    }
    float *q = malloc((size_t)(nq * Hq * D) * 4);
    for (int64_t i = 0; i < nq * Hq * D; i++) q[i] = test_rng_f32(&rng) * 1.5f;
    double *ref = malloc((size_t)(nq * Hq * D) * 8), *rlse = malloc((size_t)(nq * Hq) * 8);
    for (int i = 0; i < nq; i++)
        reference(&f, &l, pages, pb, &seqs[qseq[i]], q + (int64_t)i * Hq * D, Hq, qpos[i],
                  ref + (int64_t)i * Hq * D, rlse + (int64_t)i * Hq);
    double vmax = 0; /* tolerance scale: the largest dequantized |V| */
    for (int b = 0; b < n_seqs; b++)
        for (int64_t t = 0; t < lens[b]; t++)
            for (int64_t h = 0; h < H; h++) {
                double k[KVC_ATTN_MAX_HEAD_DIM], v[KVC_ATTN_MAX_HEAD_DIM];
                deq(&f, &l, pages, pb, &seqs[b], t, h, k, v);
                for (int64_t c = 0; c < D; c++) vmax = fabs(v[c]) > vmax ? fabs(v[c]) : vmax;
            }
    float *out1 = malloc((size_t)(nq * Hq * D) * 4), *out2 = malloc((size_t)(nq * Hq * D) * 4);
    float *lse1 = malloc((size_t)(nq * Hq) * 4), *lse2 = malloc((size_t)(nq * Hq) * 4);
    int64_t qsh[3] = {nq, Hq, D}, lsh[2] = {nq, Hq}, psh[2] = {npages + 2, (int64_t)pb};
    kvc_tensor tq = kvc_tensor_make(q, KVC_F32, 3, qsh), tp = kvc_tensor_make(pages, KVC_U8, 2, psh);
    int rc = 0;
    FOR_EACH_ISA({
        kvc_tensor to1 = kvc_tensor_make(out1, KVC_F32, 3, qsh), to2 = kvc_tensor_make(out2, KVC_F32, 3, qsh);
        kvc_tensor tl1 = kvc_tensor_make(lse1, KVC_F32, 2, lsh), tl2 = kvc_tensor_make(lse2, KVC_F32, 2, lsh);
        memset(out1, 0xff, (size_t)(nq * Hq * D) * 4);
        memset(out2, 0x7f, (size_t)(nq * Hq * D) * 4);
        ASSERT_OK(kvc_kvfmt_attention(&f, &tp, seqs, n_seqs, &tq, qseq, qpos, NULL, &to1, &tl1,
                                      test_pool(1)));
        ASSERT_OK(kvc_kvfmt_attention(&f, &tp, seqs, n_seqs, &tq, qseq, qpos, NULL, &to2, &tl2,
                                      test_pool(2)));
        if (memcmp(out1, out2, (size_t)(nq * Hq * D) * 4) || memcmp(lse1, lse2, (size_t)(nq * Hq) * 4)) {
            fprintf(stderr, "  %s H %d grp %d D %d P %d isa %s: 1 and 2 threads differ\n",
                    kvc_kv_format_name(gc->id), gc->H, gc->grp, gc->D, gc->P,
                    kvc_isa_name(kvc_get_isa()));
            rc = 1;
        }
        double worst = 0, worst_l = 0;
        for (int64_t i = 0; i < nq * Hq * D; i++) {
            const double e = fabs((double)out1[i] - ref[i]) / (2e-3 * vmax + 2e-3 * fabs(ref[i]));
            if (!(e <= worst)) worst = isnan(e) ? INFINITY : e;
        }
        for (int64_t i = 0; i < nq * Hq; i++) {
            const double e = fabs((double)lse1[i] - rlse[i]) / (2e-3 + 1e-4 * fabs(rlse[i]));
            if (!(e <= worst_l)) worst_l = isnan(e) ? INFINITY : e;
        }
        if (worst > 1 || worst_l > 1) {
            fprintf(stderr, "  %s H %d grp %d D %d P %d isa %s: error %.3g of tolerance (out), "
                    "%.3g (lse)\n", kvc_kv_format_name(gc->id), gc->H, gc->grp, gc->D, gc->P,
                    kvc_isa_name(kvc_get_isa()), worst, worst_l);
            rc = 1;
        }
    });
    free(out1), free(out2), free(lse1), free(lse2), free(q), free(ref), free(rlse);
    free(pages), free(ids), free(tails), free(sinks), free(off), free(spr);
    return rc;
}

TEST(attention_grid) {
    static const grid_case cases[] = {
        {KVC_KVFMT_KIVI8, 1, 1, 64, 16, -1},  {KVC_KVFMT_KIVI4, 1, 1, 64, 16, -1},
        {KVC_KVFMT_KIVI8, 2, 4, 128, 64, -1}, {KVC_KVFMT_KIVI4, 2, 4, 128, 64, -1},
        {KVC_KVFMT_KIVI8, 3, 3, 64, 128, -1}, {KVC_KVFMT_KIVI4, 3, 3, 64, 128, -1},
        {KVC_KVFMT_KIVI8, 1, 8, 128, 16, -1}, {KVC_KVFMT_KIVI4, 2, 8, 64, 32, -1},
        {KVC_KVFMT_KIVI8, 2, 2, 96, 16, -1},  /* Dh 96: gv 32 */
        {KVC_KVFMT_KIVI4, 1, 2, 16, 16, -1},  /* Dh 16: avx512 leaves it to the generic C */
        {KVC_KVFMT_KIVI8, 3, 6, 64, 8, -1},   /* P 8: avx512 leaves it to the generic C */
        {KVC_KVFMT_KIVI8, 1, 2, 5, 64, -1},   /* odd Dh: its last K channel unpaired */
        {KVC_KVFMT_KIVI8, 2, 4, 128, 16, 3},  /* custom sinks: S 3 at 8 bits, 16 at 4 */
        {KVC_KVFMT_KIVI4, 3, 3, 64, 32, 16},  {KVC_KVFMT_KIVI4, 1, 4, 64, 16, 0},
    };
    static const int64_t lens_a[4] = {1, 63, 200, 130};
    static const int64_t lens_b[2] = {1100, 64};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (run_case(&cases[i], lens_a, 4, test_seed + i) != 0) return 1;
        if (i % 3 == 0 && run_case(&cases[i], lens_b, 2, test_seed + 100 + i) != 0) return 1;
    }
    return 0;
}

/* core.h's 256 KiB of stack holds the compressed formats' attention too:
 * the SIMD kernels keep their per-task state there (~215 KiB at AVX-512,
 * qi2 sharing wi's rows). One sequence of 300 positions with an outlier K
 * channel (the 8-bit second query term), decode and prefill rows, both
 * members, on a thread created with exactly that stack, every ISA: the same
 * bits as on the main thread. */
typedef struct stack_job {
    const kvc_kvfmt *f;
    const kvc_tensor *pages, *q;
    const kvc_kvfmt_seq *seq;
    const int32_t *q_seq, *q_pos;
    kvc_tensor *out;
    kvc_status st;
} stack_job;

static void *stack_attention(void *arg) {
    stack_job *j = arg;
    j->st = kvc_kvfmt_attention(j->f, j->pages, j->seq, 1, j->q, j->q_seq, j->q_pos, NULL,
                                j->out, NULL, NULL);
    return NULL;
}

TEST(attention_in_256k_of_stack) {
    const kvc_kv_format members[2] = {KVC_KVFMT_KIVI8, KVC_KVFMT_KIVI4};
    enum { N = 300, P = 16, H = 2, D = 128, HQ = 16, NQ = 8, NP = (N + P - 1) / P };
    for (int m = 0; m < 2; m++) {
        kvc_kvfmt f;
        ASSERT_OK(kvc_kvfmt_make(members[m], H, D, P, &f));
        const size_t pb = kvc_kvfmt_page_bytes(&f), ob = (size_t)NQ * HQ * D * 4;
        unsigned char *pages = calloc(NP, pb);
        uint16_t *tail = calloc(1, kvc_kvfmt_tail_bytes(&f));
        uint16_t *sink = f.sink ? calloc(1, kvc_kvfmt_sink_bytes(&f)) : NULL;
        float *k = malloc((size_t)N * H * D * 4), *v = malloc((size_t)N * H * D * 4);
        float *q = malloc(ob), *o1 = malloc(ob), *o2 = malloc(ob);
        ASSERT_TRUE(pages && tail && (sink || !f.sink) && k && v && q && o1 && o2);
        uint64_t rng = test_seed + 400 + (uint64_t)m;
        for (int64_t i = 0; i < (int64_t)N * H * D; i++) {
            k[i] = test_rng_f32(&rng);
            v[i] = test_rng_f32(&rng);
            if (i % D == 7) k[i] = k[i] > 0 ? 1000.0f : -1000.0f; /* the outlier channel */
        }
        for (int64_t i = 0; i < (int64_t)NQ * HQ * D; i++) q[i] = test_rng_f32(&rng);
        int32_t ids[NP], q_seq[NQ], q_pos[NQ];
        for (int i = 0; i < NP; i++) ids[i] = NP - 1 - i;
        for (int i = 0; i < NQ; i++) q_seq[i] = 0, q_pos[i] = N - NQ + i;
        kvc_kvfmt_seq seq = {ids, N, tail, sink};
        int64_t ip[2] = {0, N}, sh[3] = {N, H, D}, psh[2] = {NP, (int64_t)pb};
        int64_t qsh[3] = {NQ, HQ, D};
        kvc_tensor tk = kvc_tensor_make(k, KVC_F32, 3, sh), tv = kvc_tensor_make(v, KVC_F32, 3, sh);
        kvc_tensor tp = kvc_tensor_make(pages, KVC_U8, 2, psh);
        kvc_tensor tq = kvc_tensor_make(q, KVC_F32, 3, qsh);
        ASSERT_OK(kvc_kvfmt_append(&f, &tp, &seq, 1, ip, &tk, &tv, NULL));
        FOR_EACH_ISA({
            kvc_tensor t1 = kvc_tensor_make(o1, KVC_F32, 3, qsh);
            kvc_tensor t2 = kvc_tensor_make(o2, KVC_F32, 3, qsh);
            memset(o2, 0xff, ob);
            ASSERT_OK(kvc_kvfmt_attention(&f, &tp, &seq, 1, &tq, q_seq, q_pos, NULL, &t1, NULL,
                                          NULL));
            stack_job j = {&f, &tp, &tq, &seq, q_seq, q_pos, &t2, KVC_ERR_INTERNAL};
            ASSERT_TRUE(test_on_small_stack(stack_attention, &j) == 0);
            ASSERT_OK(j.st);
            ASSERT_MEM_EQ(o1, o2, ob);
        });
        free(pages), free(tail), free(sink), free(k), free(v), free(q), free(o1), free(o2);
    }
    return 0;
}

/* A decode step of one sequence that ends exactly on a group (empty tail)
 * and a long one split into the kernels' chunks (over 1024 keys). */
TEST(attention_chunks) {
    static const grid_case cases[] = {{KVC_KVFMT_KIVI8, 1, 4, 128, 16, -1},
                                         {KVC_KVFMT_KIVI4, 3, 3, 64, 16, -1}};
    static const int64_t lens[1] = {2560};
    static const int64_t lens2[2] = {3000, 128};
    for (int i = 0; i < 2; i++) {
        if (run_case(&cases[i], lens, 1, test_seed + 7 * i) != 0) return 1;
        if (run_case(&cases[i], lens2, 2, test_seed + 9 * i) != 0) return 1;
    }
    return 0;
}

/* One prompt's rows through kvc_kvfmt_append_attention: in one call (many
 * work units: at Dh 128 more tasks than one wave of partial states holds),
 * in calls of 512 rows, and as a prefill followed by one-row decode steps.
 * A row gets the same bits in every schedule (docs/KV_FORMATS.md section 6;
 * the SIMD path splits every row's keys in the same chunks). */
static int rows_case(kvc_kv_format id, int32_t D, int64_t N, uint64_t seed) {
    const int64_t H = 2, grp = 3, Hq = H * grp, P = 16, row = H * D, qrow = Hq * D;
    kvc_kvfmt f;
    ASSERT_OK(kvc_kvfmt_make(id, (int32_t)H, D, (int32_t)P, &f));
    const int64_t npages = (N + P - 1) / P;
    const size_t pb = kvc_kvfmt_page_bytes(&f), tb = kvc_kvfmt_tail_bytes(&f);
    const size_t sb = kvc_kvfmt_sink_bytes(&f);
    float *k = malloc((size_t)(N * row) * 4), *v = malloc((size_t)(N * row) * 4);
    float *q = malloc((size_t)(N * qrow) * 4);
    float *want = malloc((size_t)(N * qrow) * 4), *got = malloc((size_t)(N * qrow) * 4);
    unsigned char *pages = malloc((size_t)npages * pb);
    uint16_t *tail = malloc(tb), *sink = malloc(sb + 2);
    int32_t *ids = malloc((size_t)npages * 4), *qseq = calloc((size_t)N, 4);
    int32_t *qpos = malloc((size_t)N * 4);
    ASSERT_TRUE(k && v && q && want && got && pages && tail && sink && ids && qseq && qpos);
    uint64_t rng = seed;
    for (int64_t i = 0; i < N * row; i++) {
        k[i] = (float)(i % row) * 0.05f + test_rng_f32(&rng);
        v[i] = test_rng_f32(&rng) * 2.0f;
    }
    for (int64_t i = 0; i < N * qrow; i++) q[i] = test_rng_f32(&rng) * 1.5f;
    for (int64_t i = 0; i < npages; i++) ids[i] = (int32_t)(npages - 1 - i);
    for (int64_t i = 0; i < N; i++) qpos[i] = (int32_t)i;
    /* schedules: calls' row counts (-1: the rest), ending with 0 */
    static const int64_t one[] = {-1, 0}, chunks[] = {512, 512, 512, 512, 512, -1, 0};
    int64_t steps[64];
    const int n_dec = 20;
    const int64_t *scheds[3] = {one, chunks, steps};
    int rc = 0;
    FOR_EACH_ISA({
        /* the generic C path splits no keys, and is slow: a shorter prompt */
        const int64_t Ni = kvc_get_isa() == KVC_ISA_SCALAR && N > 400 ? 400 : N;
        steps[0] = Ni - n_dec;
        for (int i = 0; i < n_dec; i++) steps[1 + i] = 1;
        steps[1 + n_dec] = 0;
        for (int sc = 0; sc < 3 && rc == 0; sc++) {
            float *out = sc == 0 ? want : got;
            memset(out, 0xff, (size_t)(N * qrow) * 4);
            memset(pages, 0, (size_t)npages * pb);
            kvc_kvfmt_seq seq = {ids, 0, tail, f.sink ? sink : NULL};
            for (const int64_t *c = scheds[sc]; *c != 0 && seq.n_kv < Ni; c++) {
                const int64_t p0 = seq.n_kv, n = *c < 0 || p0 + *c > Ni ? Ni - p0 : *c;
                seq.n_kv = p0 + n;
                int64_t ip[2] = {0, n}, sh[3] = {n, H, D}, qsh[3] = {n, Hq, D};
                int64_t psh[2] = {npages, (int64_t)pb};
                kvc_tensor tk = kvc_tensor_make(k + p0 * row, KVC_F32, 3, sh);
                kvc_tensor tv = kvc_tensor_make(v + p0 * row, KVC_F32, 3, sh);
                kvc_tensor tq = kvc_tensor_make(q + p0 * qrow, KVC_F32, 3, qsh);
                kvc_tensor to = kvc_tensor_make(out + p0 * qrow, KVC_F32, 3, qsh);
                kvc_tensor tp = kvc_tensor_make(pages, KVC_U8, 2, psh);
                ASSERT_OK(kvc_kvfmt_append_attention(&f, &tp, &seq, 1, ip, &tk, &tv, &tq, qseq,
                                                     qpos + p0, NULL, &to, NULL,
                                                     test_pool(sc == 1 ? 1 : 2)));
            }
            ASSERT_EQ_I64(seq.n_kv, Ni);
            if (sc > 0 && memcmp(want, got, (size_t)(Ni * qrow) * 4) != 0) {
                int64_t i = 0;
                while (memcmp(want + i * qrow, got + i * qrow, (size_t)qrow * 4) == 0) i++;
                fprintf(stderr, "  %s D %d isa %s: schedule %d differs from one call at row "
                        "%lld\n", kvc_kv_format_name(id), (int)D, kvc_isa_name(kvc_get_isa()),
                        sc, (long long)i);
                rc = 1;
            }
        }
    });
    free(k), free(v), free(q), free(want), free(got), free(pages), free(tail), free(sink);
    free(ids), free(qseq), free(qpos);
    return rc;
}

TEST(attention_rows_same_in_any_call) {
    /* past two of the SIMD path's 1,024-token chunks */
    if (rows_case(KVC_KVFMT_KIVI8, 128, 2300, test_seed + 1) != 0) return 1;
    return rows_case(KVC_KVFMT_KIVI4, 64, 2300, test_seed + 2);
}

/* Attention parameters: NULL or the defaults work; values outside
 * attention.h's ranges are KVC_ERR_INVALID_ARG (as decode and prefill
 * refuse them), an enabled cap/window/sinks KVC_ERR_UNSUPPORTED; a refused
 * call leaves out untouched. */
TEST(attention_params_checked_as_elsewhere) {
    enum { H = 1, D = 64, P = 16, N = 4 };
    kvc_kvfmt f;
    ASSERT_OK(kvc_kvfmt_make(KVC_KVFMT_KIVI8, H, D, P, &f));
    const size_t pb = kvc_kvfmt_page_bytes(&f);
    unsigned char *pages = calloc(1, pb);
    uint16_t *tail = malloc(kvc_kvfmt_tail_bytes(&f));
    float k[N * H * D], q[H * D], out[H * D];
    ASSERT_TRUE(pages && tail);
    for (int i = 0; i < N * H * D; i++) k[i] = 0.01f * (float)(i % 37);
    for (int i = 0; i < H * D; i++) q[i] = 0.1f;
    int32_t ids[1] = {0}, qseq[1] = {0}, qpos[1] = {N - 1};
    kvc_kvfmt_seq seq = {ids, N, tail, NULL};
    int64_t ip[2] = {0, N}, sh[3] = {N, H, D}, qsh[3] = {1, H, D}, psh[2] = {1, (int64_t)pb};
    kvc_tensor tk = kvc_tensor_make(k, KVC_F32, 3, sh), tq = kvc_tensor_make(q, KVC_F32, 3, qsh);
    kvc_tensor to = kvc_tensor_make(out, KVC_F32, 3, qsh), tp = kvc_tensor_make(pages, KVC_U8, 2, psh);
    ASSERT_OK(kvc_kvfmt_append(&f, &tp, &seq, 1, ip, &tk, &tk, NULL));
    ASSERT_OK(kvc_kvfmt_attention(&f, &tp, &seq, 1, &tq, qseq, qpos, NULL, &to, NULL, NULL));
    kvc_attn_params p = kvc_attn_default_params();
    ASSERT_OK(kvc_kvfmt_attention(&f, &tp, &seq, 1, &tq, qseq, qpos, &p, &to, NULL, NULL));
    const struct { float cap; int32_t win; float sm; kvc_status want; } bad[] = {
        {-1.0f, -1, 0.0f, KVC_ERR_INVALID_ARG},     {NAN, -1, 0.0f, KVC_ERR_INVALID_ARG},
        {INFINITY, -1, 0.0f, KVC_ERR_INVALID_ARG}, {0.0f, -2, 0.0f, KVC_ERR_INVALID_ARG},
        {0.0f, -1, -1.0f, KVC_ERR_INVALID_ARG},    {0.0f, -1, NAN, KVC_ERR_INVALID_ARG},
        {30.0f, -1, 0.0f, KVC_ERR_UNSUPPORTED},    {0.0f, 0, 0.0f, KVC_ERR_UNSUPPORTED},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        p = kvc_attn_default_params();
        p.logits_soft_cap = bad[i].cap;
        p.window_left = bad[i].win;
        p.sm_scale = bad[i].sm;
        memset(out, 0xab, sizeof out);
        kvc_clear_error();
        ASSERT_STATUS(kvc_kvfmt_attention(&f, &tp, &seq, 1, &tq, qseq, qpos, &p, &to, NULL, NULL),
                      bad[i].want);
        ASSERT_TRUE(kvc_last_error()[0] != '\0');
        for (size_t j = 0; j < sizeof out; j++) ASSERT_TRUE(((unsigned char *)out)[j] == 0xab);
    }
    free(pages);
    free(tail);
    return 0;
}

/* ---- outputs laid over the index inputs (core.h: undefined, in bounds) ----
 * Two sequences, a format whose groups the SIMD kernels take (G = P = Dh =
 * gv = 16, sink 1): sequence 0 stores positions 0..19 (group 0 completes:
 * pages and sink written), sequence 1 position 17 (straight into its tail
 * ring); four query rows, two per sequence. Every index input (seqs, each
 * sequence's page ids, row_indptr, q_seq, q_pos, the format) is laid at
 * every aligned offset of every output of each entry point. The values
 * written (about 1e4 as float16/float32, codes, log2 sums) read as indices
 * are far out of range: the old code, reading the inputs again after its
 * first writes, went out of bounds or crashed. Guard bytes after each
 * buffer catch stray writes (ASan builds any stray access). */
enum { OV_NQ = 4, OV_HQ = 2, OV_D = 16, OV_N0 = 20, OV_N1 = 18, OV_NNZ = 21 };
enum { OV_PAGES, OV_TAIL0, OV_TAIL1, OV_SINK0, OV_SINK1, OV_OUT, OV_LSE, OV_NOUT };
enum { OV_SEQS, OV_IDS0, OV_IDS1, OV_INDPTR, OV_QSEQ, OV_QPOS, OV_FMT, OV_NIN };
enum { OV_APPEND, OV_ATTENTION, OV_APPEND_ATTENTION };
static const char *const ov_out_name[OV_NOUT] = {"pages", "tail 0", "tail 1", "sink 0",
                                                 "sink 1", "out", "lse"};
static const char *const ov_in_name[OV_NIN] = {"seqs", "page ids 0", "page ids 1", "row_indptr",
                                               "q_seq", "q_pos", "format"};
static const char *const ov_entry_name[3] = {"append", "attention", "append_attention"};

static int ov_outputs(int entry, int o) {
    if (entry == OV_ATTENTION) return o == OV_OUT || o == OV_LSE;
    if (entry == OV_APPEND) return o != OV_OUT && o != OV_LSE;
    return 1;
}
static int ov_inputs(int entry, int i) {
    if (entry == OV_ATTENTION) return i != OV_INDPTR;
    if (entry == OV_APPEND) return i != OV_QSEQ && i != OV_QPOS;
    return 1;
}

/* One call of entry with input in laid at byte off of output o (o < 0: no
 * overlap). 1 when it stayed in its buffers, else 0 (with a message). */
static int ov_call(const kvc_kvfmt *f0, int entry, int o, int in, size_t off) {
    const int64_t H = f0->num_kv_heads, D = f0->head_dim, HD = H * D;
    const size_t pb = kvc_kvfmt_page_bytes(f0), tb = kvc_kvfmt_tail_bytes(f0);
    const size_t sb = kvc_kvfmt_sink_bytes(f0);
    const size_t osz[OV_NOUT] = {4 * pb, tb, tb, sb, sb, OV_NQ * OV_HQ * OV_D * 4,
                                 OV_NQ * OV_HQ * 4};
    const size_t isz[OV_NIN] = {2 * sizeof(kvc_kvfmt_seq), 8, 8, 3 * 8, OV_NQ * 4, OV_NQ * 4,
                                sizeof(kvc_kvfmt)};
    unsigned char *ob[OV_NOUT], *ib[OV_NIN] = {0};
    int ok = 1;
    for (int i = 0; i < OV_NOUT; i++) ok &= (ob[i] = test_guarded(osz[i])) != NULL;
    float *k = malloc(OV_NNZ * HD * 4), *q = malloc(OV_NQ * OV_HQ * OV_D * 4);
    if (!ok || !k || !q) {
        fprintf(stderr, "  out of memory\n");
        return 0;
    }
    /* large finite values (rotated V stays within float16's range) */
    for (int64_t i = 0; i < OV_NNZ * HD; i++)
        k[i] = (i % 3 ? 1.0f : -1.0f) * (8000.0f + (float)(i % 29) * 50.0f);
    for (int i = 0; i < OV_NQ * OV_HQ * OV_D; i++) q[i] = 0.001f * (float)(i % 5);
    uint16_t *tail[2] = {(uint16_t *)(void *)ob[OV_TAIL0], (uint16_t *)(void *)ob[OV_TAIL1]};
    uint16_t *sink[2] = {(uint16_t *)(void *)ob[OV_SINK0], (uint16_t *)(void *)ob[OV_SINK1]};
    int64_t psh[2] = {4, (int64_t)pb}, ksh[3] = {OV_NNZ, H, D}, qsh[3] = {OV_NQ, OV_HQ, OV_D};
    int64_t lsh[2] = {OV_NQ, OV_HQ}, k17[3] = {17, H, D};
    kvc_tensor tp = kvc_tensor_make(ob[OV_PAGES], KVC_U8, 2, psh);
    kvc_tensor tk = kvc_tensor_make(k, KVC_F32, 3, ksh), tk17 = kvc_tensor_make(k, KVC_F32, 3, k17);
    kvc_tensor tq = kvc_tensor_make(q, KVC_F32, 3, qsh);
    kvc_tensor to = kvc_tensor_make(ob[OV_OUT], KVC_F32, 3, qsh);
    kvc_tensor tl = kvc_tensor_make(ob[OV_LSE], KVC_F32, 2, lsh);
    /* clean set-up: sequence 1's positions 0..16; for attention also the
     * append the other entries make */
    int32_t ids[2][2] = {{0, 1}, {2, 3}};
    kvc_kvfmt_seq clean[2] = {{ids[0], 0, tail[0], sink[0]}, {ids[1], 17, tail[1], sink[1]}};
    int64_t ip17[3] = {0, 0, 17}, ip[3] = {0, OV_N0, OV_NNZ};
    if (kvc_kvfmt_append(f0, &tp, clean, 2, ip17, &tk17, &tk17, NULL) != KVC_OK) ok = 0;
    clean[0].n_kv = OV_N0, clean[1].n_kv = OV_N1;
    if (entry == OV_ATTENTION && kvc_kvfmt_append(f0, &tp, clean, 2, ip, &tk, &tk, NULL) != KVC_OK)
        ok = 0;
    if (!ok) {
        fprintf(stderr, "  set-up failed: %s\n", kvc_last_error());
        return 0;
    }
    for (int i = 0; i < OV_NIN; i++) {
        ib[i] = i == in && o >= 0 ? ob[o] + off : test_guarded(isz[i]);
        if (!ib[i]) return 0;
    }
    /* the inputs, valid when the call starts */
    int32_t *id0 = (int32_t *)(void *)ib[OV_IDS0], *id1 = (int32_t *)(void *)ib[OV_IDS1];
    id0[0] = 0, id0[1] = 1, id1[0] = 2, id1[1] = 3;
    kvc_kvfmt_seq *seqs = (kvc_kvfmt_seq *)(void *)ib[OV_SEQS];
    seqs[0] = (kvc_kvfmt_seq){id0, OV_N0, tail[0], sink[0]};
    seqs[1] = (kvc_kvfmt_seq){id1, OV_N1, tail[1], sink[1]};
    int64_t *indptr = (int64_t *)(void *)ib[OV_INDPTR];
    indptr[0] = 0, indptr[1] = OV_N0, indptr[2] = OV_NNZ;
    int32_t *qseq = (int32_t *)(void *)ib[OV_QSEQ], *qpos = (int32_t *)(void *)ib[OV_QPOS];
    /* attention alone: positions from floor(n_kv / G) * G - 1 */
    const int32_t pos[2][OV_NQ] = {{19, 17, 3, 16}, {19, 17, 16, 15}};
    for (int i = 0; i < OV_NQ; i++) qseq[i] = i % 2, qpos[i] = pos[entry == OV_ATTENTION][i];
    kvc_kvfmt *f = (kvc_kvfmt *)(void *)ib[OV_FMT];
    *f = *f0;
    /* the rows: sequence 0's 20, then sequence 1's position 17 */
    kvc_tensor trows = tk;
    trows.data = k + 0;
    kvc_status st;
    if (entry == OV_APPEND)
        st = kvc_kvfmt_append(f, &tp, seqs, 2, indptr, &trows, &trows, NULL);
    else if (entry == OV_ATTENTION)
        st = kvc_kvfmt_attention(f, &tp, seqs, 2, &tq, qseq, qpos, NULL, &to, &tl, NULL);
    else
        st = kvc_kvfmt_append_attention(f, &tp, seqs, 2, indptr, &trows, &trows, &tq, qseq, qpos,
                                        NULL, &to, &tl, NULL);
    if (o < 0 && st != KVC_OK) { /* without overlap the call must work */
        fprintf(stderr, "  %s: %s\n", ov_entry_name[entry], kvc_last_error());
        ok = 0;
    }
    for (int i = 0; i < OV_NOUT; i++)
        if (!test_guard_ok(ob[i], osz[i])) {
            fprintf(stderr, "  %s: %s over %s at byte %zu: wrote past %s\n", ov_entry_name[entry],
                    ov_in_name[in], o >= 0 ? ov_out_name[o] : "nothing", off, ov_out_name[i]);
            ok = 0;
        }
    for (int i = 0; i < OV_NIN; i++) {
        if (i == in && o >= 0) continue;
        if (!test_guard_ok(ib[i], isz[i])) {
            fprintf(stderr, "  %s: %s over %s at byte %zu: wrote past %s\n", ov_entry_name[entry],
                    ov_in_name[in], o >= 0 ? ov_out_name[o] : "nothing", off, ov_in_name[i]);
            ok = 0;
        }
        free(ib[i]);
    }
    for (int i = 0; i < OV_NOUT; i++) free(ob[i]);
    free(k);
    free(q);
    return ok;
}

TEST(outputs_over_index_inputs_stay_in_bounds) {
    kvc_kvfmt fm[2];
    for (int b = 0; b < 2; b++) { /* kivi8 and kivi4 with G = P = gv = 16 */
        ASSERT_OK(kvc_kvfmt_make(b ? KVC_KVFMT_KIVI4 : KVC_KVFMT_KIVI8, 1, OV_D, 16, &fm[b]));
        fm[b].id = KVC_KVFMT_NONE;
        fm[b].group = 16, fm[b].v_group = 16, fm[b].sink = 1, fm[b].window = 0;
        ASSERT_OK(kvc_kvfmt_check(&fm[b]));
    }
    const size_t align[OV_NIN] = {8, 4, 4, 8, 4, 4, 4};
    const size_t isz[OV_NIN] = {2 * sizeof(kvc_kvfmt_seq), 8, 8, 3 * 8, OV_NQ * 4, OV_NQ * 4,
                                sizeof(kvc_kvfmt)};
    /* the filter of a single case when looking into one: KVC_TEST_OV=entry,out,in */
    const char *only = getenv("KVC_TEST_OV");
    int oe = -1, oo = -1, oi = -1;
    if (only && sscanf(only, "%d,%d,%d", &oe, &oo, &oi) != 3) oe = oo = oi = -1;
    FOR_EACH_ISA({
        for (int b = 0; b < 2; b++) {
            const kvc_kvfmt *f = &fm[b];
            const size_t pb = kvc_kvfmt_page_bytes(f), tb = kvc_kvfmt_tail_bytes(f);
            const size_t sb = kvc_kvfmt_sink_bytes(f);
            const size_t osz[OV_NOUT] = {4 * pb, tb, tb, sb, sb, OV_NQ * OV_HQ * OV_D * 4,
                                         OV_NQ * OV_HQ * 4};
            for (int e = 0; e < 3; e++) {
                ASSERT_TRUE(ov_call(f, e, -1, 0, 0)); /* no overlap: the set-up works */
                for (int o = 0; o < OV_NOUT; o++)
                    for (int i = 0; i < OV_NIN; i++) {
                        if (!ov_outputs(e, o) || !ov_inputs(e, i)) continue;
                        if (oe >= 0 && (e != oe || o != oo || i != oi)) continue;
                        for (size_t off = 0; off + isz[i] <= osz[o]; off += align[i])
                            if (!ov_call(f, e, o, i, off)) {
                                fprintf(stderr, "  format %s isa %s\n", b ? "kivi4" : "kivi8",
                                        kvc_isa_name(kvc_get_isa()));
                                return 1;
                            }
                    }
            }
        }
    });
    return 0;
}

const char *test_suite_name = "kvfmt";
const test_case test_suite[] = {
    TEST_ENTRY(attention_grid),
    TEST_ENTRY(attention_in_256k_of_stack),
    TEST_ENTRY(attention_chunks),
    TEST_ENTRY(attention_rows_same_in_any_call),
    TEST_ENTRY(attention_params_checked_as_elsewhere),
    TEST_ENTRY(outputs_over_index_inputs_stay_in_bounds),
    {0, 0},
};
