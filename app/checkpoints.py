"""Checkpoints: `gather` every node's FSDP shards into one directory, `merge` them into a Hugging Face
model, and verify it.

verl writes, per saved step, `model_world_size_W_rank_R.pt` on the node that ran rank R, and
`fsdp_config.json` + `huggingface/` (config and tokenizer, no weights) on rank 0's node only. SFT's
layout is flat (`global_step_N/`), GRPO's actor lives in `global_step_N/actor/`. Merging needs every
rank in one directory: we check that first and say exactly which ranks are missing and how to get them.

Settings (environment, as the Makefile passes them): CKPT_DIR (the run directory holding global_step_N/
and latest_checkpointed_iteration.txt; or one global_step_N/ or actor/ directory), STEP (default
latest), OUT_DIR (default models/<run>-step<N>), FORCE=1 (replace OUT_DIR), NODES (gather's sources),
JOB (sft|grpo: which default run directory, when CKPT_DIR is unset).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from app.common import UserError, atomic_path, env, env_flag, run_dir, say, warn

SHARD_RE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)(.*)\.pt$")
STEP_RE = re.compile(r"^global_step_(\d+)$")
LATEST_FILE = "latest_checkpointed_iteration.txt"
RANK0_FILES = ("fsdp_config.json", "huggingface")
# Models up to this size get a real load + forward pass after merging; bigger ones are checked against
# an empty-weight (meta) instance of their config so verification never needs the model's RAM twice.
FORWARD_MAX_PARAMS = 600_000_000

GATHER_HINT = ("each node keeps only its own ranks' shards: run `make gather NODES=\"<ip of every node>\"` "
               "here to pull them, or put CKPT_DIR on one volume mounted at the same path on every node")


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


# --- where the shards are -----------------------------------------------------------------------

@dataclass
class Located:
    """One saved step, resolved: the directory holding its shards and what to call the result."""

    shard_dir: Path
    run_name: str
    step: int | None
    layout: str  # "sft" (flat global_step_N/), "grpo" (global_step_N/actor/), or "dir" (given directly)


def _has_shards(directory: Path) -> bool:
    return directory.is_dir() and any(SHARD_RE.match(p.name) for p in directory.iterdir())


def _steps_in(run: Path) -> list[int]:
    if not run.is_dir():
        return []
    return sorted(int(m.group(1)) for p in run.iterdir() if p.is_dir() and (m := STEP_RE.match(p.name)))


def default_run_dir() -> Path:
    """CKPT_DIR, else the run directory of JOB, else whichever of the sft/grpo defaults exists."""
    if env("CKPT_DIR") or env("JOB"):
        return run_dir(env("JOB", "sft"))
    candidates = [run_dir(job) for job in ("sft", "grpo")]
    existing = [c for c in candidates if c.exists()]
    if len(existing) == 1:
        return existing[0]
    if not existing:
        raise UserError(f"no checkpoints at {candidates[0]} or {candidates[1]}: set CKPT_DIR to the run "
                        "directory that holds global_step_N/")
    raise UserError(f"both {existing[0]} and {existing[1]} exist: set JOB=sft|grpo or CKPT_DIR to choose")


def _step_dir_layout(step_dir: Path) -> tuple[Path, str]:
    actor = step_dir / "actor"
    if actor.is_dir():
        return actor, "grpo"
    return step_dir, "sft"


def locate(ckpt_dir: Path, step: str | None) -> Located:
    """Resolve CKPT_DIR + STEP to the directory of one step's shards, with one-line errors."""
    ckpt_dir = Path(ckpt_dir).expanduser().resolve()
    if not ckpt_dir.exists():
        raise UserError(f"CKPT_DIR {ckpt_dir} does not exist: set CKPT_DIR to the run directory that holds "
                        "global_step_N/ (on this node, or mounted here)")
    # Given a step directory (or its actor/) directly: merge that one.
    if STEP_RE.match(ckpt_dir.name):
        shard_dir, layout = _step_dir_layout(ckpt_dir)
        return Located(shard_dir, ckpt_dir.parent.name, int(STEP_RE.match(ckpt_dir.name).group(1)), layout)
    if ckpt_dir.name == "actor" and STEP_RE.match(ckpt_dir.parent.name):
        number = int(STEP_RE.match(ckpt_dir.parent.name).group(1))
        return Located(ckpt_dir, ckpt_dir.parent.parent.name, number, "grpo")
    if _has_shards(ckpt_dir) or (ckpt_dir / "fsdp_config.json").exists():
        return Located(ckpt_dir, ckpt_dir.name, None, "dir")

    steps = _steps_in(ckpt_dir)
    present = ", ".join(map(str, steps))
    spec = (step or "latest").strip()
    if spec == "latest":
        latest = ckpt_dir / LATEST_FILE
        if latest.is_file() and latest.read_text().strip().isdigit():
            number = int(latest.read_text().strip())
        elif steps:
            number = steps[-1]
            warn(f"no readable {LATEST_FILE} in {ckpt_dir}: using the highest step present, {number}")
        else:
            raise UserError(f"no saved step in {ckpt_dir} (no global_step_N/ directory): check CKPT_DIR, and "
                            "that training ran with a save frequency (trainer.save_freq > 0)")
    elif spec.isdigit():
        number = int(spec)
    else:
        raise UserError(f"STEP={spec!r} is not a step number: set STEP=latest or one of: {present or 'none'}")
    step_dir = ckpt_dir / f"global_step_{number}"
    if not step_dir.is_dir():
        raise UserError(f"step {number} does not exist in {ckpt_dir}: steps present: {present or 'none'} "
                        "(set STEP to one of them)")
    shard_dir, layout = _step_dir_layout(step_dir)
    return Located(shard_dir, ckpt_dir.name, number, layout)


