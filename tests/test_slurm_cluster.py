"""The test Slurm cluster (fixtures/slurm_cluster.py) is a real one: sbatch --wait runs a two-node job whose
srun puts one task on each slurmd, a job's failure reaches sbatch's exit status, and leaving the cluster
stops every process it started, running jobs included. What `make slurm` will be tested against."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))  # slurm_cluster
from slurm_cluster import processes_of, slurm_cluster

pytestmark = pytest.mark.slow

NODES = 2  # two slurmd on this one machine, each its own node


@pytest.fixture(scope="module")
def cluster():
    try:
        with slurm_cluster(nodes=NODES) as running:
            yield running
    except RuntimeError as error:  # a failure, not a skip: .ci/run installs slurm-wlm and munge
        pytest.fail(str(error))


def sbatch_wait(cluster, script: Path, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sbatch", "--wait", *options, str(script)], env=cluster.env, capture_output=True,
                          text=True, timeout=120)


def test_two_node_job_runs_one_srun_task_on_each_node(cluster, tmp_path):
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n"
                      "srun bash -c 'echo rank=$SLURM_PROCID node=$SLURM_NODEID job_nodes=$SLURM_JOB_NODELIST "
                      "step_nodes=$SLURM_STEP_NODELIST name=$SLURMD_NODENAME'\n")
    out = tmp_path / "out.txt"
    result = sbatch_wait(cluster, script, f"--nodes={NODES}", "--ntasks-per-node=1", f"--output={out}")
    assert result.returncode == 0, result.stdout + result.stderr + cluster.logs()
    assert sorted(out.read_text().splitlines()) == [
        "rank=0 node=0 job_nodes=n[1-2] step_nodes=n[1-2] name=n1",
        "rank=1 node=1 job_nodes=n[1-2] step_nodes=n[1-2] name=n2",
    ], out.read_text()


def test_failing_batch_script_exit_code_reaches_sbatch_wait(cluster, tmp_path):
    script = tmp_path / "fail.sh"
    script.write_text("#!/bin/bash\necho before the failure\nexit 3\n")
    out = tmp_path / "out.txt"
    result = sbatch_wait(cluster, script, f"--output={out}")
    assert result.returncode == 3, result.stdout + result.stderr
    assert out.read_text() == "before the failure\n"


def test_task_failing_on_one_node_fails_sbatch_wait_with_its_code(cluster, tmp_path):
    # rank 1 (on n2) fails, rank 0 succeeds: srun exits with the failed task's code, so does the job
    script = tmp_path / "fail.sh"
    script.write_text("#!/bin/bash\nsrun bash -c '[ $SLURM_PROCID = 1 ] && exit 7; exit 0'\n")
    out = tmp_path / "out.txt"
    result = sbatch_wait(cluster, script, f"--nodes={NODES}", "--ntasks-per-node=1", f"--output={out}")
    assert result.returncode == 7, result.stdout + result.stderr
    assert "n2: task 1: Exited with exit code 7" in out.read_text(), out.read_text()


def gone(pid: int) -> bool:
    """Not running: no such process, or a zombie waiting for init to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def test_leaving_the_cluster_stops_its_daemons_and_running_jobs(tmp_path):
    pids_file = tmp_path / "tasks.txt"
    script = tmp_path / "long.sh"
    script.write_text(f"#!/bin/bash\nsrun bash -c 'echo $$ >> {pids_file}; exec sleep 600'\n")
    try:
        with slurm_cluster(nodes=NODES) as running:
            submitted = subprocess.run(["sbatch", f"--nodes={NODES}", "--ntasks-per-node=1",
                                        f"--output={tmp_path / 'out.txt'}", str(script)],
                                       env=running.env, capture_output=True, text=True, timeout=60)
            assert submitted.returncode == 0, submitted.stderr
            deadline = time.monotonic() + 60
            while not (pids_file.is_file() and len(pids_file.read_text().split()) == NODES):
                assert time.monotonic() < deadline, "the job's tasks did not start:\n" + running.logs()
                time.sleep(0.1)
            tasks = [int(pid) for pid in pids_file.read_text().split()]
            daemons = list(running.pids.values())
            assert all(not gone(pid) for pid in tasks + daemons)
            root, conf = running.root, running.conf
    except RuntimeError as error:
        pytest.fail(str(error))
    assert len(daemons) == 2 + NODES  # munged, slurmctld, one slurmd per node
    assert [pid for pid in tasks + daemons if not gone(pid)] == []
    assert [pid for pid in processes_of(conf) if not gone(pid)] == []
    assert not root.exists()
    assert os.environ.get("SLURM_CONF") != str(conf)  # the cluster's env was its own, not this process's
