"""Tracking: verl's own loggers (FileLogger, swanlab) writing where tracking_env points, in real
processes; `report` rendering real PNGs from those real-format logs; `board` serving the dashboard."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import REPO, assert_one_line_error, modes, run_app

from app.tracking import log_files, read_run, swanboard_problem, tracking_env, tracking_overrides

# One process that logs through verl's own Tracking, as sft_trainer / ray_trainer do, attempt after
# attempt (each with a fresh tracking_env, as each launch gets). One process: importing verl costs seconds.
VERL_LOGGER = textwrap.dedent("""
    import json, os, sys
    from verl.utils.tracking import Tracking
    from app.tracking import tracking_env
    for run, backends, steps in json.loads(sys.argv[1]):
        os.environ.update(tracking_env(run))
        tracking = Tracking("verl-stack", os.path.basename(run), backends, config={"trainer": {"total_epochs": 1}})
        for step, data in steps:
            tracking.log(data=data, step=step)
        tracking.finish()
""")


def grpo_metrics(step: int, attempt: int) -> dict:
    """One GRPO step with the names verl 0.9.1 logs (metric_utils.py, v1/trainer_base.py, losses.py)."""
    return {
        "actor/pg_loss": 0.01 * attempt, "actor/kl_loss": 0.001 * step, "actor/entropy": 1.5 - 0.01 * step,
        "actor/grad_norm": 0.3, "actor/pg_clipfrac": 0.02, "actor/ppo_kl": 0.0, "actor/lr": 1e-6,
        "critic/score/mean": 0.1 * step, "critic/rewards/mean": 0.05 * step + attempt,
        "critic/rewards/max": 1.0, "critic/rewards/min": 0.0, "critic/advantages/mean": 0.0,
        "response_length/mean": 200.0 + step, "response_length/max": 512.0, "response_length/min": 40.0,
        "response_length/clip_ratio": 0.01, "prompt_length/mean": 110.0,
        "perf/throughput": 1500.0 + step, "perf/time_per_step": 30.0, "perf/total_num_tokens": 40000,
        "timing_s/gen": 12.0, "timing_s/old_log_prob": 3.0, "timing_s/ref": 3.0,
        "timing_s/update_actor": 9.0, "timing_s/step": 30.0,
        "training/global_step": step, "training/epoch": 0,
        # validation every 10 steps comes in the same line (trainer merges val_metrics into metrics)
        **({"val-core/openai/gsm8k/reward/mean@1": 0.02 * step} if step % 10 == 0 else {}),
    }


def sft_steps() -> list:
    steps = []
    for s in range(1, 21):  # sft_trainer.py: train/* per step, then val/loss in its own line at test_freq
        steps.append([s, {"train/loss": 2.0 / s, "train/grad_norm": 1.0, "train/lr": 1e-5, "train/mfu": 0.3,
                          "train/global_tokens": 60000, "train/total_tokens(B)": 6e-5 * s,
                          "perf/max_memory_allocated_gb": 20.0}])
        if s % 10 == 0:
            steps.append([s, {"val/loss": 1.0 / s}])
    return steps


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Real verl logs: a GRPO run of two attempts (the second resumed from global_step_8) and an SFT
    run that also records to swanlab in local mode when swanboard is there."""
    root = tmp_path_factory.mktemp("runs")
    grpo, sft = root / "grpo-run", root / "sft-run"
    plan = [
        [str(grpo), ["file"], [[s, grpo_metrics(s, 1)] for s in range(1, 13)]],
        [str(grpo), ["file"], [[s, grpo_metrics(s, 2)] for s in range(9, 31)]],
        [str(sft), ["file"] + (["swanlab"] if swanboard_problem() is None else []), sft_steps()],
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "SWANLAB_MODE": "local"}
    result = subprocess.run([sys.executable, "-c", VERL_LOGGER, json.dumps(plan)], env=env, cwd=root,
                            capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    return {"grpo": grpo, "sft": sft, "root": root}


def test_tracking_env_gives_each_attempt_its_own_log_and_creates_its_directory(tmp_path):
    first, second = tracking_env(tmp_path / "run"), tracking_env(tmp_path / "run")
    Path(first["VERL_FILE_LOGGER_PATH"]).write_text("")  # attempt 1 started logging
    third = tracking_env(tmp_path / "run")
    assert (tmp_path / "run" / "logs").is_dir() and (tmp_path / "run" / "swanlog").is_dir()
    assert third["VERL_FILE_LOGGER_PATH"] != first["VERL_FILE_LOGGER_PATH"]
    assert first["SWANLAB_LOG_DIR"] == str(tmp_path / "run" / "swanlog")
    assert second["SWANLAB_MODE"] in ("local", "offline")
    names = [p.name for p in log_files(tmp_path / "run")]
    assert names == [Path(first["VERL_FILE_LOGGER_PATH"]).name]


def test_verl_file_logger_attempts_are_kept_and_the_resumed_one_wins(runs):
    assert len(log_files(runs["grpo"])) == 2, "the second attempt truncated the first one's log"
    log = read_run(runs["grpo"])
    assert sorted(log.steps) == list(range(1, 31))
    assert log.steps[8]["critic/rewards/mean"] == pytest.approx(0.05 * 8 + 1)  # before the resume: attempt 1
    assert log.steps[10]["critic/rewards/mean"] == pytest.approx(0.05 * 10 + 2)  # re-run step: attempt 2


def test_report_renders_png_plots_and_summary_from_a_grpo_log(runs, tmp_path):
    run = tmp_path / "grpo-run"
    shutil.copytree(runs["grpo"], run)
    with open(log_files(run)[-1], "a") as handle:
        handle.write('{"step":31,"da')  # a run killed mid-write
    result = run_app("report", env={"RUN": str(run)}, timeout=300)
    assert result.returncode == 0, result.stderr
    report = run / "report"
    for name in ("loss.png", "reward.png", "response_length.png", "throughput.png"):
        data = (report / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
    summary = (report / "summary.txt").read_text()
    assert "kind: GRPO" in summary and "steps: 1..30 (30 logged)" in summary
    rewards = next(line for line in summary.splitlines() if line.startswith("critic/rewards/mean"))
    assert rewards.split()[1:3] == ["1.05", "3.5"]  # first value (attempt 1), last value (attempt 2)
    val = next(line for line in summary.splitlines() if line.startswith("val-core/openai/gsm8k/reward/mean@1"))
    assert val.split()[1:3] == ["0.2", "0.6"]
    assert "1 unreadable lines" in summary
    assert not [p for p in run.iterdir() if p.name.startswith(".report")], "temporary left behind"


def test_report_of_an_sft_log_plots_loss_and_tokens_and_skips_reward(runs):
    result = run_app("report", str(runs["sft"]), timeout=300)
    assert result.returncode == 0, result.stderr
    names = sorted(p.name for p in (runs["sft"] / "report").iterdir())
    assert names == ["loss.png", "summary.txt", "throughput.png"]
    summary = (runs["sft"] / "report" / "summary.txt").read_text()
    assert "kind: SFT" in summary and "tokens trained on: 1,200,000" in summary
    assert read_run(runs["sft"]).steps[10]["val/loss"] == pytest.approx(0.1)


def test_report_without_logs_is_one_line_error(tmp_path):
    line = assert_one_line_error(run_app("report", env={"RUN": str(tmp_path)}))
    assert "no metrics logs" in line and "RUN=" in line
    line = assert_one_line_error(run_app("report", env={"RUN": "", "CKPT_DIR": "", "JOB": ""}, cwd=tmp_path))
    assert "which run?" in line


@pytest.mark.slow
def test_grpo_tracking_reaches_a_ray_actor_through_the_jobs_runtime_env(tmp_path):
    """The driver passes tracking_overrides; verl's main_ppo merges them into ray.init's runtime_env:
    an actor (where GRPO's loggers live) then writes this attempt's JSONL, whatever `ray start` had."""
    run = tmp_path / "run"
    tracking = tracking_env(run)
    script = textwrap.dedent("""
        import os, sys, ray
        from hydra import compose, initialize_config_dir
        from omegaconf import OmegaConf
        import verl
        from verl.trainer.constants_ppo import get_ppo_ray_runtime_env
        overrides = sys.argv[1:]
        with initialize_config_dir(os.path.join(os.path.dirname(verl.__file__), "trainer/config"), version_base=None):
            config = compose("ppo_trainer", overrides=overrides)
        # the same merge verl/trainer/main_ppo.py::run_ppo does before ray.init
        runtime_env = OmegaConf.merge(get_ppo_ray_runtime_env(config), config.ray_kwargs.ray_init.runtime_env)
        ray.init(address="local", num_cpus=1, include_dashboard=False,
                 runtime_env=OmegaConf.to_container(runtime_env))

        @ray.remote
        class Logger:
            def log(self):
                from verl.utils.tracking import Tracking
                t = Tracking("verl-stack", "actor", ["file"])
                t.log({"critic/rewards/mean": 0.5}, step=1)
                t.finish()
                return os.environ["VERL_FILE_LOGGER_PATH"]

        print("ACTOR_PATH", ray.get(Logger.remote().log.remote()))
        ray.shutdown()
    """)
    # the environment `ray start` would have had: no tracking variables at all
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SWANLAB_", "VERL_FILE", "RAY_ADDRESS"))}
    result = subprocess.run([sys.executable, "-c", script, *tracking_overrides(tracking)], env=clean,
                            capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"ACTOR_PATH {tracking['VERL_FILE_LOGGER_PATH']}" in result.stdout
    line = json.loads(Path(tracking["VERL_FILE_LOGGER_PATH"]).read_text().splitlines()[0])
    assert line == {"step": 1, "data": {"critic/rewards/mean": 0.5}}


needs_swanboard = pytest.mark.skipif(swanboard_problem() is not None, reason="swanboard (swanlab's dashboard) "
                                     "is not installed")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@needs_swanboard
def test_swanlab_local_mode_records_under_the_run_and_board_serves_it(runs, tmp_path):
    run = runs["sft"]
    assert (run / "swanlog" / "runs.swanlab").is_file(), "swanlab local mode wrote no dashboard database"
    assert not (runs["root"] / "swanlog").exists(), "swanlab wrote into the working directory"
    port = free_port()
    board = subprocess.Popen([sys.executable, "-m", "app", "board", str(run), "--port", str(port)],
                             cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                             stdout=open(tmp_path / "board.log", "w"), stderr=subprocess.STDOUT)
    try:
        page, deadline = None, time.time() + 120
        while page is None and time.time() < deadline and board.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as response:
                    page = response.read().decode("utf-8", "replace")
            except OSError:
                time.sleep(0.5)
        assert page is not None, (tmp_path / "board.log").read_text()
        assert "<html" in page.lower()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/project", timeout=5) as response:
            assert "verl-stack" in response.read().decode()
    finally:
        board.terminate()
        board.wait(timeout=30)


def test_board_without_logs_is_one_line_error(tmp_path):
    line = assert_one_line_error(run_app("board", env={"RUN": str(tmp_path)}))
    assert "no swanlab logs yet" in line
    line = assert_one_line_error(run_app("board", env={"RUN": str(tmp_path), "BOARD_HOST": "localhost"}))
    assert "IPv4" in line


# --- round 3: the modes of the report, a symlink loop as RUN ------------------------------------------------
@pytest.mark.parametrize("umask, file_mode, dir_mode", [(0o022, "0o644", "0o755"), (0o027, "0o640", "0o750")])
def test_report_files_get_the_modes_of_the_users_umask(runs, tmp_path, umask, file_mode, dir_mode):
    run = tmp_path / "sft-run"
    shutil.copytree(runs["sft"], run)
    assert run_app("report", str(run), timeout=300, umask=umask).returncode == 0
    found = modes(run / "report")
    assert found.pop(".") == dir_mode and set(found.values()) == {file_mode}, found
    assert sorted(found) == ["loss.png", "summary.txt", "throughput.png"]


def test_report_of_a_run_that_is_a_symlink_loop_is_one_line_naming_it(tmp_path):
    loop = tmp_path / "run"
    loop.symlink_to(loop)
    line = assert_one_line_error(run_app("report", env={"RUN": str(loop)}))  # was: internal error RuntimeError
    assert line.startswith(f"error: {loop} (RUN) is a symbolic link that loops back on itself -> {loop}, ")
    assert [p.name for p in tmp_path.iterdir()] == ["run"]


# --- round 3: a diverged run, what the reward plot's title promises ----------------------------------------
def png_title(path: Path) -> str:
    from PIL import Image

    with Image.open(path) as image:
        return image.text["Title"]  # the PNG's tEXt chunk, written with the figure's title


def test_report_of_a_diverged_run_shows_the_non_finite_values_and_the_step_they_start(tmp_path):
    """verl's FileLogger writes NaN and inf as null (orjson); another writer's NaN/Infinity too: the summary shows
    them as the last value and says from which step, instead of the last healthy value."""
    run = tmp_path / "diverged"
    steps = [[s, {"train/loss": 2.0 / s if s < 7 else float("nan"), "train/grad_norm": 1.0,
                  "perf/time_per_step": 10.0 if s < 8 else float("inf")}] for s in range(1, 10)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", VERL_LOGGER, json.dumps([[str(run), ["file"], steps]])], env=env,
                            cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    log = log_files(run)[0]
    assert '"train/loss":null' in log.read_text()  # how verl writes it
    with open(log, "a") as handle:  # a json writer's spelling of the same
        handle.write(json.dumps({"step": 10, "data": {"train/loss": float("nan"), "perf/time_per_step": 10.0}}) + "\n")
    result = run_app("report", env={"RUN": str(run)}, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        "warning: non-finite values (NaN or infinite) in train/loss from step 7, perf/time_per_step from step 8: the "
        f"run diverged there; see {run / 'report' / 'summary.txt'}"]
    summary = (run / "report" / "summary.txt").read_text()
    loss = next(line for line in summary.splitlines() if line.startswith("train/loss"))
    assert loss.split() == ["train/loss", "2", "nan", "0.3333", "2", "(10)", "non-finite", "from", "step", "7"]
    step_time = next(line for line in summary.splitlines() if line.startswith("perf/time_per_step"))
    assert step_time.split()[2] == "10" and step_time.endswith("non-finite at 2 steps from step 8")
    assert ("non-finite values (NaN or infinite; verl's file logger writes both as null): train/loss from step 7"
            in summary)
    assert "training time over the logged steps: 0.02 h" in summary  # 7 finite steps of 10 s + step 10
    assert sorted(p.name for p in (run / "report").iterdir()) == ["loss.png", "summary.txt", "throughput.png"]


def test_reward_plot_title_says_what_is_drawn(runs, tmp_path):
    run = tmp_path / "grpo-run"
    shutil.copytree(runs["grpo"], run)
    assert run_app("report", str(run), timeout=300).returncode == 0
    assert png_title(run / "report" / "reward.png") == "Reward: training and validation: grpo-run"  # no accuracy drawn
    assert png_title(run / "report" / "loss.png") == "Loss: grpo-run"
    # a custom reward function that returns an `acc` has verl log val-core/<source>/acc/...: then it is drawn
    with open(log_files(run)[-1], "a") as handle:
        handle.write(json.dumps({"step": 30, "data": {"val-core/openai/gsm8k/acc/mean@1": 0.5}}) + "\n")
    assert run_app("report", str(run), timeout=300).returncode == 0
    assert png_title(run / "report" / "reward.png") == "Reward and accuracy: training and validation: grpo-run"
