"""The benchmark scripts' configs compose on CPU (BENCH_CHECK=1): every candidate a GPU call would run goes
through Hydra (verl's own entry point with --cfg job for stock, preflight and verl's validate_config for
our targets), so a typo in a candidate costs no device time (one did in docs/gpu-runs.md run 2)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import REPO


def bench(script: str, configs: list[str], tmp_path, **env) -> subprocess.CompletedProcess:
    full = {**os.environ, "BENCH_CHECK": "1", "PRESET": "tiny", "BENCH_DIR": str(tmp_path / "bench"),
            "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(REPO / "scripts" / script), *configs], env=full, capture_output=True,
                          text=True, timeout=900, cwd=REPO)


def candidates(script: str, pattern: str) -> list[str]:
    """The config names of the script's `case`, e.g. `profile-v0)` lines."""
    text = (REPO / "scripts" / script).read_text()
    return sorted(set(re.findall(pattern, text, re.M)))


def test_every_grpo_bench_config_composes_and_a_refused_one_fails_the_check(tmp_path):
    configs = ["stock", "profile"] + candidates("bench_grpo.sh", r"^\s+(profile-[a-z0-9]+)\)")
    assert {"profile-v0", "profile-unfused", "profile-uni"} <= set(configs)
    result = bench("bench_grpo.sh", configs, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert f"== BENCH_CHECK: {' '.join(configs)} compose" in result.stdout
    # n=1 is refused by preflight (GRPO needs two samples a prompt): the check says which config and fails
    result = bench("bench_grpo.sh", ["profile"], tmp_path, N="1")
    assert result.returncode == 1 and "== BENCH_CHECK: profile do not compose" in result.stderr


def test_every_sft_bench_config_composes(tmp_path):
    configs = candidates("bench_sft.sh", r"^\s+([a-z][a-z0-9-]+)\)\s")
    assert {"stock", "fused", "flex", "profile", "profile-pad"} <= set(configs)
    configs.append("profile-stockopt")
    result = bench("bench_sft.sh", configs, tmp_path, SEQ_TOKENS="64", BATCH="4")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert f"== BENCH_CHECK: {' '.join(configs)} compose" in result.stdout
