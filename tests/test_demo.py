"""`make demo` on CPU: every stage but GPU training runs for real, in the demo's own plan (prep of the arith
task, the tiny model, merge of real FSDP checkpoints written by verl's checkpoint manager in the SFT and the
GRPO layout, eval with verl's scorer, report); its verdicts judge real files."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from test_checkpoints import load_tensors, make_run  # real FSDP checkpoints through verl's checkpoint manager
from conftest import REPO, assert_one_line_error, run_app

from app.common import UserError


def test_prep_arith_writes_disjoint_splits_that_verl_scorer_grades_1(tmp_path):
    import pyarrow.parquet as pq

    result = run_app("prep", "arith", env={"DATA_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert "verl's gsm8k scorer gives every reference answer 1.0" in result.stdout
    from verl.utils.reward_score.gsm8k import compute_score

    train = pq.read_table(tmp_path / "arith" / "train.parquet").to_pylist()
    test = pq.read_table(tmp_path / "arith" / "test.parquet").to_pylist()
    sft = pq.read_table(tmp_path / "arith_sft" / "train.parquet").to_pylist()
    assert len(test) == 1000 and len(train) == 9000 and len(sft) == 9000
    questions = lambda rows: {r["extra_info"]["question"] for r in rows}  # noqa: E731
    assert not questions(train) & questions(test)  # every test question unseen in training
    row = test[0]
    a, b = map(int, row["extra_info"]["question"].removeprefix("What is ").rstrip("?").split(" + "))
    assert row["reward_model"]["ground_truth"] == str(a + b)
    assert row["data_source"] == "openai/gsm8k"  # routed to verl's gsm8k scorer, as GSM8K is
    assert compute_score(f"#### {a + b}", row["reward_model"]["ground_truth"]) == 1.0
    assert compute_score(f"#### {a + b + 1}", row["reward_model"]["ground_truth"]) == 0.0
    assert sft[0]["messages"][1] == {"role": "assistant", "content": train[0]["extra_info"]["answer"]}


def test_plain_prep_writes_gsm8k_and_arith(tmp_path):
    result = run_app("prep", env={"DATA_DIR": str(tmp_path), "GSM8K_SOURCE": ""})
    assert result.returncode == 0, result.stderr
    for sub in ("gsm8k", "gsm8k_sft", "arith", "arith_sft"):
        assert (tmp_path / sub / "train.parquet").is_file() and (tmp_path / sub / "test.parquet").is_file()


def test_tiny_tokenizer_splits_numbers_into_digits():
    from app.tiny import build_tokenizer

    tokens = build_tokenizer().tokenize("What is 47 + 138? #### 185")
    assert [t for t in tokens if t.isdigit()] == ["4", "7", "1", "3", "8", "1", "8", "5"]


def test_demo_dry_run_lists_every_stage_in_order(tmp_path):
    root = tmp_path / "demo"
    result = run_app("demo", env={"DEMO_DIR": str(root), "DRY_RUN": "1", "DEMO_SFT_STEPS": "30",
                                  "DEMO_GRPO_STEPS": "8"})
    assert result.returncode == 0, result.stderr
    out = result.stdout
    order = ["prep arith", "app tiny-model", "app sft", "STEP=30", "eval --data", "app grpo-head", "STEP=8",
             "eval --data", "report"]
    positions = [out.index(word) for word in order[:3]]
    assert positions == sorted(positions)
    for expected in order + [f"MODEL_PATH={root / 'sft' / 'global_step_30' / 'huggingface'}",
                             f"MODEL={root / 'grpo' / 'global_step_8' / 'actor' / 'huggingface'}",
                             "prep: the arith task -> verl parquet (beside tiny-model",
                             "merge-sft: SFT -> HF model (beside grpo", "eval-sft: accuracy A0 (beside grpo",
                             "merge-grpo: GRPO -> HF model (starts with grpo, held", "eval-grpo: accuracy A1 (starts with grpo, held",
                             "report: plots of the GRPO run (beside eval-grpo",
                             "trainer.total_training_steps=30",
                             "trainer.total_training_steps=8", "actor_rollout_ref.rollout.n=8"]:
        assert expected in out, expected
    assert out.index("app sft") < out.index("app grpo-head")
    assert not root.exists()


def test_demo_refuses_too_few_steps(tmp_path):
    line = assert_one_line_error(run_app("demo", env={"DEMO_DIR": str(tmp_path), "DEMO_GRPO_STEPS": "2",
                                                      "DRY_RUN": "1"}))
    assert "DEMO_GRPO_STEPS='2'" in line and ">= 4" in line


def test_demo_chain_on_cpu_every_stage_but_gpu_training(tmp_path, tiny_model_dir, monkeypatch):
    """The demo's own stages (same argv and settings), with the two training stages replaced by real FSDP
    checkpoints of the tiny model written on CPU in the SFT and GRPO layouts, the whole model included as
    verl's `hf_model` content writes it: the evals read those, the merges write sft-model/ and grpo-model/."""
    from app import demo
    from app.settings import load
    from app.smoke import run_stage

    monkeypatch.setenv("DEMO_DIR", str(tmp_path / "demo"))
    monkeypatch.setenv("DEMO_SFT_STEPS", "4")
    monkeypatch.setenv("DEMO_GRPO_STEPS", "4")
    monkeypatch.setenv("LIMIT", "10")  # left in the caller's shell: the demo's evals still score every row
    settings = load()
    root, stages = demo.plan(settings)
    by_name = {s.name: s for s in stages}
    run_stage(by_name["prep"], settings)
    run_stage(by_name["tiny-model"], settings)
    make_run(root / "sft", root / "model", world_size=2, step=4, layout="sft", hf_model=True)
    run_stage(by_name["merge-sft"], settings)
    run_stage(by_name["eval-sft"], settings)
    make_run(root / "grpo", root / "sft" / "global_step_4" / "huggingface", world_size=1, step=4, layout="grpo",
             hf_model=True)
    run_stage(by_name["merge-grpo"], settings)
    run_stage(by_name["eval-grpo"], settings)
    for name in ("eval-sft", "eval-grpo"):
        summary = demo.read_summary(root / name)
        assert summary["rows"] == 1000 and summary["backend"] == "hf"
        assert 0.0 <= summary["accuracy"] <= 1.0
    assert demo.scored_items(demo.read_summary(root / "eval-sft"), demo.read_summary(root / "eval-grpo")) == 1000
    # the stage order of the plan is the pipeline of the issue
    assert [s.name for s in stages] == ["prep", "tiny-model", "sft", "merge-sft", "eval-sft", "grpo",
                                        "merge-grpo", "report", "eval-grpo"]
    # the merged models are the ones the evals scored
    merged, saved = load_tensors(root / "grpo-model"), load_tensors(root / "grpo" / "global_step_4" / "actor" / "huggingface")
    assert set(merged) == set(saved) and all(saved[k].to(merged[k].dtype).equal(merged[k]) for k in saved)


