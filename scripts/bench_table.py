"""Side-by-side table of BENCH lines (scripts/bench_run.py summaries) read from stdin, each config's
tokens/s as a multiple of the --base config's."""

from __future__ import annotations

import argparse
import json
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base", default="stock")
    parser.add_argument("--extra", nargs="*", default=[], help="more summary keys to show")
    args = parser.parse_args()
    rows = [json.loads(line.removeprefix("BENCH ")) for line in sys.stdin if line.strip()]
    base = next((r.get("tokens_per_s") for r in rows if r.get("label") == args.base), None)
    head = f"{'config':14s} {'tokens/s':>10s} {'x ' + args.base:>9s} {'mfu':>6s} {'step s':>7s} {'mem GB':>7s}"
    print(head + "".join(f" {k.split('/')[-1]:>12s}" for k in args.extra) + "  loss per step")
    for r in rows:
        tps = r.get("tokens_per_s")
        ratio = f"{tps / base:.2f}" if tps and base else "-"
        mfu = r.get("train/mfu") or r.get("perf/mfu/actor") or 0
        line = (f"{r['label']:14s} {tps or 0:10.0f} {ratio:>9s} {mfu:6.3f} {r.get('step_s', 0):7.2f} "
                f"{r.get('perf/max_memory_allocated_gb') or 0:7.1f}")
        line += "".join(f" {r.get(k, 0):12.2f}" for k in args.extra)
        print(line + f"  {r.get('loss', '')} ({r.get('end')}, {r.get('steps')} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
