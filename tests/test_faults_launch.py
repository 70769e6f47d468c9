"""Leave the node as found (issue 13): after grpo-head or grpo-worker ends - success, failure, SIGTERM - no
Ray process of ours and no Ray state naming our cluster remain, proven by a plain `ray.init()` program run
afterwards on the same machine; a successful run ends with its success line; HEAD_IP / the head's port are
checked before anything waits. Real Ray on 127.0.0.1 / 127.0.0.2, started through `python -m app`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from app.node import port_open
from conftest import REPO, assert_one_line_error, run_app
from test_launch import free_port, start_app, stop_group

PLAIN_RAY = """
import time, ray
started = time.monotonic()
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
print("address", ray.get_runtime_context().gcs_address, "seconds", round(time.monotonic() - started, 1))
ray.shutdown()
"""


@pytest.fixture
def ray_env(base_env):
    """A launch environment whose Ray temp dir (RAY_TMPDIR: short, for AF_UNIX paths) belongs to this test."""
    temp = tempfile.mkdtemp(prefix="ray")
    env = dict(base_env)
    env.update(RAY_TMPDIR=temp, HEAD_IP="127.0.0.1",
               RAY_PORT=str(free_port()), GPUS_PER_NODE="1", GRPO_TRAINER_MODULE="ray_driver",
               RAY_START_ARGS=f"--num-gpus 1 --num-cpus 1 --include-dashboard false "
                              f"--dashboard-agent-listen-port {free_port()}",
               RAY_gcs_rpc_server_reconnect_timeout_s="5", RAY_WARM_WORKERS="0")  # as test_launch.py's ray_env
    yield env
    subprocess.run(["rm", "-rf", temp])


def processes_naming(temp: str) -> list[str]:
    """Live processes whose command lines or environments name `temp`: a Ray instance's under its temp dir, a run's
    driver (running, its overrides name the run directory; held, its environment's CKPT_DIR does)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        with contextlib.suppress(psutil.Error):
            if proc.info["pid"] != os.getpid() and (temp in cmdline or any(temp in v for v in proc.environ().values())):
                found.append(f"{proc.info['pid']}: {cmdline[:160]}")
    return found


def assert_node_left_as_found(env: dict[str, str], head_address: str) -> None:
    temp = env["RAY_TMPDIR"]
    deadline = time.monotonic() + 30  # raylet's workers exit a moment after their raylet
    while processes_naming(temp) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_naming(temp) == [] and processes_naming(env["CKPT_DIR"]) == []
    assert not (Path(temp) / "ray" / "ray_current_cluster").exists()
    # a plain Ray program on this machine (no address: what `python -m verl.trainer.main_ppo` does) starts
    # its own local cluster at once, instead of trying to join our departed head
    plain = {k: v for k, v in env.items() if k not in ("RAY_ADDRESS", "RAY_gcs_rpc_server_reconnect_timeout_s")}
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", PLAIN_RAY], env=plain, capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert time.monotonic() - started < 120
    address = result.stdout.split()[1]
    assert address != head_address and "Connecting to existing Ray cluster" not in result.stderr


def last_line(log: Path) -> str:
    return [line for line in log.read_text().splitlines() if line.strip()][-1]


@pytest.mark.slow
def test_after_a_successful_grpo_head_run_the_node_is_as_found_and_the_last_line_says_success(ray_env, tmp_path):
    head = start_app("grpo-head", {**ray_env, "WAIT_TIMEOUT": "300"}, tmp_path / "head.log")
    try:
        code = head.wait(timeout=500)
    finally:
        stop_group(head)
    log = tmp_path / "head.log"
    assert code == 0, log.read_text()[-3000:]
    assert last_line(log).startswith("GRPO finished: checkpoints in "), log.read_text()[-2000:]
    # the count, beside the head's start, found every prompt within the limit: the driver got its choice
    argv = json.loads((Path(ray_env["CKPT_DIR"]) / "driver.json").read_text())["argv"]
    assert "data.filter_overlong_prompts=False" in argv and "verl's length filter at every start skipped" in log.read_text()
    assert_node_left_as_found(ray_env, f"127.0.0.1:{ray_env['RAY_PORT']}")


@pytest.mark.slow
def test_after_the_grpo_driver_fails_the_head_is_stopped_and_the_node_is_as_found(ray_env, tmp_path):
    env = {**ray_env, "GRPO_TRAINER_MODULE": "no_such_driver_module", "WAIT_TIMEOUT": "300"}
    head = start_app("grpo-head", env, tmp_path / "head.log")
    try:
        code = head.wait(timeout=500)
    finally:
        stop_group(head)
    log = tmp_path / "head.log"
    assert code == 2 and last_line(log).startswith("error: the GRPO driver exited with code 1"), log.read_text()
    assert_node_left_as_found(ray_env, f"127.0.0.1:{ray_env['RAY_PORT']}")


@pytest.mark.slow
@pytest.mark.parametrize("args, refusal", [
    ("actor_rollout_ref.actor.use_dynamic_bsz=false actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 "
     "actor_rollout_ref.actor.ppo_mini_batch_size=300", "error: verl's validate_config rejects the grpo config:"),
    ("data.max_prompt_length=4", "error: verl's length filter would leave 0 train prompts")], ids=["verl", "count"])
def test_a_config_the_prompt_count_or_verls_checks_reject_stops_the_starting_head_at_once_and_the_node_is_as_found(
        ray_env, tmp_path, args, refusal):
    """The prompts' count and verl's own checks run while the head starts: their refusal is make check's line, at
    once (not after the wait for a second node), and what had started is stopped."""
    env = {**ray_env, "ARGS": args, "NNODES": "2", "WAIT_TIMEOUT": "600"}
    check = assert_one_line_error(run_app("check", "grpo", env=env))
    head = start_app("grpo-head", env, tmp_path / "head.log")
    try:
        code = head.wait(timeout=300)  # well inside WAIT_TIMEOUT: the refusal does not wait for the missing node
    finally:
        stop_group(head)
    log = tmp_path / "head.log"
    assert code == 2 and last_line(log) == check, log.read_text()[-3000:]
    text = log.read_text()
    assert check.startswith(refusal) and "Traceback" not in text
    assert "stopping the Ray head" in text
    assert_node_left_as_found(ray_env, f"127.0.0.1:{ray_env['RAY_PORT']}")


@pytest.mark.slow
@pytest.mark.parametrize("signals", [[signal.SIGTERM], [signal.SIGTERM, signal.SIGTERM, signal.SIGINT, signal.SIGTERM]])
def test_sigterm_to_a_waiting_grpo_head_is_one_line_143_and_the_node_is_as_found(ray_env, tmp_path, signals):
    """Also when more signals follow while it stops (a scheduler's second SIGTERM, an impatient Ctrl-C): they do not
    cut its cleanup short, which would leave the Ray head and the held driver running."""
    env = {**ray_env, "NNODES": "2", "WAIT_TIMEOUT": "300"}
    head = start_app("grpo-head", env, tmp_path / "head.log")
    try:
        cluster_file = Path(ray_env["RAY_TMPDIR"]) / "ray" / "ray_current_cluster"
        deadline = time.monotonic() + 300
        while not cluster_file.exists() and time.monotonic() < deadline and head.poll() is None:
            time.sleep(0.5)
        assert cluster_file.read_text().endswith(f":{ray_env['RAY_PORT']}")  # what Ray records while it runs
        for signum in signals:  # to the app alone, as `docker stop` / `kill PID` do
            head.send_signal(signum)
            time.sleep(0.3)
        code = head.wait(timeout=120)
    finally:
        stop_group(head)
    log = tmp_path / "head.log"
    assert code == 143 and last_line(log).startswith("error: stopped by SIGTERM"), log.read_text()[-3000:]
    assert "stopping the Ray head" in log.read_text()
    assert_node_left_as_found(ray_env, f"127.0.0.1:{ray_env['RAY_PORT']}")


@pytest.mark.slow
def test_after_the_worker_and_the_head_are_stopped_the_node_is_as_found(ray_env, tmp_path):
    env = {**ray_env, "NNODES": "3", "WAIT_TIMEOUT": "300"}  # waits for a third node that never comes
    head = start_app("grpo-head", env, tmp_path / "head.log")
    worker = None
    try:
        deadline = time.monotonic() + 300
        while "joined" not in (tmp_path / "head.log").read_text():  # the head is up and counts nodes
            assert time.monotonic() < deadline and head.poll() is None, (tmp_path / "head.log").read_text()
            time.sleep(0.5)
        worker_args = f"--num-gpus 1 --num-cpus 1 --dashboard-agent-listen-port {free_port()}"
        worker = start_app("grpo-worker", {**env, "NODE_IP": "127.0.0.2", "RAY_START_ARGS": worker_args},
                           tmp_path / "worker.log")
        while "2/3" not in (tmp_path / "head.log").read_text():
            assert time.monotonic() < deadline and worker.poll() is None, (tmp_path / "worker.log").read_text()
            time.sleep(0.5)
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=120) == 143
        head.send_signal(signal.SIGTERM)
        assert head.wait(timeout=120) == 143
    finally:
        for process in (worker, head):
            if process is not None:
                stop_group(process)
    assert last_line(tmp_path / "worker.log").startswith("error: stopped by SIGTERM")
    assert_node_left_as_found(ray_env, f"127.0.0.1:{ray_env['RAY_PORT']}")