def test_demo_training_stages_pass_preflight_with_eager_for_the_tiny_model(tmp_path, monkeypatch):
    """`python -m app check` with each training stage's own settings: the profile, the demo's ARGS and verl's
    validate_config (GRPO) compose into a config that passes, and preflight says eager is the demo's choice."""
    from app import demo
    from app.settings import load
    from app.smoke import child_env, run_stage

    monkeypatch.setenv("DEMO_DIR", str(tmp_path / "demo"))
    settings = load()
    _, stages = demo.plan(settings)
    by_name = {s.name: s for s in stages}
    run_stage(by_name["prep"], settings)
    run_stage(by_name["tiny-model"], settings)
    for name, job, key in (("sft", "sft", "model"), ("grpo", "grpo", "actor_rollout_ref.model")):
        env = child_env(by_name[name], settings)
        if name == "grpo":  # the SFT stage's merged model is not there on CPU: the same tiny model stands in
            env["MODEL_PATH"] = str(tmp_path / "demo" / "model")
        result = subprocess.run([sys.executable, "-m", "app", "check", job], env=env, capture_output=True,
                                text=True, cwd=REPO)
        assert result.returncode == 0, result.stderr[-2000:]
        assert f"ok: attention: {key}.override_config.attn_implementation=eager from ARGS or CONFIG" in result.stdout
        assert f"preflight {job}: passed" in result.stdout


def _write_grpo_log(run, rewards, monkeypatch):
    """GRPO metrics written by verl's own FileLogger, where tracking_env points it."""
    from verl.utils.tracking import FileLogger

    from app.tracking import tracking_env

    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", tracking_env(run)["VERL_FILE_LOGGER_PATH"])
    logger = FileLogger("demo", "test")
    for step, reward in enumerate(rewards, 1):
        logger.log({"critic/score/mean": reward, "actor/pg_loss": 0.1}, step)
    logger.finish()


def test_reward_check_passes_on_rising_reward_from_verl_file_logger(tmp_path, monkeypatch):
    from app.demo import read_rewards, reward_rose

    _write_grpo_log(tmp_path, [0.2, 0.25, 0.3, 0.4, 0.45, 0.5, 0.6, 0.62], monkeypatch)
    first, last = reward_rose(read_rewards(tmp_path))
    assert first == pytest.approx(0.225) and last == pytest.approx(0.61)


@pytest.mark.parametrize("rewards", [[0.3] * 8, [0.6, 0.5, 0.4, 0.3, 0.3, 0.2, 0.1, 0.1], [0.1, 0.2]])
def test_reward_check_fails_on_flat_falling_or_short_curve(tmp_path, monkeypatch, rewards):
    from app.demo import read_rewards, reward_rose

    _write_grpo_log(tmp_path, rewards, monkeypatch)
    with pytest.raises(UserError):
        reward_rose(read_rewards(tmp_path))


