/* The SIMD path of the compressed formats' attention (kernels in
 * src/kernels/kvfmt_*.c). Work units: a run of up to KVC_KVFMT_NV / heads
 * consecutive query rows of one sequence that read the same quantized
 * groups (prefill: a group's codes are converted once for the whole run),
 * one KV head, its query heads (in passes of at most KVC_KVFMT_NV). Each
 * unit's keys are split in chunks of a fixed number of tokens at absolute
 * positions (tasks, so that a small batch's decode uses every thread),
 * merged in chunk order afterwards. The split depends on the unit's
 * positions alone, never on the other rows of the call or on the pool:
 * a row gets the same bits in a decode step, in a prefill of any length
 * and in any batch (docs/KV_FORMATS.md section 6). Units run in waves whose
 * partial states fit a fixed budget, so a long prefill's memory does not
 * grow with rows times chunks. The memory comes from the caller, sized by
 * kvc__kvfmt_simd_bytes before anything is written. */
#include <math.h>
#include <string.h>

#include "kvfmt_internal.h"

#if defined(__x86_64__) || defined(__i386__)
#include "../kernels/kvfmt_kernels.h"

#define SPLIT_TOKENS 1024              /* keys per task (rounded up to whole blocks) */
#define WAVE_BYTES ((int64_t)8 << 20) /* partial states of one wave of units */

typedef struct sunit {
    int64_t row0, task0;
    int32_t nrows, h, hq0, nh, nchunks;
    int64_t qend, chunk; /* quantized tokens read; tokens per chunk */
} sunit;

typedef struct simd_ctx {
    const kvc_kvfmt *f;
    kvc__kvfmt_layout l;
    const kvc_tensor *pages, *q, *out, *lse;
    const kvc_kvfmt_seq *seqs;
    const kvc__kvfmt_win *wins;
    const int32_t *q_seq, *q_pos;
    kvc_kvfmt_kernel kernel;
    const sunit *units;
    const int64_t *task_unit;
    float *scratch; /* per task of the wave: m (NV), l (NV), o (NV, Dh) */
    int64_t sstride;
    float sc;
    int64_t stride;       /* the pool's threads (prefetch guess) */
    int64_t tbase, tend;  /* the wave's tasks [tbase, tend) ... */
    int64_t ubase;        /* ... and its first unit */
} simd_ctx;

static kvc_kvfmt_kernel simd_kernel(const kvc_kvfmt *f) {
    const kvc_isa isa = kvc_get_isa();
    int vl;
    kvc_kvfmt_kernel k;
    if (isa >= KVC_ISA_AVX512 && __builtin_cpu_supports("avx512vnni"))
        k = kvc__kvfmt_run_avx512, vl = 16; /* amx included */
    else if (isa >= KVC_ISA_AVX2) /* also AVX-512 without VNNI */
        k = kvc__kvfmt_run_avx2, vl = 8;
    else
        return NULL;
    if ((f->bits != 8 && f->bits != 4) || !f->v_asym) return NULL;
    if (f->head_dim % (f->bits == 4 ? 2 * vl : vl) || f->v_group % vl || f->page_size % vl ||
        f->group % vl || f->group + f->window + f->sink > KVC_KVFMT_BT_MAX)
        return NULL;
    return k;
}

/* Rows [i, end) of one unit run: same sequence, same first float16
 * position, at most rb rows. */
static int64_t run_end(const kvc_kvfmt *f, const int32_t *q_seq, const int32_t *q_pos,
                       int64_t nq, int64_t i, int64_t rb) {
    const int64_t fs = kvc__kvfmt_f16_from(f, q_pos[i]);
    int64_t e = i + 1;
    while (e < nq && e - i < rb && q_seq[e] == q_seq[i] &&
           kvc__kvfmt_f16_from(f, q_pos[e]) == fs)
        e++;
    return e;
}

