/*
 * XXH3-128 of a || b in canonical bytes (store_internal.h): the payload
 * checksum hashes every byte a restore moves, so it is built twice, with
 * xxHash's SSE2 loop (any x86-64) and, in hash_avx2.c, its AVX2 loop,
 * chosen by kvc_get_isa() (KVC_ISA=scalar forces SSE2). Both give the same
 * digest by xxHash's definition; test_store checks it.
 */
#define XXH_INLINE_ALL
#include <string.h>
#include <xxhash.h>

#include "store_internal.h"

#ifndef KVC_HASH_SUFFIX
#define KVC_HASH_SUFFIX _base
#endif
#define KVC_CAT2(a, b) a##b
#define KVC_CAT(a, b) KVC_CAT2(a, b)

void KVC_CAT(kvc__store_hash128, KVC_HASH_SUFFIX)(const void *a, size_t na, const void *b,
                                                   size_t nb, kvc_store_key *out);
void KVC_CAT(kvc__store_hash128, KVC_HASH_SUFFIX)(const void *a, size_t na, const void *b,
                                                   size_t nb, kvc_store_key *out) {
    XXH3_state_t st;
    XXH3_128bits_reset(&st);
    XXH3_128bits_update(&st, a, na);
    if (nb) XXH3_128bits_update(&st, b, nb);
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, XXH3_128bits_digest(&st));
    memcpy(out->b, c.digest, 16);
}

#ifndef KVC_HASH_VARIANT /* the dispatcher, once */
void kvc__store_hash128_avx2(const void *a, size_t na, const void *b, size_t nb,
                             kvc_store_key *out);

void kvc__store_hash128(const void *a, size_t na, const void *b, size_t nb, kvc_store_key *out) {
#if defined(KVC_HAVE_HASH_AVX2)
    if (kvc_get_isa() >= KVC_ISA_AVX2) {
        kvc__store_hash128_avx2(a, na, b, nb, out);
        return;
    }
#endif
    kvc__store_hash128_base(a, na, b, nb, out);
}
#endif