def test_accuracy_margin_is_three_standard_errors_and_gates_the_verdict():
    from app.demo import accuracy_improved, accuracy_margin

    margin = accuracy_margin(0.4, 0.5, 1000)
    assert margin == pytest.approx(3 * math.sqrt((0.24 + 0.25) / 1000))
    assert accuracy_improved(0.4, 0.5, 1000) == pytest.approx(margin)  # +10.0% > 6.6%
    with pytest.raises(UserError, match="more than noise"):
        accuracy_improved(0.4, 0.45, 1000)  # +5.0% < 6.7%
    with pytest.raises(UserError, match="at least 500"):
        accuracy_improved(0.1, 0.9, 200)
    with pytest.raises(UserError, match="more than noise"):
        accuracy_improved(0.0, 0.0, 1000)  # both zero: the floor keeps the margin positive


def test_a0_and_a1_on_different_rows_are_refused():
    from app.demo import scored_items

    sft = {"data": "/d/test.parquet", "rows": 1000, "limit": None}
    assert scored_items(sft, dict(sft)) == 1000
    for other in ({"rows": 585, "limit": 585}, {"data": "/e/test.parquet"}):
        with pytest.raises(UserError, match="different rows"):
            scored_items(sft, {**sft, **other})


def test_demo_is_a_make_target_listed_in_help():
    import subprocess

    out = subprocess.run(["make", "help", "RUNTIME=local"], cwd=REPO, capture_output=True, text=True).stdout
    assert "make demo" in out
    dry = subprocess.run(["make", "-n", "demo", "RUNTIME=local", f"PYTHON={sys.executable}"], cwd=REPO,
                         capture_output=True, text=True).stdout
    assert "-m app demo" in dry


def test_a_rerun_skips_stages_that_finished_with_the_same_settings(tmp_path, monkeypatch):
    from app import demo
    from app.settings import load

    monkeypatch.setenv("DEMO_DIR", str(tmp_path))
    _, stages = demo.plan(load())
    stage = stages[0]
    marker = tmp_path / "stages" / f"{stage.name}.json"
    record = {"argv": stage.argv[1:], "env": stage.env}
    assert not demo._finished(marker, record)
    marker.parent.mkdir(parents=True)
    marker.write_text(json.dumps({**record, "seconds": 1.0}))
    assert demo._finished(marker, record)
    changed = {"argv": record["argv"], "env": {**stage.env, "DATA_DIR": str(tmp_path / "other")}}
    assert not demo._finished(marker, changed)  # other settings: the stage runs again


def test_demo_until_names_exactly_the_stages_of_the_plan():
    from app import demo
    from app.settings import REGISTRY, load

    _, stages = demo.plan(load())
    until = next(var for var in REGISTRY if var.name == "DEMO_UNTIL")
    # every stage but the last (stopping after the eval of the GRPO model is the whole demo)
    assert list(until.choices) == [s.name for s in stages][:-1]


def test_demo_until_stops_after_that_stage_and_a_rerun_goes_on(tmp_path, monkeypatch, capsys):
    """Stages marked finished (as an earlier run leaves them) are skipped; DEMO_UNTIL=eval-sft ends the run
    there with exit 0, before the GRPO half; without it the same call goes on to the next stage."""
    from app import demo
    from app.settings import load

    monkeypatch.setenv("DEMO_DIR", str(tmp_path))
    monkeypatch.setattr(demo, "gpu_count", lambda settings: 1)  # this machine has none; no stage runs here
    _, stages = demo.plan(load())
    for stage in stages[:5]:  # prep .. eval-sft
        marker = tmp_path / "stages" / f"{stage.name}.json"
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps({"argv": stage.argv[1:], "env": stage.env, "seconds": 2.0}))
    monkeypatch.setenv("DEMO_UNTIL", "eval-sft")
    assert demo.main("demo", [], load()) == 0
    out = capsys.readouterr().out
    assert "demo stopped after eval-sft" in out and "10s of stages" in out and "grpo:" not in out
    ran = []
    monkeypatch.setattr(demo, "run_stage", lambda stage, settings, command: ran.append(stage.name))
    monkeypatch.setenv("DEMO_UNTIL", "grpo")
    assert demo.main("demo", [], load()) == 0
    assert ran == ["grpo"] and (tmp_path / "stages" / "grpo.json").is_file()
    assert "demo stopped after grpo" in capsys.readouterr().out


def test_demo_until_refuses_a_stage_it_does_not_have(tmp_path):
    line = assert_one_line_error(run_app("demo", env={"DEMO_DIR": str(tmp_path), "DEMO_UNTIL": "eval",
                                                      "DRY_RUN": "1"}))
    assert "DEMO_UNTIL" in line and "eval-sft" in line