# --- are all ranks there? -----------------------------------------------------------------------

@dataclass
class ShardSet:
    directory: Path
    world_size: int
    files: list[Path]  # index = rank
    sizes: list[int] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)


def scan(directory: Path) -> dict[int, dict[int, list[Path]]]:
    """world size -> rank -> files claiming that rank (more than one file = a duplicate)."""
    found: dict[int, dict[int, list[Path]]] = {}
    for path in sorted(directory.iterdir()) if directory.is_dir() else []:
        match = SHARD_RE.match(path.name)
        if match and path.is_file():
            world, rank = int(match.group(1)), int(match.group(2))
            found.setdefault(world, {}).setdefault(rank, []).append(path)
    return found


def _ranks(ranks) -> str:
    """0,1,2,5 -> '0-2, 5': short enough for one line even with 64 ranks."""
    ranks = sorted(ranks)
    parts, start = [], None
    for i, rank in enumerate(ranks):
        if start is None:
            start = rank
        if i + 1 == len(ranks) or ranks[i + 1] != rank + 1:
            parts.append(str(start) if start == rank else f"{start}-{rank}")
            start = None
    return ", ".join(parts)


def check_complete(directory: Path, *, need_rank0_files: bool = True) -> ShardSet:
    """Every rank 0..W-1 exactly once, one world size, no empty or truncated file; else a UserError."""
    directory = Path(directory)
    found = scan(directory)
    world_from_config = None
    config_path = directory / "fsdp_config.json"
    if config_path.is_file():
        try:
            world_from_config = int(json.loads(config_path.read_text())["world_size"])
        except (ValueError, KeyError, TypeError) as exc:
            raise UserError(f"{config_path} is unreadable ({_one_line(exc)}): copy it again from the node "
                            "that ran rank 0") from None
    if not found:
        raise UserError(f"no model shards (model_world_size_W_rank_R.pt) in {directory}: {GATHER_HINT}")
    if len(found) > 1:
        detail = "; ".join(f"world size {w}: ranks {_ranks(r)}" for w, r in sorted(found.items()))
        raise UserError(f"shards of different world sizes in {directory} ({detail}): they come from different "
                        "runs; remove the stale ones (keep the world size in fsdp_config.json)")
    world, ranks = next(iter(found.items()))
    if world_from_config is not None and world_from_config != world:
        raise UserError(f"fsdp_config.json in {directory} says world size {world_from_config} but the shards "
                        f"are for world size {world}: they come from different runs; gather this run's shards")
    duplicates = {r: files for r, files in ranks.items() if len(files) > 1}
    if duplicates:
        rank, files = sorted(duplicates.items())[0]
        raise UserError(f"rank {rank} appears {len(files)} times in {directory} "
                        f"({', '.join(f.name for f in files)}): keep only model_world_size_{world}_rank_{rank}.pt")
    out_of_range = sorted(r for r in ranks if r >= world)
    if out_of_range:
        raise UserError(f"ranks {_ranks(out_of_range)} in {directory} do not exist in world size {world}: "
                        "remove those files")
    missing = sorted(set(range(world)) - set(ranks))
    if missing:
        raise UserError(f"{directory} is incomplete: world size {world}, ranks missing: {_ranks(missing)}; "
                        f"{GATHER_HINT}")
    files = [ranks[r][0] for r in range(world)]
    sizes = []
    for path in files:
        size = path.stat().st_size
        if size == 0:
            raise UserError(f"{path} is empty: the save was interrupted or the copy failed; copy it again "
                            "from its node (make gather) or merge an earlier STEP")
        # torch.save writes a zip; its directory sits at the end, so a cut-off copy fails here cheaply.
        if not zipfile.is_zipfile(path):
            raise UserError(f"{path} is corrupt (not a complete torch checkpoint; truncated copy?): copy it "
                            "again from its node (make gather) or merge an earlier STEP")
        sizes.append(size)
    if need_rank0_files:
        absent = [name for name in RANK0_FILES if not (directory / name).exists()]
        if absent:
            raise UserError(f"{' and '.join(absent)} missing in {directory}: rank 0's node writes them; "
                            f"{GATHER_HINT}")
    return ShardSet(directory, world, files, sizes)


