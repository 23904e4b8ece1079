/*
 * Shared by the fuzz targets (fuzz_*.c): the libFuzzer entry point and a
 * CHECK that prints the failed condition, its file and line and the
 * library's last message, then traps (libFuzzer saves the input; the replay
 * main dies with it).
 */
#ifndef KVC_TESTS_FUZZ_H
#define KVC_TESTS_FUZZ_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "kvcache/core.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: CHECK(%s) failed (%s)\n", __FILE__, __LINE__, #cond,           \
                    kvc_last_error());                                                             \
            __builtin_trap();                                                                      \
        }                                                                                          \
    } while (0)

#endif