# --- addresses checked before anything waits ---------------------------------------------------------
def foreign_address() -> str:
    """An address that cannot be this machine's: every 127.0.0.0/8 address is, so the IPv6 documentation
    prefix (RFC 3849) stands in. It is compared with this machine's addresses, never contacted."""
    from app.node import interface_addresses

    candidate = "2001:db8::7"
    if candidate in {a for addresses in interface_addresses().values() for a in addresses}:
        pytest.skip("this machine holds the documentation address")
    return candidate


def test_grpo_head_refuses_a_head_ip_that_is_not_this_machines(ray_env):
    foreign = foreign_address()
    result = run_app("grpo-head", env={**ray_env, "HEAD_IP": foreign})
    line = assert_one_line_error(result)
    assert line.startswith(f"error: HEAD_IP={foreign} is not an address of this machine (its addresses: ")
    assert "127.0.0.1" in line and "run make grpo-head on the head node itself" in line
    assert not Path(ray_env["CKPT_DIR"]).exists()  # no token, no Ray, no run directory


def test_grpo_head_dry_run_with_a_foreign_head_ip_warns_but_prints_the_plan(ray_env):
    foreign = foreign_address()
    result = run_app("grpo-head", env={**ray_env, "HEAD_IP": foreign, "DRY_RUN": "1"})
    assert result.returncode == 0, result.stderr
    assert f"warning: HEAD_IP={foreign} is not an address of this machine" in result.stderr
    assert f"--node-ip-address {foreign}" in result.stdout