typedef struct plan {
    int64_t nunits, ntasks, hp, rb, npass, chunk;
    int64_t sstride;    /* floats of one task's partial state */
    int64_t wave_tasks; /* most tasks of one wave (>= every unit's chunks) */
} plan;

static int64_t chunks_of(const plan *p, int64_t qend) {
    return qend > 0 ? (qend + p->chunk - 1) / p->chunk : 1;
}

static plan make_plan(const kvc_kvfmt *f, int64_t nq, int64_t Hq, const int32_t *q_seq,
                      const int32_t *q_pos) {
    plan p;
    const int64_t H = f->num_kv_heads, G = f->group, grp = Hq / H;
    p.hp = grp < KVC_KVFMT_NV ? grp : KVC_KVFMT_NV; /* heads per pass */
    p.rb = KVC_KVFMT_NV / p.hp;                     /* rows per unit */
    p.npass = (grp + p.hp - 1) / p.hp;
    const int64_t BT = G <= 256 ? (256 / G) * G : G;
    p.chunk = (SPLIT_TOKENS + BT - 1) / BT * BT;
    p.sstride = 2 * KVC_KVFMT_NV + KVC_KVFMT_NV * (int64_t)f->head_dim;
    int64_t nruns = 0, most = 1;
    p.ntasks = 0;
    for (int64_t i = 0; i < nq; i = run_end(f, q_seq, q_pos, nq, i, p.rb)) {
        const int64_t nch = chunks_of(&p, kvc__kvfmt_f16_from(f, q_pos[i]));
        p.ntasks += nch * H * p.npass;
        most = nch > most ? nch : most;
        nruns++;
    }
    p.nunits = nruns * H * p.npass;
    const int64_t budget = WAVE_BYTES / (p.sstride * (int64_t)sizeof(float));
    p.wave_tasks = p.ntasks < budget ? p.ntasks : budget > most ? budget : most;
    return p;
}

size_t kvc__kvfmt_simd_bytes(const kvc_kvfmt *f, int64_t nq, int64_t Hq, const int32_t *q_seq,
                             const int32_t *q_pos) {
    if (nq == 0 || !simd_kernel(f)) return 0;
    const plan p = make_plan(f, nq, Hq, q_seq, q_pos);
    return (size_t)p.nunits * sizeof(sunit) + (size_t)p.ntasks * sizeof(int64_t) +
           (size_t)(p.wave_tasks * p.sstride) * sizeof(float) + 64;
}

/* The job of one task (its outputs in the task's scratch). */
static void make_job(const simd_ctx *c, int64_t task, kvc_kvfmt_job *jp) {
    const kvc_kvfmt *f = c->f;
    const sunit *u = &c->units[c->task_unit[task]];
    const int64_t ci = task - u->task0;
    const int32_t b = c->q_seq[u->row0];
    const kvc_kvfmt_seq *s = &c->seqs[b];
    const kvc__kvfmt_win *w = &c->wins[b];
    kvc_kvfmt_job j;
    j.bits = f->bits;
    j.Dh = f->head_dim;
    j.P = f->page_size;
    j.G = f->group;
    j.gv = f->v_group;
    j.nvg = f->head_dim / f->v_group;
    j.H = f->num_kv_heads;
    j.h = u->h;
    j.base = (const unsigned char *)c->pages->data;
    j.page_stride = c->pages->stride[0];
    j.pages = s->pages;
    j.k_codes = c->l.k_codes;
    j.v_codes = c->l.v_codes;
    j.v_scale = c->l.v_scale;
    j.v_zero = c->l.v_zero;
    j.k_scale = c->l.k_scale;
    j.k_zero = c->l.k_zero;
    j.k_share = c->l.k_share;
    j.wk = w->k;
    j.wv = w->v;
    j.wrs = w->rs;
    j.w0 = w->w0;
    j.wmod = w->mod;
    j.sink = f->sink;
    j.srs = (int64_t)f->num_kv_heads * f->head_dim;
    j.sk = s->sink;
    j.sv = s->sink ? s->sink + f->sink * j.srs : NULL;
    j.fstart = u->qend;
    j.t0 = ci * u->chunk;
    j.t1 = j.t0 + u->chunk < u->qend ? j.t0 + u->chunk : u->qend;
    j.do_tail = ci == u->nchunks - 1;
    j.nv = u->nrows * u->nh;
    for (int32_t r = 0; r < u->nrows; r++)
        for (int32_t g = 0; g < u->nh; g++) {
            const int64_t row = u->row0 + r, v = r * u->nh + g;
            j.q[v] = (const float *)c->q->data + row * c->q->stride[0] +
                     (u->hq0 + g) * c->q->stride[1];
            j.pos[v] = c->q_pos[row];
        }
    j.sc = c->sc;
    float *m = c->scratch + (task - c->tbase) * c->sstride;
    j.m = m;
    j.l = m + KVC_KVFMT_NV;
    j.o = m + 2 * KVC_KVFMT_NV;
    j.next = NULL;
    j.first_fetched = 0;
    *jp = j;
}

