/* Placeholder: replaced by the benchmark. */
#include <stdio.h>

#include "bench.h"

int bench_gemm(const bench_opts *o) {
    (void)o;
    fputs("kvcache: bench gemm: not built yet\n", stderr);
    return 1;
}
