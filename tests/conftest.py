"""Shared fixtures. Real processes and real files everywhere; the only stand-ins are tiny models
built from a config (no hub) and, for the torchrun test, a tiny CPU trainer module."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# A developer's own .env must not change what the suite sees: in-process settings and every `python -m app`
# the tests start read no .env unless a test points ENV_FILE at one (tests/test_settings.py does).
os.environ["ENV_FILE"] = os.devnull

FIXTURES = REPO / "tests" / "fixtures"
sys.path.insert(0, str(FIXTURES))  # the stand-in trainers and the helpers the tests import

# The settings a launch reads, taken out of the inherited environment: only what a test sets counts.
LAUNCH_VARS = ("NNODES", "NODE_RANK", "GPUS_PER_NODE", "MASTER_ADDR", "MASTER_PORT", "HEAD_IP", "RAY_PORT",
               "ARGS", "TRAIN_FILE", "VAL_FILE", "CKPT_DIR", "EXPERIMENT", "PROJECT", "DRY_RUN", "FRESH", "CONFIG",
               "DATA_DIR", "MODEL_PATH", "CUDA_VISIBLE_DEVICES", "VLLM_ATTENTION_BACKEND", "RAY_AUTH_TOKEN",
               "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS", "WAIT_TIMEOUT", "RAY_START_ARGS", "NODE_IP", "SFT_TRAINER_MODULE",
               "GRPO_TRAINER_MODULE", "DASHBOARD_HOST", "VLLM_DISABLE_COMPILE_CACHE",
               "TORCH_COMPILE_JOB_ID")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen2 model + tokenizer + chat template, written once per test session."""
    from app.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """Small real parquet files in DATA_DIR's layout, once per test module."""
    from stack_files import write_data_dir

    return write_data_dir(tmp_path_factory.mktemp("data"))


@pytest.fixture
def base_env(tmp_path, data_dir, tiny_model_dir) -> dict[str, str]:
    """A launch's environment: no inherited launch setting; the tiny model, `data_dir`, a run directory of this
    test, and the fixtures importable (the stand-in trainers)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    return {**env, "MODEL_PATH": str(tiny_model_dir), "DATA_DIR": str(data_dir), "CKPT_DIR": str(tmp_path / "run"),
            "PYTHONPATH": f"{FIXTURES}{os.pathsep}{REPO}"}


def run_app(*args: str, env: dict | None = None, cwd: Path | None = None, timeout: float = 600,
            umask: int | None = None):
    """Run `python -m app ...` as a user would: a real subprocess, captured output (under `umask` if given)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "app", *args], cwd=cwd or REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout,
                          preexec_fn=None if umask is None else lambda: os.umask(umask))


def without_make_summary(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """make adds its own `make: *** [Makefile:N: target] Error 2` after a failing recipe: drop that frame,
    what is left is what the app said."""
    # `make: ***`, or `make[1]: ***` when the suite itself runs under make (`make test`)
    kept = [line for line in result.stderr.splitlines() if not re.match(r"make(\[\d+\])?: \*\*\*", line)]
    result.stderr = "\n".join(kept) + ("\n" if kept else "")
    return result


def make(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`make TARGET VAR=...` in the repository, as a user types it (RUNTIME=local: this interpreter's .venv)."""
    full = {**os.environ, "RUNTIME": "local", **(env or {})}
    return without_make_summary(subprocess.run(["make", "--no-print-directory", "-s", *args], cwd=REPO, env=full,
                                               capture_output=True, text=True, timeout=timeout))


def assert_one_line_error(result) -> str:
    """A user-facing failure: non-zero exit, exactly one stderr line starting 'error:', no traceback."""
    assert result.returncode != 0, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.fixture
def small_disk(tmp_path):
    """small_disk(size) -> a fresh directory with a tmpfs of `size` (mount's syntax: 2m, 3336k) mounted on it: a
    real full disk for the writers. Needs root (CI runs as root), else the test is skipped; unmounted after."""
    mounted = []

    def mount(size: str, name: str = "disk") -> Path:
        path = tmp_path / name
        path.mkdir()
        if os.geteuid() != 0:
            pytest.skip("a small real disk is a tmpfs mount, which needs root (CI runs as root)")
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", str(path)], check=True)


def weight_bytes(model_dir: Path) -> int:
    """The bytes of a model's tensors (what the merge and tiny-model estimates count: weights alone)."""
    from safetensors import safe_open

    total = 0
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                total += handle.get_tensor(name).nbytes
    return total


def pages_for(size: int) -> str:
    """A tmpfs size (mount's syntax) of the fewest 4 KiB pages that hold `size` bytes: room for the weights
    alone, so a write of them and anything beside them runs out of space midway."""
    return f"{-(-size // 4096) * 4}k"


def modes(root: Path) -> dict[str, str]:
    """relative path -> its permission bits in octal, for `root` and everything under it."""
    return {str(p.relative_to(root)): oct(p.stat().st_mode & 0o7777) for p in [root, *sorted(root.rglob("*"))]}
