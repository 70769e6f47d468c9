"""`python -m app smoke` (`make smoke`): the whole pipeline on one GPU of a fresh box, with a tiny model
built locally from a config (no downloads): prep -> tiny model -> a few SFT steps -> merge -> load and
generate. Every stage is the same CLI command a user runs (`python -m app prep gsm8k`, `... sft`,
`... merge`), started as a subprocess with smoke's own settings, so a pass means the real targets work.

Everything lives under SMOKE_DIR (default checkpoints/smoke, on the volume compose mounts):
data/ (prepared parquet), model/ (tiny random model), run/ (the SFT run: checkpoints + logs/metrics-*.jsonl),
merged/ (the Hugging Face model), smoke.json (the verdict and its figures).

Settings: SMOKE_DIR, SMOKE_STEPS (SFT steps, default 12), ARGS (extra Hydra overrides for the SFT,
appended after smoke's own), DRY_RUN=1 (print the plan and exit; works without a GPU).
"""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from app import node
from app.common import UserError, atomic_path, repo_first, say
from app.runs import LATEST_FILE, latest_step, logs_dir, step_dir
from app.settings import Settings

# Variables a user's .env / shell may carry for a real (multi-node) run; smoke sets its own or drops them.
_DROPPED = ("DRY_RUN", "TRAIN_FILE", "VAL_FILE", "STEP", "MASTER_ADDR", "MASTER_PORT", "HEAD_IP", "JOB",
            "MODEL", "RUN", "EXPERIMENT", "NODES")

# Small enough for seconds per step on any GPU, big enough that a random tiny model visibly learns.
# lr 1e-3: the profile's lr suits real models; a random 2-layer model needs a bigger one to move in 12 steps.
_SFT_OVERRIDES = [
    "data.train_batch_size=16", "data.micro_batch_size_per_gpu=4", "data.train_max_samples=512",
    "data.val_max_samples=32", "data.max_length=1024", "data.truncation=right", "data.num_workers=2",
    "optim.lr=1e-3", "optim.lr_warmup_steps_ratio=0.0",
    "trainer.logger=[console,file]", "trainer.test_freq=-1",
]


@dataclass
class Stage:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    what: str = ""


@dataclass
class Plan:
    root: Path
    steps: int
    stages: list[Stage]
    data: Path
    model: Path
    run: Path
    merged: Path


def plan(settings: Settings) -> Plan:
    """The stages smoke runs, with the exact argv and the settings each one gets."""
    root = Path(settings["SMOKE_DIR"]).expanduser().resolve()
    steps = settings["SMOKE_STEPS"]
    if steps < 4:
        raise UserError(f"SMOKE_STEPS={steps} is too few to tell whether the loss goes down: use 4 or more")
    data, model, run, merged = root / "data", root / "model", root / "run", root / "merged"
    app = [sys.executable, "-m", "app"]
    overrides = _SFT_OVERRIDES + [f"trainer.total_training_steps={steps}", f"trainer.save_freq={steps}"]
    user_args = settings.raw("ARGS")  # after smoke's own, as written: the user's win
    args = " ".join(overrides) + (f" {user_args}" if user_args else "")
    sft_env = {"MODEL_PATH": str(model), "DATA_DIR": str(data), "CKPT_DIR": str(run), "NNODES": "1",
               "NODE_RANK": "0", "GPUS_PER_NODE": "1", "FRESH": "1", "ARGS": args}
    stages = [
        Stage("prep", app + ["prep", "gsm8k"], {"DATA_DIR": str(data)}, "GSM8K -> verl parquet"),
        Stage("tiny-model", app + ["tiny-model", str(model), "--force"], {}, "random tiny Qwen2 + tokenizer"),
        Stage("sft", app + ["sft"], sft_env, f"{steps} SFT steps on 1 GPU"),
        Stage("merge", app + ["merge"], {"CKPT_DIR": str(run), "STEP": str(steps), "OUT_DIR": str(merged),
                                        "FORCE": "1"}, "FSDP shards -> Hugging Face model"),
        Stage("generate", [], {}, "load the merged model and generate"),
    ]
    return Plan(root, steps, stages, data, model, run, merged)


