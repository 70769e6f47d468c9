#!/usr/bin/env bash
# Benchmark of preflight + plan: `DRY_RUN=1 python -m app sft|grpo-head` (compose the profile over verl's
# packaged config, every preflight check, both GSM8K parquet files read and checked, the plan printed),
# plus `python -m app check grpo` (the GRPO dry run and the check both run verl's own validate_config), and the part
# of preflight a real grpo-head runs before it starts its Ray head.
# Inputs: the full bundled GSM8K (make prep) and a tiny local model, both in a throw-away directory.
# Usage: scripts/bench_preflight.sh [RUNS]   (default 5). Results go to docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-5}
python=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "machine: $(nproc) CPU cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs))," \
     "$(free -g | awk '/^Mem:/ {print $2}') GiB RAM; load average: $(cut -d' ' -f1-3 /proc/loadavg)"
DATA_DIR="$work/data" GSM8K_SOURCE="" "$python" -m app prep gsm8k >/dev/null
"$python" -m app tiny-model "$work/model" >/dev/null 2>&1
export DATA_DIR="$work/data" MODEL_PATH="$work/model" CKPT_DIR="$work/run" NNODES=1 GPUS_PER_NODE=1
# the token counts' cache (app.data.cached_lengths) starts empty: each command's run 1 counts, later runs read it
export XDG_CACHE_HOME="$work/cache"

measure() {  # label, then the command; GNU time: elapsed, user and system CPU, peak RSS (KiB)
  local label=$1
  shift
  for i in $(seq "$runs"); do
    /usr/bin/time -f '%e %U %S %M' -o "$work/time" "$@" >"$work/log" 2>&1 || { cat "$work/log"; exit 1; }
    read -r wall user sys rss < <(tail -1 "$work/time")
    printf '%-28s run %d: %5s s wall, %5s s user + %4s s sys CPU, peak RSS %d MiB\n' \
      "$label" "$i" "$wall" "$user" "$sys" "$((rss / 1024))"
  done
}
measure "DRY_RUN=1 sft" env DRY_RUN=1 "$python" -m app sft
measure "DRY_RUN=1 grpo-head" env DRY_RUN=1 "$python" -m app grpo-head
measure "check grpo (+verl validate)" "$python" -m app check grpo
# what a real grpo-head runs before its Ray head starts (the prompts' count and verl's own checks then run beside it)
measure "grpo-head's preflight" "$python" -c "from app.settings import load; from app.preflight import preflight; preflight('grpo', load(), count=False)"
[ ! -e "$work/run" ] && echo "dry runs left no run directory behind"
# what the time goes to: the heavy imports each dry run makes (the data checks count tokens with transformers,
# which imports torch; GRPO's adds verl's validate_config)
for command in sft grpo-head; do
  DRY_RUN=1 "$python" - "$command" <<'PY'
import contextlib, io, sys
from app.__main__ import main
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    assert main([sys.argv[1]]) == 0, sys.argv[1]
heavy = [name for name in ("pandas", "pyarrow.dataset", "transformers", "torch", "ray", "verl") if name in sys.modules]
print(f"DRY_RUN=1 {sys.argv[1]} imports, of pandas, pyarrow.dataset, transformers, torch, ray, verl: {', '.join(heavy) or 'none'}")
PY
done
