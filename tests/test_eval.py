"""eval: real prep output, the tiny local model generating on CPU, verl's scorer on every answer."""

from __future__ import annotations

import json
import os
import shutil
import time

import pyarrow.parquet as pq
import pytest
from conftest import assert_one_line_error, make, run_app


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """DATA_DIR as `make prep` writes it (the bundled GSM8K, RL + SFT parquet)."""
    root = tmp_path_factory.mktemp("data")
    result = run_app("prep", "gsm8k", env={"DATA_DIR": str(root), "GSM8K_SOURCE": ""})
    assert result.returncode == 0, result.stderr
    return root


def read_eval(out):
    summary = json.loads((out / "summary.json").read_text())
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    return summary, samples


def test_tiny_model_generates_on_cpu_and_every_answer_is_scored(tiny_model_dir, data_dir, tmp_path):
    out = tmp_path / "eval"
    result = run_app("eval", env={"MODEL": str(tiny_model_dir), "DATA_DIR": str(data_dir), "LIMIT": "3",
                                  "MAX_NEW_TOKENS": "12", "OUT": str(out), "EVAL_BACKEND": ""}, timeout=600)
    assert result.returncode == 0, result.stderr
    summary, samples = read_eval(out)
    assert summary["backend"] == "hf" and summary["rows"] == 3 == len(samples)
    questions = pq.read_table(data_dir / "gsm8k" / "test.parquet").slice(0, 3).to_pylist()
    assert [s["question"] for s in samples] == [q["extra_info"]["question"] for q in questions]
    assert [s["ground_truth"] for s in samples] == [q["reward_model"]["ground_truth"] for q in questions]
    assert all(s["response"] for s in samples), "the model generated nothing"
    for s in samples:  # the scorer's verdict agrees with its own extraction
        assert s["correct"] == (s["extracted"] == s["ground_truth"])
    assert summary["correct"] == sum(s["correct"] for s in samples)
    assert f"GSM8K accuracy {summary['accuracy']:.2%}" in result.stdout


def test_reference_answers_score_full_marks_through_the_same_scorer(tiny_model_dir, data_dir, tmp_path):
    out = tmp_path / "ref"
    result = run_app("eval", "--backend", "reference", "--limit", "50", "--out", str(out),
                     env={"MODEL": str(tiny_model_dir), "DATA_DIR": str(data_dir)})
    assert result.returncode == 0, result.stderr
    summary, samples = read_eval(out)
    assert summary["accuracy"] == 1.0 and summary["correct"] == 50
    assert all(s["extracted"] == s["ground_truth"] and "####" in s["response"] for s in samples)


def test_eval_file_scores_another_task_of_prep_and_names_it(tiny_model_dir, tmp_path):
    data = tmp_path / "data"
    assert run_app("prep", "arith", env={"DATA_DIR": str(data)}).returncode == 0
    out = tmp_path / "arith-eval"
    result = make("eval", env={"MODEL": str(tiny_model_dir), "EVAL_FILE": str(data / "arith" / "test.parquet"),
                               "LIMIT": "20", "EVAL_BACKEND": "reference", "OUT": str(out), "RUNTIME": "local"})
    assert result.returncode == 0, result.stderr
    summary, samples = read_eval(out)
    assert summary["data"] == str(data / "arith" / "test.parquet") and summary["rows"] == 20
    assert summary["accuracy"] == 1.0 and "arith accuracy 100.00% (20/20" in result.stdout


