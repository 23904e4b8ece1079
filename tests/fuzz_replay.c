/*
 * main() for the fuzz targets without libFuzzer: replays the files and
 * directories named on the command line (a seed corpus) through the target's
 * LLVMFuzzerTestOneInput, each from an exact-size heap copy, so ctest runs
 * the corpora with any compiler. Exit status 1 if a file cannot be read or
 * nothing was replayed; a failing check inside the target traps.
 */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz.h"

static const char *prog = "fuzz_replay";

static int replay_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "%s: cannot open %s\n", prog, path);
        return 1;
    }
    size_t cap = 4096, n = 0;
    uint8_t *buf = malloc(cap);
    for (;;) {
        if (!buf) {
            fclose(f);
            return 1;
        }
        n += fread(buf + n, 1, cap - n, f);
        if (n < cap) break;
        cap *= 2;
        uint8_t *p = realloc(buf, cap);
        if (!p) free(buf);
        buf = p;
    }
    int err = ferror(f);
    fclose(f);
    if (err) {
        fprintf(stderr, "%s: cannot read %s\n", prog, path);
        free(buf);
        return 1;
    }
    /* exact size, so a read past the input's end is past the allocation */
    uint8_t *exact = malloc(n ? n : 1);
    if (!exact) {
        free(buf);
        return 1;
    }
    if (n) memcpy(exact, buf, n);
    free(buf);
    LLVMFuzzerTestOneInput(exact, n);
    free(exact);
    return 0;
}

int main(int argc, char **argv) {
    int n_files = 0, failed = 0;
    if (argc > 0) {
        const char *slash = strrchr(argv[0], '/');
        prog = slash ? slash + 1 : argv[0];
    }
    for (int a = 1; a < argc; a++) {
        DIR *d = opendir(argv[a]);
        if (!d) {
            failed |= replay_file(argv[a]);
            n_files++;
            continue;
        }
        struct dirent *e;
        while ((e = readdir(d)) != NULL) {
            if (e->d_name[0] == '.') continue;
            char path[4096];
            snprintf(path, sizeof path, "%s/%s", argv[a], e->d_name);
            failed |= replay_file(path);
            n_files++;
        }
        closedir(d);
    }
    printf("%s: replayed %d inputs\n", prog, n_files);
    return failed || n_files == 0;
}
