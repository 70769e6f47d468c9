"""Where runs, steps and models live, and what makes a model directory complete.

One directory per run holds everything of it: verl's checkpoints (global_step_N/ and LATEST_FILE), the
JSONL metrics (logs/), swanlab's local logs (swanlog/), the Ray token, the report (report/). It sits
under checkpoints/, the directory compose mounts at the same absolute path on every node. `make merge`
writes models/<run>-step<N>.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from app.common import UserError, say, warn
from app.settings import BY_NAME, Settings, parse

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


def steps_in(run: Path) -> list[int]:
    """The global_step_N directories of `run`, in order."""
    if not run.is_dir():
        return []
    return sorted(int(m.group(1)) for p in run.iterdir() if p.is_dir() and (m := STEP_RE.match(p.name)))


def step_arg(text) -> int | str:
    """A --step argument as the STEP setting reads it: latest or a number."""
    try:
        return parse(BY_NAME["STEP"], str(text))
    except ValueError:
        raise UserError(f"STEP={text!r} is not a step number: set STEP=latest or a number") from None


def resolve_step(run: Path, step: int | str | None) -> int:
    """STEP (the registry's kind: "latest" or a number; unset is latest) as a step number of `run`: latest is
    the one verl resumes from (its LATEST_FILE), else the highest global_step_N present, said in a warning.
    The one reading of STEP for merge, gather, eval and smoke."""
    if isinstance(step, int):
        return step
    number = latest_step(run)
    if number is not None:
        return number
    present = steps_in(run)
    if not present:
        raise UserError(f"no saved step in {run} (no global_step_N/ directory): check CKPT_DIR, and that "
                        "training ran with a save frequency (trainer.save_freq > 0), or set STEP=N")
    warn(f"no readable {LATEST_FILE} in {run}: using the highest step present, {present[-1]}")
    return present[-1]


def logs_dir(run: Path) -> Path:
    return run / "logs"


def swanlog_dir(run: Path) -> Path:
    return run / "swanlog"


def token_file(run: Path) -> Path:
    return run / ".ray_auth_token"


def merged_model_dir(run_name: str, step: int | None) -> Path:
    """Where `make merge` writes a step of run `run_name` unless OUT_DIR says otherwise."""
    return Path.cwd() / "models" / (f"{run_name}-step{step}" if step is not None else run_name)


def merged_model_for_step(step: int | str, settings: Settings) -> Path:
    """The directory `make merge STEP=N` wrote: OUT_DIR, else models/<run name>-step<N> (latest: of the run here)."""
    if settings["OUT_DIR"]:
        return Path(settings["OUT_DIR"]).expanduser().resolve()
    models = Path.cwd() / "models"
    try:
        run = default_run_dir(settings)
    except UserError:  # no checkpoints on this node (a separate eval box): look at models/ alone
        run = None
    if step == "latest":
        if run is None:
            raise UserError("STEP=latest needs the run here (CKPT_DIR): set STEP to the merged step, or MODEL")
        step = resolve_step(run, step)
    found = [merged_model_dir(run.name, step)] if run is not None else []
    found = [p for p in found if p.is_dir()] or sorted(p for p in models.glob(f"*-step{step}") if p.is_dir())
    if len(found) == 1:
        return found[0]
    if not found:
        raise UserError(f"no merged model for step {step} under {models}: run `make merge STEP={step}` first, "
                        "or pass MODEL=<model directory>")
    raise UserError(f"several merged models for step {step}: {', '.join(p.name for p in found)}: "
                    "pass MODEL=<one of them>")


@dataclass(frozen=True)
class Model:
    """A Hugging Face model directory with its config.json read once: preflight, perf, doctor, the warm-up and the
    node comparison share it (read_model caches it per path)."""

    path: Path
    config: dict  # {} where absent or unreadable (problems says why)
    problems: tuple[str, ...]  # what the directory lacks, each as "has no ..." would end; () when complete

    @property
    def text(self) -> dict:
        """The language model's part of config.json (a multimodal config nests it)."""
        return self.config.get("text_config") or self.config

    @property
    def architectures(self) -> list[str]:
        return [name for name in self.config.get("architectures") or [] if isinstance(name, str)]

    @property
    def heads(self) -> int | None:
        return self.text.get("num_attention_heads")

    @property
    def weights(self) -> list[Path]:
        return sorted([*self.path.glob("*.safetensors"), *self.path.glob("*.bin")]) if self.path.is_dir() else []


def read_model(path: Path) -> Model:
    """The model directory at `path`: config, tokenizer, weights (*.safetensors or *.bin, none of them empty).
    Read once per command (cached as long as config.json is the same file)."""
    try:  # the directory's own stat too: a tokenizer or weights file added beside an unchanged config.json
        version = tuple((s.st_mtime_ns, s.st_size, s.st_ino) for s in (Path(path).stat(), (Path(path) / "config.json").stat()))
    except OSError:
        version = None
    return _read_model(Path(path), version)


@functools.cache
def _read_model(path: Path, version) -> Model:
    if not path.is_dir():
        return Model(path, {}, ("not a directory",))
    problems, config = [], {}
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
                config = config if isinstance(config, dict) else {}
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        problems.append("no tokenizer (tokenizer.json / tokenizer_config.json)")
    weights = Model(path, config, ()).weights
    empty = [w.name for w in weights if w.stat().st_size == 0]
    if not weights:
        problems.append("no weights (*.safetensors or *.bin)")
    elif empty:
        problems.append(f"an empty weights file ({', '.join(empty)})")
    return Model(path, config, tuple(problems))


# --- one live launch per node of a run directory ------------------------------------------------------
LOCKS = ".locks"  # <run>/.locks/<node>.json: host, pid, start, command of the launch that holds it
HEARTBEAT_S = 10.0  # the holder touches its lock this often
STALE_S = 60.0  # a lock untouched this long, whose process cannot be seen from here, has lost its holder


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _holder_alive(info: dict, path: Path) -> bool:
    """Whether the launch that wrote lock `path` still runs: its process where this node can see it (same host
    and pid namespace: a container has its own), else its heartbeat (another node on a shared volume)."""
    import psutil

    if info.get("host") == socket.gethostname() and info.get("pidns") == _pid_namespace():
        try:
            return abs(psutil.Process(info["pid"]).create_time() - info.get("pid_started", 0)) < 1
        except (psutil.NoSuchProcess, KeyError, TypeError, ValueError):
            return False
        except psutil.AccessDenied:
            return True
    try:
        return time.time() - path.stat().st_mtime < STALE_S
    except OSError:
        return False


def _holder(info: dict) -> str:
    return f"`{info.get('command', '?')}` on {info.get('host', '?')} (pid {info.get('pid', '?')}, since {info.get('started', '?')})"


def live_locks(run: Path) -> dict[str, str]:
    """node name -> the launch that holds it, for every live lock of `run`."""
    out = {}
    for path in sorted((run / LOCKS).glob("*.json")) if (run / LOCKS).is_dir() else []:
        try:
            info = json.loads(path.read_text())
        except (OSError, ValueError):
            info = {}
        if isinstance(info, dict) and _holder_alive(info, path):
            out[path.stem] = _holder(info)
    return out


class RunLock:
    """This node's lock of a run directory, held while a launch runs: a second launch into a live run is
    refused naming the holder; a lock whose holder is gone (SIGKILL, a crashed node) is taken over with a note.
    O_EXCL creation and a heartbeat work on a volume that several nodes share (NFS), where flock may not."""

    def __init__(self, run: Path, node: str, command: str):
        import psutil

        self.path = run / LOCKS / f"{node}.json"
        self.info = {"host": socket.gethostname(), "pid": os.getpid(), "pidns": _pid_namespace(),
                     "pid_started": psutil.Process().create_time(), "command": command,
                     "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        self._stop = threading.Event()

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                try:
                    info = json.loads(self.path.read_text())
                except (OSError, ValueError):  # being written this instant, or left half-written by a kill
                    info = {} if time.time() - self.path.stat().st_mtime > 5 else {"command": "a launch starting"}
                if isinstance(info, dict) and info and _holder_alive(info, self.path):
                    raise UserError(f"{self.path.parent.parent} is in use by {_holder(info)}: wait for it to end or "
                                    "stop it, or set CKPT_DIR to another run directory") from None
                say(f"note: taking over the lock of {self.path.parent.parent} from {_holder(info or {})}, "
                    "which is gone")
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
                continue
            with os.fdopen(fd, "w") as handle:
                json.dump(self.info, handle)
            threading.Thread(target=self._beat, daemon=True).start()
            return
        raise UserError(f"cannot take the lock {self.path}: another launch takes it at the same time; rerun")

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError, ValueError):
            if json.loads(self.path.read_text()).get("pid") == os.getpid():
                self.path.unlink()
