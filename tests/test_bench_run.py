"""scripts/bench_run.py: the summary line of a benchmark comes back even when the command goes quiet past
the deadline (GPU run 10: a GRPO step of 100 s left no BENCH line when the caller's own limit hit first)."""

from __future__ import annotations

import json
import os
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


def test_the_summary_names_the_machine_that_ran_it(tmp_path):
    """Machines of one kind differ by tens of seconds (docs/benchmarks.md, runs 71-72): each record says which."""
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_run.py"), "--label", "m", "--steps", "1",
                             "--log", str(tmp_path / "run.log"), "--", "echo", "step:1 - timing_s/step:1.0"],
                            capture_output=True, text=True, timeout=30)
    summary = json.loads(next(x for x in result.stdout.splitlines() if x.startswith("BENCH "))[len("BENCH "):])
    with open("/proc/cpuinfo") as info:
        model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), None)
    assert summary["host"]["cores"] == os.cpu_count() and summary["host"]["cpu"] == model


def test_warmup_steps_are_left_out_of_the_means(tmp_path):
    # step 2 is slow (a recompile for a new shape), steps 3-4 are steady: --warmup 2 times only 3-4
    script = ('echo "step:1 - train/global_tokens:100"; sleep 2; echo "step:2 - train/global_tokens:100"; '
              'sleep 0.2; echo "step:3 - train/global_tokens:100"; sleep 0.2; echo "step:4 - train/global_tokens:100"')
    summaries = {}
    for warmup in (1, 2):
        result = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_run.py"), "--label", "w",
                                 "--steps", "4", "--warmup", str(warmup), "--log", str(tmp_path / "run.log"),
                                 "--", "bash", "-c", script], capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stdout + result.stderr
        line = next(x for x in result.stdout.splitlines() if x.startswith("BENCH "))
        summaries[warmup] = json.loads(line[len("BENCH "):])
    assert summaries[2]["warmup"] == 2 and summaries[2]["step_s"] < 0.6  # the 2 s step is not in it
    assert summaries[1]["step_s"] > 0.7  # with --warmup 1 it is: (2 + 0.2 + 0.2) / 3


def test_the_first_steps_own_timers_are_kept_whole(tmp_path):
    """Step 1 is left out of the means, but where it went is the start-up's question: all its timing_s/* keys."""
    # verl pprints a numpy value as np.float64(...): the launch's reader (app.timeline) reads both forms
    script = ('echo "step:1 - timing_s/gen:20.5 - timing_s/update_weights:np.float64(18.25) - timing_s/step:64.0 - actor/lr:1e-06"; '
              'echo "step:2 - timing_s/gen:14.0 - timing_s/step:24.0"')
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_run.py"), "--label", "t", "--steps", "2",
                             "--log", str(tmp_path / "run.log"), "--", "bash", "-c", script],
                            capture_output=True, text=True, timeout=30)
    summary = json.loads(next(x for x in result.stdout.splitlines() if x.startswith("BENCH "))[len("BENCH "):])
    assert summary["first_step_timing"] == {"timing_s/gen": 20.5, "timing_s/update_weights": 18.25,
                                            "timing_s/step": 64.0}
    assert summary["timing_s/gen"] == 14.0  # the means: step 2 only
