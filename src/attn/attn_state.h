/*
 * The end of an online softmax, shared by the decode, prefill and cascade
 * drivers (SEMANTICS section 5, attention.h's kvc_attn_params.sinks).
 */
#ifndef KVC_ATTN_STATE_H
#define KVC_ATTN_STATE_H

#include <math.h>
#include <stdint.h>

/* Head hq's sink logit in base 2 (sinks: (Hq) natural units, or NULL: -inf). */
static inline float kvc__attn_sink2(const float *sinks, int64_t hq) {
    return sinks ? sinks[hq] * 1.4426950408889634f : -INFINITY;
}

/*
 * A state of base-2 max m and sum l (l > 0 iff a key was seen) and the
 * sink t (base 2, -inf: none) -> the factor that turns the accumulator into
 * the output, and the row's lse. The sink is a state (v = 0, lse = t)
 * merged in: it adds 2^t to the denominator. Without one: 1 / l and
 * m + log2 l, bit for bit what the drivers computed before sinks existed;
 * a row with no key: 0, and lse t (-inf without a sink).
 */
static inline float kvc__attn_finish(float m, float l, float t, float *lse) {
    if (!(l > 0.0f)) {
        *lse = t;
        return 0.0f;
    }
    if (t == -INFINITY) {
        *lse = m + log2f(l);
        return 1.0f / l;
    }
    const float M = m > t ? m : t, a = exp2f(m - M), d = l * a + exp2f(t - M);
    *lse = M + log2f(d);
    return a / d;
}

#endif
