#!/bin/sh
# Runs a command (the store_redis suite) against throw-away redis-servers:
# two on Unix sockets and one on a free TCP port of 127.0.0.1, all in a
# temporary directory that is removed afterwards. Exports:
#   KVC_TEST_REDIS, KVC_TEST_REDIS2  unix:///DIR/redis.sock, .../redis2.sock
#   KVC_TEST_REDIS_TCP               redis://127.0.0.1:PORT
#   KVC_TEST_REDIS_SERVER            the redis-server binary (tests start more)
#   KVC_TEST_REDIS_DIR               the temporary directory
# Exits with the command's status; a missing redis-server is a failure.
# Usage: sh tests/with_redis.sh COMMAND [ARG...]

set -u

server=$(command -v redis-server) || server=
cli=$(command -v redis-cli) || cli=
if [ -z "$server" ] || [ -z "$cli" ]; then
    echo "with_redis.sh: redis-server not found (Debian: redis-server; scripts/setup.sh installs it)" >&2
    exit 1
fi
[ $# -gt 0 ] || { echo "usage: with_redis.sh COMMAND [ARG...]" >&2; exit 2; }

dir=$(mktemp -d "${TMPDIR:-/tmp}/kvc-redis.XXXXXX") || exit 1
pids=
cleanup() {
    for p in $pids; do kill "$p" 2>/dev/null; done
    for p in $pids; do wait "$p" 2>/dev/null; done
    pids=
    rm -rf "$dir"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM HUP

# start NAME [ARGS...]: a server on $dir/NAME.sock (plus ARGS), its pid in
# $pid; 0 once it answers PING on the socket, 1 if it died or ~5 s passed.
start() {
    name=$1
    shift
    "$server" --unixsocket "$dir/$name.sock" --unixsocketperm 700 --port 0 --save '' \
        --appendonly no --daemonize no --dir "$dir" --logfile "$dir/$name.log" "$@" &
    pid=$!
    pids="$pids $pid"
    i=0
    while [ $i -lt 50 ]; do
        kill -0 "$pid" 2>/dev/null || return 1
        [ "$("$cli" -s "$dir/$name.sock" ping 2>/dev/null)" = PONG ] && return 0
        sleep 0.1
        i=$((i + 1))
    done
    return 1
}

fail() {
    echo "with_redis.sh: $1" >&2
    for f in "$dir"/*.log; do [ -f "$f" ] && tail -5 "$f" >&2; done
    exit 1
}

start redis || fail "redis-server did not start on $dir/redis.sock"
start redis2 || fail "redis-server did not start on $dir/redis2.sock"

# Redis needs an explicit TCP port: try some until one binds. The server
# exits when its port is taken, before it opens its socket, so a PONG on
# our socket means it holds the port (not some other server on it).
port=16379
tcp_ok=
while [ $port -lt 16479 ]; do
    if start redis_tcp --port $port --bind 127.0.0.1; then
        tcp_ok=1
        break
    fi
    port=$((port + 1))
done
[ -n "$tcp_ok" ] || fail "no redis-server could listen on 127.0.0.1:16379..16478"

KVC_TEST_REDIS="unix://$dir/redis.sock"
KVC_TEST_REDIS2="unix://$dir/redis2.sock"
KVC_TEST_REDIS_TCP="redis://127.0.0.1:$port"
KVC_TEST_REDIS_SERVER=$server
KVC_TEST_REDIS_DIR=$dir
export KVC_TEST_REDIS KVC_TEST_REDIS2 KVC_TEST_REDIS_TCP KVC_TEST_REDIS_SERVER KVC_TEST_REDIS_DIR

"$@"
status=$?
cleanup
exit $status