# --- merge ----------------------------------------------------------------------------------------

def _remove_leftovers(out: Path) -> None:
    """Temporaries of merges that were killed (SIGKILL, power loss) never got cleaned up: do it now."""
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.(tmp|old)-(\d+)?")
    for sibling in out.parent.iterdir() if out.parent.is_dir() else []:
        match = pattern.match(sibling.name)
        if not match:
            continue
        pid = int(match.group(2)) if match.group(2) else None
        if pid is not None and pid != os.getpid():
            try:
                os.kill(pid, 0)
                continue  # its merge is still running
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
        say(f"removing {sibling.name}, left by an interrupted merge")
        shutil.rmtree(sibling, ignore_errors=True) if sibling.is_dir() else sibling.unlink(missing_ok=True)


def merge_with_verl(shards: ShardSet, target: Path) -> None:
    """verl's own FSDP merger, unchanged: loads every shard into RAM at once, then writes the model."""
    from verl.model_merger.base_model_merger import ModelMergerConfig
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger

    config = ModelMergerConfig(operation="merge", backend="fsdp", local_dir=str(shards.directory),
                               target_dir=str(target), hf_model_config_path=str(shards.directory / "huggingface"))
    target.mkdir(parents=True, exist_ok=True)
    merger = FSDPModelMerger(config)
    merger.merge_and_save()
    merger.cleanup()


def _auto_class(config):
    from verl.model_merger.base_model_merger import BaseModelMerger

    # verl's own choice of Auto class for an architecture (it only reads self.model_config).
    return BaseModelMerger.get_transformers_auto_model_class(argparse.Namespace(model_config=config))


