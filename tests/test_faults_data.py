"""Bad data and interrupted or impossible writes (issue 13), each through the real CLI or `make`: the exit
code, the one `error:` line (or the warning), and what is left on disk. verl's own gsm8k scorer and SFT
dataset judge what --fix writes."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
from conftest import REPO, assert_one_line_error, make, run_app

from app.data import verl_gsm8k_scorer

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from stack_files import write_data_dir, write_rl, write_sft  # noqa: E402

SOLUTION = "2 + 3 = 5\n#### 5"


def rl_rows(truths: list, prompts: list[str] | None = None) -> pd.DataFrame:
    prompts = prompts or [f"What is {i} + 4?" for i in range(len(truths))]
    return pd.DataFrame({
        "data_source": ["openai/gsm8k"] * len(truths),
        "prompt": [[{"role": "user", "content": text}] for text in prompts],
        "reward_model": [{"style": "rule", "ground_truth": truth} for truth in truths],
    })


def prompt_response_rows(n: int = 3) -> pd.DataFrame:
    """The old walkthrough's SFT parquet: one prompt and one response string per row."""
    return pd.DataFrame({"prompt": [f"What is {i} + 1?" for i in range(n)],
                         "response": [f"{i} + 1 = {i + 1}\n#### {i + 1}" for i in range(n)],
                         "extra_info": [{"index": i} for i in range(n)]})


def files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


# --- ground truth stored as a number -------------------------------------------------------------------
def test_verls_gsm8k_scorer_gives_zero_for_an_integer_ground_truth_and_one_for_its_text():
    score = verl_gsm8k_scorer()
    assert score(SOLUTION, 5) == 0.0  # the silent wrong result the check exists for
    assert score(SOLUTION, "5") == 1.0


@pytest.mark.parametrize("truths, arrow_type", [([5, 7], "int64"), ([5.0, 7.0], "double")])
def test_data_check_refuses_a_numeric_ground_truth_in_one_line_naming_the_fix(tmp_path, truths, arrow_type):
    path = tmp_path / "train.parquet"
    rl_rows(truths).to_parquet(path)
    result = make("data-check", f"FILE={path}")
    line = assert_one_line_error(result)
    assert result.returncode == 2
    assert f"reward_model.ground_truth is stored as {arrow_type}" in line and "--fix OUT.parquet" in line
    assert files(tmp_path) == ["train.parquet"]


def test_fix_writes_a_numeric_ground_truth_as_text_that_verls_scorer_rewards(tmp_path):
    source, out = tmp_path / "in.parquet", tmp_path / "out.parquet"
    rl_rows([5, 7.0, 2.5]).to_parquet(source)  # pandas stores the mix as double
    result = make("data-check", f"FILE={source}", f"FIX={out}")
    assert result.returncode == 0, result.stderr
    assert "reward_model.ground_truth written as text (was double)" in result.stdout
    truths = [row["ground_truth"] for row in pq.read_table(out).column("reward_model").to_pylist()]
    assert truths == ["5", "7", "2.5"]
    assert verl_gsm8k_scorer()(SOLUTION, truths[0]) == 1.0
    assert run_app("data", "check", str(out)).returncode == 0
    assert files(tmp_path) == ["in.parquet", "out.parquet"]


def test_preflight_refuses_an_integer_ground_truth_before_grpo_starts(tmp_path, tiny_model_dir):
    train = tmp_path / "train.parquet"
    rl_rows([5, 7]).to_parquet(train)
    env = {"MODEL_PATH": str(tiny_model_dir), "TRAIN_FILE": str(train), "VAL_FILE": str(train),
           "CKPT_DIR": str(tmp_path / "run"), "DRY_RUN": "1"}
    line = assert_one_line_error(run_app("grpo-head", env=env))
    assert "ground_truth is stored as int64" in line
    assert not (tmp_path / "run").exists()


# --- duplicates and overlapping splits -----------------------------------------------------------------
def test_data_check_warns_about_duplicate_rows_and_still_passes(tmp_path):
    path = tmp_path / "mine.parquet"
    rl_rows(["1", "2", "1"], prompts=["a?", "b?", "a?"]).to_parquet(path)
    result = run_app("data", "check", str(path))
    assert result.returncode == 0, result.stderr
    assert "1 of 3 rows repeat an earlier row's prompt (first: row 2 = row 0)" in result.stderr
    assert result.stderr.startswith("warning: ")


