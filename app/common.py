"""Pieces every stage shares: the one-line user error, atomic writes, environment settings."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Iterator

REPO_ROOT = Path(__file__).resolve().parent.parent


# Variables a launch hands on to its processes (and Ray actors, through `ray start`) and shows in DRY_RUN;
# app.containers hands the same ones to the container.
PASS_PREFIXES = ("NCCL_", "GLOO_", "SWANLAB_", "HF_", "TRANSFORMERS_", "TORCH_", "CUDA_", "NVSHMEM_",
                 "VLLM_", "VERL_", "RAY_", "PYTORCH_", "OMP_", "TOKENIZERS_")
PASS_NAMES = ("PYTHONPATH", "LD_LIBRARY_PATH")


class UserError(Exception):
    """A failure the user can fix. The CLI prints it as one line (no traceback) and exits non-zero.

    The message should say what is wrong *and* what to do about it.
    """

    exit_code = 2


class ArgParser(argparse.ArgumentParser):
    """argparse whose usage mistakes fail as one UserError line (the house rule), not usage text + exit 2."""

    def error(self, message):
        raise UserError(f"{message}: see `{self.prog} --help`")


def verl_dir() -> Path | None:
    """The installed verl package's directory, found without importing verl (its import costs seconds:
    torch and Ray), or None where verl is not installed."""
    import importlib.util

    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def env(name: str, default: str | None = None) -> str | None:
    """An environment setting; empty strings count as unset (Make passes empty variables through)."""
    value = os.environ.get(name)
    return value if value not in (None, "") else default


def env_int(name: str, default: int) -> int:
    raw = env(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise UserError(f"{name}={raw!r} is not an integer: set {name} to a whole number") from None


def env_flag(name: str) -> bool:
    return (env(name, "0") or "0").lower() in ("1", "true", "yes", "on")


@contextlib.contextmanager
def atomic_path(final: Path | str) -> Iterator[Path]:
    """Yield a temporary sibling of `final` (file or directory) and rename it into place on success.

    On any failure (exception, Ctrl-C) the temporary is removed, so `final` is either the complete
    new result or untouched: nothing half-written is ever visible under the final name.
    The caller decides beforehand whether an existing `final` may be replaced.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        yield tmp
        if final.is_dir() and not final.is_symlink() and tmp.is_dir():
            # os.replace cannot replace a non-empty directory: move the old one aside first.
            old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()


def say(message: str) -> None:
    """Progress and results for the user (stdout, flushed so logs interleave correctly)."""
    print(message, flush=True)


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


# --- where a run lives ----------------------------------------------------------------------------
# One directory per run holds everything of it: verl's checkpoints (global_step_N/,
# latest_checkpointed_iteration.txt), the JSONL metrics (logs/) and swanlab's local logs (swanlog/).
# It sits under checkpoints/, the directory compose mounts at the same absolute path on every node.
DEFAULT_EXPERIMENT = {"sft": "sft-gsm8k", "grpo": "grpo-gsm8k"}


def run_dir(job: str) -> Path:
    """The run directory of `job` (sft|grpo): CKPT_DIR if set, else checkpoints/<EXPERIMENT>. Absolute."""
    explicit = env("CKPT_DIR")
    if explicit:
        return Path(explicit).expanduser().resolve()
    experiment = env("EXPERIMENT", DEFAULT_EXPERIMENT[job])
    return (Path.cwd() / "checkpoints" / experiment).resolve()