def child_env(stage: Stage, settings: Settings) -> dict[str, str]:
    """The environment of a stage: the caller's (with .env), minus real-run settings, plus the stage's own."""
    environ = settings.environ()
    out = {k: v for k, v in environ.items() if k not in _DROPPED}
    # Keep the repo importable in the child whatever the cwd (GPU boxes run PYTHONPATH=/some/site).
    out["PYTHONPATH"] = repo_first(environ.get("PYTHONPATH", ""))
    visible = settings["CUDA_VISIBLE_DEVICES"]  # one GPU, so the preflight's GPU count matches GPUS_PER_NODE=1
    out["CUDA_VISIBLE_DEVICES"] = "0" if visible is None else visible.split(",")[0]
    out.update(stage.env)
    return out


def print_plan(p: Plan) -> None:
    say(f"smoke plan (everything under {p.root}):")
    for i, stage in enumerate(p.stages, 1):
        say(f"  [{i}/{len(p.stages)}] {stage.name}: {stage.what}")
        if stage.argv:
            settings = " ".join(f"{k}={shlex.quote(v)}" for k, v in stage.env.items())
            say(f"      {settings + ' ' if settings else ''}{shlex.join(stage.argv)}")
        else:
            say(f"      in-process: transformers load of {p.merged}, greedy generate on a GSM8K test prompt")
    say(f"  then check: train/loss goes down in {p.run}/logs/metrics-*.jsonl, "
        f"{p.run}/global_step_{p.steps}/ holds the rank-0 shard, the merged model differs from the initial one")


def gpu_count(settings: Settings) -> int:
    return node.gpus(settings["CUDA_VISIBLE_DEVICES"]).count or 0


# --- checks (pure functions over real files, tested on CPU) -------------------------------------------

def read_losses(run: Path) -> list[tuple[int, float]]:
    """(step, train/loss) pairs from verl's file logger JSONL (`{"step": N, "data": {...}}` per line)."""
    logs = sorted(logs_dir(run).glob("metrics-*.jsonl"))
    if not logs:
        raise UserError(f"no metrics log in {run / 'logs'}: the SFT wrote no JSONL; check that "
                        "trainer.logger includes 'file' (ARGS must not replace it)")
    losses: dict[int, float] = {}
    for log in logs:  # in time order: a later attempt's value for a step wins
        for line in log.read_text().splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            value = record.get("data", {}).get("train/loss")
            if value is not None:
                losses[int(record["step"])] = float(value)
    return sorted(losses.items())


def loss_went_down(losses: list[tuple[int, float]]) -> tuple[float, float]:
    """Mean train/loss of the first and last quarter of steps; raises unless the last is clearly lower."""
    if len(losses) < 4:
        raise UserError(f"only {len(losses)} train/loss values logged: smoke needs at least 4 steps to judge "
                        "the loss; look at the SFT output above")
    values = [v for _, v in losses]
    if not all(math.isfinite(v) for v in values):
        raise UserError(f"train/loss is not finite ({values}): the SFT diverged; check the model and data")
    first, last = quarter_means(values)
    if not last < first * 0.98:
        raise UserError(f"train/loss did not go down (first steps {first:.4f}, last steps {last:.4f}): "
                        "training is not learning; check optim.lr and the data in the SFT output above")
    return first, last


