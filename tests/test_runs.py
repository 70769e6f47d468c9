"""app/runs.py: one live launch per node of a run directory, with real launches (`python -m app sft` and its
CPU stand-in trainer) holding the lock; a holder killed with SIGKILL, on another host (its own UTS namespace),
or in a container (its own pid namespace); and the step and model readers every command shares."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, assert_one_line_error, run_app
from processes import stop_group

from app import runs
from app.common import UserError


@pytest.fixture
def env(base_env, tmp_path) -> dict[str, str]:
    return {**base_env, "SFT_TRAINER_MODULE": "cpu_sft_trainer", "STANDIN_HOLD": str(tmp_path / "release")}


def start_sft(env: dict[str, str], log: Path, prefix: list[str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([*(prefix or []), sys.executable, "-m", "app", "sft"], cwd=REPO, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(predicate, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def holding(run: Path, log: Path):
    """Until the stand-in trainer has written its rank file, the launch holds node0's lock and trains."""
    return lambda: (run / "rank0.json").is_file() or "error" in log.read_text()


@pytest.mark.slow
def test_a_second_launch_into_a_live_run_is_refused_naming_the_holder_and_fresh_does_not_move_it(env, tmp_path):
    run, log = Path(env["CKPT_DIR"]), tmp_path / "first.log"
    first = start_sft(env, log)
    try:
        wait_for(holding(run, log), "the first launch did not start training")
        lock = json.loads((run / ".locks" / "node0.json").read_text())
        assert lock["pid"] == first.pid and lock["command"] == "make sft"
        line = assert_one_line_error(run_app("sft", env=env))
        assert line == (f"error: {run} is in use by `make sft` on {lock['host']} (pid {first.pid}, since "
                        f"{lock['started']}): wait for it to end or stop it, or set CKPT_DIR to another run directory")
        line = assert_one_line_error(run_app("sft", env={**env, "FRESH": "1"}))
        assert line.startswith(f"error: FRESH=1 would move a live run aside: {run} is in use by `make sft`")
        assert [p.name for p in run.parent.iterdir() if p.name.startswith("run")] == ["run"]  # nothing moved aside
        (tmp_path / "release").touch()
        assert first.wait(timeout=120) == 0, log.read_text()
    finally:
        stop_group(first, grace=10)
    assert not (run / ".locks" / "node0.json").exists()  # released at the end
    (tmp_path / "release").unlink()
    result = run_app("sft", env={**env, "FRESH": "1", "STANDIN_HOLD": ""})  # nothing live: FRESH moves it aside
    assert result.returncode == 0 and "FRESH=1: moved the previous run aside" in result.stdout, result.stderr


@pytest.mark.slow
def test_a_lock_whose_holder_was_killed_is_taken_over_with_a_note(env, tmp_path):
    run, log = Path(env["CKPT_DIR"]), tmp_path / "killed.log"
    first = start_sft(env, log)
    try:
        wait_for(holding(run, log), "the first launch did not start training")
        os.killpg(first.pid, signal.SIGKILL)  # the OOM killer: no cleanup runs
        first.wait()
    finally:
        stop_group(first, grace=5)
    assert (run / ".locks" / "node0.json").is_file()  # left behind
    result = run_app("sft", env={**env, "STANDIN_HOLD": ""})
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"note: taking over the lock of {run} from `make sft`" in result.stdout and f"(pid {first.pid}" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("namespace", ["uts", "pid"], ids=["another host", "a container"])
def test_a_holder_this_node_cannot_see_is_live_by_its_heartbeat_then_stale(env, tmp_path, namespace):
    """A run directory on a volume that several nodes share: a holder on another host (its own hostname), or in a
    container (its own pid namespace), is judged by the heartbeat it writes, not by a pid this node cannot see."""
    run, log = Path(env["CKPT_DIR"]), tmp_path / "other.log"
    prefix = ["unshare", "--uts", "sh", "-c", 'hostname node-b && exec "$@"', "sh"] if namespace == "uts" else \
        ["unshare", "--pid", "--fork", "--mount-proc"]
    other = start_sft(env, log, prefix)
    try:
        wait_for(holding(run, log), "the other launch did not start training: " + log.read_text()[-2000:])
        lock_file = run / ".locks" / "node0.json"
        lock = json.loads(lock_file.read_text())
        assert (lock["host"] == "node-b") if namespace == "uts" else (lock["pidns"] != runs._pid_namespace())
        line = assert_one_line_error(run_app("sft", env=env))
        assert f"is in use by `make sft` on {lock['host']} (pid {lock['pid']}" in line
        os.killpg(other.pid, signal.SIGKILL)
        other.wait()
        old = time.time() - runs.STALE_S - 1  # its heartbeat stopped a minute ago
        os.utime(lock_file, (old, old))
        result = run_app("sft", env={**env, "STANDIN_HOLD": ""})
        assert result.returncode == 0 and "note: taking over the lock" in result.stdout, result.stderr
    finally:
        stop_group(other, grace=5)


def test_the_heartbeat_keeps_a_lock_fresh_and_release_removes_only_ones_own(tmp_path, monkeypatch):
    monkeypatch.setattr(runs, "HEARTBEAT_S", 0.2)
    lock = runs.RunLock(tmp_path / "run", "node0", "make sft")
    lock.acquire()
    try:
        path = tmp_path / "run" / ".locks" / "node0.json"
        old = time.time() - 30
        os.utime(path, (old, old))
        wait_for(lambda: time.time() - path.stat().st_mtime < 5, "no heartbeat", timeout=10)
        assert runs.live_locks(tmp_path / "run") == {"node0": runs._holder(json.loads(path.read_text()))}
        with pytest.raises(UserError, match="is in use by `make sft`"):
            runs.RunLock(tmp_path / "run", "node0", "make sft").acquire()
        runs.RunLock(tmp_path / "run", "node1", "make sft").acquire()  # another node of the same run: its own lock
    finally:
        lock.release()
    assert not path.exists() and (path.parent / "node1.json").exists()


def test_steps_resolve_the_same_way_for_every_command(tmp_path):
    run = tmp_path / "run"
    for n in (2, 5):
        (run / f"global_step_{n}").mkdir(parents=True)
    assert runs.resolve_step(run, 2) == 2
    assert runs.resolve_step(run, "latest") == 5  # no LATEST_FILE: the highest step, said in a warning
    (run / runs.LATEST_FILE).write_text("2")
    assert runs.resolve_step(run, "latest") == runs.resolve_step(run, None) == 2
    with pytest.raises(UserError, match="no saved step in"):
        runs.resolve_step(tmp_path / "empty", "latest")
    assert runs.step_arg("latest") == "latest" and runs.step_arg("7") == 7
    with pytest.raises(UserError, match="STEP='x' is not a step number"):
        runs.step_arg("x")


def test_a_models_config_is_read_once_and_its_problems_said(tiny_model_dir, tmp_path):
    model = runs.read_model(tiny_model_dir)
    assert model.problems == () and model.architectures == ["Qwen2ForCausalLM"] and model.heads
    assert runs.read_model(tiny_model_dir) is model  # one read per command, shared by perf, preflight, warm-up
    (tmp_path / "config.json").write_text("{truncated")
    assert runs.read_model(tmp_path).problems[0].startswith("an unreadable config.json")
    assert runs.read_model(tmp_path / "missing").problems == ("not a directory",)
