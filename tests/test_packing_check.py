"""scripts/packing_check.py on CPU: verl's packed (remove-padding) call keeps samples apart, and one training
step on it gives the same gradients with each attention implementation that runs a backward here. The
GPU runs it with flex_attention too (docs/gpu-runs.md); the controls show that each check can fail."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import REPO


def packing_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "packing_check.py"), "--device", "cpu", *args],
                          capture_output=True, text=True, timeout=600, cwd=REPO)


def test_packed_rows_keep_samples_apart_and_the_leaking_control_shows_it():
    result = packing_check("--impl", "sdpa", "eager")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stdout.splitlines() if "ISOLATED" in line]
    assert len(lines) == 2
    for line in lines:
        control = float(re.search(r"all-ones attention_mask: max\|diff\|=([0-9.e+-]+)", line).group(1))
        assert control > 1e-2  # the leaking call changes the losses: the check can fail


def test_one_training_step_on_a_packed_row_has_the_same_gradients_with_sdpa_and_varlen_as_with_eager():
    result = packing_check("--grads", "--impl", "eager", "sdpa", "varlen_attention")
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    control = float(re.search(r"leaking across samples: worst grad diff ([0-9.e+-]+)", result.stdout).group(1))
    assert control > 0.1  # a leak moves the gradients by far more than the tolerance
    for impl in ("sdpa", "varlen_attention"):
        line = next(line for line in result.stdout.splitlines() if line.startswith(impl))
        assert "SAME GRADIENTS" in line and float(re.search(r"worst grad diff ([0-9.e+-]+)", line).group(1)) <= 1e-3
