/*
 * Run-time ISA selection: cpuid feature bits plus xgetbv (the OS must save
 * YMM/ZMM state, not just the CPU support the instructions), capped by the
 * KVC_ISA environment variable. Selected once, on first use.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <strings.h> /* strcasecmp */

#include "../core/internal.h"
#include "kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define KVC_X86 1

static uint64_t xgetbv0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

static kvc_isa detect(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return KVC_ISA_SCALAR;
    const unsigned need1 = (1u << 12) | (1u << 27) | (1u << 28) | (1u << 29); /* FMA OSXSAVE AVX F16C */
    if ((c & need1) != need1) return KVC_ISA_SCALAR;
    uint64_t xcr0 = xgetbv0();
    if ((xcr0 & 0x6) != 0x6) return KVC_ISA_SCALAR; /* XMM+YMM state */
    if (__get_cpuid_max(0, NULL) < 7) return KVC_ISA_SCALAR;
    __cpuid_count(7, 0, a, b, c, d);
    if (!(b & (1u << 5))) return KVC_ISA_SCALAR; /* AVX2 */
    const unsigned need7 = (1u << 16) | (1u << 17) | (1u << 30) | (1u << 31); /* F DQ BW VL */
    if ((b & need7) != need7 || (xcr0 & 0xe6) != 0xe6) return KVC_ISA_AVX2;
    /* AMX: TILE (edx 24) + INT8 (edx 25), VBMI (ecx 1), XCR0 tile config and
     * data (bits 17, 18), and Linux's per-process permission for tile data */
    const unsigned amx7 = (1u << 24) | (1u << 25);
    if ((d & amx7) == amx7 && (c & (1u << 1)) && (xcr0 & 0x60000) == 0x60000 && kvc__amx_init())
        return KVC_ISA_AMX;
    return KVC_ISA_AVX512;
}
#else
static kvc_isa detect(void) { return KVC_ISA_SCALAR; }
#endif

static kvc_isa g_best;
static char g_env_bad[40]; /* an unknown KVC_ISA value (truncated), "" if none */
static int64_t g_llc_bytes;
static _Atomic(const kvc_kernels *) g_table;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static const kvc_kernels *table_for(kvc_isa isa) {
#ifdef KVC_X86
    if (isa == KVC_ISA_AMX) return kvc__kernels_amx();
    if (isa == KVC_ISA_AVX512) return kvc__kernels_avx512();
    if (isa == KVC_ISA_AVX2) return kvc__kernels_avx2();
#endif
    (void)isa;
    return kvc__kernels_scalar();
}

/* The L3 one core sees, from sysfs ("32768K"): sysconf and cpuid report
 * the whole package's (320 MiB on the Zen 4 VMs we measured, where one core
 * shares 32 MiB). At most 32 MiB, also when unknown: a VM's sysfs may give
 * its host's L3, shared with every other guest (260 MiB on the Xeon VMs of
 * model 207, where a copy left cache speed between 16 and 32 MiB of working
 * set and plain stores reached 0.6 of non-temporal ones past it). */
static int64_t llc_bytes(void) {
    int64_t best = 0;
    for (int i = 0; i < 8; i++) {
        char path[96], buf[32];
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/level", i);
        FILE *f = fopen(path, "r");
        if (!f) break;
        const int level = fgets(buf, sizeof buf, f) ? atoi(buf) : 0;
        fclose(f);
        if (level < 2) continue;
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
        if (!(f = fopen(path, "r"))) continue;
        if (fgets(buf, sizeof buf, f)) {
            char *end;
            int64_t v = strtoll(buf, &end, 10);
            if (*end == 'K') v <<= 10;
            else if (*end == 'M') v <<= 20;
            if (v > best) best = v;
        }
        fclose(f);
    }
    return best > 0 && best < ((int64_t)32 << 20) ? best : (int64_t)32 << 20;
}

static void init_once(void) {
    g_best = detect();
    g_llc_bytes = llc_bytes();
    kvc_isa isa = g_best;
    const char *env = getenv("KVC_ISA");
    if (env && *env) {
        /* A cap, not a demand: asking for more than the CPU has gives the best it has. */
        int known = 0;
        for (int i = 0; i < KVC_ISA_COUNT; i++)
            if (strcasecmp(env, kvc_isa_name((kvc_isa)i)) == 0) {
                known = 1;
                if ((kvc_isa)i < isa) isa = (kvc_isa)i;
            }
        if (!known) { /* refused by kvc_isa_env_check; the safe path meanwhile */
            snprintf(g_env_bad, sizeof g_env_bad, "%s", env);
            isa = KVC_ISA_SCALAR;
        }
    }
    atomic_store(&g_table, table_for(isa));
}

const kvc_kernels *kvc__kernels(void) {
    pthread_once(&g_once, init_once);
    return atomic_load_explicit(&g_table, memory_order_acquire);
}

int64_t kvc__llc_bytes(void) {
    pthread_once(&g_once, init_once);
    return g_llc_bytes;
}

void kvc__set_llc_bytes(int64_t bytes) {
    pthread_once(&g_once, init_once);
    g_llc_bytes = bytes;
}

kvc_isa kvc_get_isa(void) { return kvc__kernels()->isa; }

kvc_status kvc_isa_env_check(void) {
    pthread_once(&g_once, init_once);
    if (!g_env_bad[0]) return KVC_OK;
    return kvc__error(KVC_ERR_INVALID_ARG,
                      "KVC_ISA='%s' is not an ISA: expected scalar, avx2, avx512 or amx (any "
                      "case; a cap on the best this CPU has), or unset",
                      g_env_bad);
}

kvc_isa kvc_best_isa(void) {
    pthread_once(&g_once, init_once);
    return g_best;
}

int kvc_isa_supported(kvc_isa isa) { return (unsigned)isa < KVC_ISA_COUNT && isa <= kvc_best_isa(); }

const char *kvc_isa_name(kvc_isa isa) {
    switch (isa) {
    case KVC_ISA_SCALAR: return "scalar";
    case KVC_ISA_AVX2: return "avx2";
    case KVC_ISA_AVX512: return "avx512";
    case KVC_ISA_AMX: return "amx";
    default: return "?";
    }
}

kvc_status kvc_set_isa(kvc_isa isa) {
    if ((unsigned)isa >= KVC_ISA_COUNT)
        return kvc__error(KVC_ERR_INVALID_ARG, "kvc_set_isa: invalid isa %d", (int)isa);
    if (!kvc_isa_supported(isa))
        return kvc__error(KVC_ERR_UNSUPPORTED, "kvc_set_isa: this CPU cannot run %s (best: %s)",
                          kvc_isa_name(isa), kvc_isa_name(kvc_best_isa()));
    atomic_store(&g_table, table_for(isa));
    return KVC_OK;
}