def test_a_cut_short_grpo_stage_resumes_its_run_and_other_settings_start_over(tmp_path, monkeypatch, capsys):
    """The GRPO stage runs with FRESH=1 the first time; if it dies (a killed job, a lost machine), the next
    demo with the same settings runs it with FRESH=0, so verl resumes from the last checkpoint (one every 10
    steps); changed settings start the run over."""
    from app import demo
    from app.common import UserError
    from app.settings import load

    monkeypatch.setenv("DEMO_DIR", str(tmp_path))
    monkeypatch.setenv("DEMO_UNTIL", "grpo")
    monkeypatch.setattr(demo, "gpu_count", lambda settings: 1)  # this machine has none; no stage really runs here
    _, stages = demo.plan(load())
    grpo = next(s for s in stages if s.name == "grpo")
    assert "trainer.save_freq=10" in grpo.env["ARGS"] and "trainer.total_training_steps=12" in grpo.env["ARGS"]
    for stage in stages[:5]:  # prep .. eval-sft, as an earlier run leaves them
        marker = tmp_path / "stages" / f"{stage.name}.json"
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps({"argv": stage.argv[1:], "env": stage.env, "seconds": 1.0}))
    fresh = []

    def killed(stage, settings, command):
        fresh.append(stage.env["FRESH"])
        raise UserError("demo stage 'grpo' failed (exit 143)")

    monkeypatch.setattr(demo, "run_stage", killed)
    with pytest.raises(UserError):
        demo.main("demo", [], load())
    with pytest.raises(UserError):
        demo.main("demo", [], load())
    assert fresh == ["1", "0"]
    assert "resuming the run an earlier demo started" in capsys.readouterr().out
    monkeypatch.setenv("DEMO_GRPO_STEPS", "30")  # other settings: a new run, the old one moved aside by FRESH=1
    with pytest.raises(UserError):
        demo.main("demo", [], load())
    assert fresh == ["1", "0", "1"]
    assert not (tmp_path / "stages" / "grpo.json").exists()  # never marked done
    # the same settings once more, and this time it finishes: the stage is marked done and resumed, so the
    # demo's time says that the killed attempts are not in it
    monkeypatch.setattr(demo, "run_stage", lambda stage, settings, command: fresh.append(stage.env["FRESH"]))
    assert demo.main("demo", [], load()) == 0
    assert fresh[-1] == "0"
    assert json.loads((tmp_path / "stages" / "grpo.json").read_text())["resumed"] is True


def test_a_grpo_stage_cut_after_its_last_checkpoint_is_not_started_again(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """Killed while Ray stopped, after verl saved the last step (run 14 on the GPU): the rerun goes straight to
    merge instead of spending verl's start-up to find nothing left to train; a run cut before its last step
    still resumes. The checkpoints are real FSDP ones in the GRPO layout, with verl's step tracker."""
    from app import demo
    from app.settings import load

    monkeypatch.setenv("DEMO_DIR", str(tmp_path))
    monkeypatch.setenv("DEMO_GRPO_STEPS", "4")
    monkeypatch.setenv("DEMO_UNTIL", "grpo")
    monkeypatch.setattr(demo, "gpu_count", lambda settings: 1)  # this machine has none; no stage really runs here
    _, stages = demo.plan(load())
    for stage in stages[:5]:  # prep .. eval-sft, as an earlier run leaves them
        marker = tmp_path / "stages" / f"{stage.name}.json"
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps({"argv": stage.argv[1:], "env": stage.env, "seconds": 1.0}))
    grpo = next(s for s in stages if s.name == "grpo")
    (tmp_path / "stages" / "grpo.started.json").write_text(json.dumps({"argv": grpo.argv[1:], "env": grpo.env}))
    ran = []
    monkeypatch.setattr(demo, "run_stage", lambda stage, settings, command: ran.append(stage.env["FRESH"]))

    make_run(tmp_path / "grpo", tiny_model_dir, world_size=1, step=2, layout="grpo")  # cut at step 2 of 4
    assert demo.main("demo", [], load()) == 0
    assert ran == ["0"] and "resuming the run" in capsys.readouterr().out

    (tmp_path / "stages" / "grpo.json").unlink()
    make_run(tmp_path / "grpo", tiny_model_dir, world_size=1, step=4, layout="grpo")  # the last step saved
    assert demo.main("demo", [], load()) == 0
    assert ran == ["0"]  # verl not started again
    assert "saved its last step (4) before it was cut short; not started again" in capsys.readouterr().out
    assert json.loads((tmp_path / "stages" / "grpo.json").read_text())["resumed"] is True


# --- A0's eval beside GRPO's start-up: real processes stand in for the two stages ---------------------------

def _waits_for(flag, then: str = "pass", timeout: float = 60) -> str:
    """Python source: wait until `flag` exists (the other stage is running), then run `then`; exit 3 if it
    never appears, which is what a demo that ran the two stages one after the other would do."""
    return (f"import pathlib, sys, time\nflag = pathlib.Path({str(flag)!r})\nend = time.monotonic() + {timeout}\n"
            "while not flag.exists():\n    time.sleep(0.05)\n    if time.monotonic() > end:\n"
            "        sys.exit(3)\n" + then + "\n")


