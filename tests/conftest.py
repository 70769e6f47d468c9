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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen2 model + tokenizer + chat template, written once per test session."""
    from app.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


def run_app(*args: str, env: dict | None = None, cwd: Path | None = None, timeout: float = 600):
    """Run `python -m app ...` as a user would: a real subprocess, captured output."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "app", *args], cwd=cwd or REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


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
