"""The benchmark scripts' configs compose on CPU (BENCH_CHECK=1): every candidate a GPU call would run goes
through Hydra (verl's own entry point with --cfg job for stock, preflight and verl's validate_config for
our targets), so a typo in a candidate costs no device time (one did in docs/gpu-runs.md run 2)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
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


def test_every_grpo_bench_candidate_and_a_stack_of_them_compose_and_a_refused_one_fails_the_check(tmp_path):
    modifiers = candidates("bench_grpo.sh", r"^\s+([a-z0-9]+)\) (?:extra|run_env)\+=")
    assert {"v0", "unfused", "mp", "nocache", "o0"} <= set(modifiers)
    configs = ["stock", "profile"] + [f"profile-{m}" for m in modifiers] + ["profile-mp+v0+nocache"]
    result = bench("bench_grpo.sh", configs, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert f"== BENCH_CHECK: {' '.join(configs)} compose" in result.stdout
    # the stack reached the launch: every part of it is in the composed command
    stacked = (tmp_path / "bench" / "profile-mp+v0+nocache.log").read_text()
    assert "distributed_executor_backend=mp" in stacked and "trainer.use_v1=False" in stacked
    cold = next(line for line in result.stdout.splitlines() if line.startswith("== profile-cold: "))
    assert f"TORCHINDUCTOR_CACHE_DIR={tmp_path / 'bench' / 'cold-profile-cold' / 'inductor'} " in cold
    # n=1 is refused by preflight (GRPO needs two samples a prompt): the check says which config and fails
    result = bench("bench_grpo.sh", ["profile"], tmp_path, N="1")
    assert result.returncode == 1 and "== BENCH_CHECK: profile do not compose" in result.stderr
    result = bench("bench_grpo.sh", ["profile-mp+nosuch"], tmp_path)
    assert result.returncode == 2 and "unknown config profile-mp+nosuch (nosuch)" in result.stderr


def test_every_sft_bench_config_composes(tmp_path):
    configs = candidates("bench_sft.sh", r"^\s+([a-z][a-z0-9-]+)\)\s")
    assert {"stock", "fused", "flex", "profile", "profile-pad"} <= set(configs)
    configs.append("profile-stockopt")
    result = bench("bench_sft.sh", configs, tmp_path, SEQ_TOKENS="64", BATCH="4")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert f"== BENCH_CHECK: {' '.join(configs)} compose" in result.stdout


def test_the_preflight_bench_times_every_command_and_names_what_each_dry_run_imports(tmp_path):
    result = subprocess.run(["bash", str(REPO / "scripts" / "bench_preflight.sh"), "1"], capture_output=True, text=True,
                            timeout=600, cwd=REPO, env={**os.environ, "PYTHON": sys.executable})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    for label in ("DRY_RUN=1 sft", "DRY_RUN=1 grpo-head", "check grpo (+verl validate)", "grpo-head's preflight"):
        assert re.search(rf"^{re.escape(label)} +run 1: +[\d.]+ s wall", result.stdout, re.M), label
    assert "dry runs left no run directory behind" in result.stdout
    assert re.search(r"^DRY_RUN=1 grpo-head imports, of .*: .*verl", result.stdout, re.M), result.stdout


@pytest.mark.slow
def test_the_startup_bench_starts_grpo_head_with_verls_driver_in_both_trees_and_leaves_nothing_running(tmp_path):
    """One run each of HEAD and this tree (the same code in CI): real Ray heads, verl's real driver up to its
    TaskRunner, stopped with SIGTERM; the script itself fails where a start leaves a process behind."""
    records, log = startup_bench(tmp_path, "grpo")
    for record in records:
        assert 0 < record["cluster ready s"] < record["TaskRunner up s"]
    assert "stopped by SIGTERM" in log and "SIGTERM received" not in log  # our line, not Ray's signal dump


@pytest.mark.slow
def test_the_startup_bench_times_sft_up_to_verls_trainer_imported_in_its_rank_and_the_launch_finishes(tmp_path):
    """--job sft --cold: a real torchrun whose rank imports verl's SFT trainer, its data counted without a cache;
    the script fails where the launch fails or leaves a process behind."""
    records, log = startup_bench(tmp_path, "sft", "--cold")
    assert all(record["job"] == "sft" and record["trainer imported s"] > 0 for record in records)
    assert "SFT finished" in log


def startup_bench(tmp_path, job: str, *extra: str) -> tuple[list[dict], str]:
    """scripts/bench_startup.py, one run of HEAD and one of this tree: its BENCH records and this tree's log."""
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_startup.py"), "--job", job, "--ref", "HEAD",
                             "--runs", "1", "--logs", str(tmp_path), *extra], capture_output=True, text=True,
                            timeout=900, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [json.loads(line[6:]) for line in result.stdout.splitlines() if line.startswith("BENCH ")]
    assert [r["label"].split()[0] for r in records] == ["HEAD", "this"]
    return records, (tmp_path / "this-1.log").read_text()
