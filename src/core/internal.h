/* Internal helpers shared by all modules: error reporting, tensor checks,
 * parallel loops. Nothing here is exported. */
#ifndef KVC_INTERNAL_H
#define KVC_INTERNAL_H

#include <stdint.h>

#include "kvcache/core.h"

#if defined(__GNUC__)
#define KVC_PRINTF(a, b) __attribute__((format(printf, a, b)))
#define KVC_HIDDEN __attribute__((visibility("hidden")))
#else
#define KVC_PRINTF(a, b)
#define KVC_HIDDEN
#endif

/* Records a formatted message for kvc_last_error() and returns status.
 * Exported (not API) for the companion library libkvcache_store, whose
 * errors must reach the same kvc_last_error(). */
KVC_API kvc_status kvc__error(kvc_status status, const char *fmt, ...) KVC_PRINTF(2, 3);

/* Returns st from the enclosing function if it is an error. */
#define KVC_TRY(expr)                                                                              \
    do {                                                                                           \
        kvc_status kvc__st = (expr);                                                               \
        if (kvc__st != KVC_OK) return kvc__st;                                                     \
    } while (0)

/* Fails with KVC_ERR_INVALID_ARG and a message unless cond holds. */
#define KVC_CHECK(cond, ...)                                                                       \
    do {                                                                                           \
        if (!(cond)) return kvc__error(KVC_ERR_INVALID_ARG, __VA_ARGS__);                          \
    } while (0)

/* *out = a * b * c, all >= 0; 0 when the product passes max (scratch sizes
 * computed from a caller's shapes: broadcast views make huge shapes cheap,
 * so they must not wrap into a small allocation). */
static inline int kvc__mul3_le(int64_t a, int64_t b, int64_t c, int64_t max, int64_t *out) {
    int64_t p;
    if (a < 0 || b < 0 || c < 0 || __builtin_mul_overflow(a, b, &p) ||
        __builtin_mul_overflow(p, c, &p) || p > max)
        return 0;
    *out = p;
    return 1;
}

/* Elements of float scratch a call may ask malloc for: past this a size in
 * bytes could wrap (and no machine has the memory). */
#define KVC__MAX_SCRATCH_FLOATS                                                                    \
    ((int64_t)((SIZE_MAX < (size_t)INT64_MAX ? SIZE_MAX : (size_t)INT64_MAX) / 16))

/* Size in bytes of n elements (n even for int4). Inline: it sits in the
 * per-row address arithmetic of every operator. */
static inline int64_t kvc__bytes(kvc_dtype dt, int64_t n) {
    switch (dt) {
    case KVC_F32:
    case KVC_I32: return n * 4;
    case KVC_F16:
    case KVC_BF16: return n * 2;
    case KVC_I64: return n * 8;
    case KVC_I4: return n / 2;
    default: return n;
    }
}

/* Pointer to element at elem offset (even for int4). */
static inline void *kvc__at(const kvc_tensor *t, int64_t elem) {
    return (char *)t->data + kvc__bytes(t->dtype, elem);
}

/*
 * Validates a tensor argument: non-NULL, valid dtype, ndim in range, shapes
 * >= 0, strides >= 0, last stride 1 (if need_contig_last and ndim > 0),
 * data non-NULL when it has elements, int4 strides even. name is used in
 * messages.
 */
kvc_status kvc__check_tensor(const kvc_tensor *t, const char *name, int need_contig_last);

/*
 * A tensor the call writes (an output, or a cache updated in place), after
 * kvc__check_tensor: refused when a dimension of size > 1 has stride 0, so
 * that two of its elements are one memory location and the result would
 * depend on which write lands last (on threads: on the thread count). Other
 * overlapping strides are not detected (core.h). Empty tensors pass.
 */
kvc_status kvc__check_writable(const kvc_tensor *t, const char *name);

/* Formats t's shape as "(a, b, c)" into buf. */
const char *kvc__shape_str(const kvc_tensor *t, char *buf, size_t n);

/* Reads element i (row-major logical index into a 1-D/2-D view via strides)
 * of an int64 tensor; callers validate shape first. */
static inline int64_t kvc__i64_at(const kvc_tensor *t, int64_t offset_elems) {
    return ((const int64_t *)t->data)[offset_elems];
}

/* Runs fn(ctx, task) for task in [0, n_tasks) on the pool (NULL: inline).
 * Returns after all tasks finished. Tasks must write disjoint memory. */
typedef void (*kvc__task_fn)(void *ctx, int64_t task);
void kvc__parallel_for(kvc_threadpool *pool, int64_t n_tasks, kvc__task_fn fn, void *ctx);

/* Scratch memory for one operator call, 64-byte aligned: the pool keeps its
 * largest block for the next call (a fresh multi-MB block would cost a page
 * fault per 4 KiB on first touch, every call); NULL pool: an allocation of
 * its own. NULL when out of memory. Pair with kvc__scratch_release. One
 * operator at a time per pool. A caller that must not fail half way (the
 * model's forward step, between layers) gets the largest block its
 * operators will ask for first: calls asking for no more then cannot fail. */
void *kvc__scratch_get(kvc_threadpool *pool, size_t bytes);
void kvc__scratch_release(kvc_threadpool *pool, void *p);

/* size bytes aligned to align (a power of two); on Linux a buffer of 8 MiB
 * or more is 2 MiB-aligned and offered to transparent huge pages (memory.c).
 * Free with free(); NULL when out of memory. The cache manager's default
 * allocator, and the benches' buffers (so they see the same TLB). */
void *kvc__alloc_large(size_t size, size_t align);

#endif
