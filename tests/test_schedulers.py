"""app/schedulers.py: node facts from a scheduler, and the files that submit a run to one. `make slurm` runs end to
end on a real Slurm cluster on this machine (tests/fixtures/slurm_cluster.py: munged, slurmctld, two slurmd at
127.0.0.1 and 127.0.0.2) with the suite's CPU stand-in trainers: a two-node gloo SFT and a Ray head and worker.
`make k8s`'s manifests are checked with kubernetes-validate (the core kinds' real schemas, offline)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from conftest import REPO, assert_one_line_error, run_app
from slurm_cluster import slurm_cluster
from test_settings import settings_table


@pytest.fixture
def env(base_env) -> dict[str, str]:
    return {**base_env, "GPUS_PER_NODE": "1"}


# --- node facts ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("given, expected", [
    ({"SKYPILOT_NODE_RANK": "1", "SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_IPS": "127.0.0.5\n127.0.0.6",
      "SKYPILOT_NUM_GPUS_PER_NODE": "8"},
     {"NNODES": ("skypilot", "2"), "NODE_RANK": ("skypilot", "1"), "MASTER_ADDR": ("skypilot", "127.0.0.5"),
      "HEAD_IP": ("skypilot", "127.0.0.5"), "GPUS_PER_NODE": ("skypilot", "8")}),
    ({"KUBERNETES_SERVICE_HOST": "127.0.0.9", "PET_NNODES": "1:3", "PET_NODE_RANK": "2", "PET_MASTER_ADDR":
      "job-master-0", "PET_MASTER_PORT": "23456"},
     {"NNODES": ("kubernetes", "3"), "NODE_RANK": ("kubernetes", "2"), "MASTER_ADDR": ("kubernetes", "job-master-0"),
      "MASTER_PORT": ("kubernetes", "23456")}),
    ({"KUBERNETES_SERVICE_HOST": "127.0.0.9", "JOB_COMPLETION_INDEX": "3", "NNODES": "4"},
     {"NODE_RANK": ("kubernetes", "3"), "NNODES": ("shell", "4")}),
    ({"KUBERNETES_SERVICE_HOST": "127.0.0.9", "RAY_ADDRESS": "127.0.0.7:6380"},
     {"HEAD_IP": ("kubernetes", "127.0.0.7"), "RAY_PORT": ("kubernetes", "6380")}),
    ({"SKYPILOT_NODE_RANK": "1", "SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_IPS": "127.0.0.5", "NODE_RANK": "0"},
     {"NODE_RANK": ("shell", "0")}),  # what the user set stands
])
def test_node_facts_come_from_the_scheduler_unless_the_user_set_them(given, expected):
    table = settings_table(run_app("settings", env=given))
    assert {name: table[name] for name in expected} == expected


# --- make slurm, on a real cluster -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    try:
        with slurm_cluster(nodes=2) as running:
            yield running
    except RuntimeError as error:  # a failure, not a skip: .ci/run installs slurm-wlm and munge
        pytest.fail(str(error))


def submit(cluster, env: dict[str, str], job: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, str]:
    script = tmp_path / f"{job}.sbatch"
    env = {k: v for k, v in env.items() if k != "GPUS_PER_NODE"}  # no --gpus-per-node: this cluster has no GPU
    written = run_app("slurm", job, env={**env, **cluster.env, "OUT": str(script), "NNODES": "2"})
    assert written.returncode == 0, written.stderr
    result = subprocess.run(["sbatch", "--wait", str(script)], env={**env, **cluster.env}, capture_output=True,
                            text=True, timeout=600)
    outputs = sorted(Path(env["CKPT_DIR"], "logs").glob(f"slurm-{job}-*.out"))
    return result, (outputs[0].read_text() if outputs else "") + cluster.logs(1500)


@pytest.mark.slow
def test_make_slurm_runs_a_two_node_sft_one_task_per_node_with_node_facts_from_slurm(cluster, env, tmp_path):
    result, log = submit(cluster, {**env, "SFT_TRAINER_MODULE": "cpu_sft_trainer", "MASTER_PORT": "29411"}, "sft",
                         tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr + log
    run = Path(env["CKPT_DIR"])
    for rank in (0, 1):  # both tasks wrote into the one run directory on the "shared filesystem"
        seen = json.loads((run / f"rank{rank}.json").read_text())
        assert seen["world_size"] == 2 and seen["node_rank"] == rank and seen["sum"] == 3.0
    assert log.count("SFT finished") == 2 and "Traceback" not in log
    script = (tmp_path / "sft.sbatch").read_text()
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=1" in script
    assert "NODE_RANK" not in script.split("#SBATCH --nodes", 1)[1]  # every task the same line: Slurm gives the rank


@pytest.mark.slow
def test_make_slurm_runs_a_ray_head_and_worker_that_wait_for_each_other(cluster, env, tmp_path):
    # two Ray nodes on one machine need their own ports: a wrapper gives each task its range (on two machines the
    # same RAY_PORTS would do)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexport RAY_PORTS=$((31000 + SLURM_NODEID * 300))-$((31299 + SLURM_NODEID * 300))\n"
                      f"exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    temp = tempfile.mkdtemp(prefix="ray")  # short: Ray's AF_UNIX socket paths
    result, log = submit(cluster, {**env, "GRPO_TRAINER_MODULE": "ray_driver", "PYTHON": str(python),
                                   "RAY_TMPDIR": temp, "RAY_PORT": "31900", "WAIT_TIMEOUT": "300",
                                   "RAY_START_ARGS": "--num-gpus 1 --num-cpus 1"},
                         "grpo", tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr + log
    seen = json.loads((Path(env["CKPT_DIR"]) / "driver.json").read_text())
    # the worker at n2's NodeAddr (Ray may record the head's 127.0.0.1 as this machine's own address)
    assert "127.0.0.2" in seen["nodes"] and len(seen["nodes"]) == 2 and seen["gpus"] == 2
    assert "GRPO finished" in log and "went away: worker stopped" in log


def test_make_slurm_refuses_a_setting_that_slurm_decides(env, tmp_path):
    line = assert_one_line_error(run_app("slurm", "sft", env={**env, "NODE_RANK": "1", "OUT": str(tmp_path / "x")}))
    assert line == "error: NODE_RANK=1 means nothing for make slurm: the scheduler gives each node its own; unset it"
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("container, expected", [
    ("pyxis", "srun --kill-on-bad-exit=1 --ntasks-per-node=1 --container-image=verl-stack:0.1.0 --container-mounts="),
    ("apptainer", "apptainer exec --nv --bind "),
    ("docker", "make -s --no-print-directory RUNTIME=docker sft"),
])
def test_make_slurm_runs_the_image_with_pyxis_apptainer_or_compose(env, tmp_path, container, expected):
    out = tmp_path / "sft.sbatch"
    result = run_app("slurm", "sft", env={**env, "SLURM_CONTAINER": container, "OUT": str(out),
                                          "SLURM_OPTIONS": "--partition=gpu --time=8:00:00", "NCCL_IB_HCA": "mlx5_0"})
    assert result.returncode == 0, result.stderr
    script = out.read_text()
    assert expected in script and "#SBATCH --partition=gpu\n#SBATCH --time=8:00:00" in script
    assert "export NCCL_IB_HCA=mlx5_0" in script and subprocess.run(["bash", "-n", str(out)]).returncode == 0


# --- make k8s ---------------------------------------------------------------------------------------------------
@pytest.fixture
def k8s_env(env, tmp_path, tiny_model_dir, data_dir):
    """The run's files under one mount, as on the pods' volume (K8S_MOUNT)."""
    import shutil

    root = tmp_path / "workspace"
    shutil.copytree(tiny_model_dir, root / "model")
    shutil.copytree(data_dir, root / "data")
    return {**env, "K8S_MOUNT": str(root), "MODEL_PATH": str(root / "model"), "DATA_DIR": str(root / "data"),
            "CKPT_DIR": str(root / "runs" / "r1"), "NNODES": "2", "GPUS_PER_NODE": "8"}


def manifests(env: dict[str, str], job: str, tmp_path: Path, **more: str) -> list[dict]:
    out = tmp_path / f"{job}.yaml"
    result = run_app("k8s", job, env={**env, "OUT": str(out), **more})
    assert result.returncode == 0, result.stderr
    validated = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "-k", "1.30.0", str(out)],
                               capture_output=True, text=True, timeout=120)
    docs = list(yaml.safe_load_all(out.read_text()))
    core = [d for d in docs if d["apiVersion"] in ("v1", "batch/v1")]
    if core:  # the CRDs' kinds (RayJob, PyTorchJob) it cannot check: docs/schedulers.md
        assert "INFO" in validated.stdout and validated.returncode in (0, 1), validated.stdout + validated.stderr
        assert "ERROR" not in validated.stdout, validated.stdout
    return docs


def test_make_k8s_grpo_is_a_rayjob_with_a_worker_group_gpus_shm_and_the_run_volume(k8s_env, tmp_path):
    (job,) = manifests(k8s_env, "grpo", tmp_path)
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob") and job["spec"]["entrypoint"] == \
        "python -m app grpo-head"
    cluster = job["spec"]["rayClusterSpec"]
    head = cluster["headGroupSpec"]["template"]["spec"]
    (group,) = cluster["workerGroupSpecs"]
    assert group["replicas"] == 1 and group["groupName"]
    for pod in (head, group["template"]["spec"]):
        (container,) = pod["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
        assert {"name": "shm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
        assert {"name": "run", "persistentVolumeClaim": {"claimName": "verl-stack"}} in pod["volumes"]
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["MODEL_PATH"] == k8s_env["MODEL_PATH"] and "NODE_RANK" not in env and "HEAD_IP" not in env
        assert env["NNODES"] == "2"  # KubeRay gives the entrypoint no node count: grpo-head's wait needs it
    assert "&id" not in (tmp_path / "grpo.yaml").read_text()  # each pod's env written out, no YAML aliases


def test_make_k8s_sft_is_a_pytorchjob_or_an_indexed_job_with_a_headless_service(k8s_env, tmp_path):
    (job,) = manifests(k8s_env, "sft", tmp_path)
    assert job["kind"] == "PyTorchJob" and job["spec"]["nprocPerNode"] == "8"
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
    service, indexed = manifests(k8s_env, "sft", tmp_path, K8S_SFT="indexed")
    assert service["spec"]["clusterIP"] == "None" and indexed["spec"]["completionMode"] == "Indexed"
    template = indexed["spec"]["template"]
    assert template["spec"]["subdomain"] == service["metadata"]["name"] == indexed["metadata"]["name"]
    env = {e["name"]: e["value"] for e in template["spec"]["containers"][0]["env"]}
    assert env["MASTER_ADDR"] == f"{service['metadata']['name']}-0.{service['metadata']['name']}"


def test_make_k8s_refuses_paths_the_pods_volume_does_not_hold(k8s_env, tmp_path):
    line = assert_one_line_error(run_app("k8s", "sft", env={**k8s_env, "MODEL_PATH": str(REPO / "models"),
                                                             "OUT": str(tmp_path / "x.yaml")}))
    assert "is not under K8S_MOUNT=" in line and "the volume every pod mounts" in line
