/*
 * Token sampling (model.h): greedy, or temperature with optional top-k and
 * top-p (nucleus) filtering, from a caller-held 64-bit generator state.
 * Candidates are ordered by logit (ties by lower id), so a given state and
 * logits always give the same token.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvcache/model.h"
#include "../core/internal.h"

kvc_sampling_params kvc_sampling_default_params(void) {
    kvc_sampling_params p;
    p.temperature = 0.0f;
    p.top_k = 0;
    p.top_p = 1.0f;
    p.seed = 0;
    return p;
}

/* splitmix64: a full-period generator; one 53-bit uniform per call. */
static double next_uniform(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (double)(z >> 11) * (1.0 / 9007199254740992.0);
}

typedef struct cand {
    float logit;
    int32_t id;
} cand;

static int cand_cmp(const void *a, const void *b) {
    const cand *x = a, *y = b;
    if (x->logit != y->logit) return x->logit > y->logit ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

kvc_status kvc_sample(const float *logits, int32_t n_vocab, const kvc_sampling_params *params,
                      uint64_t *rng, int32_t *token) {
    static const char fn[] = "kvc_sample";
    KVC_CHECK(logits != NULL && token != NULL, "%s: logits and token must not be NULL", fn);
    KVC_CHECK(n_vocab >= 1, "%s: n_vocab %d < 1", fn, (int)n_vocab);
    kvc_sampling_params p = params ? *params : kvc_sampling_default_params();
    KVC_CHECK(isfinite(p.temperature) && p.temperature >= 0.0f, "%s: temperature %g must be >= 0",
              fn, (double)p.temperature);
    KVC_CHECK(p.top_k >= 0, "%s: top_k %d must be >= 0", fn, (int)p.top_k);
    KVC_CHECK(p.top_p > 0.0f && p.top_p <= 1.0f, "%s: top_p %g must be in (0, 1]", fn,
              (double)p.top_p);
    int32_t best = -1;
    for (int32_t i = 0; i < n_vocab; i++) {
        KVC_CHECK(!isnan(logits[i]), "%s: logit %d is NaN", fn, (int)i);
        if (best < 0 || logits[i] > logits[best]) best = i;
    }
    /* greedy, and infinite maxima (no finite distribution to sample from) */
    if (p.temperature == 0.0f || p.top_k == 1 || isinf(logits[best])) {
        *token = best;
        return KVC_OK;
    }
    KVC_CHECK(rng != NULL, "%s: rng is NULL", fn);
    cand *c = malloc((size_t)n_vocab * sizeof(cand));
    if (!c) return kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
    for (int32_t i = 0; i < n_vocab; i++) {
        c[i].logit = logits[i];
        c[i].id = i;
    }
    int32_t n = n_vocab;
    qsort(c, (size_t)n, sizeof(cand), cand_cmp);
    if (p.top_k > 0 && p.top_k < n) n = p.top_k;
    /* probabilities at temperature, in double */
    const double mx = c[0].logit;
    double *pr = malloc((size_t)n * sizeof(double));
    if (!pr) {
        free(c);
        return kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
    }
    double sum = 0;
    for (int32_t i = 0; i < n; i++) sum += pr[i] = exp(((double)c[i].logit - mx) / p.temperature);
    if (p.top_p < 1.0f) { /* smallest prefix with mass >= top_p */
        double acc = 0;
        int32_t keep = n;
        for (int32_t i = 0; i < n; i++) {
            acc += pr[i] / sum;
            if (acc >= p.top_p) {
                keep = i + 1;
                break;
            }
        }
        n = keep;
        sum = 0;
        for (int32_t i = 0; i < n; i++) sum += pr[i];
    }
    const double u = next_uniform(rng) * sum;
    double acc = 0;
    int32_t pick = c[n - 1].id;
    for (int32_t i = 0; i < n; i++) {
        acc += pr[i];
        if (u < acc) {
            pick = c[i].id;
            break;
        }
    }
    free(pr);
    free(c);
    *token = pick;
    return KVC_OK;
}
