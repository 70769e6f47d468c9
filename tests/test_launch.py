"""The launch layer with real processes: torchrun rendezvous over gloo, a Ray head and worker on
127.0.0.1 / 127.0.0.2, resume and FRESH, DRY_RUN plans. Everything is started through `python -m app`.

Test hooks (app/launch.py): SFT_TRAINER_MODULE / GRPO_TRAINER_MODULE swap verl's entry modules for the
tiny stand-ins in tests/fixtures (no GPU here); RAY_START_ARGS declares `--num-gpus 1` to Ray.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import LAUNCH_VARS, REPO, assert_one_line_error, run_app
from processes import driver_saw_both_nodes, free_port, stop_group, worker_then_head


def start_app(command: str, env: dict[str, str], log: Path) -> subprocess.Popen:
    """`python -m app COMMAND` in its own session, output to `log` (so the test can stop all it started)."""
    handle = log.open("w")
    return subprocess.Popen([sys.executable, "-m", "app", command], cwd=REPO, env=env, stdout=handle,
                            stderr=subprocess.STDOUT, start_new_session=True)


# --- SFT ---------------------------------------------------------------------------------------------
def test_sft_dry_run_prints_the_torchrun_line_and_environment_after_preflight(base_env):
    result = run_app("sft", env={**base_env, "DRY_RUN": "1", "ARGS": "optim.lr=2e-5", "SWANLAB_API_KEY": "s3cret"})
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "ok: train file:" in out  # preflight ran first
    run = base_env["CKPT_DIR"]
    # torchrun's own CLI through app.rendezvous (one line instead of its tracebacks), which starts verl's trainer
    assert (f"-m app.rendezvous torchrun --nnodes 1 --nproc-per-node 1 --log-dir {run}/logs/torchrun --standalone "
            "-m app.rendezvous rank verl.trainer.sft_trainer") in out
    assert f"--config-dir {REPO / 'configs'} --config-name sft" in out
    assert out.rstrip().endswith("optim.lr=2e-5")  # ARGS last
    assert "export SWANLAB_MODE=local" in out and "export VERL_FILE_LOGGER_PATH=" in out
    assert "export TORCH_COMPILE_JOB_ID=verl-stack" in out  # torch's record of varying sizes, kept per node
    assert "s3cret" not in out and "export SWANLAB_API_KEY='***'" in out
    assert not Path(base_env["CKPT_DIR"]).exists()  # nothing started, nothing written


@pytest.mark.slow
def test_the_exported_job_id_makes_a_nodes_next_run_compile_flex_attention_once(base_env, tmp_path):
    """With TORCH_COMPILE_JOB_ID as the launch exports it, torch keeps which sizes varied beside Inductor's cache,
    and the node's next process compiles create_block_mask and flex_attention once each, dynamic (2 graphs);
    without it every process compiles each at its first length, then again (4): 33 s of GRPO's first step on
    1xH200 (docs/gpu-runs.md, runs 39-43)."""
    plan = run_app("sft", env={**base_env, "DRY_RUN": "1"})
    exported = dict(shlex.split(line)[1].split("=", 1) for line in plan.stdout.splitlines()
                    if line.strip().startswith("export TORCH_COMPILE_JOB_ID="))
    assert exported == {"TORCH_COMPILE_JOB_ID": "verl-stack"}, plan.stdout

    def graphs(env: dict[str, str]) -> str:
        run = subprocess.run([sys.executable, str(REPO / "tests" / "fixtures" / "flex_compiles.py")], text=True,
                             capture_output=True, env={**base_env, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path), **env})
        assert run.returncode == 0, run.stderr[-2000:]
        return run.stdout.strip()

    assert graphs(exported) == "graphs=4"  # a fresh node: the first length, then dynamic
    assert graphs(exported) == "graphs=2"  # the next run on it
    assert graphs({}) == "graphs=4"  # the same cache without a job id: as on a fresh node


def test_sft_dry_run_refuses_what_preflight_refuses(base_env):
    line = assert_one_line_error(run_app("sft", env={**base_env, "DRY_RUN": "1", "NNODES": "2", "NODE_RANK": "1"}))
    assert "MASTER_ADDR" in line


@pytest.mark.slow
def test_two_node_torchrun_rendezvous_over_gloo_meets_and_finishes(base_env, tmp_path):
    """Two `make sft` lines, different only in NODE_RANK (and each node's own disk), meet and finish."""
    port = free_port()
    elastic_dirs = set(Path(tempfile.gettempdir()).glob("torchelastic_*"))
    nodes = []
    for rank in (0, 1):
        env = {**base_env, "NNODES": "2", "NODE_RANK": str(rank), "GPUS_PER_NODE": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "SFT_TRAINER_MODULE": "cpu_sft_trainer",
               "CKPT_DIR": str(tmp_path / f"node{rank}" / "run")}
        nodes.append(start_app("sft", env, tmp_path / f"node{rank}.log"))
    try:
        codes = [node.wait(timeout=400) for node in nodes]
    finally:
        for node in nodes:
            stop_group(node, grace=10)
    logs = [(tmp_path / f"node{rank}.log").read_text() for rank in (0, 1)]
    assert codes == [0, 0], logs
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"node{rank}" / "run" / f"rank{rank}.json").read_text())
        assert seen["world_size"] == 2 and seen["sum"] == 3.0 and seen["node_rank"] == rank
        assert seen["lr"] == 1e-5 and "wandb" not in seen["logger"]
        assert seen["file_logger"].startswith(str(tmp_path / f"node{rank}" / "run" / "logs"))
        assert "SFT finished" in logs[rank]
    assert not (tmp_path / "node0" / "run" / "rank1.json").exists()  # each node writes its own disk
    # each node's start-up, phase by phase; node 0's rank 0 printed the first step, and the summary after it
    from app.timeline import read

    for rank in (0, 1):
        phases = [p for p, _ in read(tmp_path / f"node{rank}" / "run" / "logs" / f"timeline-node{rank}.jsonl")]
        # the count of the data ran while torchrun started; the ranks, held until it passed, then met
        assert phases[:4] == ["preflight done", "torchrun started", "lengths counted", "nodes agreed, trainer starts"], \
            phases
    assert phases_of_node0_end(tmp_path) == "first step done" and "start-up on this node" in logs[0]
    # torchrun's attempt files stay with each node's run, none in the temp dir
    assert all(any((tmp_path / f"node{rank}" / "run" / "logs" / "torchrun").iterdir()) for rank in (0, 1))
    assert set(Path(tempfile.gettempdir()).glob("torchelastic_*")) == elastic_dirs


