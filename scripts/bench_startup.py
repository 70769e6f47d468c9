"""GRPO's start-up on this CPU machine, up to verl's TaskRunner (or SFT's, up to verl's trainer imported in its
rank): this tree against REF, in the same run.

    python scripts/bench_startup.py [--job grpo|sft] [--ref REF] [--runs N] [--cold]   (default: grpo, HEAD~1, 3 runs
                                                                                     each, alternating)

Each run is a real `python -m app grpo-head` (a Ray head on 127.0.0.1, the full bundled GSM8K, a tiny model) with
verl's own driver, verl.trainer.main_ppo, under another module name: preflight refuses the real name on a node
without GPUs, and that check is not what is timed. Each output line is stamped on arrival; the run is stopped with
SIGTERM at the TaskRunner's first line (on CPU, verl's GPU workers never come up), and must then leave no process
of its Ray instance or its run behind. Prints a table and one `BENCH {json}` line per run (docs/bench/*.jsonl).
REF is checked out as a git worktree beside this one's temp files and removed afterwards. --cold: each start with an
empty cache of the prompts' token counts (XDG_CACHE_HOME of its own), as a node's first run of its data.
--job sft: a real `python -m app sft` (torchrun, one CPU rank, the bundled GSM8K's SFT file) whose rank runs a module
that imports verl's SFT trainer (verl.trainer.sft_trainer, under another name for the same reason) and prints a line
instead of training: the start is timed up to that line, and the launch must then finish and leave nothing running.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from bench_run import cpu_model  # this directory: run as a file

REPO = Path(__file__).resolve().parents[1]
# in the order they come; the driver joins in verl's main, or before it in app.gate --ray (RAY_WARM_WORKERS), where
# Ray's own line says it
IMPORTED = "verl's SFT trainer imported"  # what --job sft's stand-in module prints once it has imported the trainer
MARKS = {"grpo": {"cluster ready": ("cluster ready:",),
                  "driver's ray.init": ("ray init kwargs:", "Connected to Ray cluster"), "TaskRunner up": ("(TaskRunnerV1",)},
         "sft": {"trainer imported": (IMPORTED,)}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_start(tree: Path, work: Path, log: Path, cold: bool, job: str) -> dict[str, float]:
    ray_tmp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: Ray's socket paths
    cache = {"XDG_CACHE_HOME": tempfile.mkdtemp(prefix="cache", dir=work)} if cold else {}
    env = {**os.environ, "DATA_DIR": str(work / "data"), "MODEL_PATH": str(work / "model"),
           "CKPT_DIR": str(work / "run"), "NNODES": "1", "GPUS_PER_NODE": "1", "RAY_TMPDIR": str(ray_tmp),
           "HEAD_IP": "127.0.0.1", "RAY_PORT": str(free_port()), "GRPO_TRAINER_MODULE": "verl_driver",
           "SFT_TRAINER_MODULE": "verl_sft", "MASTER_PORT": str(free_port()),
           "RAY_START_ARGS": "--num-gpus 1 --num-cpus 4 --include-dashboard false", "FRESH": "1",
           "PYTHONPATH": f"{work}{os.pathsep}{tree}", "PYTHONUNBUFFERED": "1", **cache}
    marks, last = MARKS[job], list(MARKS[job])[-1]
    seen: dict[str, float] = {}
    stopped = False
    start = time.monotonic()
    app = subprocess.Popen([sys.executable, "-m", "app", "grpo-head" if job == "grpo" else "sft"], cwd=tree, env=env,
                           text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, errors="replace")
    with open(log, "w") as out:
        for line in app.stdout:
            now = time.monotonic() - start
            out.write(f"{now:7.2f} {line}")
            for mark, texts in marks.items():
                if mark not in seen and any(text in line for text in texts):
                    seen[mark] = round(now, 2)
                if mark not in seen:
                    break  # a later mark counts only once this one is seen
            if job == "grpo" and last in seen and not stopped:
                app.send_signal(signal.SIGTERM)  # once, as `docker stop` does: the launch stops what it started
                stopped = True
    code = app.wait(timeout=300)
    left = [p.pid for p in psutil.process_iter(["cmdline"])
            if any(str(d) in " ".join(p.info["cmdline"] or []) for d in (ray_tmp, work / "run"))]
    subprocess.run(["rm", "-rf", str(ray_tmp)])
    if len(seen) != len(marks) or left or (job == "sft" and code != 0):
        sys.exit(f"error: {tree}: a start reached {sorted(seen)}, exited {code} and left {left} running (see {log})")
    return seen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", choices=sorted(MARKS), default="grpo")
    parser.add_argument("--ref", default="HEAD~1")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--logs", default=None, help="keep each run's stamped output here (default: a temp dir)")
    parser.add_argument("--cold", action="store_true", help="each start without the prompts' counts cached")
    args = parser.parse_args()
    def commit(ref: str) -> str:
        return subprocess.check_output(["git", "rev-parse", "--short", ref], cwd=REPO, text=True).strip()

    trees = {f"{args.ref} ({commit(args.ref)})": None, f"this tree ({commit('HEAD')}+)": REPO}
    with tempfile.TemporaryDirectory() as temp:
        work = Path(temp)
        logs = Path(args.logs or work / "logs")
        logs.mkdir(parents=True, exist_ok=True)
        ref_tree = work / "ref"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(ref_tree), args.ref], cwd=REPO, check=True)
        trees[next(iter(trees))] = ref_tree
        try:
            python = [sys.executable, "-m", "app"]
            subprocess.run([*python, "prep", "gsm8k"], cwd=REPO, check=True, stdout=subprocess.DEVNULL,
                           env={**os.environ, "DATA_DIR": str(work / "data"), "GSM8K_SOURCE": ""})
            subprocess.run([*python, "tiny-model", str(work / "model")], cwd=REPO, check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            # verl's driver under a name preflight's GPU check lets pass on CPU
            (work / "verl_driver.py").write_text("from verl.trainer.main_ppo import main\n\nif __name__ == '__main__':"
                                                 "\n    main()\n")
            (work / "verl_sft.py").write_text(f"from verl.trainer.sft_trainer import main\n\nprint({IMPORTED!r})\n")
            machine = f"{os.cpu_count()} CPU cores ({cpu_model() or '?'}), {psutil.virtual_memory().total / 2**30:.0f} GiB RAM"
            command = f"python scripts/bench_startup.py --job {args.job} --ref {args.ref} --runs {args.runs}" \
                      f"{' --cold' if args.cold else ''}"
            print(f"machine: {machine}; load average {os.getloadavg()[0]:.2f}", flush=True)
            print(f"{'tree':28} {'run':>3} " + " ".join(f"{m:>18}" for m in MARKS[args.job]), flush=True)
            for run in range(1, args.runs + 1):
                for label, tree in trees.items():
                    seen = one_start(tree, work, logs / f"{label.split()[0]}-{run}.log", args.cold, args.job)
                    print(f"{label:28} {run:>3} " + " ".join(f"{seen[m]:>16.2f} s" for m in seen), flush=True)
                    print("BENCH " + json.dumps({"label": label, "job": args.job, "run": run,
                                                 "date": time.strftime("%Y-%m-%d"),
                                                 "machine": machine, "command": command,
                                                 **{f"{m} s": seen[m] for m in seen}}), flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(ref_tree)], cwd=REPO)
    return 0


if __name__ == "__main__":
    sys.exit(main())