def _beside_plan(tmp_path, monkeypatch, eval_code: str, grpo_code: str):
    from app import demo
    from app.smoke import Stage

    stages = [Stage("eval-sft", [sys.executable, "-c", eval_code], {}, "accuracy A0"),
              Stage("grpo", [sys.executable, "-c", grpo_code], {}, "GRPO steps")]
    monkeypatch.setenv("DEMO_DIR", str(tmp_path))
    monkeypatch.setenv("DEMO_UNTIL", "grpo")
    monkeypatch.setattr(demo, "gpu_count", lambda settings: 1)  # this machine has none; the stages here need none
    monkeypatch.setattr(demo, "gpu_shared", lambda: (True, ""))  # nor nvidia-smi to give its compute mode
    monkeypatch.setattr(demo, "plan", lambda settings: (tmp_path, stages))
    return demo


def test_eval_sft_runs_beside_grpo_and_is_marked_done_after_it(tmp_path, monkeypatch, capsys):
    """Each stand-in waits for a file the other writes, so the demo passes only if both run at once; the eval
    then works 0.5 s (its time is rounded to 0.1 s: a quicker one reads 0.0), and GRPO goes on 2 s after the
    eval ended, which the eval's own time must not include."""
    from app.settings import load

    grpo_up, eval_done = tmp_path / "grpo-up", tmp_path / "eval-done"
    demo = _beside_plan(
        tmp_path, monkeypatch,
        _waits_for(grpo_up, "time.sleep(0.5)\nprint('arith accuracy 80.00% (8/10)')\n"
                            f"pathlib.Path({str(eval_done)!r}).touch()"),
        f"import pathlib\npathlib.Path({str(grpo_up)!r}).touch()\n" + _waits_for(eval_done, "time.sleep(2)"))
    assert demo.main("demo", [], load()) == 0
    out = capsys.readouterr().out
    assert f"eval-sft: runs beside grpo; its output goes to {tmp_path / 'eval-sft.log'}" in out
    assert "eval-sft (beside grpo) took" in out and out.rstrip().splitlines()[-2].endswith("arith accuracy 80.00% (8/10)")
    assert out.index("=== grpo took") < out.index("eval-sft (beside grpo) took")
    took = {name: json.loads((tmp_path / "stages" / f"{name}.json").read_text())["seconds"]
            for name in ("eval-sft", "grpo")}
    assert 0.5 <= took["eval-sft"] <= took["grpo"] - 1.5
    # a rerun skips both
    assert demo.main("demo", [], load()) == 0
    assert capsys.readouterr().out.count("done in an earlier run with the same settings, skipped") == 2


def test_the_merge_and_the_eval_both_run_beside_grpo_and_a_failing_one_is_named(tmp_path, monkeypatch, capsys):
    """merge-sft and eval-sft start one after the other without waiting, and GRPO's stand-in goes on only once
    both have written their flag: all three ran at once. A second run whose merge fails names it in one line."""
    from app import demo
    from app.settings import load
    from app.smoke import Stage

    grpo_up, merged, evaluated = tmp_path / "grpo-up", tmp_path / "merged", tmp_path / "evaluated"
    touch = "pathlib.Path({!r}).touch()".format
    said = "print('merged model ok')\nprint('  phase   at s (a table, indented)')\n"  # its head line is reported
    stages = [Stage("merge-sft", [sys.executable, "-c", _waits_for(grpo_up, said + touch(str(merged)))], {}, "merge"),
              Stage("eval-sft", [sys.executable, "-c", _waits_for(grpo_up, touch(str(evaluated)))], {}, "A0"),
              Stage("grpo", [sys.executable, "-c", f"import pathlib\n{touch(str(grpo_up))}\n"
                             + _waits_for(merged, _waits_for(evaluated))], {}, "GRPO steps")]
    monkeypatch.setenv("DEMO_DIR", str(tmp_path))
    monkeypatch.setenv("DEMO_UNTIL", "grpo")
    monkeypatch.setattr(demo, "gpu_count", lambda settings: 1)
    monkeypatch.setattr(demo, "gpu_shared", lambda: (True, ""))
    monkeypatch.setattr(demo, "plan", lambda settings: (tmp_path, stages))
    assert demo.main("demo", [], load()) == 0
    out = capsys.readouterr().out
    assert "merge-sft: runs beside grpo" in out and "eval-sft: runs beside grpo" in out
    assert out.index("=== grpo took") < out.index("merge-sft (beside grpo) took") < out.index("eval-sft (beside grpo) took")
    assert "s: merged model ok\n" in out
    assert all((tmp_path / "stages" / f"{name}.json").is_file() for name in ("merge-sft", "eval-sft", "grpo"))

    stages[0] = Stage("merge-sft", [sys.executable, "-c", "import sys\nprint('no shards')\nsys.exit(2)"], {"X": "1"}, "merge")
    stages[2] = Stage("grpo", [sys.executable, "-c", "pass"], {"X": "1"}, "GRPO steps")
    with pytest.raises(UserError) as failed:
        demo.main("demo", [], load())
    line = str(failed.value)
    assert "stage 'merge-sft' failed (exit 2)" in line and "\n" not in line and "eval-sft" not in line
    assert (tmp_path / "stages" / "grpo.json").is_file()


