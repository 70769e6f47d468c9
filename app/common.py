"""Pieces every stage shares: the one-line user error, argument parsing, atomic writes, output."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
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


def directory_problem(path: Path, writable: bool = True) -> str | None:
    """Why a command cannot create or write the directory `path` (a file there or above it; with `writable`, no
    write access), as the end of a sentence about it; None where it can."""
    if path.exists() and not path.is_dir():
        return "is a file"
    existing = next(parent for parent in [path, *path.parents] if parent.exists())
    if not existing.is_dir():
        return f"is under {existing}, which is a file"
    if writable and not os.access(existing, os.W_OK | os.X_OK):
        return "is not writable" if existing == path else f"cannot be created in {existing} (not writable)"
    return None


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


class Terminated(KeyboardInterrupt):
    """SIGTERM (docker stop, kill, a scheduler) raised like Ctrl-C, so that every `finally` and
    atomic_path cleans up exactly as for an interrupt; the CLI reports it as one line, exit 143."""


def raise_terminated(signum, frame) -> None:
    raise Terminated


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def sweep_stale_temporaries(final: Path) -> list[Path]:
    """Remove `.NAME.tmp-PID-*` / `.NAME.old-PID-*` siblings of `final` whose process is gone.

    atomic_path cleans its temporary on any exception, but not after SIGKILL, OOM or power loss: the next
    write of the same path does it here. A temporary of a live process (a concurrent run) is kept.
    """
    removed = []
    prefix = f".{final.name}."
    try:
        siblings = list(final.parent.iterdir())
    except OSError:
        return removed
    for sibling in siblings:
        name = sibling.name
        if not name.startswith(prefix):
            continue
        kind, _, rest = name[len(prefix):].partition("-")
        pid = rest.split("-", 1)[0]
        if kind not in ("tmp", "old") or not pid.isdigit() or int(pid) == os.getpid() or _pid_alive(int(pid)):
            continue
        with contextlib.suppress(OSError):
            if sibling.is_dir() and not sibling.is_symlink():
                shutil.rmtree(sibling)
            else:
                sibling.unlink()
            removed.append(sibling)
    return removed


def unwritable(path: Path, reason: str, setting: str | None = None) -> UserError:
    """The one-line refusal for a location we cannot write (permissions, read-only mount, a file in the way)."""
    named = f" ({setting})" if setting else ""
    where = f"set {setting} to a writable directory" if setting else "choose a writable location"
    return UserError(f"cannot write {path}{named}: {reason}: {where}, or fix its permissions / mount")


def writable_dir(directory: Path, setting: str | None = None) -> Path:
    """Create `directory` if needed and check that this process may create files in it (else UserError)."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise unwritable(directory, "a file is in the way (not a directory)", setting) from None
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        if exc.filename and str(exc.filename) != str(directory):
            reason += f" at {exc.filename}"
        raise unwritable(directory, reason, setting) from None
    if not os.access(directory, os.W_OK | os.X_OK):
        reason = "read-only file system" if _read_only_mount(directory) else "permission denied"
        raise unwritable(directory, reason, setting)
    return directory


def _read_only_mount(directory: Path) -> bool:
    try:
        return bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        return False


@contextlib.contextmanager
def atomic_path(final: Path | str, setting: str | None = None) -> Iterator[Path]:
    """Yield a temporary sibling of `final` (file or directory) and rename it into place on success.

    On any failure (exception, Ctrl-C, SIGTERM through the CLI's handler) the temporary is removed, so
    `final` is either the complete new result or untouched: nothing half-written is ever visible under
    the final name. Temporaries left by a killed process (SIGKILL) are removed by the next write of the
    same path. An unwritable parent is a UserError naming it (and `setting`, the variable that chose it).
    The caller decides beforehand whether an existing `final` may be replaced.
    """
    final = Path(final)
    writable_dir(final.parent, setting)
    sweep_stale_temporaries(final)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        yield tmp
        if final.is_dir() and not final.is_symlink() and tmp.is_dir():
            # os.replace cannot replace a non-empty directory: move the old one aside first.
            old = final.parent / f".{final.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
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


def hydra_quoted(text: str) -> str:
    """`text` as a quoted string of Hydra's override grammar. There a run of backslashes is literal unless a
    quote follows it, and then it is halved: only those runs are doubled (a path's `a\\b` stays as it is)."""
    body = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", text)
    return "'" + re.sub(r"(\\+)$", lambda m: m.group(1) * 2, body) + "'"


def stop_group(process, what: str = "", grace: float = 60.0) -> None:
    """The one way the stack stops what it started: SIGTERM to the process group `process` leads (started with
    start_new_session=True, so that its children go too: torchrun's ranks, vLLM's inspection child), SIGKILL
    after `grace` seconds. `ray start --block` stops its own Ray processes on SIGTERM. Nothing where it is over."""
    import signal
    import time

    if process is None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        process.poll()  # reaps the leader (a zombie still counts as a member of its group)
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    if what:
        warn(f"{what} did not stop within {grace:.0f}s: killing it")
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def say(message: str) -> None:
    """Progress and results for the user (stdout, flushed so logs interleave correctly)."""
    print(message, flush=True)


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)
