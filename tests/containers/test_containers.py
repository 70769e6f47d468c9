"""Every make target in its compose service, RUNTIME=docker, on a real engine (tests/containers/conftest.py).
One test per point of issue 11 that broke: paths outside the checkout (1), command-line settings (2), output
owned by the user (3), the merger's ssh as the user (4), a missing image (5), no NVIDIA runtime / memlock (7),
no bridge network and an overridable project name (8), host edits of configs/ (9); the build itself (6) is
what made IMAGE (.ci/run)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from app.node import port_open
from containers.conftest import FIXTURES, IMAGE, REPO, USER_UID, error_lines, owned_dir, plan_line, read_json

sys.path.insert(0, str(FIXTURES))
from processes import driver_saw_both_nodes, free_port, stop_group, worker_then_head  # noqa: E402


def owned_by_user(root: Path) -> list[str]:
    """Paths under `root` (itself included) not owned by USER_UID."""
    bad = []
    for path in [root, *root.rglob("*")]:
        if path.lstat().st_uid != USER_UID:
            bad.append(f"{path} uid {path.lstat().st_uid}")
    return bad


# --- prep, tiny-model: paths outside the checkout, written as the user (points 1 and 3) ---------------
def test_prep_writes_a_data_dir_outside_the_checkout_as_the_invoking_user(stack, outside):
    data = owned_dir(outside / "elsewhere") / "data"  # missing: created as the user, then mounted
    result = stack.make("prep", f"DATA_DIR={data}", as_user=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "runtime: docker (image" in result.stdout
    for sub in ("gsm8k", "gsm8k_sft"):
        for split in ("train", "test"):
            assert (data / sub / f"{split}.parquet").stat().st_size > 1000, (sub, split)
    assert owned_by_user(outside / "elsewhere") == []
    shutil.rmtree(data)  # the user can delete what the stack wrote (point 3)
    assert not data.exists()


def test_tiny_model_in_the_merger_is_readable_by_the_user_who_asked(stack, outside):
    out = owned_dir(outside / "models") / "tiny"
    result = stack.make("tiny-model", f"OUT={out}", as_user=True)
    assert result.returncode == 0, result.stdout + result.stderr
    weights = out / "model.safetensors"
    assert weights.stat().st_uid == USER_UID and weights.stat().st_size > 1000
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert owned_by_user(outside / "models") == []


def test_nothing_root_owned_is_left_in_the_checkout_or_home(stack, outside):
    """The user's state directory (HOME and caches inside) and the checkout's mounted directories."""
    result = stack.make("prep", f"DATA_DIR={owned_dir(outside / 'd')}", as_user=True)
    assert result.returncode == 0, result.stderr
    assert owned_by_user(stack.home) == []
    assert not (stack.home / ".ssh").exists()  # no ~/.ssh is created where there was none


# --- DRY_RUN plans and what reaches the container (points 2 and 7) ------------------------------------
def test_command_line_settings_reach_the_container_and_its_plan(stack, tiny_model, data_dir, outside):
    ckpt = outside / "run"
    result = stack.make("sft", "DRY_RUN=1", f"MODEL_PATH={tiny_model}", f"DATA_DIR={data_dir}", f"CKPT_DIR={ckpt}",
                        "GPUS_PER_NODE=1", "CUDA_VISIBLE_DEVICES=0", "NCCL_IB_GID_INDEX=3",
                        "TORCH_NCCL_ASYNC_ERROR_HANDLING=1", "RSYNC_RSH=ssh -p 2222", "ARGS=optim.lr=3e-5")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "plan for sft on node 0 of 1 (DRY_RUN=1" in out
    for line in ("export NCCL_IB_GID_INDEX=3", "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
                 "export CUDA_VISIBLE_DEVICES=0"):
        assert line in out, line
    assert "optim.lr=3e-5" in out and f"trainer.default_local_dir={ckpt}" in out
    plan = plan_line(result)
    assert " -e RSYNC_RSH " in plan and "ssh -p 2222" not in plan  # by name: values stay out of argv
    assert f"{data_dir}:{data_dir}" in plan and f"{tiny_model}:{tiny_model}" in plan


def test_gpu_services_run_where_the_engine_has_no_nvidia_runtime(stack, tiny_model, data_dir, outside):
    runtimes = subprocess.run(["docker", "info", "--format", "{{json .Runtimes}}"], capture_output=True, text=True)
    assert "nvidia" not in runtimes.stdout  # this engine: the GPU overlay must stay out
    result = stack.make("grpo-head", "DRY_RUN=1", f"MODEL_PATH={tiny_model}", f"DATA_DIR={data_dir}",
                        f"CKPT_DIR={outside / 'grpo'}", "GPUS_PER_NODE=1", "HEAD_IP=127.0.0.1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "plan for grpo-head at 127.0.0.1:" in result.stdout
    plan = plan_line(result)
    assert "compose.gpu.yaml" not in plan and "compose.ib.yaml" not in plan and " ray-head " in plan


def test_infiniband_overlay_where_memlock_is_not_permitted_is_one_line(stack, tiny_model):
    probe = subprocess.run(["docker", "run", "--rm", "--pull", "never", "--network", "none", "--ulimit",
                            "memlock=-1:-1", "--entrypoint", "true", IMAGE], capture_output=True, text=True)
    result = stack.make("doctor", "IB=1")
    if probe.returncode == 0:  # an engine that may raise memlock: the overlay is used (and needs the devices)
        assert "compose.ib.yaml" in plan_line(result)
        return
    lines = error_lines(result)
    assert result.returncode != 0 and len(lines) == 1, result.stderr
    assert "may not raise memlock" in lines[0] and "IB=0" in lines[0] and "not permitted" in lines[0]
    assert "Traceback" not in result.stderr and stack.containers() == []


# --- a missing image: one line, no pull (point 5) ------------------------------------------------------
def test_missing_image_is_one_line_and_nothing_is_pulled_or_built(stack):
    absent = "verl-stack:absent-in-this-test"
    result = stack.make("prep", IMAGE=absent)
    lines = error_lines(result)
    assert result.returncode != 0 and lines == [
        f"error: image {absent} not found on this node: make build, or docker load -i FILE"], result.stderr
    assert subprocess.run(["docker", "image", "inspect", absent], capture_output=True).returncode != 0


def test_runtime_auto_without_the_image_runs_locally_and_says_why(stack, outside):
    result = stack.make("prep", f"DATA_DIR={outside / 'local-data'}", RUNTIME="auto", IMAGE="verl-stack:absent")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "runtime: local (image verl-stack:absent is not on this node" in result.stdout
    assert (outside / "local-data" / "gsm8k" / "train.parquet").is_file()


# --- paths: refused in one line, symlinks resolved (point 1) -------------------------------------------
def test_a_path_that_cannot_be_mounted_is_refused_before_anything_starts(stack):
    result = stack.make("prep", "DATA_DIR=/usr/share/verl-stack-data")
    lines = error_lines(result)
    assert result.returncode != 0 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: DATA_DIR=/usr/share/verl-stack-data:") and "part of the image" in lines[0]
    assert stack.containers() == []


def test_checkout_and_settings_reached_through_symlinks(stack, tiny_model, data_dir, outside):
    (outside / "repo-link").symlink_to(REPO)
    (outside / "model-link").symlink_to(tiny_model)
    real = owned_dir(outside / "real-data")
    (outside / "data-link").symlink_to(real)
    result = stack.make("prep", f"DATA_DIR={outside / 'data-link'}", cwd=outside / "repo-link")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (real / "gsm8k" / "test.parquet").is_file()
    result = stack.make("sft", "DRY_RUN=1", f"MODEL_PATH={outside / 'model-link'}", f"DATA_DIR={data_dir}",
                        f"CKPT_DIR={outside / 'run'}", "GPUS_PER_NODE=1", cwd=outside / "repo-link")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"model.path={outside / 'model-link'} " in result.stdout or f"model.path={tiny_model} " in result.stdout


# --- host edits of configs/ run (point 9) ----------------------------------------------------------------
def test_a_host_edit_of_configs_is_what_runs_in_the_container(stack, tiny_model, data_dir, outside):
    profile = REPO / "configs" / "sft.yaml"
    original = profile.read_text()
    assert "  train_batch_size: 64\n" in original
    try:
        profile.write_text(original.replace("  train_batch_size: 64\n", "  train_batch_size: 48\n"))
        result = stack.make("check", f"MODEL_PATH={tiny_model}", f"DATA_DIR={data_dir}", f"CKPT_DIR={outside / 'r'}",
                            "GPUS_PER_NODE=1", "JOB=sft")
    finally:
        profile.write_text(original)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "global batch 48," in result.stdout, result.stdout  # the image's copy says 64


# --- compose: host network only, project name (point 8) -------------------------------------------------
def test_no_service_creates_a_network_and_the_project_name_is_overridable(stack, outside):
    before = subprocess.run(["docker", "network", "ls", "-q"], capture_output=True, text=True).stdout.split()
    result = stack.make("prep", f"DATA_DIR={outside / 'd'}")
    assert result.returncode == 0, result.stderr
    after = subprocess.run(["docker", "network", "ls", "-q"], capture_output=True, text=True).stdout.split()
    assert sorted(after) == sorted(before)
    config = subprocess.run(["docker", "compose", "-f", "compose.yaml", "-f", "compose.gpu.yaml", "-f", "compose.ib.yaml",
                             "--profile", "*", "config", "--format", "json"], cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "UID": "1", "GID": "1", "PWD": str(REPO),
                                 "COMPOSE_PROJECT_NAME": stack.project})
    assert config.returncode == 0, config.stderr
    spec = json.loads(config.stdout)
    assert spec["name"] == stack.project and not spec.get("networks")
    assert {name: s["network_mode"] for name, s in spec["services"].items()} == {
        name: "host" for name in ("gsm8k-prep", "sft-runner", "ray-head", "ray-worker", "merger")}


# --- multi-node in containers: torchrun over gloo, Ray head + worker -------------------------------------
@pytest.mark.timeout(900)
def test_two_containers_meet_in_a_torchrun_rendezvous_over_gloo(stack, tiny_model, data_dir, outside):
    port = free_port()
    nodes = []
    common = [f"MODEL_PATH={tiny_model}", f"DATA_DIR={data_dir}", "NNODES=2", "GPUS_PER_NODE=1",
              "MASTER_ADDR=127.0.0.1", f"MASTER_PORT={port}", "SFT_TRAINER_MODULE=cpu_sft_trainer",
              f"PYTHONPATH={FIXTURES}", f"MOUNTS={FIXTURES}", "ARGS=optim.lr=1e-5"]
    try:
        for rank in (0, 1):
            run = outside / f"node{rank}" / "run"  # each node's own disk, the same run (directory name)
            nodes.append(stack.start("sft", *common, f"NODE_RANK={rank}", f"CKPT_DIR={run}",
                                     log=outside / f"node{rank}.log"))
        codes = [node.wait(timeout=600) for node in nodes]
    finally:
        for node in nodes:
            stop_group(node, grace=60)
    logs = [(outside / f"node{rank}.log").read_text() for rank in (0, 1)]
    assert codes == [0, 0], logs
    for rank in (0, 1):
        seen = read_json(outside / f"node{rank}" / "run" / f"rank{rank}.json")
        assert seen["world_size"] == 2 and seen["sum"] == 3.0 and seen["node_rank"] == rank
        assert "SFT finished" in logs[rank]


@pytest.mark.timeout(900)
def test_ray_head_and_worker_as_two_containers_run_the_driver_on_both(stack, tiny_model, data_dir, outside):
    run = outside / "grpo-run"
    common = [f"MODEL_PATH={tiny_model}", f"DATA_DIR={data_dir}", f"CKPT_DIR={run}", "NNODES=2", "GPUS_PER_NODE=1",
              "HEAD_IP=127.0.0.1", f"RAY_PORT={free_port()}", "GRPO_TRAINER_MODULE=ray_driver",
              f"PYTHONPATH={FIXTURES}", f"MOUNTS={FIXTURES}", "WAIT_TIMEOUT=300",
              "RAY_gcs_rpc_server_reconnect_timeout_s=5"]
    worker_args = f"--num-gpus 1 --num-cpus 1 --dashboard-agent-listen-port {free_port()}"
    head_args = f"--num-gpus 1 --num-cpus 1 --include-dashboard false --dashboard-agent-listen-port {free_port()}"
    head_log, worker_log = outside / "head.log", outside / "worker.log"
    worker_then_head(
        lambda: stack.start("grpo-worker", *common, "NODE_IP=127.0.0.2", f"RAY_START_ARGS={worker_args}",
                            "RAY_TMPDIR=/tmp/rw", log=worker_log),
        lambda: stack.start("grpo-head", *common, f"RAY_START_ARGS={head_args}", "RAY_TMPDIR=/tmp/rh", log=head_log),
        head_log, worker_log, head_timeout=600)
    driver_saw_both_nodes(run)  # as the CPU suite (tests/test_launch.py)


# --- merge of a real FSDP checkpoint, report -------------------------------------------------------------
@pytest.mark.timeout(900)
def test_merger_merges_a_real_fsdp_checkpoint_exactly(stack, tiny_model, outside):
    from safetensors.torch import load_file

    run = owned_dir(outside / "ckpt")
    factory = subprocess.run([sys.executable, str(REPO / "tests" / "ckpt_factory.py"), "--model", str(tiny_model),
                              "--out", str(run), "--world-size", "2", "--step", "5", "--layout", "sft"],
                             capture_output=True, text=True, timeout=600)
    assert factory.returncode == 0, factory.stderr[-3000:]
    subprocess.run(["chown", "-R", f"{USER_UID}:{USER_UID}", str(run)], check=True)
    out = owned_dir(outside / "models") / "merged"  # merge writes beside it, then renames: the user's directory
    result = stack.make("merge", f"CKPT_DIR={run}", f"OUT_DIR={out}", as_user=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "forward on" in result.stdout
    merged = {k: v for p in out.glob("*.safetensors") for k, v in load_file(p).items()}
    original = {k: v for p in tiny_model.glob("*.safetensors") for k, v in load_file(p).items()}
    assert set(merged) == set(original) and all(merged[k].equal(v) for k, v in original.items())
    assert owned_by_user(out) == []


def test_report_in_the_merger_writes_plots_and_summary(stack, outside):
    run = owned_dir(outside / "sft-run")
    logs = owned_dir(run / "logs")
    lines = [json.dumps({"step": s, "data": {"train/loss": 2.0 / s, "train/lr": 1e-5, "train/global_tokens": 1000}})
             for s in range(1, 11)]
    (logs / "metrics-20260101T000000Z.jsonl").write_text("\n".join(lines) + "\n")
    os.chown(logs / "metrics-20260101T000000Z.jsonl", USER_UID, USER_UID)
    result = stack.make("report", f"RUN={run}", as_user=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (run / "report" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "kind: SFT" in (run / "report" / "summary.txt").read_text()
    assert owned_by_user(run) == []


# --- gather in the merger: your own ssh setup, read-only, as you (point 4) ------------------------------
@pytest.mark.timeout(900)
def test_gather_in_the_merger_uses_your_own_ssh_config_keys_and_known_hosts(stack, tiny_model, sshd, outside):
    node0 = outside / "node0"
    factory = subprocess.run([sys.executable, str(REPO / "tests" / "ckpt_factory.py"), "--model", str(tiny_model),
                              "--out", str(node0), "--world-size", "2", "--step", "3", "--layout", "sft"],
                             capture_output=True, text=True, timeout=600)
    assert factory.returncode == 0, factory.stderr[-3000:]
    node1 = outside / "node1"  # the second node holds only its own rank
    shutil.copytree(node0, node1)
    (node0 / "global_step_3" / "model_world_size_2_rank_1.pt").unlink()
    for path in node1.rglob("*"):
        if path.is_file() and path.name != "model_world_size_2_rank_1.pt":
            path.unlink()
    ssh = owned_dir(stack.home / ".ssh")
    ssh.chmod(0o700)
    kind, key = sshd["host_pub"]
    files = {"id_ed25519": (sshd["key"].read_text(), 0o600),
             "known_hosts": "".join(f"[{ip}]:{sshd['port']} {kind} {key}\n" for ip in ("127.0.0.1", "127.0.0.2")),
             "config": (f"Host node-a\n  HostName 127.0.0.1\nHost node-b\n  HostName 127.0.0.2\nHost node-*\n"
                        f"  Port {sshd['port']}\n  User root\n  IdentityFile ~/.ssh/id_ed25519\n  IdentitiesOnly yes\n"
                        "  BatchMode yes\n", 0o600)}
    for name, value in files.items():
        text, mode = value if isinstance(value, tuple) else (value, 0o644)
        (ssh / name).write_text(text)
        (ssh / name).chmod(mode)
        os.chown(ssh / name, USER_UID, USER_UID)
    before = {p.name: p.read_bytes() for p in ssh.iterdir()}
    here = owned_dir(outside / "mine") / "run"
    result = stack.make("gather", f"CKPT_DIR={here}", f"NODES=node-a:{node0} node-b:{node1}", as_user=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"-v {ssh}:{ssh}:ro " in plan_line(result)
    step = here / "global_step_3"
    assert sorted(p.name for p in step.glob("model_*")) == [f"model_world_size_2_rank_{r}.pt" for r in (0, 1)]
    assert owned_by_user(outside / "mine") == []
    log = sshd["log"].read_text()
    for address in ("127.0.0.1", "127.0.0.2"):  # the config's aliases, port and key took it to both nodes
        assert f"on {address} port {sshd['port']}" in log, log[-2000:]
    assert "Accepted publickey for root" in log
    assert {p.name: p.read_bytes() for p in ssh.iterdir()} == before  # read-only: nothing written there


# --- the build: nothing of the site's CA in the image (point 6) ------------------------------------------
def _cert_lines(text: str) -> list[list[str]]:
    import re

    return [block.split() for block in re.findall(r"-----BEGIN CERTIFICATE-----(.*?)-----END CERTIFICATE-----",
                                                   text, re.S)]


def test_the_image_holds_nothing_of_the_site_ca_it_was_built_with():
    """SITE_CA (.ci/run passes this machine's pip CA) was served to the build on loopback: no layer and no
    history entry may hold any certificate of it that the image's own public bundles lack."""
    history = subprocess.run(["docker", "history", "--no-trunc", IMAGE], capture_output=True, text=True)
    assert history.returncode == 0 and "BEGIN CERTIFICATE" not in history.stdout
    site_ca = os.environ.get("SITE_CA")
    if not site_ca:
        return  # built without a site CA: nothing to look for beyond the history
    bundles = subprocess.run(["docker", "run", "--rm", "--pull", "never", "--network", "none", "--entrypoint", "sh",
                              IMAGE, "-c", "cat /etc/ssl/certs/ca-certificates.crt "
                              "$(find /opt/venv -name '*.pem' -path '*cert*' -o -name roots.pem)"],
                             capture_output=True, text=True)
    assert bundles.returncode == 0, bundles.stderr
    public = {"".join(lines) for lines in _cert_lines(bundles.stdout)}
    public_lines = set(bundles.stdout.split())
    site = [lines for lines in _cert_lines(Path(site_ca).read_text()) if "".join(lines) not in public]
    unique = {line for lines in site for line in lines if len(line) == 64 and line not in public_lines}
    if not unique:
        return  # every certificate of SITE_CA is public and in the image anyway: nothing site-specific to find
    patterns = Path(tempfile.mkdtemp()) / "site-ca-lines"
    patterns.write_text("\n".join(sorted(unique)) + "\n")
    try:
        found = subprocess.run(["bash", "-c", f"set -o pipefail; docker save {IMAGE} | grep -a -c -F -f {patterns}"],
                               capture_output=True, text=True, timeout=600)
    finally:
        shutil.rmtree(patterns.parent)
    assert found.stdout.strip() == "0", f"{found.stdout.strip()} lines of SITE_CA's own certificates in {IMAGE}"


# --- make slurm, its docker variant: each task's make runs the stack in the image -----------------------------
@pytest.mark.timeout(900)
def test_make_slurm_docker_variant_runs_one_container_per_node_in_a_real_slurm_job(stack, tiny_model, data_dir,
                                                                                   outside):
    """The sbatch script `make slurm SLURM_CONTAINER=docker` writes, submitted to a real Slurm cluster on this
    machine (two slurmd, 127.0.0.1 and 127.0.0.2): each task's `make sft` runs the sft-runner container; the node
    facts come from Slurm on the host and reach the containers; the two meet over gloo."""
    from slurm_cluster import slurm_cluster

    run, script = owned_dir(outside / "run"), outside / "sft.sbatch"
    settings = {"MODEL_PATH": str(tiny_model), "DATA_DIR": str(data_dir), "CKPT_DIR": str(run), "NNODES": "2",
                "MASTER_PORT": str(free_port()), "SFT_TRAINER_MODULE": "cpu_sft_trainer", "PYTHONPATH": str(FIXTURES),
                "MOUNTS": str(FIXTURES), "SLURM_CONTAINER": "docker", "OUT": str(script)}
    try:
        with slurm_cluster(nodes=2) as cluster:
            env = {**stack.env(**settings), "SLURM_CONF": cluster.env["SLURM_CONF"]}
            written = subprocess.run(["make", "--no-print-directory", "-s", "slurm", "JOB=sft", "RUNTIME=local",
                                      f"PYTHON={sys.executable}"], cwd=REPO, env=env, capture_output=True, text=True,
                                     timeout=300)
            assert written.returncode == 0, written.stdout + written.stderr
            result = subprocess.run(["sbatch", "--wait", str(script)], env=env, capture_output=True, text=True,
                                    timeout=800)
            log = "".join(p.read_text() for p in sorted((run / "logs").glob("slurm-sft-*.out")))
            assert result.returncode == 0, result.stdout + result.stderr + log + cluster.logs(1500)
    except RuntimeError as error:  # the cluster did not start: a failure, .ci/run installs slurm-wlm and munge
        pytest.fail(str(error))
    assert "RUNTIME=docker sft" in script.read_text() and log.count("runtime: docker") == 2
    for rank in (0, 1):
        seen = read_json(run / f"rank{rank}.json")
        assert seen["world_size"] == 2 and seen["sum"] == 3.0 and seen["node_rank"] == rank


@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", ["pytorchjob", "indexed"])
def test_make_k8s_sft_pods_meet_in_the_image_with_the_environment_kubernetes_gives_them(tiny_model, data_dir, outside,
                                                                                        kind):
    """The manifests' two SFT pods, each run as `docker run` of IMAGE with its manifest's command and env plus what
    Kubernetes adds (the Training Operator's PET_* variables, or an Indexed Job's JOB_COMPLETION_INDEX; the DNS name
    of pod 0 stands as 127.0.0.1): they meet over gloo and train. The volume is a directory at K8S_MOUNT."""
    import yaml

    mount = owned_dir(outside / "workspace")
    shutil.copytree(tiny_model, mount / "model")
    shutil.copytree(data_dir, mount / "data")
    out = outside / "sft.yaml"
    written = subprocess.run([sys.executable, "-m", "app", "k8s", "sft"], cwd=REPO, capture_output=True, text=True,
                             env={**os.environ, "ENV_FILE": os.devnull, "OUT": str(out), "K8S_SFT": kind, "IMAGE": IMAGE,
                                  "K8S_MOUNT": str(mount), "MODEL_PATH": str(mount / "model"), "NNODES": "2",
                                  "DATA_DIR": str(mount / "data"), "CKPT_DIR": str(mount / "run"), "GPUS_PER_NODE": "1",
                                  "SFT_TRAINER_MODULE": "cpu_sft_trainer", "PYTHONPATH": str(REPO)}, timeout=300)
    assert written.returncode == 0, written.stderr
    docs = list(yaml.safe_load_all(out.read_text()))
    if kind == "pytorchjob":
        specs = docs[0]["spec"]["pytorchReplicaSpecs"]
        pods = [specs["Master"]["template"], specs["Worker"]["template"]]
    else:
        pods = [docs[1]["spec"]["template"]] * 2
    port, names = free_port(), [f"vstest-k8s-{os.getpid()}-{rank}" for rank in (0, 1)]
    runs = []
    try:
        for rank, pod in enumerate(pods):
            (container,) = pod["spec"]["containers"]
            given = {e["name"]: e["value"] for e in container["env"]}
            given.update(KUBERNETES_SERVICE_HOST="127.0.0.1", PYTHONPATH=str(FIXTURES))
            given.update({"PET_NNODES": "2", "PET_NODE_RANK": str(rank), "PET_MASTER_ADDR": "127.0.0.1",
                          "PET_MASTER_PORT": str(port)} if kind == "pytorchjob" else
                         {"JOB_COMPLETION_INDEX": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
            command = ["docker", "run", "--rm", "--name", names[rank], "--network", "host", "--pull", "never",
                       "-v", f"{mount}:{mount}", "-v", f"{FIXTURES}:{FIXTURES}:ro",
                       *[arg for k, v in given.items() for arg in ("-e", f"{k}={v}")], IMAGE, *container["command"]]
            runs.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = [run.communicate(timeout=600)[0] for run in runs]
    finally:
        subprocess.run(["docker", "rm", "-f", *names], capture_output=True)
    assert [run.returncode for run in runs] == [0, 0], outputs
    for rank in (0, 1):
        seen = read_json(mount / "run" / f"rank{rank}.json")
        assert seen["world_size"] == 2 and seen["node_rank"] == rank and seen["sum"] == 3.0


@pytest.mark.timeout(900)
def test_make_k8s_rayjob_pods_run_grpo_on_the_cluster_kuberay_starts(tiny_model, data_dir, outside):
    """The RayJob's two pods, each `docker run` of IMAGE with its manifest's env plus what KubeRay adds (RAY_ADDRESS,
    RAY_PORT, RAY_IP; the head service's DNS name stands as 127.0.0.1) and the `ray start ... --block` KubeRay writes
    for a pod without a command; then the job's entrypoint on the head pod, as Ray's job supervisor runs it (RAY_ADDRESS
    set): grpo-head takes the head and port from the scheduler, waits for both nodes and runs the driver on both."""
    import yaml

    mount = owned_dir(outside / "workspace")
    shutil.copytree(tiny_model, mount / "model")
    shutil.copytree(data_dir, mount / "data")
    out = outside / "grpo.yaml"
    written = subprocess.run([sys.executable, "-m", "app", "k8s", "grpo"], cwd=REPO, capture_output=True, text=True,
                             env={**os.environ, "ENV_FILE": os.devnull, "OUT": str(out), "IMAGE": IMAGE, "NNODES": "2",
                                  "K8S_MOUNT": str(mount), "MODEL_PATH": str(mount / "model"), "WAIT_TIMEOUT": "300",
                                  "DATA_DIR": str(mount / "data"), "CKPT_DIR": str(mount / "run"), "GPUS_PER_NODE": "1",
                                  "GRPO_TRAINER_MODULE": "ray_driver", "PYTHONPATH": str(REPO)}, timeout=300)
    assert written.returncode == 0, written.stderr
    (job,) = yaml.safe_load_all(out.read_text())
    cluster = job["spec"]["rayClusterSpec"]
    pods = [cluster["headGroupSpec"]["template"], cluster["workerGroupSpecs"][0]["template"]]
    port, names = free_port(), [f"vstest-rayjob-{os.getpid()}-{role}" for role in ("head", "worker")]
    address = f"127.0.0.1:{port}"
    ray_start = [["ray", "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--include-dashboard=false"],
                 ["ray", "start", f"--address={address}", "--node-ip-address=127.0.0.2"]]
    try:
        for role, pod in enumerate(pods):
            (container,) = pod["spec"]["containers"]
            assert "command" not in container  # KubeRay writes `ray start` for it
            given = {e["name"]: e["value"] for e in container["env"]}
            given.update(KUBERNETES_SERVICE_HOST="127.0.0.1", PYTHONPATH=str(FIXTURES), RAY_PORT=str(port),
                         RAY_ADDRESS=address, **({"RAY_IP": "127.0.0.1"} if role else {}))
            command = ["docker", "run", "-d", "--name", names[role], "--network", "host", "--pull", "never",
                       "--shm-size", "1g", "-v", f"{mount}:{mount}", "-v", f"{FIXTURES}:{FIXTURES}:ro",
                       *[arg for k, v in given.items() for arg in ("-e", f"{k}={v}")], IMAGE,
                       *ray_start[role], "--block", "--num-cpus=1", "--num-gpus=1",
                       f"--dashboard-agent-listen-port={free_port()}"]
            subprocess.run(command, check=True, capture_output=True, timeout=120)
        # KubeRay runs the entrypoint once the cluster it started is ready: the head's port answers by then
        deadline = time.monotonic() + 120
        while not port_open("127.0.0.1", port) and time.monotonic() < deadline:
            time.sleep(0.5)
        entry = subprocess.run(["docker", "exec", "-e", f"RAY_ADDRESS={address}", names[0], "bash", "-c",
                                job["spec"]["entrypoint"]], capture_output=True, text=True, timeout=600)
        logs = [subprocess.run(["docker", "logs", name], capture_output=True, text=True).stdout for name in names]
    finally:
        subprocess.run(["docker", "rm", "-f", *names], capture_output=True)
    assert entry.returncode == 0, entry.stdout[-3000:] + entry.stderr[-3000:] + "".join(logs)[-3000:]
    assert "a Ray head already answers" in entry.stdout and "GRPO finished" in entry.stdout
    seen = read_json(mount / "run" / "driver.json")
    # Ray names the head by this machine's own address (it rewrites 127.0.0.1), the worker by the one it was given
    assert len(seen["nodes"]) == 2 and "127.0.0.2" in seen["nodes"] and seen["gpus"] == 2
    assert seen["RAY_ADDRESS"] == address
