"""scripts/bench_run.py: the summary line of a benchmark comes back even when the command goes quiet past
the deadline (GPU run 10: a GRPO step of 100 s left no BENCH line when the caller's own limit hit first)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO


def test_deadline_ends_a_silent_command_and_still_prints_the_steps_so_far(tmp_path):
    script = 'echo "step:1 - train/global_tokens:100"; sleep 1; echo "step:2 - train/global_tokens:300"; sleep 60'
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_run.py"), "--label", "quiet",
                             "--steps", "5", "--log", str(tmp_path / "run.log"), "--timeout", "3", "--",
                             "bash", "-c", script], capture_output=True, text=True, timeout=30)
    line = next(x for x in result.stdout.splitlines() if x.startswith("BENCH "))
    summary = json.loads(line[len("BENCH "):])
    assert summary["end"] == "timeout" and summary["steps"] == 2
    assert summary["wall_s"] < 15  # not the 60 s the command would have slept
    assert 250 < summary["tokens_per_s"] < 320  # step 2's 300 tokens over the ~1 s since step 1
    assert "step:2" in (tmp_path / "run.log").read_text()
