"""app.raystart: Ray's `ray start --block`, ending with the node's record of its current cluster as it was found.
A real Ray head on 127.0.0.1 in a temp dir of the test's own; the launch's paths (stopped, killed outright, a worker
whose head went away) are in test_faults_launch.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import REPO
from test_launch import free_port, stop_group

from app.raystart import flag


def test_ray_starts_flags_are_read_in_both_spellings():
    args = ["start", "--head", "--port=6400", "--temp-dir", "/x/ray", "--block"]
    assert (flag(args, "--port"), flag(args, "--temp-dir"), flag(args, "--address")) == ("6400", "/x/ray", None)


@pytest.mark.slow
def test_a_record_of_another_cluster_is_put_back_when_the_head_is_stopped():
    """A user's own cluster was this node's current one before ours: a plain ray.init() joins it again afterwards,
    not our dead head (Ray itself would leave its file naming ours)."""
    temp = tempfile.mkdtemp(prefix="ray")
    record = Path(temp) / "ray" / "ray_current_cluster"
    record.parent.mkdir()
    record.write_text("127.0.0.9:7000")
    port = free_port()
    env = {**os.environ, "RAY_TMPDIR": temp, "PYTHONPATH": str(REPO)}
    head = subprocess.Popen([sys.executable, "-m", "app.raystart", "start", "--head", "--block", "--port", str(port),
                             "--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--include-dashboard", "false",
                             "--dashboard-agent-listen-port", str(free_port()), "--disable-usage-stats"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not record.read_text().endswith(f":{port}") and time.monotonic() < deadline and head.poll() is None:
            time.sleep(0.3)
        ours = record.read_text()
        head.send_signal(signal.SIGTERM)
        out, _ = head.communicate(timeout=120)
        after = record.read_text() if record.exists() else None
    finally:
        stop_group(head)
        subprocess.run(["rm", "-rf", temp])
    assert ours.endswith(f":{port}"), out[-3000:]  # what Ray recorded while it ran
    assert after == "127.0.0.9:7000", out[-3000:]