def test_data_check_refuses_a_test_split_identical_to_the_train_split(tmp_path):
    write_rl(tmp_path / "train.parquet")
    shutil.copy(tmp_path / "train.parquet", tmp_path / "test.parquet")
    line = assert_one_line_error(make("data-check", f"FILE={tmp_path / 'train.parquet'}"))
    assert f"{tmp_path / 'test.parquet'} holds the same rows as {tmp_path / 'train.parquet'}" in line
    assert "held-out split" in line
    assert files(tmp_path) == ["test.parquet", "train.parquet"]


def test_data_check_warns_when_the_test_split_overlaps_the_train_split(tmp_path):
    write_sft(tmp_path / "train.parquet", rows=8)
    write_sft(tmp_path / "test.parquet", rows=4, start=6)  # rows 6 and 7 are in both
    result = run_app("data", "check", str(tmp_path / "test.parquet"))
    assert result.returncode == 0, result.stderr
    assert f"warning: 2 of 4 rows of {tmp_path / 'test.parquet'} also appear in {tmp_path / 'train.parquet'}" \
        in result.stderr


def test_data_check_against_names_the_other_split_explicitly(tmp_path):
    write_sft(tmp_path / "a.parquet")
    write_sft(tmp_path / "b.parquet")
    line = assert_one_line_error(run_app("data", "check", str(tmp_path / "a.parquet"), "--against",
                                         str(tmp_path / "b.parquet")))
    assert "holds the same rows as" in line


@pytest.fixture
def launch_env(tmp_path, tiny_model_dir) -> dict[str, str]:
    data = write_data_dir(tmp_path / "data")
    return {"MODEL_PATH": str(tiny_model_dir), "DATA_DIR": str(data), "CKPT_DIR": str(tmp_path / "run")}


def test_preflight_refuses_a_val_file_identical_to_the_train_file(launch_env):
    train = Path(launch_env["DATA_DIR"]) / "gsm8k_sft" / "train.parquet"
    line = assert_one_line_error(run_app("sft", env={**launch_env, "DRY_RUN": "1", "VAL_FILE": str(train)}))
    assert "holds the same rows as" in line and "VAL_FILE" in line
    assert not Path(launch_env["CKPT_DIR"]).exists()


def test_preflight_warns_when_the_val_file_overlaps_the_train_file(launch_env, tmp_path):
    val = write_sft(tmp_path / "val.parquet", rows=4, start=62)  # train holds rows 0-63
    result = run_app("check", "sft", env={**launch_env, "VAL_FILE": str(val)})
    assert result.returncode == 0, result.stderr
    assert f"warning: 2 of 4 rows of {val} also appear in" in result.stderr


# --- the old walkthrough's prompt/response SFT data ------------------------------------------------------
@pytest.mark.parametrize("kind", [None, "sft", "rl"])
def test_prompt_response_sft_parquet_is_named_as_such_not_as_rl_data(tmp_path, kind):
    path = tmp_path / "sft.parquet"
    prompt_response_rows().to_parquet(path)
    args = ["data", "check", str(path)] + (["--kind", kind] if kind else [])
    line = assert_one_line_error(run_app(*args))
    assert "is prompt/response SFT data" in line and "--fix OUT.parquet" in line and "RL" not in line
    assert files(tmp_path) == ["sft.parquet"]


