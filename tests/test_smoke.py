"""`make smoke` on a CPU machine: it refuses early with one line, DRY_RUN prints the plan, and its checks
(loss, checkpoint, merged model) judge real files: verl's own file logger output and a real tiny model."""

from __future__ import annotations

import pytest
from conftest import assert_one_line_error, run_app

from app.common import UserError


@pytest.mark.parametrize("command, dir_var", [("smoke", "SMOKE_DIR"), ("demo", "DEMO_DIR")])
def test_smoke_and_demo_without_gpu_stop_with_one_line_and_write_nothing(tmp_path, command, dir_var):
    root = tmp_path / command
    line = assert_one_line_error(run_app(command, env={dir_var: str(root), "CUDA_VISIBLE_DEVICES": ""}))
    assert "needs a GPU" in line and "DRY_RUN=1" in line
    assert not root.exists()


def test_dry_run_plan_lists_every_stage_with_smoke_settings_and_user_args_last(tmp_path):
    root = tmp_path / "smoke"
    result = run_app("smoke", env={"SMOKE_DIR": str(root), "DRY_RUN": "1", "SMOKE_STEPS": "6",
                                   "ARGS": "optim.lr=5e-4"})
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for expected in ("-m app prep gsm8k", "-m app tiny-model", "-m app sft", "-m app merge", "generate",
                     f"CKPT_DIR={root / 'run'}", f"MODEL_PATH={root / 'model'}", "FRESH=1", "GPUS_PER_NODE=1",
                     "trainer.total_training_steps=6", "trainer.save_freq=6", "STEP=6", "FORCE=1"):
        assert expected in out, expected
    # The user's overrides come after smoke's, so Hydra lets them win.
    assert out.index("optim.lr=1e-3") < out.index("optim.lr=5e-4")
    assert not root.exists()


def test_too_few_steps_is_refused(tmp_path):
    line = assert_one_line_error(run_app("smoke", env={"SMOKE_DIR": str(tmp_path), "SMOKE_STEPS": "2",
                                                       "DRY_RUN": "1"}))
    assert "SMOKE_STEPS=2" in line


