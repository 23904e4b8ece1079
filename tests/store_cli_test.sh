#!/bin/sh
# Two processes sharing a KV store through the CLI, on the default model:
#   store_cli_test.sh CASE KVCACHE_BINARY MODEL
# Cases: dir (f16 and int4 = kivi4), redis (KVC_TEST_REDIS: run through
# tests/with_redis.sh), redis_auth (a server of its own with a password,
# given in the environment: KVCACHE_REDIS_PASSWORD; through with_redis.sh
# too, for KVC_TEST_REDIS_SERVER), dir_full (every write fails: the file
# size limit), events_fail (--kv-events cannot bind: the store's directory is not left).
# The second process must restore the prompt (--json-stats) and print
# exactly what a process without a store prints (greedy decoding).
# Exit 0 pass, 1 fail (with the reason), 77 skip (the model is absent and
# KVC_NO_MODEL is set, as tests/cli_status.sh --needs-model).
set -u
case_name=$1 kv=$2 model=$3
if [ ! -f "$model" ]; then # a skip only where scripts/setup.sh was told not to fetch it
    [ -n "${KVC_NO_MODEL:-}" ] &&
        { echo "skipped: the default model is absent and KVC_NO_MODEL is set"; exit 77; }
    echo "FAIL: the default model $model is absent: run scripts/fetch_model.sh (or set KVC_NO_MODEL=1)"
    exit 1
fi
tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL ($case_name): $*"; for f in "$tmp"/*.err; do
    [ -f "$f" ] && { echo "--- $f"; cat "$f"; }; done; exit 1; }
# a prompt of ~150 tokens: two whole 64-token K groups for int4 (kivi4)
i=0; while [ $i -lt 14 ]; do
    printf 'Line %d of a long prompt: the quick brown fox jumps over the lazy dog. ' $i
    i=$((i + 1)); done > "$tmp/prompt.txt"
run() { # NAME [options...]: stdout to NAME.out, stderr to NAME.err
    name=$1; shift
    "$kv" run -m "$model" -f "$tmp/prompt.txt" -n 6 -t 2 -q --json-stats "$@" \
        > "$tmp/$name.out" 2> "$tmp/$name.err" || fail "$name: exit status $?"
}
stat_of() { # NAME KEY: an integer field of NAME's --json-stats line
    sed -n "s/.*\"$2\": \([0-9]*\).*/\1/p" "$tmp/$1.err" | tail -1
}
two_runs() { # URL [options...]: a process without a store, one storing, one restoring
    url=$1; shift
    run ref "$@"
    run first --kv-store "$url" "$@"
    run second --kv-store "$url" "$@"
    cmp -s "$tmp/ref.out" "$tmp/first.out" || fail "output with a store differs"
    cmp -s "$tmp/ref.out" "$tmp/second.out" || fail "restored output differs"
    [ "$(stat_of first store_hit_tokens)" -eq 0 ] || fail "the first process hit an empty store"
    [ "$(stat_of first store_bytes_written)" -gt 0 ] || fail "the first process wrote nothing"
    hit=$(stat_of second store_hit_tokens) p=$(stat_of second prompt_tokens)
    [ "$hit" -gt 0 ] && [ "$hit" -lt "$p" ] || fail "second process restored $hit of $p tokens"
    [ "$(stat_of second store_verify_failures)" -eq 0 ] || fail "verify failures"
    echo "$case_name $*: restored $hit of $p prompt tokens"
}
case $case_name in
dir)
    two_runs "dir:$tmp/store"
    two_runs "dir:$tmp/store" --kv-dtype int4
    ;;
redis)
    [ -n "${KVC_TEST_REDIS:-}" ] || fail "KVC_TEST_REDIS is not set: run through tests/with_redis.sh"
    two_runs "$KVC_TEST_REDIS"
    two_runs "$KVC_TEST_REDIS" --kv-dtype int8
    ;;