def test_fix_converts_prompt_response_to_messages_that_verls_sft_dataset_trains_on(tmp_path, tiny_model_dir):
    from hydra import compose, initialize_config_dir
    from transformers import AutoTokenizer
    from verl.trainer.sft_trainer import create_sft_dataset

    from app.spec import verl_config_dir

    source, out = tmp_path / "sft.parquet", tmp_path / "messages.parquet"
    prompt_response_rows().to_parquet(source)
    result = make("data-check", f"FILE={source}", f"FIX={out}")
    assert result.returncode == 0, result.stderr
    assert "prompt + response converted to a `messages` conversation in 3 rows" in result.stdout
    assert "SFT (messages)" in result.stdout
    table = pq.read_table(out)
    assert table.column_names == ["messages", "extra_info"]
    assert table.column("messages")[1].as_py() == [{"role": "user", "content": "What is 1 + 1?"},
                                                   {"role": "assistant", "content": "1 + 1 = 2\n#### 2"}]
    with initialize_config_dir(config_dir=str(verl_config_dir()), version_base=None):
        config = compose("sft_trainer_engine")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    item = create_sft_dataset([str(out)], config.data, tokenizer, None)[1]
    assert tokenizer.decode(item["input_ids"][item["loss_mask"].bool()]) == "1 + 1 = 2\n#### 2<|im_end|>\n"
    assert pd.read_parquet(out)["messages"].map(len).tolist() == [2, 2, 2]  # pandas reads it too
    assert files(tmp_path) == ["messages.parquet", "sft.parquet"]


def test_preflight_refuses_a_prompt_response_train_file_for_sft(launch_env, tmp_path):
    train = tmp_path / "old.parquet"
    prompt_response_rows().to_parquet(train)
    line = assert_one_line_error(run_app("check", "sft", env={**launch_env, "TRAIN_FILE": str(train)}))
    assert "is prompt/response SFT data" in line


