"""Checkpoints: `gather` every node's FSDP shards into one directory, `merge` them into a Hugging Face model,
and verify it. Settings: CKPT_DIR (a run, or one global_step_N/ or actor/), STEP, OUT_DIR, FORCE, NODES, JOB.

verl writes, per saved step, `model_world_size_W_rank_R.pt` on the node that ran rank R, and `fsdp_config.json`
+ `huggingface/` (config and tokenizer, no weights) on rank 0's node only; SFT's layout is flat (`global_step_N/`),
GRPO's actor lives in `global_step_N/actor/`. Merging needs every rank in one directory: we check that first
and say exactly which ranks are missing and how to get them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import pickle
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import groupby
from pathlib import Path

from app.common import (ArgParser, NoRoom, UserError, atomic_path, check_room, ends_with_us, no_room_errno,
                        refuse_symlink_loop, resolved, say, sweep_stale_temporaries, warn)
from app.runs import (LATEST_FILE, STEP_RE, default_run_dir, latest_step, merged_model_dir, resolve_step, step_arg,
                      step_dir, steps_in)
from app.settings import Settings

SHARD_RE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)(.*)\.pt$")
RANK0_FILES = ("fsdp_config.json", "huggingface")
# Bigger merged models are checked against an empty-weight (meta) instance of their config only, without the
# load + forward pass that would need their RAM a second time.
FORWARD_MAX_PARAMS = 600_000_000
# Output file size of the streaming merge. Peak memory is about twice this (the bf16 pieces of one file
# and their merged result) plus one rank's slice of it in fp32, whatever the model's size.
STREAM_FILE_BYTES = 512 << 20

GATHER_HINT = ("each node keeps only its own ranks' shards: run `make gather NODES=\"<ip of every node>\"` "
               "here to pull them, or put CKPT_DIR on one volume mounted at the same path on every node")


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _shard_dir(saved_step: Path) -> Path:
    actor = saved_step / "actor"  # GRPO's actor saves in global_step_N/actor/, SFT in global_step_N/
    return actor if actor.is_dir() else saved_step


def locate(ckpt_dir: Path, step: str | None) -> tuple[Path, str, int | None]:
    """CKPT_DIR + STEP -> (directory of one step's shards, run name, step), with one-line errors."""
    ckpt_dir = resolved(ckpt_dir, "CKPT_DIR")
    if not ckpt_dir.exists():
        raise UserError(f"CKPT_DIR {ckpt_dir} does not exist: set CKPT_DIR to the run directory that holds "
                        "global_step_N/ (on this node, or mounted here)")
    if ckpt_dir.name == "actor" and STEP_RE.match(ckpt_dir.parent.name):
        ckpt_dir = ckpt_dir.parent  # a step's actor/, given directly: that step
    if match := STEP_RE.match(ckpt_dir.name):  # a step directory, given directly
        return _shard_dir(ckpt_dir), ckpt_dir.parent.name, int(match.group(1))
    if scan(ckpt_dir) or (ckpt_dir / "fsdp_config.json").exists():  # a directory of shards
        return ckpt_dir, ckpt_dir.name, None
    number = resolve_step(ckpt_dir, step)
    saved = step_dir(ckpt_dir, number)
    if not saved.is_dir():
        present = ", ".join(map(str, steps_in(ckpt_dir))) or "none"
        raise UserError(f"step {number} does not exist in {ckpt_dir}: steps present: {present} "
                        "(set STEP to one of them)")
    return _shard_dir(saved), ckpt_dir.name, number


@dataclass
class ShardSet:
    directory: Path
    world_size: int
    files: list[Path]  # index = rank
    total_bytes: int


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
    # consecutive ranks share rank - position: each group is one run
    runs = [[rank for _, rank in group] for _, group in groupby(enumerate(sorted(ranks)), lambda ir: ir[1] - ir[0])]
    return ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


def check_complete(directory: Path) -> ShardSet:
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
    if duplicates := {r: files for r, files in ranks.items() if len(files) > 1}:
        rank, files = sorted(duplicates.items())[0]
        raise UserError(f"rank {rank} appears {len(files)} times in {directory} "
                        f"({', '.join(f.name for f in files)}): keep only model_world_size_{world}_rank_{rank}.pt")
    if out_of_range := sorted(r for r in ranks if r >= world):
        raise UserError(f"ranks {_ranks(out_of_range)} in {directory} do not exist in world size {world}: "
                        "remove those files")
    if missing := sorted(set(range(world)) - set(ranks)):
        raise UserError(f"{directory} is incomplete: world size {world}, ranks missing: {_ranks(missing)}; "
                        f"{GATHER_HINT}")
    files = [ranks[r][0] for r in range(world)]
    for path in files:
        if path.stat().st_size == 0:
            raise UserError(f"{path} is empty: the save was interrupted or the copy failed; copy it again "
                            "from its node (make gather) or merge an earlier STEP")
        # torch.save writes a zip; its directory sits at the end, so a cut-off copy fails here cheaply.
        if not zipfile.is_zipfile(path):
            raise UserError(f"{path} is corrupt (not a complete torch checkpoint; truncated copy?): copy it "
                            "again from its node (make gather) or merge an earlier STEP")
    if absent := [name for name in RANK0_FILES if not (directory / name).exists()]:
        raise UserError(f"{' and '.join(absent)} missing in {directory}: rank 0's node writes them; {GATHER_HINT}")
    return ShardSet(directory, world, files, sum(path.stat().st_size for path in files))


def _verl_merger(shards: ShardSet, target: Path):
    from verl.model_merger.base_model_merger import ModelMergerConfig
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger

    target.mkdir(parents=True, exist_ok=True)
    merger = FSDPModelMerger(ModelMergerConfig(
        operation="merge", backend="fsdp", local_dir=str(shards.directory), target_dir=str(target),
        hf_model_config_path=str(shards.directory / "huggingface")))
    # verl saves the trainer's attn_implementation in the checkpoint's config.json; a merged model is for any loader
    # (the varlen_attention of nodes without flash-attn exists only where app.attention is imported)
    merger.model_config._attn_implementation = None
    return merger


def merge_with_verl(shards: ShardSet, target: Path) -> None:
    """verl's own FSDP merger, unchanged: loads every shard into RAM at once, then writes the model."""
    merger = _verl_merger(shards, target)
    try:
        merger.merge_and_save()
    except (RuntimeError, ValueError, EOFError, OSError, pickle.UnpicklingError) as exc:
        raise UserError(f"verl.model_merger failed on {shards.directory} ({type(exc).__name__}: "
                        f"{_one_line(exc)[:300]}): a shard may be damaged; copy it again (make gather) or "
                        "merge an earlier STEP") from None


def _load_mmap(path: Path):
    import torch

    # Unpickling a DTensor outside its process group warns about torch.compile, once per file: noise here.
    logging.getLogger("torch.distributed.device_mesh").setLevel(logging.ERROR)
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception as exc:  # torch raises RuntimeError/UnpicklingError/EOFError/... for a damaged file
        raise UserError(f"{path} is corrupt and cannot be read ({type(exc).__name__}: {_one_line(exc)[:200]}): "
                        "copy it again from its node (make gather) or merge an earlier STEP") from None


class _Ranks:
    """Every rank's shard of one checkpoint, memory-mapped, merged a few keys at a time as verl merges them."""

    def __init__(self, merger, shards: ShardSet):
        self.merger, self.files = merger, shards.files
        self.world = merger._get_world_size()
        self.workers = max(1, min(4, os.cpu_count() or 1, self.world))
        rank0 = _load_mmap(shards.files[0])
        mesh, self.mesh_dim_names = merger._extract_device_mesh_info(rank0, self.world)
        total_shards, mesh_shape = merger._calculate_shard_configuration(mesh, self.mesh_dim_names)
        if total_shards != self.world or len(mesh_shape) != 1:
            raise UserError(f"device mesh {self.mesh_dim_names} of shape {tuple(mesh.shape)} in {shards.directory}: "
                            "only FSDP (optionally with DDP) checkpoints merge here; try --engine verl")
        self.keys = list(rank0)
        self.sizes = {k: rank0[k].numel() * 2 for k in self.keys}  # bf16 bytes, merged (DTensor.numel is global)
        del rank0
        for path in shards.files[1:]:  # every rank readable and alike before anything is written (cheap: mmap)
            other = set(_load_mmap(path))
            if other != set(self.keys):
                odd = sorted(other ^ set(self.keys))[0]
                raise UserError(f"{path} and rank 0 hold different tensors (e.g. {odd}): the shards come from "
                                "different runs; gather this run's shards")

    def _pieces(self, path: Path, keys: list[str]) -> dict[str, tuple]:
        """key -> (bf16 local piece, placements) of one rank; its mapping is dropped on return."""
        from torch.distributed.tensor import DTensor

        state = _load_mmap(path)
        result = {}
        for key in keys:
            value = state[key]
            if isinstance(value, DTensor):
                placements = tuple(value.placements)
                if self.mesh_dim_names[0] in ("dp", "ddp"):  # replicated over data parallel: dropped, as verl does
                    placements = placements[1:]
                result[key] = (value._local_tensor.bfloat16(), placements)
            else:
                result[key] = (value.bfloat16(), None)
        return result  # `state` goes out of scope: the file is unmapped and its pages leave memory

    def merged(self, keys: list[str], bar=None) -> dict:
        """key -> its merged bf16 tensor; `bar` advances by each rank's share as it is read."""
        from verl.model_merger.fsdp_model_merger import merge_non_dtensor_shards

        pieces: dict[str, list] = {k: [] for k in keys}  # key -> [(piece, placements) per rank, in rank order]
        per_rank = sum(self.sizes[k] for k in keys) // self.world
        # A few ranks at once, as verl loads its shards: the casts release the GIL, and only `workers`
        # mappings are open at a time, so memory grows by a few ranks' slices only.
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            for result in pool.map(lambda path: self._pieces(path, keys), self.files):
                for key in keys:
                    pieces[key].append(result[key])
                if bar is not None:
                    bar.update(per_rank)
        merged = {}
        for key in keys:
            parts = pieces.pop(key)
            tensors, placements = [t for t, _ in parts], parts[0][1]
            if placements is None:
                merged[key] = merge_non_dtensor_shards(key, tensors)
            elif any(p != placements for _, p in parts):
                raise UserError(f"ranks disagree on how {key} is sharded: the shards come from different runs")
            else:
                merged[key] = self.merger._merge_by_placement(tensors, placements[0])
        return merged


def merge_streaming(shards: ShardSet, target: Path, file_bytes: int = STREAM_FILE_BYTES) -> None:
    """verl's FSDP merge, one output file at a time: verl.model_merger holds every rank's whole state dict at
    once (about the fp32 model); here only one file's tensors are read, merged and written before the next.
    The per-tensor work is verl's own, so the tensors are bit-identical to verl's (tests/test_checkpoints.py
    and scripts/bench_merge.sh check that)."""
    import torch
    from accelerate import init_empty_weights

    from verl.model_merger.output_validation import validate_hf_model_output
    from verl.utils import hf_processor, hf_tokenizer
    from verl.utils.transformers_compat import drop_tied_target_keys

    merger = _verl_merger(shards, target)
    if not merger.model_config.architectures:
        raise UserError(f"{shards.directory / 'huggingface' / 'config.json'} names no architecture: copy "
                        "config.json of the model you trained into it (with \"architectures\")")
    ranks = _Ranks(merger, shards)
    # Names as verl writes them: LoRA weights split off into lora_adapter/ (verl's save_lora_adapter renames
    # the base keys), then tied aliases (lm_head.weight) dropped. Placeholder values carry the source key.
    names: dict[str, object] = {k: k for k in ranks.keys}
    lora_keys = [k for k in ranks.keys if "lora_" in k]
    if lora_keys:
        if len(lora_keys) == len(ranks.keys):
            raise UserError(f"{shards.directory} holds only LoRA weights (checkpoint.save_lora_only=True): there is "
                            "no base model to merge into; save full checkpoints, or load the adapter with PEFT")
        names.update(ranks.merged(lora_keys))
        merger.save_lora_adapter(names)
    with init_empty_weights():
        model = merger.get_transformers_auto_model_class().from_config(
            merger.model_config, dtype=torch.bfloat16, trust_remote_code=merger.config.trust_remote_code)
    model = merger.patch_model_generation_config(model)
    drop_tied_target_keys(names, model, merger.model_config)
    plan = [(name, source) for name, source in names.items() if isinstance(source, str)]
    _write_weights(ranks, plan, target, file_bytes, sum(p.numel() for p in model.parameters()))
    # config + generation config as save_pretrained writes them for this bf16 model (what verl's merger calls)
    model.config.dtype = "bfloat16"
    model.config.architectures = [model.__class__.__name__]
    model.config.save_pretrained(target)
    if model.can_generate():
        model.generation_config.save_pretrained(target)
    trust = merger.config.trust_remote_code
    for artefact in (hf_processor(merger.hf_model_config_path, trust_remote_code=trust),
                     hf_tokenizer(merger.hf_model_config_path, trust_remote_code=trust)):
        if artefact is not None:
            artefact.save_pretrained(target)
    validate_hf_model_output(target)


def _write_weights(ranks: _Ranks, plan: list[tuple[str, str]], target: Path, file_bytes: int, n_params: int) -> None:
    """`plan` (name, source key) as safetensors files of about file_bytes each, in the model's own order."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    groups: list[list[tuple[str, str]]] = [[]]
    filled = 0
    for name, source in plan:
        if groups[-1] and filled + ranks.sizes[source] > file_bytes:
            groups.append([])
            filled = 0
        groups[-1].append((name, source))
        filled += ranks.sizes[source]
    files = ["model.safetensors"] if len(groups) == 1 else [
        f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map: dict[str, str] = {}
    total = sum(ranks.sizes[source] for _, source in plan)
    # disable=None: a bar on a terminal, nothing in logs (so a failure midway stays one line there)
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"Merging {ranks.world} FSDP shards", disable=None) as bar:
        for group, filename in zip(groups, files):
            before = bar.n
            merged = ranks.merged([source for _, source in group], bar)
            out = {name: merged.pop(source) for name, source in group}
            save_file(out, str(target / filename), metadata={"format": "pt"})
            del out
            weight_map.update((name, filename) for name, _ in group)
            bar.update(before + sum(ranks.sizes[source] for _, source in group) - bar.n)
    if len(files) > 1:  # the same index transformers' save_pretrained writes for a sharded model
        index = {"metadata": {"total_parameters": n_params, "total_size": total}, "weight_map": weight_map}
        (target / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _auto_class(config):
    from verl.model_merger.base_model_merger import BaseModelMerger

    # verl's own choice of Auto class for an architecture (it only reads self.model_config).
    return BaseModelMerger.get_transformers_auto_model_class(argparse.Namespace(model_config=config))


def verify(directory: Path) -> str:
    """Prove the merged model is usable: complete files, names/shapes as its config, tokenizer, forward."""
    import torch
    from accelerate import init_empty_weights
    from safetensors import safe_open
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
    saved = {}  # name -> shape, from the safetensors headers only (no tensor is read)
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                saved[name] = tuple(handle.get_slice(name).get_shape())
    missing = sorted(set(expected) - set(saved))
    extra = sorted(set(saved) - set(expected))
    wrong = sorted(n for n in set(expected) & set(saved) if expected[n] != saved[n])
    parts = [f"{len(missing)} tensors missing (e.g. {missing[0]})"] if missing else []
    parts += [f"{len(extra)} unexpected (e.g. {extra[0]})"] if extra else []
    parts += [f"{len(wrong)} of the wrong shape (e.g. {wrong[0]}: {saved[wrong[0]]} "
              f"vs {expected[wrong[0]]} in config.json)"] if wrong else []
    if parts:
        raise UserError(f"merged weights do not match config.json: {', '.join(parts)}; the shards and "
                        "huggingface/config.json come from different models")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    if not getattr(tokenizer, "chat_template", None):
        warn(f"{directory} has no chat template: chat-style prompts (GRPO, eval) will not format")
    if n_params > FORWARD_MAX_PARAMS:
        return f"{len(saved)} tensors match config.json ({n_params / 1e9:.2f}B parameters; forward skipped)"
    model = auto_class.from_pretrained(directory, dtype=torch.float32)
    if tokenizer.chat_template:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tokenizer("What is 2 + 3?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    if not torch.isfinite(logits).all():
        raise UserError(f"the merged model in {directory} produces non-finite logits: its weights are broken "
                        "(training diverged?); merge an earlier STEP")
    return (f"{len(saved)} tensors match config.json, loads with transformers, forward on "
            f"{ids.shape[1]} tokens gives finite logits")


def fold_lora(directory: Path) -> None:
    """verl leaves the base model and lora_adapter/ apart: fold the adapter in with PEFT so that `directory`
    is a complete model (what eval and vLLM load). verl's base moves to base/, the adapter stays beside it."""
    import torch
    from peft import PeftModel
    from transformers import AutoConfig

    base = directory / "base"
    base.mkdir()
    for entry in list(directory.iterdir()):
        if entry.name not in ("base", "lora_adapter"):
            os.replace(entry, base / entry.name)
    say("folding lora_adapter/ into the base model (PEFT merge_and_unload)")
    model = _auto_class(AutoConfig.from_pretrained(base)).from_pretrained(base, dtype=torch.bfloat16)
    model = PeftModel.from_pretrained(model, directory / "lora_adapter").merge_and_unload()
    model.save_pretrained(directory)
    for entry in base.iterdir():  # tokenizer, chat template, processor: as in the base
        weights = entry.suffix == ".safetensors" or entry.name in ("model.safetensors.index.json", "config.json")
        if entry.is_file() and not weights and not (directory / entry.name).exists():
            shutil.copy2(entry, directory / entry.name)


def merged_bytes(shards: ShardSet) -> int:
    """About what a merge writes: the weights in bf16 (verl's merger casts to it), a tied lm_head.weight once;
    twice that for LoRA (the base model is kept beside the folded one). A DTensor's numel is the global count."""
    from transformers import AutoConfig

    state = _load_mmap(shards.files[0])
    sizes = {key: value.numel() * 2 for key, value in state.items() if hasattr(value, "numel")}
    del state
    try:
        tied = getattr(AutoConfig.from_pretrained(shards.directory / "huggingface"), "tie_word_embeddings", False)
    except Exception:  # noqa: BLE001 - an estimate; the merge itself refuses a broken config in its own line
        tied = False
    if tied:
        sizes.pop("lm_head.weight", None)
    lora = sum(size for key, size in sizes.items() if "lora_" in key)
    base = sum(sizes.values()) - lora
    return 2 * base + lora if lora else base


def merge(ckpt_dir: Path, step: str | None, out: Path | None, force: bool, engine: str = "stream",
          file_bytes: int = STREAM_FILE_BYTES) -> Path:
    """Check, merge into a temporary directory, verify, then rename into OUT_DIR. Returns OUT_DIR."""
    shard_dir, run_name, number = locate(ckpt_dir, step)
    shards = check_complete(shard_dir)
    out = resolved(out or merged_model_dir(run_name, number), "OUT_DIR")
    if out.exists() and not force:
        raise UserError(f"OUT_DIR {out} already exists: set FORCE=1 to replace it, or choose another OUT_DIR")
    if out.exists() and not out.is_dir():
        raise UserError(f"OUT_DIR {out} is a file: choose a directory path for OUT_DIR")
    for left in sweep_stale_temporaries(out):  # atomic_path would too, silently: say what a killed merge left
        say(f"removed {left.name}, left by an interrupted merge")
    needed = merged_bytes(shards)
    say(f"merging {shards.world_size} shards ({shards.total_bytes / 2**30:.2f} GiB) of {shard_dir} "
        f"into {out} (about {needed / 2**30:.2f} GiB)")
    # a full OUT_DIR disk is refused before minutes of merging, and is one line (NoRoom) if it fills anyway
    with atomic_path(out, "OUT_DIR", needed=needed, what="the merged model",
                     needs="its weights alone need about") as tmp:
        if engine == "verl":
            merge_with_verl(shards, tmp)
        else:
            merge_streaming(shards, tmp, file_bytes=file_bytes)
        if (tmp / "lora_adapter").is_dir():
            fold_lora(tmp)
        say("verifying the merged model")
        summary = verify(tmp)
    say(f"merged model in {out}: {summary}")
    return out


@dataclass
class Node:
    """One source of shards: `[user@]host[:RUN_DIR]`, read over ssh (RUN_DIR defaults to CKPT_DIR's path)."""

    spec: str
    host: str
    run: str
    environ: dict[str, str] = field(default_factory=dict, repr=False)  # rsync's (RSYNC_RSH from .env too)

    def url(self, relative: str) -> str:
        return f"{self.host}:{self.run.rstrip('/')}/{relative}"


def parse_nodes(text: str, local_run: Path, environ: dict[str, str] | None = None) -> list[Node]:
    nodes = []
    for spec in text.replace(",", " ").split():
        host, _, path = spec.partition(":")  # no RUN_DIR, the usual case: the same absolute path on every node
        nodes.append(Node(spec, host, path or str(local_run), dict(environ or {})))
    return nodes


# What ssh says when it never got a working connection. rsync then exits 255 (ssh's own code), or 12
# ("connection unexpectedly closed") where it noticed the closed pipe before ssh had exited: a race, so the
# exit code alone cannot tell a host that is not there from a path that is not there.
_SSH_ERRORS = re.compile(r"^ssh: |Could not resolve hostname|Permission denied \(|Host key verification failed|"
                         r"kex_exchange_identification|Connection (closed|reset) by|Connection timed out")


def _rsync(args: list[str], node: Node, what: str, missing_ok: bool = False, into: Path | None = None,
           needed: int | None = None) -> str | None:
    """rsync over ssh; a one-line UserError on failure, or None if missing_ok and the source does not exist.
    `into`: the local file it writes (its directory named, with `needed` bytes, when that disk is full)."""
    if shutil.which("rsync") is None:
        raise UserError("rsync is not installed on this node: install it (apt-get install rsync openssh-client)")
    cmd = ["rsync"]
    if not node.environ.get("RSYNC_RSH"):  # RSYNC_RSH (rsync's own) overrides
        cmd += ["-e", "ssh -o BatchMode=yes -o ConnectTimeout=10"]
    # its own process group: rsync leaves without waiting for its ssh when the connection closes (exit 12);
    # what is left of the group (ssh, a wrapper named in RSYNC_RSH) is ended below, so nothing outlives gather
    proc = subprocess.Popen(cmd + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=node.environ or None, start_new_session=True, preexec_fn=ends_with_us)
    try:
        stdout, stderr = proc.communicate()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
    if proc.returncode == 0:
        return stdout
    # rsync code 23 + "change_dir ... No such file": the source is absent (the remote's message may come
    # anywhere among the local side's, in either order).
    if missing_ok and proc.returncode == 23 and "No such file or directory" in stderr:
        return None
    # Show the cause, not its echoes: rsync's "rsync error: ... (code N)" summary and the broken pipe or
    # closed connection that follow the other side quitting say nothing about why.
    lines = [line for line in stderr.splitlines() if line.strip()]
    echoes = ("rsync error:", "Warning: Permanently added")
    causes = [line for line in lines if not line.startswith(echoes)
              and "Broken pipe" not in line and "connection unexpectedly closed" not in line]
    detail = _one_line((causes or lines or [""])[0])
    ssh_error = next((line for line in lines if _SSH_ERRORS.search(line)), None)
    if ssh_error is not None and "Could not resolve hostname" in ssh_error:
        raise UserError(f"cannot resolve the host name {node.host} (NODES) to {what} ({_one_line(ssh_error)}): "
                        "check its spelling, or give that node's IP address in NODES")
    if ssh_error is not None or proc.returncode == 255:
        raise UserError(f"cannot reach {node.host} over ssh to {what} ({_one_line(ssh_error or detail)}): make "
                        f"`ssh {node.host}` work without a password from this node (ssh-copy-id {node.host}), or "
                        "use a shared volume")
    if re.search(r"rsync: (command )?not found", stderr):
        raise UserError(f"{node.host} has no rsync ({detail}): install it there (apt-get install rsync)")
    if into is not None and (number := no_room_errno(OSError(stderr))) is not None:  # rsync's "(28)" is text
        raise NoRoom(into.parent, "CKPT_DIR", needed, into.name, number)
    raise UserError(f"rsync from {node.spec} failed to {what} (exit {proc.returncode}: {detail}): check that "
                    f"{node.url('')} exists on that node")


def _listing(node: Node, relative: str) -> dict[str, int] | None:
    """relative path -> size of the files under RUN_DIR/relative on the node; None if it is not there."""
    out = _rsync(["-r", "--list-only", node.url(relative.rstrip("/") + "/")], node, f"list {relative}", missing_ok=True)
    if out is None:
        return None
    rows = [line.split(None, 4) for line in out.splitlines()]
    return {parts[4]: int(parts[1].replace(",", "").replace(".", "")) for parts in rows
            if len(parts) == 5 and parts[0].startswith("-")}


def _copy_with_progress(node: Node, relative: str, dest: Path, size: int, bar) -> None:
    """rsync one file; the bar follows rsync's temporary file (.NAME.XXXXXX) as it grows."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    done = threading.Event()
    start = bar.n

    def follow():
        while not done.wait(0.5):
            grown = sum(p.stat().st_size for p in dest.parent.glob(f".{dest.name}.*") if p.is_file())
            bar.update(max(0, start + min(grown, size) - bar.n))

    watcher = threading.Thread(target=follow, daemon=True)
    watcher.start()
    try:
        _rsync(["-a", node.url(relative), str(dest)], node, f"copy {relative}", into=dest, needed=size)
    finally:
        done.set()
        watcher.join()
    bar.update(start + size - bar.n)
    if dest.stat().st_size != size:
        raise UserError(f"{dest} has {dest.stat().st_size} bytes but {node.spec} lists {size}: the file changed "
                        "during the copy (is training still saving?); rerun make gather once the save is done")


def _latest_on_nodes(nodes: list[Node]) -> int:
    """Only rank 0's node has the trainer's pointer to the latest step: read it from whichever has it."""
    numbers = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, node in enumerate(nodes):
            if LATEST_FILE in (_listing(node, "") or {}):
                _rsync([node.url(LATEST_FILE), f"{tmp}/{i}/"], node, f"read {LATEST_FILE}")
                if (number := latest_step(Path(tmp, str(i)))) is not None:
                    numbers.append(number)
    if not numbers:
        raise UserError(f"no {LATEST_FILE} here nor on {', '.join(n.spec for n in nodes) or 'any node'}: "
                        "set STEP=N (the global_step_N to gather)")
    return max(numbers)


def _to_copy(nodes: list[Node], local_step: Path, spec: int) -> tuple[dict[str, tuple[Node, int]], str]:
    """relative path -> (node, size) of each shard and rank-0 file of the step this node lacks, and the
    GRPO layout's "actor/" prefix (or ""); a file that differs between nodes is refused, as are mixed worlds."""
    local_files = {str(p.relative_to(local_step)): p.stat().st_size
                   for p in local_step.rglob("*") if p.is_file()} if local_step.is_dir() else {}
    holdings = {node.spec: _listing(node, local_step.name) or {} for node in nodes}
    held = [rel for files in (local_files, *holdings.values()) for rel in files]
    prefix = "actor/" if any(rel.startswith("actor/") for rel in held) else ""  # GRPO layout
    worlds: dict[int, set[str]] = {}  # world size -> where shards of it are
    for rel in local_files:
        if match := SHARD_RE.match(rel[len(prefix):]):
            worlds.setdefault(int(match.group(1)), set()).add("this node")
    wanted: dict[str, tuple[Node, int]] = {}
    for node in nodes:
        for rel, size in holdings[node.spec].items():
            name = rel[len(prefix):]
            match = SHARD_RE.match(name)
            rank0_file = name in ("fsdp_config.json", "lora_train_meta.json") or name.startswith("huggingface/")
            if not rel.startswith(prefix) or not (match or rank0_file):
                continue  # optimizer and extra state: not needed to merge
            if match:
                worlds.setdefault(int(match.group(1)), set()).add(node.spec)
            if match and rel in local_files and local_files[rel] != size:
                raise UserError(f"{prefix}{name} differs between this node ({local_files[rel]} bytes) and "
                                f"{node.spec} ({size} bytes): one is from an older run; remove the stale copy")
            if match and rel in wanted and wanted[rel][1] != size:
                raise UserError(f"{rel} is on both {wanted[rel][0].spec} and {node.spec} with different sizes: "
                                "one is from an older run; remove the stale copy")
            if rel not in local_files:
                wanted.setdefault(rel, (node, size))
    if len(worlds) > 1:
        detail = "; ".join(f"world size {w} on {', '.join(sorted(where))}" for w, where in sorted(worlds.items()))
        raise UserError(f"step {spec} has shards of different world sizes ({detail}): stale shards from another "
                        "run; remove them")
    return wanted, prefix


def gather(ckpt_dir: Path, step: str | None, nodes_text: str | None, environ: dict[str, str] | None = None) -> Path:
    """Pull the shards of one step from every node into this node's run directory; return its shard dir."""
    from tqdm import tqdm

    ckpt_dir = resolved(ckpt_dir, "CKPT_DIR")
    nodes = parse_nodes(nodes_text or "", ckpt_dir, environ)
    if not nodes and not ckpt_dir.is_dir():
        raise UserError(f"no run directory {ckpt_dir} on this node and no NODES to pull from: set CKPT_DIR to "
                        "the run, and NODES=\"host1 host2\" to the nodes that hold its shards")
    spec = step if isinstance(step, int) else latest_step(ckpt_dir)
    if spec is None:
        spec = _latest_on_nodes(nodes)
    local_step = step_dir(ckpt_dir, spec)
    local_shards = _shard_dir(local_step)
    with contextlib.suppress(UserError):
        shards = check_complete(local_shards)
        say(f"all {shards.world_size} ranks of step {spec} are already in {local_shards} (a shared volume, or "
            "gathered before): nothing to do")
        return local_shards
    if not nodes:
        raise UserError(f"{local_shards} lacks shards from other nodes and NODES is empty: set NODES=\"<ip of "
                        "every node>\" (ssh access from here) or use a shared volume")
    wanted, prefix = _to_copy(nodes, local_step, spec)
    total = sum(size for _, size in wanted.values())
    check_room(local_step, total, "CKPT_DIR", f"the {len(wanted)} files of step {spec}", "they need")
    say(f"gathering {len(wanted)} files ({total / 2**30:.2f} GiB) of step {spec} from "
        f"{len({n.spec for n, _ in wanted.values()})} node(s) into {local_step}")
    with tqdm(total=total, unit="B", unit_scale=True, desc="Gathering shards", disable=None) as bar:  # as merge's
        for rel, (node, size) in sorted(wanted.items()):
            _copy_with_progress(node, f"{local_step.name}/{rel}", local_step / rel, size, bar)
    if not (ckpt_dir / LATEST_FILE).is_file():
        with atomic_path(ckpt_dir / LATEST_FILE) as tmp:
            tmp.write_text(str(spec))
    shards = check_complete(local_step / prefix)
    say(f"all {shards.world_size} ranks of step {spec} are in {shards.directory}: next, make merge STEP={spec}")
    return shards.directory


def main(command: str, argv: list[str], settings: Settings) -> int:
    if command not in ("merge", "gather"):
        raise UserError(f"unknown checkpoint command {command!r}: use gather or merge")
    parser = ArgParser(prog=f"python -m app {command}", description=(merge if command == "merge" else gather).__doc__)
    parser.add_argument("--ckpt-dir", default=None, help="run directory here (default: CKPT_DIR or the job's)")
    parser.add_argument("--step", default=settings.get("STEP", "latest"), type=step_arg,
                        help="step number or latest (STEP)")
    if command == "merge":
        parser.add_argument("--out", default=settings["OUT_DIR"], help="output directory (OUT_DIR)")
        parser.add_argument("--force", action="store_true", default=settings["FORCE"], help="replace OUT_DIR")
        parser.add_argument("--engine", default="stream", choices=["stream", "verl"],
                            help="stream (default): verl's merge tensor by tensor through memory-mapped shards, "
                                 "bit-identical, a fraction of the memory; verl: verl.model_merger as is")
        parser.add_argument("--file-mb", type=float, default=STREAM_FILE_BYTES / 2**20,
                            help="size of each output safetensors file (stream engine; memory is about twice it)")
    else:
        parser.add_argument("--nodes", default=settings["NODES"], help='NODES: "ip1 ip2 ..." ([user@]host[:RUN_DIR]; '
                            "RUN_DIR defaults to the same path as here)")
    args = parser.parse_args(argv)
    path = args.ckpt_dir or settings["CKPT_DIR"]
    if path:  # a symlink loop, in one line naming it (default_run_dir resolves it: RuntimeError)
        refuse_symlink_loop(path, "CKPT_DIR")
    ckpt_dir = Path(args.ckpt_dir) if args.ckpt_dir else default_run_dir(settings)
    if command == "gather":
        gather(ckpt_dir, args.step, args.nodes, settings.environ())
    else:
        merge(ckpt_dir, args.step, Path(args.out) if args.out else None, args.force, engine=args.engine,
              file_bytes=int(args.file_mb * 2**20))
    return 0
