#!/usr/bin/env bash
# Benchmark of `make prep` on the full bundled GSM8K (8,792 rows -> 4 parquet files, self-checked):
# wall time and peak memory per run, into a throw-away DATA_DIR. Results go to docs/benchmarks.md.
# Usage: scripts/bench_prep.sh [RUNS]   (default 3; RUNTIME defaults to local here)
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "machine: $(nproc) CPU cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs))," \
     "$(free -g | awk '/^Mem:/ {print $2}') GiB RAM; RUNTIME=${RUNTIME:-local}"
for i in $(seq "$runs"); do
  rm -rf "$work/data"
  # GNU time: elapsed, user and system CPU seconds, peak resident memory (KiB) of the largest process
  /usr/bin/time -f '%e %U %S %M' -o "$work/time" make -s prep RUNTIME="${RUNTIME:-local}" \
    DATA_DIR="$work/data" GSM8K_SOURCE= >"$work/log" 2>&1 || { cat "$work/log"; exit 1; }
  read -r wall user sys rss < <(tail -1 "$work/time")
  printf 'run %d: %s s wall, %s s user + %s s sys CPU, peak RSS %d MiB\n' "$i" "$wall" "$user" "$sys" "$((rss / 1024))"
done
grep '^wrote' "$work/log"
du -ch "$work"/data/*/*.parquet | tail -1 | awk '{print "total parquet size: " $1}'