def quarter_means(values: list[float]) -> tuple[float, float]:
    """The mean of the first and of the last quarter of `values` (smoke's loss, the demo's reward)."""
    k = max(1, len(values) // 4)
    return sum(values[:k]) / k, sum(values[-k:]) / k


def check_checkpoint(run: Path, step: int) -> Path:
    """The rank-0 model shard of `step`, after checking verl's SFT layout around it."""
    latest = latest_step(run)
    if latest is None:
        raise UserError(f"{run / LATEST_FILE} is missing: the SFT saved no checkpoint; look at its output above")
    if latest != step:
        raise UserError(f"latest checkpoint is step {latest}, expected {step}: the SFT stopped early")
    shard = step_dir(run, step) / "model_world_size_1_rank_0.pt"
    if not shard.is_file() or shard.stat().st_size == 0:
        raise UserError(f"{shard} is missing or empty: the checkpoint is incomplete")
    return shard


def load_and_generate(merged: Path, initial: Path | None, prompt: str, device: str,
                      max_new_tokens: int = 24) -> str:
    """Load the merged model, prove it holds trained weights (not the initial ones), and generate."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(merged)
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.bfloat16 if device != "cpu" else torch.float32)
    model.to(device).eval()
    if initial is not None:
        changed = 0
        merged_state = model.state_dict()
        for file in sorted(initial.glob("*.safetensors")):
            with safe_open(str(file), "pt") as handle:
                for name in handle.keys():
                    if name not in merged_state:
                        raise UserError(f"merged model lacks {name}: the merge dropped a tensor")
                    before = handle.get_tensor(name).float()
                    after = merged_state[name].detach().float().cpu()
                    if before.shape != after.shape:
                        raise UserError(f"{name}: shape {tuple(after.shape)} after merge, "
                                        f"{tuple(before.shape)} before: the merge is wrong")
                    changed += int(not torch.equal(before.to(after.dtype), after))
        if changed == 0:
            raise UserError("the merged weights equal the initial model: the merge did not take the trained "
                            "checkpoint")
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)
    ids = tokenizer(text, return_tensors="pt").to(device)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    new = out[0, ids["input_ids"].shape[1]:]
    if new.numel() == 0:
        raise UserError("the merged model generated nothing: check its generation_config.json")
    return tokenizer.decode(new, skip_special_tokens=True)


def first_test_prompt(data: Path) -> str:
    import pyarrow.parquet as pq

    table = pq.read_table(data / "gsm8k" / "test.parquet", columns=["prompt"])
    return table.column("prompt")[0].as_py()[0]["content"]


# --- the command ------------------------------------------------------------------------------------

def stage_failed(stage: Stage, command: str, returncode: int, seconds: float,
                 output: str = "its output above") -> UserError:
    """The one line for a stage that exited non-zero: where its output is and how to rerun it alone."""
    settings = " ".join(f"{k}={shlex.quote(v)}" for k, v in stage.env.items())
    return UserError(f"{command} stage '{stage.name}' failed (exit {returncode}) after {seconds:.0f}s: read "
                     f"{output}; rerun it alone with {settings + ' ' if settings else ''}python -m app "
                     f"{shlex.join(stage.argv[3:])}")


def run_stage(stage: Stage, settings: Settings, command: str = "smoke") -> None:
    started = time.monotonic()
    result = subprocess.run(stage.argv, env=child_env(stage, settings), cwd=os.getcwd())
    if result.returncode != 0:
        raise stage_failed(stage, command, result.returncode, time.monotonic() - started)


def main(command: str, argv: list[str], settings: Settings) -> int:
    if argv and argv[0] in ("-h", "--help"):
        say(__doc__)
        return 0
    if argv:
        raise UserError(f"smoke takes no arguments (got {' '.join(argv)}): use SMOKE_DIR, SMOKE_STEPS, ARGS")
    p = plan(settings)
    if settings["DRY_RUN"]:
        print_plan(p)
        return 0
    if gpu_count(settings) == 0:
        raise UserError("smoke needs a GPU: no CUDA device is visible here; run `make smoke` on a GPU node "
                        "(DRY_RUN=1 prints the plan anywhere)")

    from tqdm import tqdm

    started = time.monotonic()
    p.root.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(p.stages), desc="smoke", unit="stage", file=sys.stderr, dynamic_ncols=True)
    figures: dict = {"steps": p.steps}
    for stage in p.stages:
        bar.set_description(f"smoke: {stage.name}")
        say(f"\n=== smoke [{bar.n + 1}/{len(p.stages)}] {stage.name}: {stage.what}")
        if stage.argv:
            run_stage(stage, settings)
        if stage.name == "sft":
            check_checkpoint(p.run, p.steps)
            first, last = loss_went_down(read_losses(p.run))
            figures.update(loss_first=first, loss_last=last)
            say(f"train/loss went down: {first:.4f} -> {last:.4f}; checkpoint global_step_{p.steps} written")
        if stage.name == "generate":
            text = load_and_generate(p.merged, p.model, first_test_prompt(p.data), "cuda")
            figures["generated"] = text
            say(f"merged model generated: {text!r}")
        bar.update(1)
    bar.close()
    figures["seconds"] = round(time.monotonic() - started, 1)
    with atomic_path(p.root / "smoke.json") as tmp:
        tmp.write_text(json.dumps({"passed": True, **figures}, indent=2) + "\n")
    say(f"smoke passed in {figures['seconds']:.0f}s: loss {figures['loss_first']:.3f} -> "
        f"{figures['loss_last']:.3f}, merged model {p.merged} loads and generates (details: {p.root}/smoke.json)")
    return 0