def _saved_tensors(directory: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype) from the safetensors headers only (no tensor is read)."""
    from safetensors import safe_open

    result = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                piece = handle.get_slice(name)
                result[name] = (tuple(piece.get_shape()), piece.get_dtype())
    return result


def verify(directory: Path, *, forward_max_params: int = FORWARD_MAX_PARAMS) -> str:
    """Prove the merged model is usable: complete files, names/shapes as its config, tokenizer, forward."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoTokenizer

    from verl.model_merger.output_validation import validate_hf_model_output
    from verl.utils.transformers_compat import drop_tied_target_keys

    try:
        validate_hf_model_output(directory)
    except RuntimeError as exc:
        raise UserError(f"merge output failed verl's check: {_one_line(exc)}") from None
    config = AutoConfig.from_pretrained(directory)
    auto_class = _auto_class(config)
    with init_empty_weights():
        empty = auto_class.from_config(config)
    expected = {name: tuple(t.shape) for name, t in empty.state_dict().items()}
    drop_tied_target_keys(expected, empty, config)
    n_params = sum(p.numel() for p in empty.parameters())
    del empty
    saved = _saved_tensors(directory)
    missing = sorted(set(expected) - set(saved))
    extra = sorted(set(saved) - set(expected))
    wrong = sorted(n for n in set(expected) & set(saved) if expected[n] != saved[n][0])
    if missing or extra or wrong:
        parts = []
        if missing:
            parts.append(f"{len(missing)} tensors missing (e.g. {missing[0]})")
        if extra:
            parts.append(f"{len(extra)} unexpected (e.g. {extra[0]})")
        if wrong:
            parts.append(f"{len(wrong)} of the wrong shape (e.g. {wrong[0]}: {saved[wrong[0]][0]} "
                         f"vs {expected[wrong[0]]} in config.json)")
        raise UserError(f"merged weights do not match config.json: {', '.join(parts)}; the shards and "
                        "huggingface/config.json come from different models")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    if not getattr(tokenizer, "chat_template", None):
        warn(f"{directory} has no chat template: chat-style prompts (GRPO, eval) will not format")
    if n_params > forward_max_params:
        return f"{len(saved)} tensors match config.json ({n_params / 1e9:.2f}B parameters; forward skipped)"
    model = auto_class.from_pretrained(directory, dtype=torch.float32)
    if tokenizer.chat_template:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                            add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ids = ids["input_ids"]
    else:
        ids = tokenizer("What is 2 + 3?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    if not torch.isfinite(logits).all():
        raise UserError(f"the merged model in {directory} produces non-finite logits: its weights are broken "
                        "(training diverged?); merge an earlier STEP")
    return (f"{len(saved)} tensors match config.json, loads with transformers, forward on "
            f"{ids.shape[1]} tokens gives finite logits")


def merge(ckpt_dir: Path, step: str | None, out: Path | None, force: bool, engine: str = "verl") -> Path:
    """Check, merge into a temporary directory, verify, then rename into OUT_DIR. Returns OUT_DIR."""
    where = locate(ckpt_dir, step)
    shards = check_complete(where.shard_dir)
    suffix = f"-step{where.step}" if where.step is not None else ""
    out = Path(out or Path.cwd() / "models" / f"{where.run_name}{suffix}").expanduser().resolve()
    if out.exists() and not force:
        raise UserError(f"OUT_DIR {out} already exists: set FORCE=1 to replace it, or choose another OUT_DIR")
    if out.exists() and not out.is_dir():
        raise UserError(f"OUT_DIR {out} is a file: choose a directory path for OUT_DIR")
    _remove_leftovers(out)
    say(f"merging {shards.world_size} shards ({shards.total_bytes / 2**30:.2f} GiB) of {where.shard_dir} "
        f"into {out}")
    with atomic_path(out) as tmp:
        if engine == "verl":
            merge_with_verl(shards, tmp)
        else:
            raise UserError(f"unknown merge engine {engine!r}: choose verl")
        say("verifying the merged model")
        summary = verify(tmp)
    say(f"merged model in {out}: {summary}")
    return out


# --- CLI ------------------------------------------------------------------------------------------

def _merge_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m app merge", description=merge.__doc__)
    parser.add_argument("--ckpt-dir", default=None, help="run directory (default: CKPT_DIR or the job's)")
    parser.add_argument("--step", default=env("STEP", "latest"), help="step number or latest (STEP)")
    parser.add_argument("--out", default=env("OUT_DIR"), help="output directory (OUT_DIR)")
    parser.add_argument("--force", action="store_true", default=env_flag("FORCE"), help="replace OUT_DIR")
    parser.add_argument("--engine", default="verl", choices=["verl"],
                        help="verl: verl.model_merger as is")
    args = parser.parse_args(argv)
    ckpt_dir = Path(args.ckpt_dir) if args.ckpt_dir else default_run_dir()
    merge(ckpt_dir, args.step, Path(args.out) if args.out else None, args.force, engine=args.engine)
    return 0


def main(command: str, argv: list[str]) -> int:
    if command == "merge":
        return _merge_main(argv)
    raise UserError(f"{command} is not available yet")
