#!/usr/bin/env bash
# Installs what kvcache needs (only what is missing), builds it into build/
# (Release) and fetches the default model into models/ (checked by size and
# SHA-256). Safe to run again: it does nothing that is already done.
#   KVC_NO_MODEL=1  skip the model download
#   BUILD_DIR=dir  build somewhere else     CMAKE_ARGS="..."  extra cmake flags
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}

need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)
command -v ninja >/dev/null || need_apt+=(ninja-build)
command -v cc >/dev/null || need_apt+=(gcc libc6-dev)
command -v python3 >/dev/null || need_apt+=(python3 python3-pip)
# the KV store (libkvcache_store): keys and checksums, Redis, authentication,
# events; redis-server for its tests
pc_has() { pkg-config --exists "$1" 2>/dev/null; }
command -v pkg-config >/dev/null || need_apt+=(pkg-config)
pc_has libxxhash || need_apt+=(libxxhash-dev)
pc_has hiredis || need_apt+=(libhiredis-dev)
pc_has libsodium || need_apt+=(libsodium-dev)
pc_has libzmq || need_apt+=(libzmq3-dev)
pc_has msgpack || need_apt+=(libmsgpack-dev)
command -v redis-server >/dev/null || need_apt+=(redis-server)
command -v redis-cli >/dev/null || need_apt+=(redis-tools)
if [ ${#need_apt[@]} -gt 0 ]; then
    echo "setup: installing ${need_apt[*]} with apt-get"
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}"
fi

PY=$(command -v python3)
# (the tokenizer tests' reference needs a regex that knows Unicode 16.0, as the C tables do)
if ! "$PY" -c 'import numpy, ml_dtypes, pytest, gguf, regex, jinja2, zmq, msgpack, xxhash
assert regex.match(r"\p{L}", "\u1c89")' 2>/dev/null; then
    echo "setup: installing Python packages from python/requirements.txt"
    "$PY" -m pip install -q --disable-pip-version-check -r python/requirements.txt
fi

gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
    cmake -S . -B "$BUILD_DIR" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
        -DPython3_EXECUTABLE="$PY" ${CMAKE_ARGS:-} >/dev/null
fi
cmake --build "$BUILD_DIR" -j "$(nproc)"

if [ -z "${KVC_NO_MODEL:-}" ]; then
    bash scripts/fetch_model.sh >/dev/null
fi