def _held_plan(tmp_path, monkeypatch, grpo_code: str):
    """grpo (a stand-in run in CKPT_DIR=run), then merge-grpo and eval-grpo, modules run through app.gate as the
    demo holds them: each records that it ran and prints its line."""
    from app import demo
    from app.smoke import Stage

    (tmp_path / "standin_eval.py").write_text(
        "import pathlib, time\n"
        f"pathlib.Path({str(tmp_path / 'eval-ran')!r}).write_text(str(time.time()))\n"
        "print('arith accuracy 90.00% (9/10)')\n")
    (tmp_path / "standin_merge.py").write_text(
        f"import pathlib\npathlib.Path({str(tmp_path / 'merge-ran')!r}).touch()\nprint('merged model in grpo-model')\n")
    stages = [Stage("grpo", [sys.executable, "-c", grpo_code], {"CKPT_DIR": str(tmp_path / "run")}, "GRPO steps"),
              Stage("merge-grpo", [sys.executable, "-m", "standin_merge"], {}, "GRPO -> HF model"),
              Stage("eval-grpo", [sys.executable, "-m", "standin_eval"], {}, "accuracy A1")]
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("DEMO_DIR", str(tmp_path))
    monkeypatch.setenv("DEMO_GRPO_STEPS", "4")
    monkeypatch.setattr(demo, "gpu_count", lambda settings: 1)
    monkeypatch.setattr(demo, "gpu_shared", lambda: (True, ""))
    monkeypatch.setattr(demo, "plan", lambda settings: (tmp_path, stages))
    monkeypatch.setattr(demo, "_verdict", lambda *args: None)  # judged elsewhere; here: when the eval runs
    return demo


def test_a1s_eval_starts_with_grpo_and_goes_when_its_last_step_is_saved_before_grpo_ends(tmp_path, monkeypatch, capsys):
    """GRPO's stand-in checks the eval has not run, saves step 2 (not the last: the eval must not go), then step
    4, and ends only once the eval has run: the held eval went on the tracker, while its stage still ran."""
    from app.settings import load

    tracker, ran = tmp_path / "run" / "latest_checkpointed_iteration.txt", tmp_path / "eval-ran"
    demo = _held_plan(tmp_path, monkeypatch,
                      "import pathlib, sys, time\n"
                      f"tracker, ran = pathlib.Path({str(tracker)!r}), pathlib.Path({str(ran)!r})\n"
                      "tracker.parent.mkdir()\ntime.sleep(1)\ntracker.write_text('2')\ntime.sleep(1)\n"
                      "if ran.exists():\n    sys.exit(3)\n"
                      "tracker.write_text('4')\n" + _waits_for(ran, _waits_for(tmp_path / "merge-ran")))
    assert demo.main("demo", [], load()) == 0
    out = capsys.readouterr().out
    assert f"eval-grpo: starts now, held until grpo saves step 4; its output goes to {tmp_path / 'eval-grpo.log'}" in out
    assert out.index("=== grpo took") < out.index("=== eval-grpo took")
    assert "after grpo's last checkpoint: arith accuracy 90.00% (9/10)" in out
    assert "=== merge-grpo took" in out and "after grpo's last checkpoint: merged model in grpo-model" in out
    assert all((tmp_path / "stages" / f"{name}.json").is_file() for name in ("merge-grpo", "eval-grpo"))


@pytest.mark.parametrize("grpo_code, says", [
    ("import sys\nsys.exit(1)", "stage 'grpo' failed (exit 1)"),
    ("pass", "grpo ended without saving its step 4"),
])
def test_when_grpo_fails_or_saves_no_last_step_the_held_eval_is_stopped_unrun(tmp_path, monkeypatch, grpo_code, says):
    from app.settings import load

    demo = _held_plan(tmp_path, monkeypatch, grpo_code)
    with pytest.raises(UserError) as failed:
        demo.main("demo", [], load())
    assert says in str(failed.value) and "\n" not in str(failed.value)
    assert not (tmp_path / "eval-ran").exists() and not (tmp_path / "merge-ran").exists()
    assert not [p for p in (tmp_path / "stages").glob("*-grpo.json")]
    left = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert "standin_eval" not in left and "standin_merge" not in left


