"""Benchmark of `python -m app report` on a long GRPO run: how long, how much memory.

    python scripts/bench_report.py --steps 3000 --attempts 3 --repeat 3

builds, in a temporary directory, a run whose logs/ holds --attempts JSONL files in verl's FileLogger
format (each later attempt resumed 50 steps before the previous one stopped, as after a crash between
checkpoints), with the ~70 metric names verl 0.9.1's GRPO trainer logs per step, then runs
`python -m app report RUN` --repeat times as a user would (a fresh process each time) and prints wall
time, CPU time and peak RSS of each run. Nothing is downloaded; the log is built from numbers alone.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TIMING = ["gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "update_weights", "step"]


def grpo_step(step: int, rng: random.Random) -> dict:
    """One step with the metric names of verl/trainer/ppo/metric_utils.py and the v1 trainer."""
    progress = 1 - math.exp(-step / 800)
    data = {"training/global_step": step, "training/epoch": step // 500}
    for name in ("pg_loss", "kl_loss", "kl_coef", "entropy", "grad_norm", "pg_clipfrac", "pg_clipfrac_lower",
                 "ppo_kl", "lr", "entropy_loss"):
        data[f"actor/{name}"] = rng.gauss(0.1, 0.02)
    for group in ("score", "rewards", "advantages", "returns"):
        for stat in ("mean", "max", "min"):
            data[f"critic/{group}/{stat}"] = rng.gauss(0.3 + 0.5 * progress, 0.05)
    for group in ("response_length", "response_length_non_aborted", "prompt_length"):
        for stat in ("mean", "max", "min", "clip_ratio"):
            data[f"{group}/{stat}"] = rng.gauss(300 - 100 * progress, 20) if stat != "clip_ratio" else 0.01
    data["response/aborted_ratio"] = 0.0
    for stat in ("mean", "max", "min"):
        data[f"num_turns/{stat}"] = data[f"training/num_turns/{stat}"] = 2
    for name in TIMING:
        data[f"timing_s/{name}"] = rng.uniform(2, 30)
    for name in ("gen", "ref", "adv", "update_actor"):
        data[f"timing_per_token_ms/{name}"] = rng.uniform(0.01, 0.1)
    data.update({"perf/total_num_tokens": 400_000, "perf/time_per_step": data["timing_s/step"],
                 "perf/throughput": rng.gauss(1800, 50), "perf/mfu/actor": 0.35,
                 "perf/max_memory_allocated_gb": 60.0, "perf/max_memory_reserved_gb": 70.0,
                 "perf/cpu_memory_used_gb": 200.0, "global_seqlen/mean": 40_000})
    if step % 10 == 0:
        data["val-core/openai/gsm8k/reward/mean@1"] = 0.4 + 0.4 * progress
    return data


def build_run(run: Path, steps: int, attempts: int) -> int:
    from tqdm import tqdm

    rng = random.Random(0)
    (run / "logs").mkdir(parents=True)
    per = math.ceil(steps / attempts)
    start, lines = 1, 0
    for a in range(attempts):
        end = steps if a == attempts - 1 else start + per + 49
        with open(run / "logs" / f"metrics-20260101T{a:02d}0000Z.jsonl", "w") as handle:
            for step in tqdm(range(start, end + 1), desc=f"attempt {a + 1}", unit="step"):
                handle.write(json.dumps({"step": step, "data": grpo_step(step, rng)}) + "\n")
                lines += 1
        start = end - 49  # resumed from a checkpoint 50 steps back
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--attempts", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-report-") as tmp:
        run = Path(tmp) / "grpo-run"
        lines = build_run(run, args.steps, args.attempts)
        size = sum(p.stat().st_size for p in (run / "logs").iterdir())
        print(f"log: {args.attempts} attempts, {lines} lines, {size / 2**20:.1f} MiB, {args.steps} distinct steps")
        print("| run | wall (s) | user + sys CPU (s) | peak RSS (MiB) |")
        print("|----:|---------:|-------------------:|---------------:|")
        for i in range(1, args.repeat + 1):
            # each run in a fresh child: RUSAGE_CHILDREN's maxrss is the largest child so far, so fork a
            # measuring wrapper per run to read only that run's peak
            wrapper = ("import resource, subprocess, sys, time; t = time.time(); "
                       "rc = subprocess.call(sys.argv[1:], stdout=subprocess.DEVNULL); "
                       "u = resource.getrusage(resource.RUSAGE_CHILDREN); "
                       "print(time.time() - t, u.ru_utime, u.ru_stime, u.ru_maxrss, rc)")
            out = subprocess.run([sys.executable, "-c", wrapper, sys.executable, "-m", "app", "report", str(run)],
                                 cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                                 text=True, check=True).stdout.split()
            wall, user, system, rss, rc = float(out[0]), float(out[1]), float(out[2]), int(out[3]), int(out[4])
            if rc != 0:
                print(f"report failed with exit code {rc}", file=sys.stderr)
                return 1
            print(f"| {i} | {wall:.2f} | {user:.2f} + {system:.2f} | {rss / 1024:.0f} |")
        summary = (run / "report" / "summary.txt").read_text().splitlines()
        print("summary.txt:", summary[2], "/", " ".join(sorted(p.name for p in (run / "report").iterdir())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