redis_auth)
    [ -n "${KVC_TEST_REDIS_SERVER:-}" ] ||
        fail "KVC_TEST_REDIS_SERVER is not set: run through tests/with_redis.sh"
    pw='env pw :@/%,?&' sock=$tmp/auth.sock
    "$KVC_TEST_REDIS_SERVER" --port 0 --unixsocket "$sock" --unixsocketperm 700 --save '' \
        --appendonly no --daemonize no --dir "$tmp" --logfile "$tmp/auth.log" \
        --requirepass "$pw" &
    srv=$!
    trap 'kill $srv 2>/dev/null; wait $srv 2>/dev/null; rm -rf "$tmp"' EXIT
    i=0; while [ ! -S "$sock" ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
    [ -S "$sock" ] || fail "redis-server with a password did not start"
    # without the password: the run goes on, its writes fail and it says why
    run noauth --kv-store "unix://$sock"
    [ "$(stat_of noauth store_errors)" -gt 0 ] || fail "no store errors without the password"
    grep -Eq "(NOAUTH|unauthenticated).*KVCACHE_REDIS_PASSWORD" "$tmp/noauth.err" ||
        fail "the error does not say how to give the password: $(cat "$tmp/noauth.err")"
    # set but empty, or a user without a password: the run fails
    KVCACHE_REDIS_PASSWORD= "$kv" run -m "$model" -p hi -n 1 -q --kv-store "unix://$sock" \
        > "$tmp/empty.out" 2> "$tmp/empty.err" && fail "an empty KVCACHE_REDIS_PASSWORD passed"
    grep -q "KVCACHE_REDIS_PASSWORD is set but empty" "$tmp/empty.err" ||
        fail "empty password: $(cat "$tmp/empty.err")"
    KVCACHE_REDIS_USER=u "$kv" run -m "$model" -p hi -n 1 -q --kv-store "unix://$sock" \
        > "$tmp/user.out" 2> "$tmp/user.err" && fail "KVCACHE_REDIS_USER alone passed"
    grep -q "KVCACHE_REDIS_USER is set without KVCACHE_REDIS_PASSWORD" "$tmp/user.err" ||
        fail "a user without a password: $(cat "$tmp/user.err")"
    # the password as is (no %-encoding), for the server whose URL gives none
    export KVCACHE_REDIS_PASSWORD="$pw"
    two_runs "unix://$sock"
    [ "$(stat_of second store_errors)" -eq 0 ] || fail "store errors with the password"
    # a URL's own (wrong) password wins over the environment's
    run own --kv-store "unix://:wrong@$sock"
    [ "$(stat_of own store_errors)" -gt 0 ] || fail "the URL's wrong password was not used"
    unset KVCACHE_REDIS_PASSWORD
    ;;
dir_full)
    # files may hold 64 KiB, a page object 368 KiB: every write fails
    # (EFBIG), the run is unchanged, counts the errors and warns of them
    run ref
    (trap '' XFSZ; ulimit -f 128; exec "$kv" run -m "$model" -f "$tmp/prompt.txt" -n 6 -t 2 -q \
        --json-stats --kv-store "dir:$tmp/full" > "$tmp/full.out" 2> "$tmp/full.err") ||
        fail "full: exit status $?"
    cmp -s "$tmp/ref.out" "$tmp/full.out" || fail "output with a full disk differs"
    [ "$(stat_of full store_errors)" -gt 0 ] || fail "no store errors counted"
    grep -q "^kvcache: run: warning: --kv-store: [1-9][0-9]* tier calls failed (the last: dir tier.*[Ff]ile too large)" "$tmp/full.err" ||
        fail "the failed writes were not warned about with their reason: $(cat "$tmp/full.err")"
    [ "$(stat_of full store_bytes_written)" -eq 0 ] || fail "bytes written to a full disk"
    find "$tmp/full" -name '*.kvp' | grep -q . && fail "an object is visible"
    find "$tmp/full/tmp" -type f | grep -q . && fail "a temporary file is left"
    echo "dir_full: $(stat_of full store_errors) failed writes, output unchanged"
    ;;
events_fail)
    # the store opens (making its directory), then --kv-events fails: the
    # run fails and leaves no directory; one that existed keeps its files
    mkdir "$tmp/old" && echo mine > "$tmp/old/mine" || fail "cannot set up"
    "$kv" run -m "$model" -p hi -n 1 -q --kv-store "dir:$tmp/new" --kv-store "dir:$tmp/old" \
        --kv-events "bogus://x" > "$tmp/ev.out" 2> "$tmp/ev.err" && fail "a bad endpoint passed"
    grep -q -- "--kv-events" "$tmp/ev.err" || fail "no --kv-events message"
    [ ! -e "$tmp/new" ] || fail "dir:$tmp/new was left behind"
    [ ! -e "$tmp/old/tmp" ] || fail "dir:$tmp/old/tmp was left behind"
    [ "$(cat "$tmp/old/mine")" = mine ] || fail "a file of an existing directory changed"
    echo "events_fail: nothing left behind"
    ;;
*) fail "unknown case" ;;
esac
exit 0
