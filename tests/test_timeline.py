"""app/timeline.py: a launch's start-up, phase by phase, from what the launch does and what verl prints; its
summary after the first step, and `make report`'s picture of it. Real launches are in test_launch.py."""

from __future__ import annotations

import json
import time

from conftest import run_app

from app import timeline


def test_the_launch_stamps_verls_own_lines_once_and_prints_the_summary_after_the_first_step(tmp_path, capsys):
    line = timeline.Timeline(tmp_path / "logs" / "timeline-head.jsonl", time.time() - 10)
    line.stamp("preflight done")
    for printed in ["(TaskRunner pid=7) INFO actor and ref model engine initialized",
                    "(TaskRunner pid=7) INFO checkpoint engine manager initialized",
                    "(TaskRunner pid=7) INFO actor and ref model engine initialized",  # again: stamped once
                    "(TaskRunner pid=7) INFO all initialize finished, ready to fit",
                    "\x1b[36m(AgentLoopWorkerTQ pid=9)\x1b[0m Using dataset class: RLHFDataset",  # Ray's colours
                    "\x1b[36m(AgentLoopWorkerTQ pid=8)\x1b[0m Using dataset class: RLHFDataset",
                    "step:1 - actor/pg_loss:0.1 - timing_s/gen:24.2 - timing_s/old_log_prob:np.float64(42.7) - "
                    "timing_s/update_actor:26.0 - timing_s/update_weights:3.1 - timing_s/step:124.0",
                    "step:2 - actor/pg_loss:0.1 - timing_s/gen:3.0"]:
        line.watch(printed)
    phases = [phase for phase, _ in timeline.read(line.path)]
    assert phases == ["preflight done", "trainer workers ready", "vLLM engines ready", "ready to fit",
                      "agent-loop workers up", "first step done"]
    out = capsys.readouterr().out
    assert out.count("start-up on this node") == 1 and "first step done" in out  # once, after step 1
    rows = [row.split() for row in out.splitlines()[2:8]]
    assert [row[-1] for row in rows][-1].endswith("%") and all(float(row[-3]) >= 10 for row in rows)
    # where step 1 went, by verl's own timers, largest first, and what none of them covers
    assert out.splitlines()[8].startswith("  step 1 by verl's timers") and " ".join(out.split("\n", 8)[8].split()) == (
        "step 1 by verl's timers, s: old_log_prob 42.7, update_actor 26.0, gen 24.2, update_weights 3.1; "
        "outside them 28.0 of the step's 124.0")


def test_a_first_step_without_verls_timers_adds_no_line(tmp_path, capsys):
    line = timeline.Timeline(tmp_path / "timeline-node0.jsonl", time.time() - 5)
    line.watch("step:1 - train/loss:2.5 - train/lr:1e-05")  # SFT's: no timing_s
    assert capsys.readouterr().out.splitlines()[-1].startswith("  first step done")


def test_a_line_left_half_written_by_a_kill_is_skipped(tmp_path):
    path = tmp_path / "timeline-node0.jsonl"
    path.write_text(json.dumps({"phase": "preflight done", "t": 3.5}) + '\n{"phase": "torchrun st')
    assert timeline.read(path) == [("preflight done", 3.5)]
    assert timeline.summary(tmp_path / "missing.jsonl").startswith("start-up: no phases recorded")


def test_make_report_draws_every_nodes_start_up_and_lists_it_in_the_summary(tmp_path):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    for node, scale in (("head", 1.0), ("worker-127.0.0.2", 0.5)):
        (run / "logs" / f"timeline-{node}.jsonl").write_text("".join(
            json.dumps({"phase": phase, "t": at * scale}) + "\n"
            for phase, at in (("preflight done", 10), ("all nodes joined", 30), ("first step done", 200))))
    (run / "logs" / "metrics-1.jsonl").write_text(json.dumps({"step": 1, "data": {"train/loss": 1.0}}) + "\n")
    result = run_app("report", env={"RUN": str(run)})
    assert result.returncode == 0, result.stderr
    assert (run / "report" / "startup.png").stat().st_size > 1000
    summary = (run / "report" / "summary.txt").read_text()
    assert "startup.png" in summary and "start-up on this node, 200 s to first step done" in summary
    assert "start-up on this node, 100 s to first step done" in summary  # the worker's too