static void simd_task(void *arg, int64_t i) {
    const simd_ctx *c = arg;
    const int64_t task = c->tbase + i;
    kvc_kvfmt_job j, nx;
    make_job(c, task, &j);
    /* tasks are claimed in order, so with n threads of similar speed this
     * one runs task + n next: its first lines are fetched during our last
     * block instead of stalling its start (a guess: only prefetches) */
    if (task + c->stride < c->tend) {
        make_job(c, task + c->stride, &nx);
        j.next = &nx;
    }
    j.first_fetched = i >= c->stride;
    c->kernel(&j);
}

/* Merges a unit's chunks (in order), normalizes, rotates back, writes. */
static void simd_finish(void *arg, int64_t i) {
    const simd_ctx *c = arg;
    const sunit *u = &c->units[c->ubase + i];
    const float *part = c->scratch + (u->task0 - c->tbase) * c->sstride; /* chunk 0's */
    const int64_t Dh = c->f->head_dim;
    for (int32_t r = 0; r < u->nrows; r++)
        for (int32_t g = 0; g < u->nh; g++) {
            const int64_t row = u->row0 + r, v = r * u->nh + g, qh = u->hq0 + g;
            float mx = -INFINITY;
            for (int32_t k = 0; k < u->nchunks; k++) {
                const float mk = part[k * c->sstride + v];
                mx = mk > mx ? mk : mx;
            }
            float *o = (float *)c->out->data + row * c->out->stride[0] + qh * c->out->stride[1];
            float l = 0;
            for (int64_t ch = 0; ch < Dh; ch++) o[ch] = 0;
            for (int32_t k = 0; k < u->nchunks; k++) {
                const float *st = part + k * c->sstride;
                if (st[v] == -INFINITY) continue;
                const float w = u->nchunks == 1 ? 1.0f : exp2f(st[v] - mx);
                l += st[KVC_KVFMT_NV + v] * w;
                const float *ok = st + 2 * KVC_KVFMT_NV + v * Dh;
                for (int64_t ch = 0; ch < Dh; ch++) o[ch] += ok[ch] * w;
            }
            const float inv = l > 0 ? 1.0f / l : 0.0f;
            for (int64_t ch = 0; ch < Dh; ch++) o[ch] *= inv;
            if (c->f->rotate_v) kvc__kvfmt_rotate(o, (int32_t)Dh);
            if (c->lse) {
                float *ls = (float *)c->lse->data + row * c->lse->stride[0] + qh * c->lse->stride[1];
                *ls = l > 0 ? mx + log2f(l) : -INFINITY;
            }
        }
}