def test_step_finds_the_model_merge_wrote_and_writes_eval_inside_it(tiny_model_dir, data_dir, tmp_path):
    merged = tmp_path / "models" / "grpo-gsm8k-step40"
    shutil.copytree(tiny_model_dir, merged)
    result = run_app("eval", env={"STEP": "40", "JOB": "grpo", "MODEL": "", "OUT_DIR": "", "CKPT_DIR": "",
                                  "DATA_DIR": str(data_dir), "LIMIT": "5", "EVAL_BACKEND": "reference"},
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    summary, _ = read_eval(merged / "eval")
    assert summary["model"] == str(merged) and summary["rows"] == 5
    assert not [p for p in merged.iterdir() if p.name.startswith(".eval")], "temporary left behind"


def test_missing_model_or_step_or_data_are_one_line_errors(tiny_model_dir, data_dir, tmp_path):
    line = assert_one_line_error(run_app("eval", env={"MODEL": str(tmp_path / "nope"), "STEP": ""}))
    assert "does not exist" in line
    line = assert_one_line_error(run_app("eval", env={"MODEL": "", "STEP": "9", "JOB": "sft", "OUT_DIR": "",
                                                      "CKPT_DIR": ""}, cwd=tmp_path))
    assert "make merge STEP=9" in line
    line = assert_one_line_error(run_app("eval", env={"MODEL": str(tiny_model_dir), "DATA_DIR": str(tmp_path)}))
    assert "make prep" in line
    sft_file = data_dir / "gsm8k_sft" / "test.parquet"  # the SFT file is not the RL format
    line = assert_one_line_error(run_app("eval", "--data", str(sft_file), env={"MODEL": str(tiny_model_dir)}))
    assert "RL format" in line
    assert_one_line_error(run_app("eval", "--bogus", env={"MODEL": str(tiny_model_dir)}))
    # an OUT that cannot be a directory is refused before the model loads, not after it generated
    afile = tmp_path / "afile"
    afile.write_text("x")
    line = assert_one_line_error(run_app("eval", env={"MODEL": str(tiny_model_dir), "DATA_DIR": str(data_dir),
                                                      "OUT": str(afile), "EVAL_BACKEND": "hf"}))
    assert line == f"error: the eval output {afile} is a file: set OUT to a directory you can write"


@pytest.mark.parametrize("setting, value, expected", [
    ("LIMIT", "0", "error: LIMIT='0' is not a whole number >= 1: set LIMIT to a whole number >= 1, or unset it"),
    ("EVAL_BATCH", "0", "error: EVAL_BATCH='0' is not a whole number >= 1: set EVAL_BATCH to a whole number >= 1, or "
                        "unset it"),
])
def test_make_eval_refuses_a_zero_limit_or_batch_in_one_line_before_loading_the_model(tiny_model_dir, data_dir,
                                                                                       tmp_path, setting, value,
                                                                                       expected):
    # LIMIT=0 evaluated every row (an hour of generation on GSM8K's 1319 rows): `0 or None` was "all"
    out = tmp_path / "eval"
    result = make("eval", env={"MODEL": str(tiny_model_dir), "DATA_DIR": str(data_dir), "OUT": str(out),
                               "EVAL_BACKEND": "hf", setting: value, "RUNTIME": "local"}, timeout=120)
    assert assert_one_line_error(result) == expected and result.returncode == 2
    assert "evaluating" not in result.stdout and list(tmp_path.iterdir()) == []


def test_eval_of_a_model_dir_that_is_a_symlink_loop_is_one_line_naming_it(tmp_path):
    loop = tmp_path / "model"
    loop.symlink_to(loop)
    line = assert_one_line_error(run_app("eval", env={"MODEL": str(loop), "STEP": ""}))  # was: RuntimeError
    assert line.startswith(f"error: {loop} (MODEL) is a symbolic link that loops back on itself -> {loop}, ")
    assert os.readlink(loop) == str(loop) and [p.name for p in tmp_path.iterdir()] == ["model"]


def test_eval_of_a_fifo_as_eval_file_answers_at_once_in_one_line(tiny_model_dir, tmp_path):
    fifo = tmp_path / "test.parquet"
    os.mkfifo(fifo)
    started = time.monotonic()
    line = assert_one_line_error(run_app("eval", env={"MODEL": str(tiny_model_dir), "EVAL_FILE": str(fifo),
                                                      "OUT": str(tmp_path / "eval")}, timeout=120))
    assert line == (f"error: test data {fifo} is a FIFO (named pipe), not a file: reading it would wait for a writer "
                    "forever: set EVAL_FILE to a parquet file (or DATA_DIR to `make prep`'s)")
    assert time.monotonic() - started < 60 and sorted(p.name for p in tmp_path.iterdir()) == ["test.parquet"]