def test_a_worker_says_within_seconds_that_no_head_answers_and_fails_at_wait_timeout(ray_env):
    started = time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "app", "grpo-worker"], cwd=REPO,
                               env={**ray_env, "WAIT_TIMEOUT": "12"}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    first = process.stderr.readline()
    said_after = time.monotonic() - started
    rest_out, rest_err = process.communicate(timeout=120)
    address = f"127.0.0.1:{ray_env['RAY_PORT']}"
    assert first.startswith(f"warning: nothing answers at {address} yet: waiting up to 12s for make grpo-head")
    assert said_after < 15  # the interpreter start included; not after WAIT_TIMEOUT
    errors = [line for line in rest_err.splitlines() if line.startswith("error:")]
    assert process.returncode == 2 and "Traceback" not in rest_err and len(errors) == 1
    assert errors[0].startswith("error: no head within 12s") and rest_err.rstrip().endswith(errors[0])


def test_the_grpo_profile_starts_no_dataloader_worker_processes(ray_env, monkeypatch):
    from app.preflight import preflight
    from app.settings import load

    assert preflight("grpo", load(ray_env)).spec.cfg.data.dataloader_num_workers == 0


# --- after a kill: what is left over is named, never waited on ----------------------------------------------
def the_one_error(result) -> str:
    """A launch that failed after preflight passed: preflight's warnings, then one error line, last; no traceback."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert result.returncode != 0 and "Traceback" not in result.stderr and errors == lines[-1:], result.stderr
    return errors[0]


def test_a_ray_port_held_by_something_else_is_refused_naming_the_holder(ray_env):
    import socket

    with socket.socket() as server:
        server.bind(("127.0.0.1", int(ray_env["RAY_PORT"])))
        server.listen()
        line = the_one_error(run_app("grpo-head", env={**ray_env, "WAIT_TIMEOUT": "600"}, timeout=120))
    assert line.startswith(f"error: RAY_PORT {ray_env['RAY_PORT']} is in use by python") and "which is not a Ray head" in line
    assert processes_naming(ray_env["RAY_TMPDIR"]) == []


@pytest.mark.slow
def test_a_ray_head_left_by_an_earlier_run_is_one_line_not_a_hang(ray_env, tmp_path):
    """A head this run did not start (say, left by a launch the OOM killer took): it does not take this run's token,
    so the launch cannot join it, and says so in one line, with how to stop it; Ray's own retries go to a log."""
    args = ray_env["RAY_START_ARGS"].split()
    left = subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
                             "--node-ip-address", "127.0.0.1", "--port", ray_env["RAY_PORT"], *args],
                            env={**ray_env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "f" * 64},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not port_open("127.0.0.1", int(ray_env["RAY_PORT"])) and time.monotonic() < deadline:
            time.sleep(0.5)
        result = run_app("grpo-head", env={**ray_env, "WAIT_TIMEOUT": "600"}, timeout=300)
        line = the_one_error(result)
        assert line.startswith(f"error: cannot join the Ray cluster at 127.0.0.1:{ray_env['RAY_PORT']} (")
        assert "stop it (`ray stop` on that node) or set RAY_PORT to a free port" in line
        assert "gcs_client" not in result.stderr + result.stdout  # Ray's retries: in the run's ray-wait.log
    finally:
        stop_group(left)


