"""`python -m app merge` / `gather` on real sharded checkpoints, written on CPU by real gloo processes
through verl's own FSDPCheckpointManager (tests/ckpt_factory.py), in SFT's and GRPO's layouts."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, assert_one_line_error, run_app


def make_run(out: Path, model: Path, world_size: int, step: int, layout: str = "sft", lora: bool = False) -> Path:
    """A run directory with one saved step, written by `world_size` real processes."""
    cmd = [sys.executable, str(REPO / "tests" / "ckpt_factory.py"), "--model", str(model), "--out", str(out),
           "--world-size", str(world_size), "--step", str(step), "--layout", layout]
    result = subprocess.run(cmd + (["--lora"] if lora else []), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory) -> dict[int, Path]:
    """Run directories of world sizes 1 (SFT layout), 2 (GRPO layout: actor/) and 4 (SFT layout)."""
    root = tmp_path_factory.mktemp("runs")
    return {
        1: make_run(root / "w1", tiny_model_dir, 1, step=3),
        2: make_run(root / "w2", tiny_model_dir, 2, step=5, layout="grpo"),
        4: make_run(root / "w4", tiny_model_dir, 4, step=7),
    }


def load_tensors(directory: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def copy_run(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest)
    return dest


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_merged_tensors_equal_the_original_model_exactly(runs, tiny_model_dir, tmp_path, world_size):
    out = tmp_path / "merged"
    result = run_app("merge", env={"CKPT_DIR": str(runs[world_size]), "OUT_DIR": str(out)})
    assert result.returncode == 0, result.stderr
    assert "forward on" in result.stdout
    merged, original = load_tensors(out), load_tensors(tiny_model_dir)
    assert set(merged) == set(original)
    for name, tensor in original.items():
        # the tiny model is stored in bf16, the merger's output dtype: the round trip must be lossless
        assert merged[name].dtype == tensor.dtype and merged[name].equal(tensor), name
    for name in ("config.json", "tokenizer.json", "generation_config.json", "chat_template.jinja"):
        assert (out / name).is_file(), name
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".merged.")]  # no temporaries left


def test_latest_step_and_default_out_dir_name(runs, tmp_path):
    result = run_app("merge", env={"CKPT_DIR": str(runs[2])}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "models" / "w2-step5" / "model.safetensors").is_file()
    assert "actor" in result.stdout  # the GRPO layout was found under global_step_5/actor


def test_missing_rank_lists_it_and_says_how_to_gather(runs, tmp_path):
    run = copy_run(runs[4], tmp_path / "run")
    for rank in (1, 3):
        (run / "global_step_7" / f"model_world_size_4_rank_{rank}.pt").unlink()
    line = assert_one_line_error(run_app("merge", env={"CKPT_DIR": str(run), "OUT_DIR": str(tmp_path / "o")}))
    assert "ranks missing: 1, 3" in line and "make gather" in line
    assert not (tmp_path / "o").exists()


def test_step_that_does_not_exist_lists_the_present_ones(runs, tmp_path):
    line = assert_one_line_error(run_app("merge", env={"CKPT_DIR": str(runs[1]), "STEP": "9",
                                                       "OUT_DIR": str(tmp_path / "o")}))
    assert "step 9 does not exist" in line and "steps present: 3" in line


def test_existing_out_dir_is_kept_without_force_and_replaced_with_it(runs, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    line = assert_one_line_error(run_app("merge", env={"CKPT_DIR": str(runs[1]), "OUT_DIR": str(out)}))
    assert "FORCE=1" in line and (out / "keep.txt").read_text() == "mine"
    result = run_app("merge", env={"CKPT_DIR": str(runs[1]), "OUT_DIR": str(out), "FORCE": "1"})
    assert result.returncode == 0, result.stderr
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