def phases_of_node0_end(tmp_path: Path) -> str:
    from app.timeline import read

    return read(tmp_path / "node0" / "run" / "logs" / "timeline-node0.jsonl")[-1][0]


def two_sft_nodes(base_env: dict[str, str], tmp_path: Path, node1: dict[str, str]) -> tuple[list[int], list[str]]:
    """Two `make sft` nodes over gloo on this machine, node 1 with `node1` changed; their exit codes and logs."""
    port = free_port()
    nodes = []
    for rank in (0, 1):
        env = {**base_env, "NNODES": "2", "NODE_RANK": str(rank), "GPUS_PER_NODE": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "SFT_TRAINER_MODULE": "cpu_sft_trainer", "STACK_RENDEZVOUS_TIMEOUT": "120",
               "CKPT_DIR": str(tmp_path / f"node{rank}" / "run"), **(node1 if rank else {})}
        nodes.append(start_app("sft", env, tmp_path / f"node{rank}.log"))
    try:
        codes = [node.wait(timeout=400) for node in nodes]
    finally:
        for node in nodes:
            stop_group(node, grace=10)
    return codes, [(tmp_path / f"node{rank}.log").read_text() for rank in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("differs", ["ARGS", "MODEL_PATH", "data file", "NNODES"])
def test_two_sft_nodes_that_run_different_runs_stop_before_training_naming_the_node_and_keys(
        base_env, tmp_path, tiny_model_dir, differs):
    """The README's promise, checked: the same line on every node, only NODE_RANK differs. A node with other ARGS,
    another model or data set, or another NNODES, stops every node at the rendezvous, before verl's trainer."""
    import shutil

    from stack_files import write_sft

    node1, said = {  # node 1's change, and what node 0 / node 1 say of it
        "ARGS": ({"ARGS": "optim.lr=1e-3"}, ["optim.lr: 1e-05 on node 0, 0.001 on node 1",
                                             "optim.lr: 0.001 on node 1, 1e-05 on node 0"]),
        "MODEL_PATH": ({"MODEL_PATH": str(shutil.copytree(tiny_model_dir, tmp_path / "copy"))}, ["model.path: "] * 2),
        "data file": ({"TRAIN_FILE": str(write_sft(tmp_path / "other.parquet", rows=64, start=500))},
                      ["data.train_files: "] * 2),
        "NNODES": ({"NNODES": "4"}, ["NNODES: 2 on node 0, 4 on node 1", "NNODES: 4 on node 1, 2 on node 0"]),
    }[differs]
    codes, logs = two_sft_nodes(base_env, tmp_path, node1)
    for rank, other in ((0, 1), (1, 0)):
        last = [line for line in logs[rank].splitlines() if line.strip()][-1]
        errors = [line for line in logs[rank].splitlines() if line.startswith("error:") or "Traceback" in line]
        assert codes[rank] != 0 and errors == [last], logs[rank][-3000:]
        assert last.startswith(f"error: node {rank} does not run the same run as node {other} ("), last
        assert last.endswith("(only NODE_RANK differs), then start every node again")
        assert said[rank] in last, last
        assert not (tmp_path / f"node{rank}" / "run" / f"rank{rank}.json").exists()  # verl's trainer never started


@pytest.mark.slow
def test_rerun_says_it_resumes_and_fresh_moves_the_old_run_aside(base_env):
    run = Path(base_env["CKPT_DIR"])
    (run / "global_step_7").mkdir(parents=True)
    (run / "latest_checkpointed_iteration.txt").write_text("7")
    result = run_app("sft", env={**base_env, "DRY_RUN": "1"})
    assert result.returncode == 0, result.stderr
    assert f"resuming from global_step_7 in {run}" in result.stdout

    result = run_app("sft", env={**base_env, "FRESH": "1", "SFT_TRAINER_MODULE": "cpu_sft_trainer"})
    assert result.returncode == 0, result.stdout + result.stderr
    aside = [p for p in run.parent.iterdir() if p.name.startswith("run.old-")]
    assert len(aside) == 1 and (aside[0] / "latest_checkpointed_iteration.txt").read_text() == "7"
    assert (run / "rank0.json").is_file() and not (run / "global_step_7").exists()
    assert f"moved the previous run aside to {aside[0]}" in result.stdout


# --- GRPO: Ray head and worker -------------------------------------------------------------------------
@pytest.fixture
def ray_env(base_env):
    # short socket paths (AF_UNIX limit) in a temp dir of this test; Ray's other ports are chosen free
    temp = tempfile.mkdtemp(prefix="ray")
    env = {**base_env, "RAY_TMPDIR": temp, "HEAD_IP": "127.0.0.1", "RAY_PORT": str(free_port()),
           "GPUS_PER_NODE": "1", "GRPO_TRAINER_MODULE": "ray_driver",
           "RAY_START_ARGS": "--num-gpus 1 --num-cpus 1 --include-dashboard false "
                             f"--dashboard-agent-listen-port {free_port()}",
           "RAY_gcs_rpc_server_reconnect_timeout_s": "5",
           # off where the test is about something else: the prestarted worker's imports of verl take ~11 s of this
           # machine's cores (the warm-worker test and tests/test_schedulers.py run it as shipped)
           "RAY_WARM_WORKERS": "0"}
    yield env
    subprocess.run(["rm", "-rf", temp])


def test_grpo_head_dry_run_shows_token_auth_loopback_dashboard_and_the_cluster_driver(base_env):
    result = run_app("grpo-head", env={**base_env, "DRY_RUN": "1", "HEAD_IP": "127.0.0.3", "NNODES": "2",
                                       "RAY_AUTH_TOKEN": "abc123"})
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "app.raystart start --head --block --node-ip-address 127.0.0.3 --port 6379" in out
    assert "--dashboard-host 127.0.0.1" in out
    assert "export RAY_AUTH_MODE=token" in out and "abc123" not in out
    assert "export RAY_ADDRESS=127.0.0.3:6379" in out
    assert "export VLLM_DISABLE_COMPILE_CACHE=0" in out  # verl's 1 only where the user asks for it
    # and in the job's runtime_env, so it holds under a Ray head that this command did not start
    assert shlex.quote("++ray_kwargs.ray_init.runtime_env.env_vars.VLLM_DISABLE_COMPILE_CACHE='0'") in out
    assert shlex.quote("++ray_kwargs.ray_init.runtime_env.env_vars.TORCH_COMPILE_JOB_ID='verl-stack'") in out
    result = run_app("grpo-head", env={**base_env, "DRY_RUN": "1", "VLLM_DISABLE_COMPILE_CACHE": "1",
                                       "TORCH_COMPILE_JOB_ID": "my-job"})
    assert result.returncode == 0, result.stderr
    assert "export VLLM_DISABLE_COMPILE_CACHE=1" in result.stdout and "export TORCH_COMPILE_JOB_ID=my-job" in result.stdout
    # RAY_WARM_WORKERS as shipped: the driver joins before verl's main, without a runtime_env
    assert "-m app.gate --ray verl.trainer.main_ppo --config-dir" in out and "ray_kwargs.ray_init.address=127.0.0.3:6379" in out


@pytest.mark.slow
def test_ray_head_waits_for_the_worker_then_runs_the_driver_on_that_cluster(ray_env, tmp_path):
    """Worker first (it retries until the head is up), then the head: both nodes join with token auth,
    the driver sees both and their actors inherit the tracking environment; when the head goes away
    the worker leaves on its own."""
    env = {**ray_env, "NNODES": "2", "WAIT_TIMEOUT": "300"}
    worker_args = f"--num-gpus 1 --num-cpus 1 --dashboard-agent-listen-port {free_port()}"
    head_log, worker_log = tmp_path / "head.log", tmp_path / "worker.log"
    worker_then_head(
        lambda: start_app("grpo-worker", {**env, "NODE_IP": "127.0.0.2", "RAY_START_ARGS": worker_args}, worker_log),
        lambda: start_app("grpo-head", env, head_log), head_log, worker_log, head_timeout=500)

    run = Path(env["CKPT_DIR"])
    seen = driver_saw_both_nodes(run)
    assert seen["RAY_ADDRESS"] == f"127.0.0.1:{env['RAY_PORT']}"
    for task in seen["tasks"]:  # actors on both nodes: the run's tracking directory, vLLM's compile cache kept
        assert task["SWANLAB_LOG_DIR"] == str(run / "swanlog")
        assert task["VLLM_DISABLE_COMPILE_CACHE"] == "0" and task["TORCH_COMPILE_JOB_ID"] == "verl-stack"
    head_text = head_log.read_text()
    assert "cluster ready:" in head_text and "127.0.0.2 (1 GPU)" in head_text
    # the head's start-up, phase by phase: its own stamps and those read off verl's lines (the stand-in prints them)
    from app.timeline import read

    phases = [p for p, _ in read(run / "logs" / "timeline-head.jsonl")]
    assert [p for p in phases if p not in ("prompts counted", "verl's checks passed")] == [
        "preflight done", "Ray head up", "all nodes joined", "driver started", "trainer workers ready",
        "vLLM engines ready", "ready to fit", "agent-loop workers up", "first step done"]
    # the prompts' count, then verl's own checks ran while the head started (in either order with its port), and
    # passed before the go
    assert phases.index("preflight done") < phases.index("prompts counted") < phases.index("verl's checks passed") \
        < phases.index("all nodes joined")
    assert "ok: verl's config types and validate_config: passed" in head_text
    assert "start-up on this node" in head_text
    assert [p for p, _ in read(run / "logs" / "timeline-worker-127.0.0.2.jsonl")] == ["preflight done",
                                                                                     "the head answers"]
    # each node's warm-up of vLLM's cache ran to its end (where vLLM is not installed, it says so)
    end = "done in " if importlib.util.find_spec("vllm") else "vLLM is not importable here ("
    for log in ("vllm-warmup.log", "vllm-warmup-127.0.0.2.log"):
        lines = (run / "logs" / log).read_text().strip().splitlines()
        assert lines and lines[-1].startswith(end), lines


@pytest.mark.slow
@pytest.mark.parametrize("differs", ["ARGS", "MODEL_PATH", "data file", "NNODES"])
def test_a_ray_worker_that_runs_another_run_is_refused_as_it_joins_and_both_nodes_say_so(ray_env, tmp_path,
                                                                                      tiny_model_dir, differs):
    import shutil

    from stack_files import write_rl

    change, said = {
        "ARGS": ({"ARGS": "actor_rollout_ref.actor.optim.lr=1e-5"}, "actor_rollout_ref.actor.optim.lr: 1e-05 on "
                 "the node at 127.0.0.2, 1e-06 on the head"),
        "MODEL_PATH": ({"MODEL_PATH": str(shutil.copytree(tiny_model_dir, tmp_path / "copy"))},
                       "actor_rollout_ref.model.path: "),
        "data file": ({"TRAIN_FILE": str(write_rl(tmp_path / "other.parquet", rows=256, start=500))},
                      "data.train_files: "),
        "NNODES": ({"NNODES": "4"}, "NNODES: 4 on the node at 127.0.0.2, 2 on the head"),
    }[differs]
    env = {**ray_env, "NNODES": "2", "WAIT_TIMEOUT": "300"}
    worker_args = f"--num-gpus 1 --num-cpus 1 --dashboard-agent-listen-port {free_port()}"
    head_log, worker_log = tmp_path / "head.log", tmp_path / "worker.log"
    worker = start_app("grpo-worker", {**env, "NODE_IP": "127.0.0.2", "RAY_START_ARGS": worker_args, **change},
                       worker_log)
    head = None
    try:
        time.sleep(3)
        head = start_app("grpo-head", env, head_log)
        codes = [head.wait(timeout=500), worker.wait(timeout=180)]
    finally:
        for process in (head, worker):
            if process is not None:
                stop_group(process)
    for code, log in zip(codes, (head_log, worker_log)):
        text = log.read_text()
        last = [line for line in text.splitlines() if line.strip()][-1]
        assert code != 0 and last.startswith("error: the node at 127.0.0.2 does not run the same run as the head ("), \
            text[-3000:]
        assert said in last and "Traceback" not in text
    assert not (Path(env["CKPT_DIR"]) / "driver.json").exists()  # the driver never ran


@pytest.mark.slow
def test_ray_head_times_out_with_how_many_joined_and_from_where(ray_env, tmp_path):
    env = {**ray_env, "NNODES": "2", "WAIT_TIMEOUT": "15"}
    head = start_app("grpo-head", env, tmp_path / "head.log")
    try:
        code = head.wait(timeout=400)
    finally:
        stop_group(head)
    log = (tmp_path / "head.log").read_text()
    last = [line for line in log.splitlines() if line.strip()][-1]
    assert code != 0
    assert last.startswith("error: only 1 of 2 nodes joined within 15s (") and "(1 GPU)" in last, log[-3000:]
    assert "make grpo-worker HEAD_IP=127.0.0.1" in last
    assert "stopping the Ray head" in log and not (Path(env["CKPT_DIR"]) / "driver.json").exists()


def test_warm_workers_put_verls_own_job_environment_on_ray_start_or_nothing_where_verl_gives_more(
        base_env, monkeypatch):
    """RAY_WARM_WORKERS: the driver joins without a runtime_env (Ray prestarts workers only for such a job), so what
    verl 0.9.1 would give its job is on `ray start` instead: exactly its own function's answer for this config, under
    the driver's environment (the launch's VLLM_DISABLE_COMPILE_CACHE, which verl then leaves out)."""
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    from app import launch, spec as specs
    from app.settings import load

    for name in [*LAUNCH_VARS, *launch.VERL_JOB_ENV, "TRANSFER_QUEUE_ENABLE", "RAY_worker_maximum_startup_concurrency"]:
        monkeypatch.delenv(name, raising=False)
    for name in ("MODEL_PATH", "DATA_DIR", "CKPT_DIR"):
        monkeypatch.setenv(name, base_env[name])
    monkeypatch.setenv("RAY_WARM_WORKERS", "1")
    for tq in ("False", "True"):
        monkeypatch.setenv("ARGS", f"transfer_queue.enable={tq}")
        spec = specs.read("grpo", load())
        env, why = launch.warm_workers(spec)
        with monkeypatch.context() as driver:
            for name, value in launch.compile_env(spec.settings, vllm=True).items():
                driver.setenv(name, value)
            verls = get_ppo_ray_runtime_env(spec.cfg)["env_vars"]
        verls.update({"TRANSFER_QUEUE_ENABLE": "1"} if tq == "True" else {})
        cap = {"RAY_worker_maximum_startup_concurrency": str(min(os.cpu_count(), 32))}  # the workers Ray prestarts
        assert env.pop("PYTHONPATH").split(os.pathsep)[0] == str(REPO)  # app.rayworker importable, installed or not
        assert why == "" and env == {"RAY_preload_python_modules": "app.rayworker", **verls, **cap}
    assert spec.fingerprint()["RAY_WARM_WORKERS"] == "True"  # every node the same: compared as they join
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # the node's own value wins, as verl lets the driver's
    assert "TOKENIZERS_PARALLELISM" not in launch.warm_workers(specs.read("grpo", load()))[0]
    for args, named in (("actor_rollout_ref.rollout.full_determinism=True", "full_determinism"),
                        ("+ray_kwargs.ray_init.runtime_env.env_vars.MINE=1", "ray_kwargs.ray_init.runtime_env"),
                        ("global_profiler.tool=nsys", "a profiler")):
        monkeypatch.setenv("ARGS", args)
        env, why = launch.warm_workers(specs.read("grpo", load()))
        assert env == {} and why == f"verl gives the job its own environment with {named}"
    result = run_app("grpo-head", env={**base_env, "DRY_RUN": "1", "RAY_WARM_WORKERS": "1", "ARGS": args})
    assert result.returncode == 0, result.stderr
    assert "RAY_WARM_WORKERS: not for this run (verl gives the job its own environment with a profiler)" in \
        result.stderr and "app.gate --ray" not in result.stdout
    monkeypatch.delenv("RAY_WARM_WORKERS")  # the default: said, not warned
    result = run_app("grpo-head", env={**base_env, "DRY_RUN": "1", "ARGS": args})
    assert result.returncode == 0 and "RAY_WARM_WORKERS: not for this run" in result.stdout, result.stderr
    assert "RAY_WARM_WORKERS" not in result.stderr


@pytest.mark.slow
def test_warm_workers_have_imported_verl_and_hold_its_job_environment_when_the_driver_uses_them(ray_env, tmp_path):
    env = {**ray_env, "RAY_WARM_WORKERS": "1", "NNODES": "1", "WAIT_TIMEOUT": "300"}
    result = run_app("grpo-head", env=env, timeout=500)
    assert result.returncode == 0, result.stderr
    assert "-m app.gate --ray ray_driver" in result.stdout
    seen = json.loads((Path(env["CKPT_DIR"]) / "driver.json").read_text())
    assert seen["job_runtime_env"] == {}  # the job Ray prestarted its workers for
    [task] = seen["tasks"]
    assert task["preloaded"] and task["TOKENIZERS_PARALLELISM"] == "true" and task["TORCH_COMPILE_JOB_ID"] == "verl-stack"
    assert task["VLLM_DISABLE_COMPILE_CACHE"] == "0"  # the launch's, not verl's job default (1): the cache is kept
    assert "app.rayworker:" not in result.stdout + result.stderr  # every module of verl's preloaded


@pytest.mark.slow
def test_a_grpo_head_whose_reader_goes_away_stops_the_run_instead_of_hanging(ray_env):
    """`make grpo-head | head`: once the reader has exited, copying the driver's output meets a broken pipe; the
    launch then stops the driver and the head as on SIGTERM. Before, the copy ended there and the driver (verl's:
    Ray prints every worker's lines through it) blocked on its full pipe for ever (docs/gpu-runs.md, run 58)."""
    env = {**ray_env, "NNODES": "1", "WAIT_TIMEOUT": "300", "STANDIN_LINES": "20000"}
    head = subprocess.Popen([sys.executable, "-m", "app", "grpo-head"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        for line in head.stdout:  # up to the driver's go: the launch itself prints nothing more until the end
            if "-m app.gate" in line:
                break
        head.stdout.close()
        code = head.wait(timeout=300)
    finally:
        stop_group(head)
    assert code == 143
    left = subprocess.run(["pgrep", "-f", env["RAY_TMPDIR"]], capture_output=True, text=True).stdout.split()
    assert not left, left  # the Ray head and its workers went with it
    assert not (Path(env["CKPT_DIR"]) / "driver.json").exists()  # stopped while it printed


def test_grpo_worker_dry_run_joins_the_head_address_and_needs_head_ip(base_env):
    result = run_app("grpo-worker", env={**base_env, "DRY_RUN": "1", "HEAD_IP": "127.0.0.3", "RAY_PORT": "6400",
                                         "NODE_IP": "127.0.0.4"})
    assert result.returncode == 0, result.stderr
    assert "app.raystart start --address 127.0.0.3:6400 --block" in result.stdout
    assert "--node-ip-address 127.0.0.4" in result.stdout and "export RAY_AUTH_MODE=token" in result.stdout
    line = assert_one_line_error(run_app("grpo-worker", env={**base_env, "DRY_RUN": "1"}))
    assert "HEAD_IP is not set" in line