# --- interrupted writes ----------------------------------------------------------------------------------
def test_prep_killed_mid_write_leaves_temporaries_that_the_rerun_removes(tmp_path):
    data = tmp_path / "data"
    env = {**os.environ, "PYTHONPATH": str(REPO), "DATA_DIR": str(data), "GSM8K_SOURCE": ""}
    proc = subprocess.Popen([sys.executable, "-m", "app", "prep", "gsm8k"], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None and not list(data.glob("*/.train.parquet.tmp-*")):
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    left = list(data.glob("*/.*.tmp-*"))
    assert left, "prep finished before it could be killed mid-write"
    result = run_app("prep", "gsm8k", env={"DATA_DIR": str(data), "GSM8K_SOURCE": ""})
    assert result.returncode == 0, result.stderr
    assert files(data) == ["gsm8k", "gsm8k/test.parquet", "gsm8k/train.parquet", "gsm8k_sft",
                           "gsm8k_sft/test.parquet", "gsm8k_sft/train.parquet"]


def test_a_live_processs_temporary_is_not_swept_by_another_write(tmp_path):
    data = tmp_path / "data"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        live = data / "gsm8k" / f".train.parquet.tmp-{sleeper.pid}-0000abcd"
        dead = data / "gsm8k" / ".train.parquet.tmp-999999999-0000abcd"
        live.parent.mkdir(parents=True)
        live.write_text("a concurrent run writes here")
        dead.write_text("a killed run wrote here")
        result = run_app("prep", "gsm8k", env={"DATA_DIR": str(data), "GSM8K_SOURCE": ""})
        assert result.returncode == 0, result.stderr
        assert live.read_text() == "a concurrent run writes here" and not dead.exists()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_sigterm_during_prep_is_one_line_exit_143_and_leaves_nothing(tmp_path):
    data = tmp_path / "data"
    env = {**os.environ, "PYTHONPATH": str(REPO), "DATA_DIR": str(data), "GSM8K_SOURCE": ""}
    proc = subprocess.Popen([sys.executable, "-m", "app", "prep", "gsm8k"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120  # stop it mid-write: its temporaries are on disk
    while time.monotonic() < deadline and proc.poll() is None and not list(data.glob("*/.train.parquet.tmp-*")):
        time.sleep(0.005)
    assert proc.poll() is None, "prep finished before it could be stopped mid-write"
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    result = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    line = assert_one_line_error(result)
    assert proc.returncode == 143 and line.startswith("error: stopped by SIGTERM")
    assert not data.exists() or files(data) == []  # no parquet, no temporary, no directory made for it


# --- locations that cannot be written -----------------------------------------------------------------
@pytest.fixture
def read_only_dir(tmp_path):
    """A directory nobody may write: a read-only tmpfs mount as root (root ignores permission bits), else
    mode 0555."""
    path = tmp_path / "read-only"
    path.mkdir()
    mounted = False
    if os.geteuid() == 0:
        mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], capture_output=True)
        if mount.returncode != 0:
            pytest.skip(f"cannot mount a read-only tmpfs as root here: {mount.stderr.decode().strip()}")
        mounted = True
    else:
        path.chmod(0o555)
    yield path
    if mounted:
        subprocess.run(["umount", str(path)], check=True)
    else:
        path.chmod(0o755)


def test_prep_into_an_unwritable_data_dir_is_one_line_naming_it(read_only_dir):
    target = read_only_dir / "data"
    result = make("prep", env={"DATA_DIR": str(target), "GSM8K_SOURCE": ""})
    line = assert_one_line_error(result)
    assert line.startswith(f"error: cannot write {target / 'gsm8k'} (DATA_DIR): ")
    assert "set DATA_DIR to a writable directory" in line and "internal error" not in line
    assert list(read_only_dir.iterdir()) == []


def test_data_dir_under_a_file_is_one_line_saying_a_file_is_in_the_way(tmp_path):
    (tmp_path / "afile").write_text("x")
    line = assert_one_line_error(run_app("prep", "gsm8k", env={"DATA_DIR": str(tmp_path / "afile" / "data"),
                                                               "GSM8K_SOURCE": ""}))
    assert "(DATA_DIR)" in line and ("not a directory" in line.lower() or "in the way" in line)
    assert (tmp_path / "afile").read_text() == "x"


def test_fix_into_an_unwritable_directory_is_one_line_naming_it(tmp_path, read_only_dir):
    source = tmp_path / "in.parquet"
    rl_rows(["1", "2"], prompts=["a?", "b?"]).to_parquet(source)
    out = read_only_dir / "out.parquet"
    line = assert_one_line_error(make("data-check", f"FILE={source}", f"FIX={out}"))
    assert line.startswith(f"error: cannot write {read_only_dir} (FIX): ")
    assert "set FIX to a writable directory" in line
    assert list(read_only_dir.iterdir()) == [] and source.is_file()


# --- an interpreter without the stack's packages ---------------------------------------------------------
def test_local_runtime_with_an_interpreter_lacking_packages_says_how_to_install(tmp_path, tiny_model_dir):
    # -S: the same interpreter without its site-packages, i.e. a bare python3 lacking omegaconf & co
    result = make("check", "JOB=sft", f"PYTHON={sys.executable} -S",
                  env={"PYTHONPATH": str(REPO), "MODEL_PATH": str(tiny_model_dir), "CKPT_DIR": str(tmp_path / "r")})
    line = assert_one_line_error(result)
    assert re.search(r"cannot import '(yaml|omegaconf)', which the stack needs", line), line
    assert "make setup" in line and "PYTHONPATH" in line and "internal error" not in line
    assert not (tmp_path / "r").exists()


# --- report of a metrics file, doctor on a tiny or broken model ------------------------------------------
def write_metrics(path: Path, steps: int = 5) -> Path:
    """verl's file logger format: one {"step": N, "data": {...}} per line."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"step": s, "data": {"train/loss": 2.0 / s, "train/lr": 1e-5}}) + "\n"
                            for s in range(1, steps + 1)))
    return path


def test_make_report_accepts_verls_own_metrics_jsonl_file(tmp_path):
    log = write_metrics(tmp_path / "somewhere" / "metrics.jsonl")
    result = make("report", f"RUN={log}")
    assert result.returncode == 0, result.stderr
    out = tmp_path / "somewhere" / "metrics-report"
    assert (out / "summary.txt").is_file() and "train/loss" in (out / "summary.txt").read_text()
    assert any(p.suffix == ".png" for p in out.iterdir())
    assert files(tmp_path) == sorted(["somewhere", "somewhere/metrics.jsonl", "somewhere/metrics-report",
                                      *(f"somewhere/metrics-report/{p.name}" for p in out.iterdir())])


def test_make_report_of_a_file_that_is_not_jsonl_is_one_line(tmp_path):
    other = tmp_path / "metrics.csv"
    other.write_text("step,loss\n1,2.0\n")
    line = assert_one_line_error(make("report", f"RUN={other}"))
    assert "is a file but not a .jsonl metrics log" in line
    assert files(tmp_path) == ["metrics.csv"]


DOCTOR_CLEAN = {k: "" for k in ("HEAD_IP", "MASTER_ADDR", "NNODES", "GPUS_PER_NODE", "DATA_DIR", "TRAIN_FILE",
                                "VAL_FILE", "JOB", "RAY_PORT", "EXPERIMENT", "CONFIG")}


def test_doctor_sizes_a_tiny_models_checkpoint_in_mib_not_zero_gib(tiny_model_dir, tmp_path):
    result = run_app("doctor", env={**DOCTOR_CLEAN, "MODEL_PATH": str(tiny_model_dir), "CKPT_DIR": str(tmp_path / "r")})
    disk = next(line for line in result.stdout.splitlines() if " disk " in line)
    assert "0.00B" not in disk and "~0.0 GiB" not in disk
    assert re.search(r"one checkpoint of this [0-9.]+[MK] model is ~[0-9.]+ (MiB|KiB), 3 are kept", disk), disk


def test_doctor_with_an_empty_safetensors_file_prints_every_check_and_one_red_model_line(tiny_model_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    for weights in model.glob("*.safetensors"):
        weights.write_bytes(b"")
    result = run_app("doctor", env={**DOCTOR_CLEAN, "MODEL_PATH": str(model), "CKPT_DIR": str(tmp_path / "r")})
    assert result.returncode == 1 and "Traceback" not in result.stderr and "internal error" not in result.stderr
    lines = result.stdout.splitlines()
    red = [line for line in lines if "FAIL" in line and "MODEL_PATH" in line]
    assert len(red) == 1 and "empty" in red[0] and "model.safetensors" in red[0], result.stdout
    for name in ("/dev/shm", "memlock", "disk", "verl"):  # the other checks are all there
        assert any(name in line for line in lines), (name, result.stdout)
    assert lines[-1].startswith("NOT READY") and not (tmp_path / "r").exists()


# --- round 3: sources with repeated rows or no held-out split ----------------------------------------------
def gsm8k_source(directory: Path, train: list[int], test: list[int], replace: dict | None = None) -> Path:
    """A GSM8K_SOURCE directory whose splits are the bundled test rows at these indices (replace: index ->
    the row to write instead, for a conflicting repeat)."""
    import gzip
    import json

    with gzip.open(REPO / "data" / "gsm8k_source" / "test.jsonl.gz", "rt", encoding="utf-8") as handle:
        bundled = [json.loads(line) for line in handle]
    directory.mkdir(parents=True)
    for split, indices in (("train", train), ("test", test)):
        rows = [(replace or {}).get((split, n), bundled[i]) for n, i in enumerate(indices)]
        (directory / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return directory


def test_prep_refuses_a_source_whose_test_split_is_its_train_split_before_writing(tmp_path):
    source = gsm8k_source(tmp_path / "src", train=[0, 1, 2, 3], test=[3, 2, 1, 0])  # same rows, another order
    data = tmp_path / "data"
    result = make("prep", env={"GSM8K_SOURCE": str(source), "DATA_DIR": str(data)})
    line = assert_one_line_error(result)
    assert result.returncode == 2
    assert line.startswith(f"error: every question of the test split of {source} is also in its train split")
    assert f"first: {source / 'test.jsonl'} line 1 = {source / 'train.jsonl'} line 4" in line
    assert "give GSM8K_SOURCE a held-out test split" in line
    assert not data.exists()  # nothing written, no directory made


def test_prep_warns_in_one_line_when_some_test_questions_are_in_train_and_writes(tmp_path):
    source = gsm8k_source(tmp_path / "src", train=[0, 1, 2, 3], test=[10, 11, 2])
    data = tmp_path / "data"
    result = run_app("prep", "gsm8k", env={"GSM8K_SOURCE": str(source), "DATA_DIR": str(data)})
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        f"warning: 1 of 3 test questions of {source} are also in its train split (first: {source / 'test.jsonl'} "
        f"line 3 = {source / 'train.jsonl'} line 3): their validation and eval scores are inflated; remove them "
        "from one split"]
    assert pq.read_metadata(data / "gsm8k" / "test.parquet").num_rows == 3
    # the stack's own check says the same of what prep wrote, and nothing worse
    check = run_app("data", "check", str(data / "gsm8k" / "test.parquet"))
    assert check.returncode == 0 and "1 of 3 rows" in check.stderr


def test_prep_drops_exact_repeats_with_a_warning_and_data_check_accepts_the_result(tmp_path):
    # rows 1 and 2 twice more (a doubled shard): this ended in "internal error ... report it"
    source = gsm8k_source(tmp_path / "src", train=[0, 1, 2, 3, 1, 2], test=[10, 11])
    data = tmp_path / "data"
    result = make("prep", env={"GSM8K_SOURCE": str(source), "DATA_DIR": str(data)})
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        f"warning: dropped 2 repeated rows of the train split of {source} (the same question and answer as an "
        f"earlier row, first: {source / 'train.jsonl'} line 5 = {source / 'train.jsonl'} line 2); 4 rows are "
        "prepared"]
    for name in ("gsm8k", "gsm8k_sft"):
        train = data / name / "train.parquet"
        rows = pq.read_table(train).to_pylist()
        assert [row["extra_info"]["index"] for row in rows] == [0, 1, 2, 3]
        check = run_app("data", "check", str(train))
        assert check.returncode == 0 and check.stderr == "", check.stderr  # no duplicate left, no overlap
    assert files(data) == [f"{name}{split}" for name in ("arith", "arith_sft", "gsm8k", "gsm8k_sft")  # make prep: both
                           for split in ("", "/test.parquet", "/train.parquet")]


def test_prep_refuses_a_question_repeated_with_another_answer_naming_both_rows(tmp_path):
    source = gsm8k_source(tmp_path / "src", train=[0, 1, 2, 1], test=[10])
    import json

    rows = (source / "train.jsonl").read_text().splitlines()
    other = json.loads(rows[3])
    other["answer"] = other["answer"].rsplit("####", 1)[0] + "#### 12345"
    rows[3] = json.dumps(other)
    (source / "train.jsonl").write_text("\n".join(rows) + "\n")
    data = tmp_path / "data"
    line = assert_one_line_error(run_app("prep", "gsm8k", env={"GSM8K_SOURCE": str(source), "DATA_DIR": str(data)}))
    assert line == (f"error: {source / 'train.jsonl'} line 4 asks the same question as {source / 'train.jsonl'} line 2 "
                    "with a different answer: keep the right one and remove the other (prep writes one RL prompt "
                    "per question)")
    assert not data.exists()


# --- round 3: --fix of numeric responses and content parts --------------------------------------------------
def test_fix_writes_a_numeric_response_as_text_in_the_conversation(tmp_path):
    source, out = tmp_path / "sft.parquet", tmp_path / "messages.parquet"
    pd.DataFrame({"prompt": ["What is 2 + 3?", "What is 1 + 1.5?"], "response": [5, 2.5]}).to_parquet(source)
    result = make("data-check", f"FILE={source}", f"FIX={out}")  # was: internal error ArrowTypeError
    assert result.returncode == 0, result.stderr
    assert "2 numeric responses written as text (was double)" in result.stdout
    assert [chat[-1] for chat in pq.read_table(out).column("messages").to_pylist()] == [
        {"role": "assistant", "content": "5"}, {"role": "assistant", "content": "2.5"}]
    assert run_app("data", "check", str(out)).returncode == 0
    assert files(tmp_path) == ["messages.parquet", "sft.parquet"]


def test_fix_refuses_a_missing_numeric_response_naming_the_row(tmp_path):
    source, out = tmp_path / "sft.parquet", tmp_path / "messages.parquet"
    pd.DataFrame({"prompt": ["a?", "b?"], "response": [5, None]}).to_parquet(source)  # pandas: 5.0, NaN
    line = assert_one_line_error(make("data-check", f"FILE={source}", f"FIX={out}"))
    assert "row 1 has a message without content" in line and "nan" not in line.lower()
    assert files(tmp_path) == ["sft.parquet"]


CHAT_PARTS = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
              {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2 + 3?"}]}]


@pytest.mark.parametrize("stored", ["json string", "nested list"])
def test_fix_joins_text_content_parts_into_text_that_verls_rl_dataset_loads(tmp_path, tiny_model_dir, stored):
    import json

    from transformers import AutoTokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    source, out = tmp_path / "parts.parquet", tmp_path / "fixed.parquet"
    prompt = [json.dumps(CHAT_PARTS)] if stored == "json string" else [CHAT_PARTS]
    rl_rows(["5"]).assign(prompt=prompt).to_parquet(source)
    check = make("data-check", f"FILE={source}")  # the nested form was: internal error, unhashable list
    assert "--fix OUT.parquet" in assert_one_line_error(check)
    result = make("data-check", f"FILE={source}", f"FIX={out}")
    assert result.returncode == 0, result.stderr
    assert pq.read_table(out).column("prompt").to_pylist() == [[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    dataset = RLHFDataset(str(out), tokenizer, {"cache_dir": str(tmp_path / "cache"), "filter_overlong_prompts": True,
                                                "filter_overlong_prompts_workers": 1})
    assert dataset[0]["raw_prompt"][1] == {"role": "user", "content": "What is 2 + 3?"}
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".parquet") == ["fixed.parquet", "parts.parquet"]


def test_fix_refuses_an_image_content_part_in_one_line_and_writes_nothing(tmp_path):
    import json

    source, out = tmp_path / "parts.parquet", tmp_path / "fixed.parquet"
    chat = [{"role": "user", "content": [{"type": "image", "image": "cat.png"}, {"type": "text", "text": "what?"}]}]
    rl_rows(["5", "6"]).assign(prompt=[json.dumps(chat), "plain?"]).to_parquet(source)
    line = assert_one_line_error(make("data-check", f"FILE={source}", f"FIX={out}"))
    assert line == (f"error: {source} row 0 has a content part of type 'image', not text: --fix joins text parts only "
                    "(this stack trains text models); drop that part or write it as text")
    assert files(tmp_path) == ["parts.parquet"]


# --- round 3: a full disk, FIFOs and symlink loops -----------------------------------------------------------
def test_prep_on_a_full_disk_names_the_directory_and_leaves_nothing(small_disk):
    disk = small_disk("2m")  # GSM8K's four parquet files take ~8 MiB
    data = disk / "data"
    result = make("prep", env={"DATA_DIR": str(data), "GSM8K_SOURCE": ""})
    line = assert_one_line_error(result)
    assert result.returncode == 2 and "internal error" not in line
    assert re.fullmatch(rf"error: no space left on the disk of {re.escape(str(data))}/gsm8k(_sft)? \(DATA_DIR\) "
                        r"writing (train|test)\.parquet \([0-9.]+ (KiB|MiB) is free there\): free space there or set "
                        r"DATA_DIR to a disk with room; nothing half-written was kept", line), line
    assert list(disk.iterdir()) == []  # no parquet, no temporary, no directory made for it


def test_data_check_of_a_fifo_answers_at_once_in_one_line(tmp_path):
    fifo = tmp_path / "rows.parquet"
    os.mkfifo(fifo)
    started = time.monotonic()
    result = make("data-check", f"FILE={fifo}", timeout=60)  # it waited for a writer forever (SIGTERM too)
    line = assert_one_line_error(result)
    assert time.monotonic() - started < 30
    assert line == f"error: {fifo} is a FIFO (named pipe), not a file: reading it would wait for a writer forever: " \
                   "pass a parquet file"
    assert files(tmp_path) == ["rows.parquet"] and fifo.is_fifo()


@pytest.mark.parametrize("setting", ["FILE", "FIX", "DATA_DIR"])
def test_a_symlink_loop_as_a_data_path_is_one_line_naming_the_link(tmp_path, setting):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    good = write_rl(tmp_path / "good.parquet")
    if setting == "DATA_DIR":
        result = make("prep", env={"DATA_DIR": str(loop), "GSM8K_SOURCE": ""})
    else:
        args = {"FILE": [f"FILE={loop}"], "FIX": [f"FILE={good}", f"FIX={loop / 'fixed.parquet'}"]}[setting]
        result = make("data-check", *args)
    line = assert_one_line_error(result)
    assert re.search(rf"{re.escape(str(loop))}( \({setting}\))? is a symbolic link that loops back on itself -> "
                     rf"{re.escape(str(loop))}", line), line
    assert f"point {setting} at a real file or directory" in line and "internal error" not in line
    assert os.readlink(loop) == str(loop) and files(tmp_path) == ["good.parquet", "loop"]