def test_child_env_drops_real_run_settings_and_pins_one_gpu(monkeypatch):
    from app.settings import load
    from app.smoke import child_env, plan

    monkeypatch.setenv("DRY_RUN", "1")
    monkeypatch.setenv("TRAIN_FILE", "/elsewhere/train.parquet")
    monkeypatch.setenv("NNODES", "4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    settings = load()
    sft = next(s for s in plan(settings).stages if s.name == "sft")
    env = child_env(sft, settings)
    assert "DRY_RUN" not in env and "TRAIN_FILE" not in env
    assert env["NNODES"] == "1" and env["CUDA_VISIBLE_DEVICES"] == "3"


def _write_verl_log(run, losses, monkeypatch):
    """Metrics written by verl's own FileLogger, where tracking_env points it."""
    from verl.utils.tracking import FileLogger

    from app.tracking import tracking_env

    path = tracking_env(run)["VERL_FILE_LOGGER_PATH"]
    (run / "logs").mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", path)
    logger = FileLogger("smoke", "test")
    for step, loss in enumerate(losses, 1):
        logger.log({"train/loss": loss, "train/lr": 1e-3}, step)
    logger.log({"val/loss": 1.0}, len(losses))
    logger.finish()


def test_loss_check_passes_on_falling_loss_from_verl_file_logger(tmp_path, monkeypatch):
    from app.smoke import loss_went_down, read_losses

    _write_verl_log(tmp_path, [6.9, 6.5, 6.0, 5.1, 4.8, 4.2, 3.9, 3.5], monkeypatch)
    losses = read_losses(tmp_path)
    assert [s for s, _ in losses] == list(range(1, 9))
    first, last = loss_went_down(losses)
    assert first == pytest.approx(6.7) and last == pytest.approx(3.7)


@pytest.mark.parametrize("losses", [[5.0, 5.0, 5.0, 5.0], [4.0, 4.5, 5.0, 6.0], [6.0, 5.0, float("nan"), 3.0]])
def test_loss_check_fails_on_flat_rising_or_nan_loss(tmp_path, monkeypatch, losses):
    from app.smoke import loss_went_down, read_losses

    _write_verl_log(tmp_path, losses, monkeypatch)
    with pytest.raises(UserError):
        loss_went_down(read_losses(tmp_path))


def test_missing_metrics_log_says_what_to_do(tmp_path):
    from app.smoke import read_losses

    with pytest.raises(UserError, match="trainer.logger"):
        read_losses(tmp_path)


def test_checkpoint_check_wants_marker_step_and_nonempty_shard(tmp_path):
    import torch

    from app.smoke import check_checkpoint

    with pytest.raises(UserError, match="latest_checkpointed_iteration"):
        check_checkpoint(tmp_path, 4)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("4")
    with pytest.raises(UserError, match="missing or empty"):
        check_checkpoint(tmp_path, 4)
    shard = tmp_path / "global_step_4" / "model_world_size_1_rank_0.pt"
    shard.parent.mkdir()
    torch.save({"w": torch.ones(2)}, shard)
    assert check_checkpoint(tmp_path, 4) == shard
    with pytest.raises(UserError, match="expected 8"):
        check_checkpoint(tmp_path, 8)


def test_generate_check_loads_model_and_rejects_untrained_weights(tiny_model_dir, tmp_path):
    from app.smoke import load_and_generate
    from app.tiny import write_tiny_model

    other = write_tiny_model(tmp_path / "initial", seed=1)
    text = load_and_generate(tiny_model_dir, other, "What is 2 + 3?", "cpu", max_new_tokens=4)
    assert isinstance(text, str)
    with pytest.raises(UserError, match="equal the initial model"):
        load_and_generate(tiny_model_dir, tiny_model_dir, "What is 2 + 3?", "cpu", max_new_tokens=4)


def test_smoke_stages_run_through_the_real_cli_on_cpu_with_a_factory_checkpoint_for_training(tmp_path, monkeypatch):
    """Every smoke stage but the GPU training, through the real commands with smoke's settings: prep,
    tiny-model, the SFT launch (DRY_RUN: preflight + plan), merge of a real verl-layout checkpoint written
    by the test factory in the SFT's place, then the load-and-generate check on the merged model."""
    import gzip
    import subprocess
    import sys

    from app.settings import load
    from app.smoke import check_checkpoint, child_env, first_test_prompt, load_and_generate, plan
    from app.tiny import BUNDLED_GSM8K, write_tiny_model
    from conftest import REPO

    source = tmp_path / "gsm8k"
    source.mkdir()
    rows = gzip.open(BUNDLED_GSM8K, "rt", encoding="utf-8").read().splitlines()
    (source / "train.jsonl").write_text("\n".join(rows[:40]) + "\n")
    (source / "test.jsonl").write_text("\n".join(rows[40:50]) + "\n")
    monkeypatch.setenv("GSM8K_SOURCE", str(source))
    monkeypatch.setenv("SMOKE_DIR", str(tmp_path / "smoke"))
    monkeypatch.setenv("SMOKE_STEPS", "4")
    settings = load()
    p = plan(settings)
    stages = {stage.name: stage for stage in p.stages}

    def run(stage, **extra):
        result = subprocess.run(stage.argv, env={**child_env(stage, settings), **extra}, capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 0, f"{stage.name}: {result.stdout[-2000:]}{result.stderr[-2000:]}"
        return result.stdout

    run(stages["prep"])
    assert (p.data / "gsm8k_sft" / "train.parquet").is_file()
    run(stages["tiny-model"])
    assert (p.model / "config.json").is_file()
    launch_plan = run(stages["sft"], DRY_RUN="1")
    assert "verl.trainer.sft_trainer" in launch_plan and "trainer.total_training_steps=4" in launch_plan
    # The SFT's place: a real world-size-1 verl checkpoint of other ("trained") weights.
    trained = write_tiny_model(tmp_path / "trained", seed=7)
    subprocess.run([sys.executable, str(REPO / "tests" / "ckpt_factory.py"), "--model", str(trained),
                    "--out", str(p.run), "--world-size", "1", "--step", "4"], check=True, timeout=600)
    check_checkpoint(p.run, 4)
    run(stages["merge"])
    text = load_and_generate(p.merged, p.model, first_test_prompt(p.data), "cpu", max_new_tokens=4)
    assert isinstance(text, str)
