#!/usr/bin/env bash
# Thread scaling of batch-1 decode, as docs/BENCHMARKS.md records it:
# `kvcache bench-serve --batch 1` with -t 1, 2 and 4 on an idle machine, then
# -t 1 and 2 with a busy process (a shell loop) pinned to one CPU. Each case
# runs REPEATS times (default 3); the table gives the median decode tokens/s
# and its ratio to the goal's reference case.
#
#   bash scripts/bench_threads.sh [REPEATS]     BUILD_DIR=build  KVCACHE_MODEL=...
#   PROMPT_LEN=512 GEN=128 KV=f16
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BUILD_DIR:-build}/kvcache
REPEATS=${1:-3}
PROMPT_LEN=${PROMPT_LEN:-512}
GEN=${GEN:-128}
KV=${KV:-f16}
command -v taskset >/dev/null || { echo "bench_threads: needs taskset (util-linux)" >&2; exit 1; }
CPUS=$(nproc)
[ "$CPUS" -ge 2 ] || { echo "bench_threads: needs 2 CPUs or more, this process may use $CPUS" >&2; exit 1; }
BUSY_CPU=$(taskset -pc $$ | sed 's/.*: //; s/[,-].*//')

decode_rate() { # threads -> one decode tok/s figure
    "$BIN" bench-serve --batch 1 --prompt-len "$PROMPT_LEN" --gen "$GEN" --kv-dtype "$KV" \
        -t "$1" --json 2>/dev/null | sed -n 's/.*"decode_tok_s": \([0-9.]*\).*/\1/p'
}
median() { sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
run_case() { # threads -> median
    for _ in $(seq "$REPEATS"); do decode_rate "$1"; done | median
}

echo "# $(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -1), $CPUS CPUs, commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
echo "# bench-serve --batch 1 --prompt-len $PROMPT_LEN --gen $GEN --kv-dtype $KV, median of $REPEATS"
t1=$(run_case 1); t2=$(run_case 2); t4=$(run_case 4)
busy_pid=""
trap '[ -n "$busy_pid" ] && kill "$busy_pid" 2>/dev/null || true' EXIT
taskset -c "$BUSY_CPU" bash -c 'while :; do :; done' &
busy_pid=$!
sleep 0.5
b1=$(run_case 1); b2=$(run_case 2)
kill "$busy_pid"; busy_pid=""
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.2f", (b > 0) ? a / b : 0}'; }
printf "%-34s %12s %8s %s\n" case decode_t/s ratio goal
printf "%-34s %12s %8s %s\n" "-t 1" "$t1" "" ""
printf "%-34s %12s %8s %s\n" "-t 2" "$t2" "$(ratio "$t2" "$t1")" ">= 1.6 x (-t 1)"
printf "%-34s %12s %8s %s\n" "-t 4" "$t4" "$(ratio "$t4" "$t2")" ">= 0.8 x (-t 2)"
printf "%-34s %12s %8s %s\n" "-t 1, busy process on CPU $BUSY_CPU" "$b1" "" ""
printf "%-34s %12s %8s %s\n" "-t 2, busy process on CPU $BUSY_CPU" "$b2" "$(ratio "$b2" "$b1")" ">= 0.8 x (-t 1, busy)"
