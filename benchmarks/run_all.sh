#!/usr/bin/env bash
# Runs the whole comparison and prints its tables (markdown) on stdout; progress on stderr.
#
#   benchmarks/run_all.sh                 # everything, about 10-15 min on a quiet 2-core machine
#   benchmarks/run_all.sh --reps 1 --models mlp --scale 0.25    # a quick check
#
# Builds what it needs (benchmark_compare, through scripts/build), then runs
# benchmarks/compare/driver.py, which runs trainkit, the branching variant, the hand-written
# LibTorch loop (build/benchmarks/compare/compare) and the Python loop (.venv/bin/python
# benchmarks/compare/loop.py), each configuration in its own process, repetitions interleaved.
# Arguments go to driver.py (--help lists them). The tables are also kept in
# $TRAINKIT_BUILD_DIR/benchmarks/compare/last_run.md (for benchmarks/RESULTS.md), the raw JSON
# lines of every process in last_run.jsonl next to it.
#
# Environment: TRAINKIT_BENCH_THREADS (default 2) intra-op threads in every implementation;
# TRAINKIT_JOBS (default 1 here) compile jobs; TRAINKIT_BUILD_DIR as for scripts/build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${TRAINKIT_BUILD_DIR:-$ROOT/build}"
TRAINKIT_JOBS="${TRAINKIT_JOBS:-1}" TRAINKIT_BUILD_DIR="$BUILD_DIR" \
  "$ROOT/scripts/build" --target benchmark_compare >&2
python3 "$ROOT/benchmarks/compare/driver.py" \
  --compare "$BUILD_DIR/benchmarks/compare/compare" --python "$ROOT/.venv/bin/python" \
  --raw "$BUILD_DIR/benchmarks/compare/last_run.jsonl" "$@" |
  tee "$BUILD_DIR/benchmarks/compare/last_run.md"