def test_gpus_held_by_a_killed_runs_processes_are_refused_naming_them(ray_env, tmp_path):
    """nvidia-smi (a stand-in here: this machine has no GPU) lists a vLLM engine on the node's GPU, as after a GRPO
    run taken by SIGKILL: a new launch there would wait for memory it cannot get. One line, the pid to stop."""
    import stat

    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\ncase \"$1\" in\n"
                   "  --query-compute-apps*) echo 'GPU-aaaa, 4242, VLLM::EngineCore, 61234' ;;\n"
                   "  *) echo '0, GPU-aaaa, NVIDIA H200, 143771, 580.82, Default' ;;\nesac\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    env = {**ray_env, "PATH": f"{smi.parent}:{os.environ['PATH']}"}
    for command in ("sft", "grpo-head"):
        line = assert_one_line_error(run_app(command, env=env))
        assert line.startswith("error: this node's GPUs are in use by pid 4242 (VLLM::EngineCore, 61234 MiB), perhaps "
                               "left by a run that was killed: stop it (kill PID) before make"), line
    assert not Path(ray_env["CKPT_DIR"]).exists()


@pytest.mark.slow
@pytest.mark.parametrize("signum, code, said", [(signal.SIGINT, 130, "error: interrupted;"),
                                                (signal.SIGTERM, 143, "error: stopped by SIGTERM;")])
