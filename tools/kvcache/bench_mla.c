/* Placeholder: replaced by the benchmark. */
#include <stdio.h>

#include "bench.h"

int bench_mla(const bench_opts *o) {
    (void)o;
    fputs("kvcache: bench mla: not built yet\n", stderr);
    return 1;
}
