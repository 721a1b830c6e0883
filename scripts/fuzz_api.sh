#!/usr/bin/env bash
# A long, random run of the API fuzzer (tests/entrypoints/test_fuzz.py) against a real
# `loom serve` on the tiny test model, loopback only.
#
#   scripts/fuzz_api.sh [EXAMPLES]       # default 5000, shared out over the routes
#
# CI runs the same tests with ~160 derandomized examples. Here every run draws new ones;
# a failure prints the request and a @reproduce_failure blob. After the run, the counts
# of (route, status, error param) show what the examples reached.
set -euo pipefail
cd "$(dirname "$0")/.."
LOOM_FUZZ_EXAMPLES="${1:-5000}" exec python -m pytest tests/entrypoints/test_fuzz.py \
    -k "not regressions" -x -q -s -p no:cacheprovider
