/* Placeholder: replaced by the benchmark. */
#include <stdio.h>

#include "bench.h"

int bench_prefill(const bench_opts *o) {
    (void)o;
    fputs("kvcache: bench prefill: not built yet\n", stderr);
    return 1;
}
