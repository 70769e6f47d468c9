"""Run one training command, time its logged steps, stop it after --steps, print one summary line.

    python scripts/bench_run.py --label stock --steps 4 --log runs/x.log -- torchrun ... verl.trainer.sft_trainer ...

verl's console logger prints `step:N - key:value - ...` once per step, but SFT logs no step time, so
each line is stamped on arrival here and tokens/s is the step's train/global_tokens over the time
since the previous step line. The first --warmup steps (default 1: compile and warm-up) are left out
of the means; a later step can still recompile for a new shape (torch.compile's dynamic shapes), so a
steady-state reading times from step 3 on (--warmup 2).
The command runs in its own process session and that session is ended after step --steps, so a
benchmark does not pay for verl's end-of-training checkpoint. The summary is one JSON line starting
with `BENCH ` (scripts/bench_sft.sh and bench_grpo.sh collect those).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file from any directory
from app.node import gpus  # noqa: E402
from app.timeline import step_metrics  # noqa: E402  (one reader of verl's step line, with the launch's)


def cpu_model() -> str | None:
    """This machine's CPU as /proc/cpuinfo names it; None where it does not."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), None)
    except OSError:
        return None


def machine() -> dict:
    """What ran it: two H100s of one kind took 142 and 217 s to a warm first step (docs/benchmarks.md, runs 71-72),
    so a record says which CPU and GPU it had."""
    facts: dict = {"cores": os.cpu_count(), "cpu": cpu_model()}
    found = gpus(None)  # preflight's reading of the driver (nvidia-smi, else /proc): never fails the run
    if found.count is not None:
        facts["gpus"] = [row["name"] for row in found.rows]
    return facts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", required=True)
    parser.add_argument("--steps", type=int, default=4, help="stop after this step is logged")
    parser.add_argument("--log", required=True, help="full output goes here")
    parser.add_argument("--warmup", type=int, default=1, help="steps left out of the means (at least 1)")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--tokens-key", default="train/global_tokens")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    warmup = max(args.warmup, 1)  # each step is timed from the previous step line, so step 1 never is

    host = machine()  # before the clock starts
    start = time.monotonic()
    steps: list[tuple[int, float, dict]] = []
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    stopped = "exited"

    def end_run(reason: str) -> None:  # the deadline fires even while the command prints nothing
        nonlocal stopped
        if proc.poll() is None:
            stopped = reason
            os.killpg(proc.pid, signal.SIGTERM)  # our own session: torchrun / Ray and their workers

    deadline = threading.Timer(args.timeout, end_run, ("timeout",))
    deadline.daemon = True
    deadline.start()
    # a SIGTERM from outside (the caller's own time limit) still gets the summary of the steps so far
    signal.signal(signal.SIGTERM, lambda *_: end_run("terminated"))
    with open(args.log, "w", encoding="utf-8") as log:
        for line in proc.stdout:
            now = time.monotonic() - start
            log.write(f"[{now:8.2f}] {line}")
            step = step_metrics(line)
            if step:
                steps.append((step[0], now, step[1]))
                print(f"[{args.label} {now:7.1f}s] {line.strip()[:400]}", flush=True)
                if step[0] >= args.steps:
                    stopped = "stopped after the last timed step"
                    break
    deadline.cancel()
    if proc.poll() is None:
        end_run(stopped)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    summary: dict = {"label": args.label, "steps": len(steps), "warmup": warmup, "end": stopped,
                     "rc": proc.returncode, "wall_s": round(time.monotonic() - start, 1), "host": host}
    timed = [(n, t, m, t - steps[i - 1][1]) for i, (n, t, m) in enumerate(steps) if i >= warmup]
    if timed:
        tokens = sum(m.get(args.tokens_key, 0.0) for _, _, m, _ in timed)
        seconds = sum(dt for *_, dt in timed)
        summary["step_s"] = round(seconds / len(timed), 2)
        if tokens:
            summary["tokens_per_s"] = round(tokens / seconds, 1)
        for key in ("train/mfu", "perf/mfu/actor", "perf/throughput", "timing_s/gen", "timing_s/old_log_prob",
                    "timing_s/ref", "timing_s/update_actor", "timing_s/step", "perf/max_memory_allocated_gb"):
            values = [m[key] for _, _, m, _ in timed if key in m]
            if values:
                summary[key] = round(sum(values) / len(values), 4)
    if steps:
        summary["loss"] = [round(m["train/loss"], 4) for _, _, m, in steps if "train/loss" in m]
        summary["first_step_s"] = round(steps[0][1], 1)
        # step 1's own split, every timer verl logs (update_weights too): where the start-up's first step goes
        summary["first_step_timing"] = {k: round(v, 2) for k, v in steps[0][2].items() if k.startswith("timing_s/")}
    print("BENCH " + json.dumps(summary), flush=True)
    return 0 if len(steps) >= min(args.steps, warmup + 1) else 1


if __name__ == "__main__":
    sys.exit(main())
