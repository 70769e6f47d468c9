"""Benchmark: counting the GRPO prompts' tokens, verl 0.9.1's way against preflight's, in one run.

verl's RLHFDataset, with data.filter_overlong_prompts on (the profile's value; verl's packaged one is off), tokenizes every prompt of the
train and val files row by row in `datasets.filter` at every start of `make grpo-head`, with
filter_overlong_prompts_workers processes (1 in verl's packaged config). Preflight now counts them once with
`app.data.prompt_lengths` (a chunk of rows per tokenizer call) and, where all fit, turns verl's filter off.
Both count the same tokens (tests/test_data.py checks it on GSM8K with the tiny tokenizer); this times them on the same files and tokenizer,
each in a fresh process, several times: verl's dataset with the filter on and off (the difference is what the
filter costs at every start) and preflight's count; one BENCH line per method, and the ratio.

    python scripts/bench_prompt_lengths.py [--model DIR] [--runs 3] [--workers 1]

Without --model it builds the tiny tokenizer of `make demo` (app/tiny.py). Data: the bundled GSM8K through
`make prep`'s code, 7,473 train + 1,319 test prompts, in a throw-away directory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# Each method in its own interpreter, timed inside from the moment its work starts (imports excluded: both
# need transformers; preflight has imported verl already, and verl's TaskRunner imports both anyway)
VERL = """
import sys, time
from omegaconf import OmegaConf
from transformers import AutoTokenizer
from verl.utils.dataset.rl_dataset import RLHFDataset
model, cache, workers, limit, filtering, *files = sys.argv[1:]
tokenizer = AutoTokenizer.from_pretrained(model)
start = time.perf_counter()
kept = [len(RLHFDataset(f, tokenizer, OmegaConf.create({"cache_dir": cache, "max_prompt_length": int(limit),
         "filter_overlong_prompts": filtering == "on", "filter_overlong_prompts_workers": int(workers)})))
        for f in files]
print(time.perf_counter() - start, sum(kept))
"""
OURS = """
import sys, time
from transformers import AutoTokenizer
from app.data import prompt_lengths
model, cache, workers, limit, _, *files = sys.argv[1:]
tokenizer = AutoTokenizer.from_pretrained(model)
start = time.perf_counter()
kept = [sum(n <= int(limit) for n in prompt_lengths(f, tokenizer)) for f in files]
print(time.perf_counter() - start, sum(kept))
"""


def timed(code: str, model: Path, cache: Path, workers: int, limit: int, filtering: str,
          files: list[Path]) -> tuple[float, int]:
    out = subprocess.run([sys.executable, "-c", code, str(model), str(cache), str(workers), str(limit), filtering,
                          *map(str, files)], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO), "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"})
    if out.returncode != 0:
        sys.exit(f"error: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
    seconds, kept = out.stdout.split()[-2:]
    return float(seconds), int(kept)


def main() -> int:
    from app.data import prep_gsm8k
    from app.tiny import write_tiny_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a local model dir (its tokenizer and chat template)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=1, help="verl's data.filter_overlong_prompts_workers")
    parser.add_argument("--limit", type=int, default=512, help="data.max_prompt_length (the profile's)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        written = prep_gsm8k(None, work / "data")
        files = [written["gsm8k/train"], written["gsm8k/test"]]
        model = args.model or write_tiny_model(work / "model")
        methods = (("verl-filter-on", VERL, "on"), ("verl-filter-off", VERL, "off"), ("preflight-count", OURS, ""))
        results = {label: [] for label, _, _ in methods}
        kept = {}
        for run in range(args.runs):
            for label, code, filtering in methods:
                # a fresh cache per run: verl copies the parquet there and `datasets` caches its filter's result
                seconds, kept[label] = timed(code, model, work / f"cache-{label}-{run}", args.workers, args.limit,
                                             filtering, files)
                results[label].append(round(seconds, 3))
                print(f"{label:16s} run {run + 1}: {seconds:6.2f} s, {kept[label]} prompts within {args.limit}",
                      flush=True)
        if kept["verl-filter-on"] != kept["preflight-count"]:
            sys.exit(f"error: the two counts disagree: {kept}")
        machine = (f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), "
                   f"Python {platform.python_version()}")
        date = time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime())
        command = "python scripts/bench_prompt_lengths.py " + " ".join(sys.argv[1:])
        best = {label: min(values) for label, values in results.items()}
        for label, values in results.items():
            print("BENCH " + json.dumps({"label": label, "runs_s": values, "best_s": best[label],
                                         "kept": kept[label], "limit": args.limit, "workers": args.workers,
                                         "tokenizer": "tiny (app/tiny.py)" if args.model is None else str(args.model.name),
                                         "date": date, "machine": machine, "command": command}))
        filter_s = best["verl-filter-on"] - best["verl-filter-off"]
        print(f"verl's filter costs {filter_s:.2f} s of every start (dataset with it on minus off); preflight's count "
              f"{best['preflight-count']:.2f} s: {filter_s / best['preflight-count']:.1f}x (best of {args.runs} each, "
              f"same files and tokenizer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
