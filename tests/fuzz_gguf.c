/*
 * libFuzzer target for the GGUF reader: every input is opened with
 * kvc_gguf_open_memory from an exact-size copy (so ASan sees any read past
 * the end), and when it opens, every accessor is called on every key-value
 * and tensor, touching the first and last byte of each string, array and
 * tensor the reader hands out.
 *
 * Built with clang -fsanitize=fuzzer,address,undefined when -DKVC_FUZZ=ON;
 * otherwise fuzz_replay.c replays the seed corpus through the same entry
 * point, so ctest runs it with any compiler.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvcache/gguf.h"
#include "fuzz.h"

/* Sums bytes so the reads cannot be optimized away. */
static volatile uint64_t sink;

static void touch(const void *p, size_t n) {
    if (n == 0) return;
    const uint8_t *b = p;
    sink += b[0] + b[n - 1];
}

static void walk(const kvc_gguf *g) {
    sink += kvc_gguf_version(g) + kvc_gguf_alignment(g);
    int64_t n_kv = kvc_gguf_n_kv(g);
    for (int64_t i = 0; i < n_kv; i++) {
        const char *key = kvc_gguf_key(g, i);
        kvc_gguf_type t, et;
        int64_t n;
        if (!key || kvc_gguf_kv_type(g, i, &t, &et, &n) != KVC_OK) __builtin_trap();
        if (kvc_gguf_find_key(g, key) != i) __builtin_trap(); /* keys are unique */
        int64_t iv;
        double fv;
        const char *s;
        size_t len;
        const void *data;
        if (kvc_gguf_get_i64(g, key, &iv) == KVC_OK) sink += (uint64_t)iv;
        if (kvc_gguf_get_f64(g, key, &fv) == KVC_OK) sink += fv != 0;
        if (kvc_gguf_get_str(g, key, &s, &len) == KVC_OK) touch(s, len);
        if (kvc_gguf_get_arr(g, key, &et, &n, &data) == KVC_OK && data && n > 0) {
            static const size_t esize[] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
            touch(data, (size_t)n * esize[et]);
        }
        if (t == KVC_GGUF_ARRAY && et == KVC_GGUF_STRING) {
            for (int64_t j = 0; j < n; j++) {
                if (kvc_gguf_get_arr_str(g, key, j, &s, &len) != KVC_OK) __builtin_trap();
                touch(s, len);
            }
        }
        /* error paths */
        (void)kvc_gguf_get_arr_str(g, key, -1, &s, &len);
        (void)kvc_gguf_get_arr_str(g, key, n, &s, &len);
    }
    int64_t n_t = kvc_gguf_n_tensors(g);
    for (int64_t i = 0; i < n_t; i++) {
        kvc_gguf_tensor t;
        if (kvc_gguf_get_tensor(g, i, &t) != KVC_OK) __builtin_trap();
        if (kvc_gguf_find_tensor(g, t.name) != i) __builtin_trap(); /* names are unique */
        if (t.n_dims < 1 || t.n_dims > 4 || !kvc_ggml_type_name(t.type)) __builtin_trap();
        touch(t.data, t.size);
    }
    (void)kvc_gguf_find_key(g, "general.alignment");
    (void)kvc_gguf_find_tensor(g, "token_embd.weight");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    uint8_t *copy = malloc(size ? size : 1);
    if (!copy) return 0;
    if (size) memcpy(copy, data, size);
    kvc_gguf *g = NULL;
    if (kvc_gguf_open_memory(copy, size, &g) == KVC_OK) {
        walk(g);
        kvc_gguf_close(g);
    } else if (g != NULL) {
        __builtin_trap(); /* failure must leave *out NULL */
    }
    free(copy);
    return 0;
}
