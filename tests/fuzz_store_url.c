/*
 * libFuzzer target for Redis tier URLs (docs/KV_STORE.md section 5), two
 * parsers held against each other: the store's own (src/store/redis.c,
 * kvc__tier_redis_open) and the CLI's check (tools/kvcache/cli_store_url.c,
 * which refuses a malformed --kv-store before the model loads). For every
 * redis:// or unix:// input they must agree on malformed or not; for one
 * both accept, the CLI's credential-free form (cli_store_url_shown) must be
 * the tier's name (both hide passwords the same way). Inputs with a
 * "write=" option are left out: the store takes that out before the tier
 * sees the URL.
 *
 * Built with clang -fsanitize=fuzzer,address,undefined when -DKVC_FUZZ=ON;
 * otherwise fuzz_replay.c replays the seed corpus through the same entry
 * point.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../tools/kvcache/cli_store.h"
#include "kvcache/core.h"
#include "store/tier.h"
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size > 4096 || memchr(data, 0, size)) return 0;
    char *u = malloc(size + 1);
    if (!u) return 0;
    memcpy(u, data, size);
    u[size] = 0;
    if ((strncmp(u, "redis://", 8) && strncmp(u, "unix://", 7)) || strstr(u, "write=")) {
        free(u);
        return 0;
    }
    kvc_tier *t = NULL;
    const kvc_status st = kvc__tier_redis_open(u, &t);
    const char *why = cli_store_url_problem(u);
    if (st == KVC_ERR_NOMEM) { /* no verdict */
        free(u);
        return 0;
    }
    if ((st != KVC_OK) != (why != NULL)) {
        fprintf(stderr, "disagree on \"%s\": store %s (%s), CLI %s\n", u, kvc_status_str(st),
                st != KVC_OK ? kvc_last_error() : "", why ? why : "fine");
        __builtin_trap();
    }
    if (st == KVC_OK) {
        char shown[sizeof t->name + 64];
        /* both whole (the tier's name is cut at its 256 bytes, the CLI's
         * form at its buffer's) */
        const size_t need = cli_store_url_shown(u, shown, sizeof shown);
        if (need < sizeof t->name && strcmp(shown, t->name)) {
            fprintf(stderr, "names differ for \"%s\": store \"%s\", CLI \"%s\"\n", u, t->name,
                    shown);
            __builtin_trap();
        }
        /* the CLI's form: its length is the whole's, and a cut one is the
         * whole's start (an input is at most 4096 bytes: whole here) */
        static char whole[4200];
        if (cli_store_url_shown(u, whole, sizeof whole) != need || strlen(whole) != need ||
            strncmp(whole, shown, strlen(shown)) || (need < sizeof shown) != !strcmp(whole, shown)) {
            fprintf(stderr, "CLI form of \"%s\": \"%s\" (%zu) cut to \"%s\"\n", u, whole, need,
                    shown);
            __builtin_trap();
        }
        t->ops->close(t);
    }
    kvc_clear_error();
    free(u);
    return 0;
}
