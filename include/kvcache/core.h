/*
 * kvcache core API: status codes, error messages, versions, dtypes, the tensor
 * description used by every operator, CPU ISA selection and the thread pool.
 *
 * Conventions used by every kvcache header:
 *   - Fallible functions return kvc_status (KVC_OK == 0, errors negative) and,
 *     on error, set a per-thread message readable with kvc_last_error().
 *   - A call that fails leaves every caller buffer (caches included) unchanged.
 *   - Handles: kvc_X_create / open / load(..., kvc_X **out) set *out to NULL
 *     when they fail (out itself must not be NULL); kvc_X_destroy / close
 *     accept NULL.
 *   - Shapes are written (d0, d1, ...), row-major; strides are in elements.
 *   - The caller owns every buffer; the library keeps no pointer past a call.
 *   - An output must not share memory with an input or another output unless
 *     its operator says so (caches updated in place are inputs and outputs
 *     by design). Overlap is not detected: like memcpy's, such a call's
 *     result is undefined, though nothing is read or written out of bounds.
 *     Nor may a tensor the call writes overlap itself: one with stride 0
 *     over a dimension of size > 1 (a broadcast view) is refused
 *     (KVC_ERR_INVALID_ARG); other self-overlapping strides are not detected.
 *   - Objects are not internally locked; kernels are reentrant.
 */
#ifndef KVCACHE_CORE_H
#define KVCACHE_CORE_H

#include <stddef.h>
#include <stdint.h>

#include "kvcache/version.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32) && defined(KVC_BUILDING_SHARED)
#define KVC_API __declspec(dllexport)
#elif defined(__GNUC__)
#define KVC_API __attribute__((visibility("default")))
#else
#define KVC_API
#endif

/* ---- status ------------------------------------------------------------ */

typedef enum kvc_status {
    KVC_OK = 0,
    KVC_ERR_NOMEM = -1,       /* an allocation failed */
    KVC_ERR_INVALID_ARG = -2, /* bad shape, dtype, attribute, index or value */
    KVC_ERR_NO_SPACE = -3,    /* a cache has no free pages left */
    KVC_ERR_NOT_FOUND = -4,   /* unknown or freed handle/id */
    KVC_ERR_UNSUPPORTED = -5, /* valid request this build/CPU cannot serve */
    KVC_ERR_IO = -6,          /* file read/write failed */
    KVC_ERR_CORRUPT = -7,     /* malformed file or broken invariant */
    KVC_ERR_INTERNAL = -8     /* a bug in kvcache: please report it */
} kvc_status;

/* Static name of a status, e.g. "invalid argument". Never NULL. */
KVC_API const char *kvc_status_str(kvc_status status);

/* Detail message of the last failed call on this thread ("" if none). Read
 * it before the next kvcache call on this thread: that call may replace or
 * clear it (even when it succeeds), and the pointer stays valid until then. */
KVC_API const char *kvc_last_error(void);

/* Clears this thread's last error message. */
KVC_API void kvc_clear_error(void);

/* ---- version ----------------------------------------------------------- */

KVC_API unsigned kvc_version_number(void); /* KVC_VERSION_NUMBER of the library */
KVC_API const char *kvc_version_string(void);

/* ---- dtypes ------------------------------------------------------------ */

typedef enum kvc_dtype {
    KVC_F32 = 0,
    KVC_F16 = 1,  /* IEEE binary16 */
    KVC_BF16 = 2, /* bfloat16 (upper half of a float32) */
    KVC_I8 = 3,
    KVC_I4 = 4, /* packed: element 2i in the low nibble of byte i, 2i+1 high */
    KVC_FP8_E4M3 = 5, /* reserved: no operator accepts it yet */
    KVC_I32 = 6,
    KVC_I64 = 7,
    KVC_U8 = 8,
    KVC_DTYPE_COUNT
} kvc_dtype;

/* "float32", "float16", "bfloat16", "int8", "int4", "float8_e4m3", "int32",
 * "int64", "uint8"; "?" for an invalid value. */
KVC_API const char *kvc_dtype_name(kvc_dtype dtype);

/* Storage bits per element: 32, 16, 16, 8, 4, 8, 32, 64, 8; 0 if invalid. */
KVC_API int kvc_dtype_bits(kvc_dtype dtype);

/* Scalar conversions, round to nearest even. Narrowing keeps NaN a NaN
 * (quieted, top payload bits kept); widening is exact, payload included. */
KVC_API uint16_t kvc_f32_to_f16(float x);
KVC_API float kvc_f16_to_f32(uint16_t h);
KVC_API uint16_t kvc_f32_to_bf16(float x);
KVC_API float kvc_bf16_to_f32(uint16_t h);

/* ---- tensors ----------------------------------------------------------- */

#define KVC_MAX_DIMS 8

/*
 * A view of caller memory. shape[i] >= 0; stride[i] is in elements (for
 * KVC_I4, in 4-bit elements, so every stride but the last must be even and
 * data points at the byte holding element 0 in its low nibble). Operators
 * require stride[ndim-1] == 1 unless they say otherwise; other strides may be
 * anything non-negative, so slices of larger arrays can be passed. A 0-d
 * tensor (ndim == 0) holds one element. data must be aligned to the element
 * size (2 bytes for F16/BF16, 4 for F32/I32, 8 for I64; any for 8- and
 * 4-bit types), as C requires for the loads; operators refuse it otherwise.
 */
