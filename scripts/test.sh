#!/usr/bin/env bash
# Sets up, builds and runs every test (C suites and Python tests) with ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec ctest --test-dir "${BUILD_DIR:-build}" --output-on-failure -j 2