def test_a_failing_eval_beside_grpo_fails_the_demo_in_one_line_naming_its_log(tmp_path, monkeypatch):
    from app.settings import load

    demo = _beside_plan(tmp_path, monkeypatch, "import sys\nprint('no model here')\nsys.exit(4)", "pass")
    with pytest.raises(UserError) as failed:
        demo.main("demo", [], load())
    line = str(failed.value)
    assert "stage 'eval-sft' failed (exit 4)" in line and f"read {tmp_path / 'eval-sft.log'}" in line
    assert "\n" not in line and "no model here" in (tmp_path / "eval-sft.log").read_text()
    assert (tmp_path / "stages" / "grpo.json").is_file()  # GRPO finished: a rerun skips it
    assert not (tmp_path / "stages" / "eval-sft.json").exists()  # and runs the eval again


def test_when_grpo_fails_the_eval_beside_it_still_ends_and_is_kept(tmp_path, monkeypatch, capsys):
    from app.settings import load

    grpo_up = tmp_path / "grpo-up"
    demo = _beside_plan(tmp_path, monkeypatch, _waits_for(grpo_up, "print('arith accuracy 70.00% (7/10)')"),
                        f"import pathlib, sys\npathlib.Path({str(grpo_up)!r}).touch()\nsys.exit(1)")
    with pytest.raises(UserError) as failed:
        demo.main("demo", [], load())
    assert "stage 'grpo' failed (exit 1)" in str(failed.value)
    assert (tmp_path / "stages" / "eval-sft.json").is_file() and not (tmp_path / "stages" / "grpo.json").exists()


def test_when_grpo_and_the_eval_beside_it_both_fail_one_line_names_both(tmp_path, monkeypatch):
    from app.settings import load

    demo = _beside_plan(tmp_path, monkeypatch, "import sys, time\ntime.sleep(0.5)\nsys.exit(4)", "import sys\nsys.exit(1)")
    with pytest.raises(UserError) as failed:
        demo.main("demo", [], load())
    line = str(failed.value)
    assert "stage 'grpo' failed (exit 1)" in line and "stage 'eval-sft' failed (exit 4)" in line and "\n" not in line
    assert not list((tmp_path / "stages").glob("*-sft.json")) and not (tmp_path / "stages" / "grpo.json").exists()


def test_without_a_shared_gpu_the_eval_runs_before_grpo_and_says_why(tmp_path, monkeypatch, capsys):
    """An exclusive compute mode refuses a second CUDA context: the eval runs first (GRPO's stand-in exits 5
    unless the eval's result is already there)."""
    from app.settings import load

    eval_done = tmp_path / "eval-done"
    demo = _beside_plan(tmp_path, monkeypatch, f"import pathlib\npathlib.Path({str(eval_done)!r}).touch()",
                        f"import pathlib, sys\nsys.exit(0 if pathlib.Path({str(eval_done)!r}).exists() else 5)")
    monkeypatch.setattr(demo, "gpu_shared", lambda: (False, "the GPU's compute mode is Exclusive_Process"))
    assert demo.main("demo", [], load()) == 0
    out = capsys.readouterr().out
    assert "eval-sft: runs before grpo, not beside it: the GPU's compute mode is Exclusive_Process" in out
    assert "beside grpo)" not in out and not (tmp_path / "eval-sft.log").exists()


def test_without_a_shared_gpu_the_held_stages_run_after_grpo_and_say_why_asking_nvidia_smi_once(
        tmp_path, monkeypatch, capsys):
    from app.settings import load

    tracker, ran = tmp_path / "run" / "latest_checkpointed_iteration.txt", tmp_path / "eval-ran"
    demo = _held_plan(tmp_path, monkeypatch, "import pathlib, sys, time\n"
                      f"tracker = pathlib.Path({str(tracker)!r})\ntracker.parent.mkdir()\ntracker.write_text('4')\n"
                      f"time.sleep(1)\nsys.exit(3 if pathlib.Path({str(ran)!r}).exists() else 0)")
    asked = []
    monkeypatch.setattr(demo, "gpu_shared",
                        lambda: asked.append(1) or (False, "the GPU's compute mode is Exclusive_Process"))
    assert demo.main("demo", [], load()) == 0
    out = capsys.readouterr().out
    assert len(asked) == 1  # one answer for the run, not one per stage
    for name in ("merge-grpo", "eval-grpo"):
        assert f"{name}: runs after grpo, not with it: the GPU's compute mode is Exclusive_Process" in out
        assert (tmp_path / "stages" / f"{name}.json").is_file() and not (tmp_path / f"{name}.log").exists()
    assert "held until" not in out and ran.exists()


def _sigterm_in(seconds: float):
    """SIGTERM's effect in the CLI (app.common.raise_terminated) after `seconds`, through a real signal
    (SIGALRM, so that pytest itself is not terminated); returns what restores the old handler."""
    import signal

    from app.common import raise_terminated

    old = signal.signal(signal.SIGALRM, raise_terminated)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    return lambda: (signal.setitimer(signal.ITIMER_REAL, 0), signal.signal(signal.SIGALRM, old))