typedef struct kvc_tensor {
    void *data;
    kvc_dtype dtype;
    int32_t ndim;
    int64_t shape[KVC_MAX_DIMS];
    int64_t stride[KVC_MAX_DIMS];
} kvc_tensor;

/* A contiguous row-major tensor over data. ndim in [0, KVC_MAX_DIMS] (shape
 * may be NULL only for ndim 0); otherwise the tensor gets ndim -1, which
 * every operator rejects. */
KVC_API kvc_tensor kvc_tensor_make(void *data, kvc_dtype dtype, int32_t ndim,
                                   const int64_t *shape);

/* Number of elements (product of shape; 1 for ndim 0); -1 for NULL, an
 * invalid ndim, a negative size or a count that overflows int64. */
KVC_API int64_t kvc_tensor_numel(const kvc_tensor *t);

/* ---- CPU ISA dispatch -------------------------------------------------- */

typedef enum kvc_isa {
    KVC_ISA_SCALAR = 0, /* portable C reference kernels */
    KVC_ISA_AVX2 = 1,   /* AVX2 + FMA + F16C */
    KVC_ISA_AVX512 = 2, /* AVX-512 F/BW/VL/DQ */
    KVC_ISA_AMX = 3,    /* AVX-512 (+ VBMI) and AMX-INT8 tiles: int8/int4 decode attention on the
                           tile unit (Linux: needs the kernel's tile data permission) */
    KVC_ISA_COUNT
} kvc_isa;

/* The ISA kernels run with now. Chosen once, at the first call that needs
 * kernels, from cpuid + xgetbv, capped by the environment variable
 * KVC_ISA=scalar|avx2|avx512|amx if set (any case: "AVX2" is avx2; a cap,
 * so asking for more than the CPU has gives the best it has). Any other
 * non-empty value is refused: kvc_isa_env_check() reports it, and
 * kvc_model_load, kvc_cache_create and the plan constructors fail with it;
 * kernels called anyway run the scalar path. */
KVC_API kvc_isa kvc_get_isa(void);

/* KVC_OK if KVC_ISA is unset, empty or an ISA name (any case), else
 * KVC_ERR_INVALID_ARG with a message naming the value and the valid ones. */
KVC_API kvc_status kvc_isa_env_check(void);

/* Best ISA this CPU and OS support (ignores KVC_ISA). */
KVC_API kvc_isa kvc_best_isa(void);

/* 1 if the CPU/OS can run isa, else 0. */
KVC_API int kvc_isa_supported(kvc_isa isa);

/* "scalar", "avx2", "avx512", "amx". */
KVC_API const char *kvc_isa_name(kvc_isa isa);

/* Selects the kernels used from now on (tests, benchmarks). Fails with
 * KVC_ERR_UNSUPPORTED if the CPU cannot run isa. Not thread-safe with
 * respect to calls running concurrently. */
KVC_API kvc_status kvc_set_isa(kvc_isa isa);

/* ---- thread pool ------------------------------------------------------- */

/*
 * A fixed set of n_threads - 1 worker threads plus the calling thread. Work
 * is always split into fixed chunks independent of n_threads, so results are
 * bitwise identical for any thread count. Operators accept a NULL pool and
 * then run on the calling thread only. One operator at a time per pool.
 * A pool also keeps scratch memory some operators need between calls (the
 * largest block asked for so far, e.g. 1/8 to 1/4 of the input of the
 * largest quantized append), released by kvc_threadpool_destroy.
 * Stack: attention tasks keep their state on the stack of the thread that
 * runs them (no allocation per call), so a thread that calls a decode,
 * prefill, cascade or MLA run (or the model runtime) needs 256 KiB of stack
 * or more. glibc's default is 8 MiB; musl gives new threads 128 KiB, too
 * little: create such threads with a larger stack. Pool workers get 1 MiB
 * or the C library's default, whichever is larger.
 * Scheduling: the caller runs tasks too and waits only for workers that
 * took one, so a worker that is descheduled (a busy machine, more threads
 * than CPUs) costs nothing; idle workers spin about 0.1 ms, then sleep.
 * More threads than kvc_cpu_count() work, without spinning, but are slower
 * than kvc_cpu_count() threads.
 */
typedef struct kvc_threadpool kvc_threadpool;

/* The CPUs this process may run on (sched_getaffinity; the online CPUs where
 * that is unavailable); at least 1. */
KVC_API int kvc_cpu_count(void);

/* n_threads >= 1, at most 1024 (n_threads <= 0 means kvc_cpu_count()). */
KVC_API kvc_status kvc_threadpool_create(int n_threads, kvc_threadpool **out);
KVC_API void kvc_threadpool_destroy(kvc_threadpool *pool); /* NULL is a no-op */
KVC_API int kvc_threadpool_n_threads(const kvc_threadpool *pool); /* 1 for NULL */

#ifdef __cplusplus
}
#endif
#endif
