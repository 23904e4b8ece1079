/* hash.c's XXH3-128 built with AVX2 (this file alone gets -mavx2). */
#define XXH_VECTOR XXH_AVX2
#define KVC_HASH_VARIANT 1
#define KVC_HASH_SUFFIX _avx2
#include "hash.c"