@pytest.mark.parametrize("way_out", ["interrupted during grpo", "crash during grpo",
                                     "interrupted while waiting for the eval after grpo",
                                     "interrupted while waiting for the eval after grpo failed"])
def test_every_way_out_of_the_demo_stops_the_eval_beside_it(tmp_path, monkeypatch, way_out):
    """Ctrl-C, SIGTERM (app.common.Terminated) or a crash, during GRPO or while the demo waits for the eval
    after it: the eval beside it is stopped and reaped, not left running, and not marked done."""
    import os
    import time

    from app.common import Terminated
    from app.settings import load

    pid_file = tmp_path / "eval.pid"
    demo = _beside_plan(tmp_path, monkeypatch,
                        f"import os, pathlib, time\npathlib.Path({str(pid_file)!r}).write_text(str(os.getpid()))\n"
                        "time.sleep(120)", "pass")

    def grpo(stage, settings, command):
        end = time.monotonic() + 60
        while not pid_file.exists() and time.monotonic() < end:
            time.sleep(0.05)
        if way_out == "interrupted during grpo":
            raise Terminated
        if way_out == "crash during grpo":
            raise OSError(28, "No space left on device")
        if way_out.endswith("grpo failed"):
            raise UserError("demo stage 'grpo' failed (exit 1)")

    monkeypatch.setattr(demo, "run_stage", grpo)
    expected = OSError if way_out == "crash during grpo" else Terminated
    restore = _sigterm_in(2.0) if "waiting" in way_out else (lambda: None)
    try:
        with pytest.raises(expected):
            demo.main("demo", [], load())
    finally:
        restore()
    with pytest.raises(ProcessLookupError):  # stopped and reaped
        os.kill(int(pid_file.read_text()), 0)
    assert not (tmp_path / "stages" / "eval-sft.json").exists()


def test_the_verdict_gives_this_runs_wall_time_and_what_it_went_on_from(tmp_path, monkeypatch, capsys):
    """Every stage done by an earlier run (GRPO's after a cut-short attempt): the verdict is judged on the
    files those runs left, and its time is this run's, saying what it did not include."""
    from verl.utils.tracking import FileLogger

    from app import demo
    from app.settings import load
    from app.tracking import tracking_env

    monkeypatch.setenv("DEMO_DIR", str(tmp_path))
    monkeypatch.setattr(demo, "gpu_count", lambda settings: 1)  # this machine has none; no stage runs here
    _, stages = demo.plan(load())
    for stage in stages:
        marker = tmp_path / "stages" / f"{stage.name}.json"
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps({"argv": stage.argv[1:], "env": stage.env, "seconds": 30.0,
                                      "resumed": stage.name == "grpo"}))
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", tracking_env(tmp_path / "sft")["VERL_FILE_LOGGER_PATH"])
    logger = FileLogger("demo", "sft")
    for step, loss in enumerate([6.8, 2.0, 0.9, 0.4], 1):
        logger.log({"train/loss": loss}, step)
    logger.finish()
    _write_grpo_log(tmp_path / "grpo", [0.5, 0.5, 0.6, 0.7], monkeypatch)
    test = str(tmp_path / "data" / "arith" / "test.parquet")
    for name, accuracy in (("eval-sft", 0.5), ("eval-grpo", 0.9)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps({"accuracy": accuracy, "data": test,
                                                                   "rows": 1000, "limit": None}))
    (tmp_path / "grpo" / "logs" / "timeline-head.jsonl").write_text(  # as the GRPO stage's launch stamped it
        json.dumps({"phase": "driver started", "t": 30.0}) + "\n" + json.dumps(
            {"phase": "first step done", "t": 250.0, "timers": {"gen": 20.0, "update_weights": 5.0, "step": 35.0}}))
    assert demo.main("demo", [], load()) == 0
    figures = json.loads((tmp_path / "demo.json").read_text())
    assert figures["total_seconds"] == 30.0 * len(stages) and figures["wall_seconds"] < 30.0
    assert figures["skipped"] == [s.name for s in stages] and figures["resumed"] == ["grpo"]
    assert figures["grpo_startup"] == {"driver started": 30.0, "first step done": 250.0}
    assert figures["grpo_first_step_timers"] == {"gen": 20.0, "update_weights": 5.0, "step": 35.0}
    out = capsys.readouterr().out
    assert "GRPO's start-up, 250 s to first step done" in out
    assert "step 1 by verl's timers, s: gen 20.0, update_weights 5.0; outside them 10.0 of the step's 35.0" in out
    verdict = out.rstrip().splitlines()[-1]
    assert verdict.startswith(f"demo passed in {figures['wall_seconds']:.0f}s (this run only: prep, tiny-model,")
    assert "eval-grpo done by an earlier run; the cut-short earlier attempts of grpo not counted)" in verdict
    assert "A0 = 50.0%, after GRPO A1 = 90.0% on 1000 unseen test items" in verdict