def test_ctrl_c_or_sigterm_on_a_running_sft_is_our_one_line_not_torchruns_traceback(ray_env, tmp_path, signum, code,
                                                                                      said):
    """Ctrl-C reaches the whole foreground process group (the terminal's), SIGTERM the launch (docker stop, kill):
    torchrun's agent raises its SignalException, and its ranks stop; the user reads one line, nothing is left."""
    env = {**ray_env, "SFT_TRAINER_MODULE": "cpu_sft_trainer", "STANDIN_HOLD": str(tmp_path / "never")}
    # SIGINT handled as in a terminal's foreground job: a shell's background job (`.ci/run &`) inherits it ignored
    launch = subprocess.Popen([sys.executable, "-m", "app", "sft"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    run = Path(env["CKPT_DIR"])
    deadline = time.monotonic() + 180
    while not (run / "rank0.json").exists() and time.monotonic() < deadline:  # training (the stand-in holds)
        time.sleep(0.3)
    (os.killpg if signum == signal.SIGINT else os.kill)(launch.pid, signum)
    out, err = launch.communicate(timeout=120)
    assert launch.returncode == code and "Traceback" not in err + out, err[-3000:]
    assert [line for line in err.splitlines() if line.startswith("error:")] == [err.strip().splitlines()[-1]]
    assert err.strip().splitlines()[-1].startswith(said)
    stray = [p.info["cmdline"] for p in psutil.process_iter(["cmdline"]) if str(run) in " ".join(p.info["cmdline"] or [])]
    assert stray == [] and not (run / ".locks" / "node0.json").exists() and not (run / "logs" / "go-node0").exists()


@pytest.mark.slow
def test_an_sft_whose_count_refuses_stops_the_torchrun_it_started_with_make_checks_line(ray_env, tmp_path):
    """SFT's conversations are counted while torchrun starts, its ranks held: the count's refusal is make check's
    line, and the torchrun already started stops before verl's trainer runs, leaving nothing running."""
    import pandas as pd

    from stack_files import write_sft

    train = write_sft(tmp_path / "train.parquet", rows=64)
    table = pd.read_parquet(train)
    table.at[3, "messages"] = [{"role": "user", "content": "What is 1 + 1? " + "and " * 400},
                               {"role": "assistant", "content": "1 + 1 = 2\n#### 2"}]
    table.to_parquet(train)
    env = {**ray_env, "SFT_TRAINER_MODULE": "cpu_sft_trainer", "TRAIN_FILE": str(train),
           "ARGS": "data.max_length=256 data.truncation=error"}
    check = assert_one_line_error(run_app("check", "sft", env=env))
    assert check.startswith("error: 1 of 64 train conversations are longer than data.max_length=256"), check
    result = run_app("sft", env=env, timeout=300)
    assert result.returncode == 2 and the_one_error(result) == check and "Traceback" not in result.stdout
    from app.timeline import read

    run = Path(env["CKPT_DIR"])
    assert [p for p, _ in read(run / "logs" / "timeline-node0.jsonl")] == ["preflight done", "torchrun started"]
    assert not (run / "rank0.json").exists() and not (run / ".locks" / "node0.json").exists()
    stray = [p.info["cmdline"] for p in psutil.process_iter(["cmdline"]) if str(run) in " ".join(p.info["cmdline"] or [])]
    assert stray == []


@pytest.mark.slow
@pytest.mark.parametrize("command", ["sft", "grpo-head"])
def test_a_launch_killed_outright_leaves_nothing_of_its_run_running(ray_env, tmp_path, command):
    """The OOM killer (or kill -9) takes the launch alone, and it stops nothing itself. What it started in sessions
    of their own (torchrun; `ray start --block` and the held driver) learn their parent is gone (PR_SET_PDEATHSIG)
    and stop their own children: no rank, Ray process or driver keeps going, and no record of the dead head."""
    env = {**ray_env, "SFT_TRAINER_MODULE": "cpu_sft_trainer", "STANDIN_HOLD": str(tmp_path / "never"),
           "NNODES": "2" if command == "grpo-head" else "1", "WAIT_TIMEOUT": "300"}  # the head waits for a worker
    launch = start_app(command, env, tmp_path / "launch.log")
    run = Path(env["CKPT_DIR"])
    started = run / "rank0.json" if command == "sft" else Path(env["RAY_TMPDIR"]) / "ray" / "ray_current_cluster"
    deadline = time.monotonic() + 180
    while not started.exists() and time.monotonic() < deadline and launch.poll() is None:
        time.sleep(0.3)
    assert started.exists(), (tmp_path / "launch.log").read_text()[-3000:]

    def ours() -> list[str]:
        found = processes_naming(env["RAY_TMPDIR"])
        for proc in psutil.process_iter(["pid", "cmdline"]):
            with contextlib.suppress(psutil.Error):
                if proc.info["pid"] != launch.pid and proc.environ().get("CKPT_DIR") == str(run):
                    found.append(" ".join(proc.info["cmdline"] or [])[:160])
        return found

    assert ours(), "no process of the run found to begin with: the check below would prove nothing"
    os.kill(launch.pid, signal.SIGKILL)
    launch.wait()
    deadline = time.monotonic() + 60  # each stops its own children, with time to
    while ours() and time.monotonic() < deadline:
        time.sleep(0.5)
    left = ours()
    stop_group(launch, grace=5)
    assert left == []
    if command == "grpo-head":  # `ray start` put back the node's record of its cluster as it went: nothing names
        assert not started.exists()  # the dead head for a later plain ray.init()


def test_a_master_port_in_use_on_node_0_is_one_line_naming_its_holder(ray_env):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**ray_env, "NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "SFT_TRAINER_MODULE": "cpu_sft_trainer"}
        line = the_one_error(run_app("sft", env=env))
    assert line.startswith(f"error: MASTER_PORT {port} is already in use on this node by python") \
        and line.endswith("set MASTER_PORT to a free port, the same on every node")
