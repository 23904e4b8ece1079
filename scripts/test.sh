#!/usr/bin/env bash
# Sets up, builds and runs every test (C suites and Python tests) with ctest,
# then lists every skip of the run with its verdict: each suite checks its
# skips against tests/expected_skips.txt and fails on an unexpected one, but
# ctest shows the output of failed tests only.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BUILD_DIR=${BUILD_DIR:-build}
status=0
ctest --test-dir "$BUILD_DIR" --output-on-failure -j 2 || status=$?
log="$BUILD_DIR/Testing/Temporary/LastTest.log"
if [ -f "$log" ]; then
    echo "== skips (C suites, pytest; checked against tests/expected_skips.txt) =="
    grep -E '^(skipped|path not run) \(' "$log" || echo "none"
fi
exit "$status"
