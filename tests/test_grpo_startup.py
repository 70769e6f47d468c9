"""What shortens GRPO's start-up and steps on a GPU node, checked here on CPU with verl's and the launcher's
real code: the replay buffer verl builds from the demo's sampler overrides (app/replay.py), and the vLLM
model-info warm-up that grpo-head and grpo-worker start in the background (app/warmup.py). Their effect on
the GPU is measured in docs/gpu-runs.md."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from conftest import REPO
from app import demo, warmup
from app.runs import read_model
from app.spec import compose

from verl.trainer.ppo.v1.trainer_base import PPOTrainer  # noqa: E402  (imports TransferQueue: pyproject.toml)

from app.replay import QuickPollReplayBuffer  # noqa: E402


def built_by_verl(cfg):
    """The replay buffer verl's sync trainer builds for `cfg`, through its own _build_replay_buffer (which
    reads only these attributes of the trainer)."""
    trainer = types.SimpleNamespace(config=cfg, trainer_mode=cfg.trainer.v1.trainer_mode,
                                    _add_prompts_to_generate=lambda count: None)
    trainer._resolve_filter_groups_metric = types.MethodType(PPOTrainer._resolve_filter_groups_metric, trainer)
    return PPOTrainer._build_replay_buffer(trainer)


def test_verl_builds_the_demos_buffer_as_its_own_but_polling_every_tenth_of_a_second():
    demo_cfg = compose("grpo", list(demo.GRPO_ARGS))
    ours = built_by_verl(demo_cfg)
    stock_args = [a for a in demo.GRPO_ARGS if "trainer.v1.sampler" not in a]
    stock = built_by_verl(compose("grpo", stock_args))
    assert type(ours) is QuickPollReplayBuffer and type(stock).__name__ == "ReplayBuffer"
    assert (ours.poll_interval, stock.poll_interval) == (0.1, 2.0)
    mine = {k: v for k, v in vars(ours).items() if k not in ("poll_interval", "sampler_kwargs", "refill_fn")}
    verls = {k: v for k, v in vars(stock).items() if k not in ("poll_interval", "sampler_kwargs", "refill_fn")}
    assert mine == verls and mine["train_batch_size"] == mine["gen_batch_size"] == demo.GRPO_BATCH


# --- the vLLM model-info warm-up ------------------------------------------------------------------------
def test_warmup_reads_the_architectures_vllm_will_inspect(tiny_model_dir, tmp_path):
    assert read_model(tiny_model_dir).architectures == ["Qwen2ForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert read_model(tmp_path).architectures == [] and read_model(tmp_path / "missing").architectures == []
    assert warmup.start(tmp_path, tmp_path / "log", {}) is None  # nothing to warm: no process


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="about a node without vLLM")
def test_warmup_without_vllm_ends_at_once_and_says_so(tiny_model_dir, tmp_path):
    """Here vLLM is not installed (the image has it): the background process must end on its own, exit 0,
    and say that nothing was warmed, so that a launch never waits for or fails on it."""
    log = tmp_path / "logs" / "vllm-warmup.log"
    process = warmup.start(tiny_model_dir, log, {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    assert process is not None
    entry, deadline = Path(f"/proc/{process.pid}"), time.monotonic() + 60
    # a zombie keeps its /proc entry until reaped; the reaping thread's Popen.wait sets returncode just after
    # waitpid returns, so the entry can be gone a moment before returncode is set (CI once read it then).
    # Neither is this test's doing: it reads the attribute, it never waits or polls.
    while (entry.exists() or process.returncode is None) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not entry.exists() and process.returncode == 0  # ended and reaped without anyone waiting for it
    assert log.read_text().strip().splitlines()[-1].startswith("vLLM is not importable here (")


def test_stopping_the_warmup_ends_vllms_inspection_child_too(tiny_model_dir, tmp_path):
    """vLLM inspects the model in a child process (a stand-in registry here, tests/fixtures/vllm_standin): a
    launch that ends while it runs must leave neither the warm-up nor that child behind."""
    pidfile = tmp_path / "child.pid"
    environ = {"PATH": "/usr/bin:/bin", "STANDIN_PIDFILE": str(pidfile),
               "PYTHONPATH": f"{Path(__file__).parent / 'fixtures' / 'vllm_standin'}{os.pathsep}{REPO}"}
    process = warmup.start(tiny_model_dir, tmp_path / "warmup.log", environ)
    deadline = time.monotonic() + 60
    while not (pidfile.is_file() and pidfile.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    child = int(pidfile.read_text())
    try:
        began = time.monotonic()
        warmup.stop(process)
        assert time.monotonic() - began < 10  # both ended on SIGTERM, no SIGKILL needed
        gone = time.monotonic() + 10
        # the child is reaped by init once it ends; the warm-up by start()'s thread, which sets returncode a
        # moment after waitpid (poll() would answer None while that thread holds Popen's waitpid lock)
        while (Path(f"/proc/{child}").exists() or process.returncode is None) and time.monotonic() < gone:
            time.sleep(0.1)
        assert not Path(f"/proc/{child}").exists() and process.returncode is not None
    finally:
        for pid in (child, process.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_stopping_a_finished_warmup_does_nothing(tmp_path):
    done = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    done.wait()
    warmup.stop(done)
    warmup.stop(None)
    assert done.returncode == 0
