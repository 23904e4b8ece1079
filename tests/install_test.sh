#!/usr/bin/env bash
# Installs the build into a temporary prefix and builds a consumer with
# pkg-config and with CMake's find_package, statically and dynamically: the
# install rules, kvcache.pc and the CMake package config work.
set -euo pipefail
build=$1; src=$2
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
pcdir=$(dirname "$(find "$tmp/prefix" -name kvcache.pc | head -1)")
cat > "$tmp/use.c" <<'C'
#include <stdio.h>
#include <kvcache/kvcache.h>
int main(void) {
    float x = 1.5f; uint16_t h;
    if (kvc_convert(&x, KVC_F32, &h, KVC_F16, 1) != KVC_OK || h != 0x3e00) return 1;
    printf("kvcache %s isa %s\n", kvc_version_string(), kvc_isa_name(kvc_get_isa()));
    return 0;
}
C
flags=$(PKG_CONFIG_PATH="$pcdir" pkg-config --cflags --libs kvcache)
libdir=$(PKG_CONFIG_PATH="$pcdir" pkg-config --variable=libdir kvcache)
cc -std=c11 "$tmp/use.c" -o "$tmp/use_shared" $flags -Wl,-rpath,"$libdir"
"$tmp/use_shared"
cc -std=c11 "$tmp/use.c" -o "$tmp/use_static" $(PKG_CONFIG_PATH="$pcdir" pkg-config --cflags kvcache) \
    "$libdir/libkvcache.a" -lpthread -lm
"$tmp/use_static"
test -x "$tmp/prefix/bin/kvcache"
# find_package(kvcache): a CMake consumer of each imported target
if command -v cmake >/dev/null; then
    mkdir "$tmp/cm"
    cp "$tmp/use.c" "$tmp/cm/use.c"
    cat > "$tmp/cm/CMakeLists.txt" <<'CM'
cmake_minimum_required(VERSION 3.20)
project(use_kvcache C)
find_package(kvcache 0.1 REQUIRED)
add_executable(use_shared use.c)
target_link_libraries(use_shared PRIVATE kvcache::kvcache)
add_executable(use_static use.c)
target_link_libraries(use_static PRIVATE kvcache::kvcache_static)
CM
    # the consumer is a plain build: no sanitizer flags from the environment
    # (no rpath given: CMake's build rpath for the imported library must do)
    env -u CFLAGS -u LDFLAGS cmake -S "$tmp/cm" -B "$tmp/cm/build" \
        -DCMAKE_PREFIX_PATH="$tmp/prefix" >/dev/null
    cmake --build "$tmp/cm/build" >/dev/null
    "$tmp/cm/build/use_shared"
    "$tmp/cm/build/use_static"
    # each target links what it names: the shared one needs libkvcache.so,
    # the static one must not
    if command -v readelf >/dev/null; then
        readelf -d "$tmp/cm/build/use_shared" | grep -q 'NEEDED.*libkvcache'
        if readelf -d "$tmp/cm/build/use_static" | grep -q 'NEEDED.*libkvcache'; then
            echo "use_static needs libkvcache.so" >&2
            exit 1
        fi
    fi
fi
# The Python package as pip installs it (python/pyproject.toml), outside the
# repository, finding the installed library through the loader's path.
if command -v python3 >/dev/null && python3 -c 'import numpy' 2>/dev/null; then
    mkdir "$tmp/pysrc"   # pip builds in the source tree: build a copy
    cp -r "$src/python/kvcache" "$src/python/pyproject.toml" "$tmp/pysrc/"
    # with setuptools and wheel at hand, no download of the build backend
    iso=(); python3 -c 'import setuptools, wheel' 2>/dev/null && iso=(--no-build-isolation)
    python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore \
        "${iso[@]}" --no-deps --target "$tmp/py" "$tmp/pysrc"
    (cd "$tmp" && env -u KVCACHE_LIBRARY PYTHONPATH="$tmp/py" LD_LIBRARY_PATH="$libdir" \
        python3 -c '
import sys, kvcache, numpy as np
assert kvcache.__file__.startswith(sys.argv[1]), kvcache.__file__
x = np.arange(8, dtype=np.float32)
assert (kvcache.convert(x, np.float16) == x).all()
print("python package", kvcache.__version__, "loads", kvcache.library_path, kvcache.get_isa())
' "$tmp/py")
fi
echo "install: 1 passed, 0 failed"
