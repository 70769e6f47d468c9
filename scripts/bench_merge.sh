#!/usr/bin/env bash
# Memory benchmark of the merge: `make merge` vs `python -m verl.model_merger merge` on one
# 8-rank checkpoint of a ~1B model (written first, if absent, by real gloo processes through verl's saver).
# usage: scripts/bench_merge.sh [WORK_DIR] [--repeat N] [--layers L]   (WORK_DIR default: a temp dir)
# Needs about 12 GB of disk (3.7 GB of shards, two merged models) and 6 GB of RAM.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
if [[ $# -gt 0 && $1 != --* ]]; then WORK=$1; shift; else WORK=$(mktemp -d -t bench_merge.XXXXXX); fi
mkdir -p "$WORK"
exec "$PYTHON" scripts/bench_merge.py "$WORK" "$@"
