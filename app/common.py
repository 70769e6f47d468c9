"""Pieces every stage shares: the one-line user error, argument parsing, atomic writes, output."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import os
import re
import shutil
import signal
import stat
import sys
import time
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
    existing = existing_parent(path)
    if not existing.is_dir():
        return f"is under {existing}, which is a file"
    if writable and not os.access(existing, os.W_OK | os.X_OK):
        return "is not writable" if existing == path else f"cannot be created in {existing} (not writable)"
    return None


class UserError(Exception):
    """A failure the user can fix, saying what is wrong and what to do: the CLI prints it as one line (no
    traceback) and exits non-zero."""

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


def stop_once(signum, frame) -> None:
    """The CLI's handler of SIGTERM and Ctrl-C: the first raises (Terminated, KeyboardInterrupt); later ones are let
    pass, because one raised inside the cleanup the first started (a scheduler's second SIGTERM, a second Ctrl-C)
    would cut it short and leave the Ray head or trainer running."""
    for other in (signal.SIGTERM, signal.SIGINT):
        if signal.getsignal(other) is stop_once:
            signal.signal(other, _let_pass)  # a Python handler, not SIG_IGN: a child started later gets the default
    raise KeyboardInterrupt if signum == signal.SIGINT else Terminated


def _let_pass(signum, frame) -> None:
    pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def sweep_stale_temporaries(final: Path) -> list[Path]:
    """Remove the `.NAME.tmp-PID-*` / `.NAME.old-PID-*` siblings of `final` that atomic_path left behind when
    killed (SIGKILL, OOM, power loss), and return them; a live process's (a concurrent run) are kept."""
    prefix, removed = f".{final.name}.", []
    try:
        siblings = list(final.parent.iterdir())
    except OSError:
        return removed
    for sibling in siblings:
        if not sibling.name.startswith(prefix):
            continue
        kind, _, rest = sibling.name[len(prefix):].partition("-")
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


def writable_dir(directory: Path, setting: str | None = None) -> Path:
    """Create `directory` if needed and check that this process may create files in it (else UserError)."""
    directory = Path(directory)
    refuse_symlink_loop(directory, setting)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        reason = "a file is in the way (not a directory)"
    except OSError as exc:
        if exc.errno in NO_ROOM:
            raise NoRoom(directory, setting, None, directory.name, exc.errno) from None
        reason = exc.strerror or type(exc).__name__
        if exc.filename and str(exc.filename) != str(directory):
            reason += f" at {exc.filename}"
    else:
        if os.access(directory, os.W_OK | os.X_OK):
            return directory
        try:
            read_only = os.statvfs(directory).f_flag & os.ST_RDONLY
        except OSError:
            read_only = False
        reason = "read-only file system" if read_only else "permission denied"
    named = f" ({setting})" if setting else ""
    where = f"set {setting} to a writable directory" if setting else "choose a writable location"
    raise UserError(f"cannot write {directory}{named}: {reason}: {where}, or fix its permissions / mount")


# --- paths the user gives -----------------------------------------------------------------------------

def _stat_errno(path: Path) -> int | None:
    try:
        os.stat(path)
    except OSError as exc:
        return exc.errno
    return None


def refuse_symlink_loop(path: Path | str, setting: str | None = None) -> None:
    """One line naming the link where `path` (the value of `setting`) runs through a symbolic link loop.
    pathlib reads such a path as absent (exists() is False) and resolve() raises RuntimeError, so without
    this a loop is "does not exist", replaced by a rename, or an internal error."""
    given = Path(path).expanduser()
    if _stat_errno(given) != errno.ELOOP:
        return
    # the culprit is the shortest prefix that loops
    loop = next((p for p in [*reversed(given.parents), given] if _stat_errno(p) == errno.ELOOP), given)
    named = f" ({setting})" if setting else ""
    try:
        target = f" -> {os.readlink(loop)}"
    except OSError:
        target = ""
    inside = "" if loop == given else f"{path}{named}: "
    raise UserError(f"{inside}{loop}{'' if inside else named} is a symbolic link that loops back on itself{target}, "
                    f"so nothing can be read or written through it: point {setting or 'the path'} at a real "
                    f"file or directory, or repoint the link (ln -sfn TARGET {loop})")


def resolved(path: Path | str, setting: str | None = None) -> Path:
    """`path` made absolute with links resolved, for a path the user gave (a loop refused in one line)."""
    refuse_symlink_loop(path, setting)
    return Path(path).expanduser().resolve()


def file_problem(path: Path) -> str | None:
    """Why `path` cannot be read as a regular file, as the end of a sentence about it; None where it can.
    stat only, never open: opening a FIFO blocks until some other process writes to it."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "does not exist"
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "is a symbolic link that loops back on itself"
        return f"cannot be read ({exc.strerror})"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "is a directory"
    if stat.S_ISFIFO(mode):
        return "is a FIFO (named pipe), not a file: reading it would wait for a writer forever"
    if stat.S_ISSOCK(mode):
        return "is a socket, not a file"
    return "is a device, not a file"


# --- full disks ---------------------------------------------------------------------------------------
NO_ROOM = (errno.ENOSPC, errno.EDQUOT)
# How writers that do not raise a plain OSError say it: safetensors (Rust: "os error 28", StorageFull),
# pyarrow's "[errno 28]" detail, a library that wraps the OSError in its own exception.
_NO_ROOM_TEXT = ((re.compile(r"No space left on device|os error 28\b|StorageFull"), errno.ENOSPC),
                 (re.compile(r"Disk quota exceeded|os error 122\b|QuotaExceeded"), errno.EDQUOT))


def no_room_errno(exc: BaseException | None) -> int | None:
    """ENOSPC or EDQUOT where `exc`, or an exception it came from, is a full disk or an exhausted quota."""
    seen = set()
    while exc is not None and id(exc) not in seen and not isinstance(exc, UserError):
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in NO_ROOM:
            return exc.errno
        for pattern, number in _NO_ROOM_TEXT:
            if pattern.search(str(exc)):
                return number
        exc = exc.__cause__ or exc.__context__
    return None


def human_bytes(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def existing_parent(path: Path) -> Path:
    """`path` or the nearest directory above it that exists."""
    return next((p for p in [path, *path.parents] if p.exists()), Path("/"))


def free_bytes(directory: Path) -> int | None:
    """Bytes this user may still write on the disk of `directory` (or of the nearest directory above it)."""
    try:
        fs = os.statvfs(existing_parent(Path(directory)))
    except OSError:
        return None
    return fs.f_bavail * fs.f_frsize


class NoRoom(UserError):
    """The one line for a full disk or an exhausted quota: which directory, how much the write needs where that
    is known, how much is free (measured when the line is printed: after the failed write's temporaries are gone)."""

    def __init__(self, directory: Path, setting: str | None, needed: int | None, what: str, number: int = errno.ENOSPC,
                 ahead: bool = False, needs: str = "it needs about"):
        super().__init__(str(directory))
        self.directory, self.setting, self.needed, self.what = Path(directory), setting, needed, what
        self.number, self.ahead, self.needs = number, ahead, needs

    def __str__(self) -> str:
        named = f" ({self.setting})" if self.setting else ""
        where = f"set {self.setting} to a disk with room" if self.setting else "write it to a disk with room"
        amounts = [f"{self.needs} {human_bytes(self.needed)}"] if self.needed else []
        if self.number == errno.EDQUOT:
            head = f"disk quota exceeded in {self.directory}{named} writing {self.what}"
            fix = f"free space in your quota there or {where}"
        else:
            start = "not enough space" if self.ahead else "no space left"
            head = f"{start} on the disk of {self.directory}{named} {'for' if self.ahead else 'writing'} {self.what}"
            fix = f"free space there or {where}"
            free = free_bytes(self.directory)
            if free is not None:
                amounts.append(f"{human_bytes(free)} is free there")
        tail = "nothing was written" if self.ahead else "nothing half-written was kept"
        detail = f" ({', '.join(amounts)})" if amounts else ""
        return f"{head}{detail}: {fix}; {tail}"


def check_room(directory: Path, needed: int, setting: str | None, what: str, needs: str = "it needs about") -> None:
    """Refuse, before anything is written, a write of about `needed` bytes where less is free."""
    free = free_bytes(directory)
    if free is not None and free < needed:
        raise NoRoom(directory, setting, needed, what, ahead=True, needs=needs)


# --- writing ----------------------------------------------------------------------------------------

def _umask() -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as status:  # reads it without changing it
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(root: Path) -> None:
    """Give `root` and everything under it the mode a plain create gives under the user's umask (0644 files,
    0755 directories under 022). Writers that go through a private temporary file (safetensors' save_file,
    tempfile.mkstemp: 0600) or mkdtemp (0700) would otherwise hand other accounts files they cannot read."""
    mask = _umask()
    paths = [root]
    if root.is_dir() and not root.is_symlink():
        for directory, dirnames, filenames in os.walk(root):  # links are not followed
            paths += [Path(directory) / name for name in dirnames + filenames]
    for path in paths:
        mode = os.lstat(path).st_mode
        if stat.S_ISLNK(mode):
            continue
        full = 0o777 if stat.S_ISDIR(mode) or mode & 0o111 else 0o666
        wanted = (full & ~mask) | (mode & stat.S_ISGID if stat.S_ISDIR(mode) else 0)  # keep group inheritance
        if stat.S_IMODE(mode) != wanted:
            os.chmod(path, wanted)


@contextlib.contextmanager
def atomic_path(final: Path | str, setting: str | None = None, needed: int | None = None,
                what: str | None = None, needs: str = "it needs about") -> Iterator[Path]:
    """Yield a temporary sibling of `final` (file or directory) and rename it into place, with the modes of the
    user's umask, on success; on any failure (exception, Ctrl-C, SIGTERM) remove it: `final` is the complete
    new result or untouched. An unwritable parent and a full disk or quota (whichever writer hit it; `needed`
    bytes, where known, are checked before anything is written) are one line naming `setting` and `what`,
    saying the amount as `needs`. The caller decides beforehand whether an existing `final` may be replaced."""
    final = Path(final)
    what = what or final.name
    refuse_symlink_loop(final, setting)
    writable_dir(final.parent, setting)
    sweep_stale_temporaries(final)
    if needed:
        check_room(final.parent, needed, setting, what, needs)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        try:
            yield tmp
            apply_umask(tmp)
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
    except Exception as exc:  # noqa: BLE001 - only a full disk is turned into its line; the rest is re-raised
        number = no_room_errno(exc)
        if number is None:
            raise
        raise NoRoom(final.parent, setting, needed, what, number, needs=needs) from None


def hydra_quoted(text: str) -> str:
    """`text` as a quoted string of Hydra's override grammar. There a run of backslashes is literal unless a
    quote follows it, and then it is halved: only those runs are doubled (a path's `a\\b` stays as it is)."""
    body = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", text)
    return "'" + re.sub(r"(\\+)$", lambda m: m.group(1) * 2, body) + "'"


_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def ends_with_us() -> None:
    """preexec_fn of what the stack starts in a session of its own: Linux sends it SIGTERM when the command that
    started it dies, even by SIGKILL (the OOM killer, which kills only that), and it stops its children as under
    stop_group, instead of training on orphaned. PR_SET_PDEATHSIG, which subprocess has no argument for."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG; resolved before the fork, so the child only calls it


def stop_group(process, what: str = "", grace: float = 60.0) -> None:
    """The one way the stack stops what it started (start_new_session=True): SIGTERM to the leader, which stops
    its own children in order (`ray start --block` its Ray processes, torchrun its ranks, the warm-up vLLM's
    child); then SIGTERM to what is left of its group, SIGKILL after `grace` seconds in all. Signalling the
    whole group at once would kill Ray's GCS under `ray start`, which then waits 30 s and prints a traceback."""
    def group_alive() -> bool:
        process.poll()  # reaps the leader (a zombie still counts as a member of its group)
        try:
            os.killpg(process.pid, 0)
            return True
        except ProcessLookupError:
            return False

    if process is None or not group_alive():
        return
    deadline = time.monotonic() + grace
    with contextlib.suppress(ProcessLookupError):
        os.kill(process.pid, signal.SIGTERM)
    while process.poll() is None and time.monotonic() < deadline:  # the leader stops its own children
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)  # what it left behind
    while group_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    if not group_alive():
        return
    if what:
        warn(f"{what} did not stop within {grace:.0f}s: killing it")
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def mute(stream) -> None:
    """The rest of `stream` to /dev/null: its reader is gone (`make ... | head`), and the command still has to stop
    what it started and exit with its own code instead of a BrokenPipeError."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())


def write_line(message: str, stream) -> None:
    """print, flushed; muted once its reader is gone."""
    try:
        print(message, file=stream, flush=True)
    except BrokenPipeError:
        mute(stream)


def repo_first(pythonpath: str) -> str:
    """PYTHONPATH with this checkout first: a child process imports `app` whatever its cwd, installed or not."""
    return os.pathsep.join([str(REPO_ROOT), *(p for p in pythonpath.split(os.pathsep) if p and p != str(REPO_ROOT))])


def say(message: str) -> None:
    """Progress and results for the user (stdout, flushed so logs interleave correctly)."""
    write_line(message, sys.stdout)


def warn(message: str) -> None:
    write_line(f"warning: {message}", sys.stderr)
