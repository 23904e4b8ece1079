#!/bin/sh
# Runs a command for ctest with stderr joined to stdout, then prints its exit
# status last as "exit: N". ctest ignores the status of a test that has a
# PASS_REGULAR_EXPRESSION, so the CLI tests put the status in that regex
# (kvc_cli_test in tests/CMakeLists.txt): one match checks output and status.
#   usage: cli_status.sh [--needs-model PATH] COMMAND [ARGS...]
# --needs-model: exit 77 (ctest: skipped) when PATH is absent and KVC_NO_MODEL
# is set (scripts/setup.sh then does not fetch the model); absent without it
# is a failure, like any other unexpected skip (tests/expected_skips.txt).
if [ "$1" = --needs-model ]; then
    if [ ! -f "$2" ]; then
        if [ -n "${KVC_NO_MODEL:-}" ]; then
            echo "skipped: the default model is absent and KVC_NO_MODEL is set"
            exit 77
        fi
        echo "the default model $2 is absent: run scripts/fetch_model.sh (or set KVC_NO_MODEL=1)"
        exit 1
    fi
    shift 2
fi
"$@" 2>&1
echo "exit: $?"
