#!/usr/bin/env bash
# Run loom against every baseline installed under $LOOM_BENCH_ENVS (default
# /work/bench-envs), interleaved and repeated; results in benchmarks/results/.
#   benchmarks/run_all.sh                     # full run (< 15 min on 2 cores)
#   benchmarks/run_all.sh --quick             # a few minutes
#   benchmarks/run_all.sh --report-only       # redo tables and plot from results/raw
# Extra flags go to run_all.py (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
exec python benchmarks/run_all.py "$@"
