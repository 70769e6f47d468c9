"""Peak memory and wall time of `make merge` (python -m app merge) against `python -m verl.model_merger
merge` on the same 8-rank checkpoint of a ~1B model, and proof that both write bit-identical tensors.

Run through scripts/bench_merge.sh. Each merge is its own process; its peak RSS is the kernel's ru_maxrss
from os.wait4 (the largest process of its tree over its whole life, no sampling), its wall time the clock
around it, its CPU time user + sys from the same rusage. The two are run alternately, REPEAT times each,
so page-cache warmth favours neither.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def timed(cmd: list[str], log: Path) -> tuple[float, int, float]:
    """(wall seconds, peak RSS bytes, user + sys CPU seconds) of one command, which must succeed."""
    with open(log, "w") as handle:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} failed ({proc.returncode}): see {log}")
    return wall, usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime  # Linux reports ru_maxrss in KiB


def compare(a: Path, b: Path) -> int:
    """Number of tensors compared; exits unless names, dtypes and every value are identical."""
    import torch
    from safetensors import safe_open

    def index(directory: Path) -> dict[str, Path]:
        names = {}
        for path in sorted(directory.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as handle:
                names.update({name: path for name in handle.keys()})
        return names

    left, right = index(a), index(b)
    if set(left) != set(right):
        sys.exit(f"error: tensor names differ: only in {a}: {sorted(set(left) - set(right))[:5]}, "
                 f"only in {b}: {sorted(set(right) - set(left))[:5]}")
    for name in sorted(left):  # one tensor at a time: the comparison itself stays small
        with safe_open(str(left[name]), framework="pt") as x, safe_open(str(right[name]), framework="pt") as y:
            t, u = x.get_tensor(name), y.get_tensor(name)
        if t.dtype != u.dtype or t.shape != u.shape or not torch.equal(t, u):
            sys.exit(f"error: tensor {name} differs between {a} and {b}")
    for name in ("config.json", "generation_config.json"):
        if (a / name).is_file() and json.loads((a / name).read_text()) != json.loads((b / name).read_text()):
            sys.exit(f"error: {name} differs between {a} and {b}")
    return len(left)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path, help="directory for the checkpoint and the merged models")
    parser.add_argument("--preset", default="qwen2.5-1.5b")
    parser.add_argument("--layers", type=int, default=16, help="16 layers of qwen2.5-1.5b: 0.98B parameters")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    work = args.work.resolve()
    run = work / "run"
    py = sys.executable
    if not (run / "latest_checkpointed_iteration.txt").is_file():
        print(f"writing the {args.world_size}-rank checkpoint to {run} (real gloo processes, verl's saver)")
        subprocess.run([py, str(REPO / "tests" / "ckpt_factory.py"), "--preset", args.preset, "--layers",
                        str(args.layers), "--out", str(run), "--world-size", str(args.world_size), "--step", "1",
                        "--no-optimizer"], check=True, cwd=REPO)
    step = run / "global_step_1"
    shard_bytes = sum(p.stat().st_size for p in step.glob("model_world_size_*.pt"))
    commands = {
        "verl": lambda out: [py, "-m", "verl.model_merger", "merge", "--backend", "fsdp", "--local_dir", str(step),
                             "--target_dir", str(out)],
        # `make merge` as a user runs it (RUNTIME=local: the Makefile's one line into `python -m app merge`)
        "app": lambda out: ["make", "-s", "merge", "RUNTIME=local", f"PYTHON={py}", f"CKPT_DIR={run}", "STEP=1",
                            f"OUT_DIR={out}", "FORCE=1"],
    }
    results: dict[str, list[tuple[float, int, float]]] = {name: [] for name in commands}
    for i in range(args.repeat):
        for name, make in commands.items():
            out = work / f"out_{name}"
            shutil.rmtree(out, ignore_errors=True)
            wall, peak, cpu = timed(make(out), work / f"{name}-{i}.log")
            results[name].append((wall, peak, cpu))
            print(f"run {i + 1} {name:4s}: {wall:6.1f} s wall, {cpu:6.1f} s CPU, peak RSS {peak / 2**30:.2f} GiB",
                  flush=True)
    n = compare(work / "out_verl", work / "out_app")
    med = {name: tuple(statistics.median(run[i] for run in runs) for i in range(3))
           for name, runs in results.items()}
    mem_ratio = med["app"][1] / med["verl"][1]
    time_ratio = med["app"][0] / med["verl"][0]
    cpu_ratio = med["app"][2] / med["verl"][2]
    cpus = os.cpu_count()
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    print()
    print(f"machine: {platform.machine()}, {cpus} CPUs, {mem_gib:.0f} GiB RAM, {platform.platform()}")
    print(f"checkpoint: {args.preset} x {args.layers} layers, {args.world_size} ranks, "
          f"{shard_bytes / 2**30:.2f} GiB of fp32 shards")
    print("| command | wall s (median) | CPU s (median) | peak RSS GiB (median) | each run: wall s / CPU s / GiB |")
    print("|---|---:|---:|---:|---|")
    for name, label in (("verl", "python -m verl.model_merger merge"), ("app", "make merge")):
        runs = "; ".join(f"{w:.1f} / {c:.1f} / {p / 2**30:.2f}" for w, p, c in results[name])
        print(f"| `{label}` | {med[name][0]:.1f} | {med[name][2]:.1f} | {med[name][1] / 2**30:.2f} | {runs} |")
    print(f"ratio make merge / verl: peak memory {mem_ratio:.2f}x, wall time {time_ratio:.2f}x, "
          f"CPU time {cpu_ratio:.2f}x; "
          f"{n} tensors bit-identical, config.json identical")


if __name__ == "__main__":
    main()