int kvc__kvfmt_attend_simd(const kvc_kvfmt *f, const kvc_tensor *pages,
                           const kvc_kvfmt_seq *seqs, const kvc__kvfmt_win *wins,
                           const kvc_tensor *q, const int32_t *q_seq, const int32_t *q_pos,
                           float sm, kvc_tensor *out, kvc_tensor *lse, kvc_threadpool *pool,
                           void *mem) {
    const kvc_kvfmt_kernel kern = simd_kernel(f);
    const int64_t nq = q->shape[0], Hq = q->shape[1];
    if (!kern || !mem || nq == 0) return 0;
    const plan p = make_plan(f, nq, Hq, q_seq, q_pos);
    const int64_t H = f->num_kv_heads, grp = Hq / H;
    float *scratch = (float *)(((uintptr_t)mem + 63) & ~(uintptr_t)63);
    sunit *units = (sunit *)(scratch + p.wave_tasks * p.sstride);
    int64_t *task_unit = (int64_t *)(units + p.nunits);
    int64_t ntasks = 0, ui = 0;
    for (int64_t i = 0; i < nq;) {
        const int64_t e = run_end(f, q_seq, q_pos, nq, i, p.rb);
        const int64_t qend = kvc__kvfmt_f16_from(f, q_pos[i]);
        const int64_t nch = chunks_of(&p, qend);
        for (int64_t h = 0; h < H; h++)
            for (int64_t ps = 0; ps < p.npass; ps++) {
                sunit *u = &units[ui++];
                u->row0 = i;
                u->nrows = (int32_t)(e - i);
                u->h = (int32_t)h;
                u->hq0 = (int32_t)(h * grp + ps * p.hp);
                u->nh = (int32_t)(grp - ps * p.hp < p.hp ? grp - ps * p.hp : p.hp);
                u->nchunks = (int32_t)nch;
                u->qend = qend;
                u->chunk = p.chunk;
                u->task0 = ntasks;
                ntasks += nch;
            }
        i = e;
    }
    for (int64_t u = 0; u < p.nunits; u++)
        for (int32_t k = 0; k < units[u].nchunks; k++) task_unit[units[u].task0 + k] = u;
    simd_ctx c = {f, kvc__kvfmt_layout_of(f), pages, q, out, lse, seqs, wins, q_seq, q_pos,
                  kern, units, task_unit, scratch, p.sstride, sm * 1.44269504088896341f,
                  kvc_threadpool_n_threads(pool), 0, 0, 0};
    /* waves: the most whole units whose tasks fit wave_tasks */
    for (int64_t u0 = 0, u1; u0 < p.nunits; u0 = u1) {
        for (u1 = u0 + 1; u1 < p.nunits &&
                          units[u1].task0 + units[u1].nchunks - units[u0].task0 <= p.wave_tasks;
             u1++) {
        }
        c.ubase = u0;
        c.tbase = units[u0].task0;
        c.tend = units[u1 - 1].task0 + units[u1 - 1].nchunks;
        kvc__parallel_for(pool, c.tend - c.tbase, simd_task, &c);
        kvc__parallel_for(pool, u1 - u0, simd_finish, &c);
    }
    return 1;
}

#else

size_t kvc__kvfmt_simd_bytes(const kvc_kvfmt *f, int64_t nq, int64_t Hq, const int32_t *q_seq,
                             const int32_t *q_pos) {
    (void)f, (void)nq, (void)Hq, (void)q_seq, (void)q_pos;
    return 0;
}

int kvc__kvfmt_attend_simd(const kvc_kvfmt *f, const kvc_tensor *pages,
                           const kvc_kvfmt_seq *seqs, const kvc__kvfmt_win *wins,
                           const kvc_tensor *q, const int32_t *q_seq, const int32_t *q_pos,
                           float sm, kvc_tensor *out, kvc_tensor *lse, kvc_threadpool *pool,
                           void *mem) {
    (void)f, (void)pages, (void)seqs, (void)wins, (void)q, (void)q_seq, (void)q_pos, (void)sm;
    (void)out, (void)lse, (void)pool, (void)mem;
    return 0;
}

#endif
