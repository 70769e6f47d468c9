"""Where runs, steps and models live, and what makes a model directory complete.

One directory per run holds everything of it: verl's checkpoints (global_step_N/ and LATEST_FILE), the
JSONL metrics (logs/), swanlab's local logs (swanlog/), the Ray token, the report (report/). It sits
under checkpoints/, the directory compose mounts at the same absolute path on every node. `make merge`
writes models/<run>-step<N>.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from app.common import UserError
from app.settings import Settings

DEFAULT_EXPERIMENT = {"sft": "sft-gsm8k", "grpo": "grpo-gsm8k"}
LATEST_FILE = "latest_checkpointed_iteration.txt"  # verl writes the last saved step's number here
STEP_RE = re.compile(r"^global_step_(\d+)$")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def run_dir(job: str, settings: Settings) -> Path:
    """The run directory of `job` (sft|grpo): CKPT_DIR if set, else checkpoints/<EXPERIMENT>. Absolute."""
    if settings["CKPT_DIR"]:
        return Path(settings["CKPT_DIR"]).expanduser().resolve()
    return (Path.cwd() / "checkpoints" / settings.get("EXPERIMENT", DEFAULT_EXPERIMENT[job])).resolve()


def default_run_dir(settings: Settings) -> Path:
    """CKPT_DIR, else the run directory of JOB, else whichever of the sft/grpo defaults exists."""
    if settings["CKPT_DIR"] or settings["JOB"]:
        return run_dir(settings.get("JOB", "sft"), settings)
    candidates = [run_dir(job, settings) for job in ("sft", "grpo")]
    existing = [c for c in candidates if c.exists()]
    if len(existing) == 1:
        return existing[0]
    if not existing:
        raise UserError(f"no checkpoints at {candidates[0]} or {candidates[1]}: set CKPT_DIR to the run "
                        "directory that holds global_step_N/")
    raise UserError(f"both {existing[0]} and {existing[1]} exist: set JOB=sft|grpo or CKPT_DIR to choose")


def step_dir(run: Path, step: int | str) -> Path:
    return run / f"global_step_{step}"


def latest_step(run: Path) -> int | None:
    """The step verl resumes from in `run` (its LATEST_FILE), or None where there is none readable."""
    try:
        text = (run / LATEST_FILE).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def logs_dir(run: Path) -> Path:
    return run / "logs"


def swanlog_dir(run: Path) -> Path:
    return run / "swanlog"


def token_file(run: Path) -> Path:
    return run / ".ray_auth_token"


def merged_model_dir(run_name: str, step: int | None) -> Path:
    """Where `make merge` writes a step of run `run_name` unless OUT_DIR says otherwise."""
    return Path.cwd() / "models" / (f"{run_name}-step{step}" if step is not None else run_name)


def merged_model_for_step(step: str, settings: Settings) -> Path:
    """The directory `make merge STEP=N` wrote: OUT_DIR, else models/<run name>-step<N>."""
    if not step.isdigit():
        raise UserError(f"STEP={step!r} is not a step number: set STEP to the merged step (e.g. STEP=100) "
                        "or MODEL=<model directory>")
    if settings["OUT_DIR"]:
        return Path(settings["OUT_DIR"]).expanduser().resolve()
    models = Path.cwd() / "models"
    names = []
    try:
        names.append(default_run_dir(settings).name)
    except UserError:  # no checkpoints on this node (a separate eval box): look at models/ alone
        pass
    found = [merged_model_dir(name, int(step)) for name in names if merged_model_dir(name, int(step)).is_dir()]
    if not found:
        found = sorted(p for p in models.glob(f"*-step{step}") if p.is_dir())
    if len(found) == 1:
        return found[0]
    if not found:
        raise UserError(f"no merged model for step {step} under {models}: run `make merge STEP={step}` first, "
                        "or pass MODEL=<model directory>")
    raise UserError(f"several merged models for step {step}: {', '.join(p.name for p in found)}: "
                    "pass MODEL=<one of them>")


def model_dir_problems(path: Path) -> list[str]:
    """What a Hugging Face model directory lacks, each as "has no ..." would end: config, tokenizer,
    weights (*.safetensors or *.bin, none of them empty). [] when complete; ["not a directory"] when absent.
    The one check preflight, doctor and eval use."""
    if not path.is_dir():
        return ["not a directory"]
    problems = []
    if not (path / "config.json").is_file():
        problems.append("no config.json")
    else:
        try:  # transformers, verl and vLLM all read it first: a truncated copy fails each of them minutes in
            config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            problems.append(f"an unreadable config.json ({' '.join(str(exc).split())[:120]})")
        else:
            if not isinstance(config, dict) or not config.get("model_type"):
                problems.append("a config.json without model_type (not a Hugging Face model config)")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        problems.append("no tokenizer (tokenizer.json / tokenizer_config.json)")
    weights = sorted([*path.glob("*.safetensors"), *path.glob("*.bin")])
    empty = [w.name for w in weights if w.stat().st_size == 0]
    if not weights:
        problems.append("no weights (*.safetensors or *.bin)")
    elif empty:
        problems.append(f"an empty weights file ({', '.join(empty)})")
    return problems
