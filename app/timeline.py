"""Where a launch's start-up goes: every launch (SFT and GRPO, every node) stamps its phases into
<run>/logs/timeline-<node>.jsonl, seconds since the launch's process started, and prints a one-screen summary once
the first step is done. `make report` draws it; the demo's verdict includes it.

The launch stamps what it does itself (preflight, torchrun or Ray up, all nodes joined, the driver started); the
rest is read off the lines verl 0.9.1 prints as it goes (its logger's own words, below), which the launch copies
through unchanged: no patch of verl.
"""

from __future__ import annotations

import json
import re
import textwrap
import time
from pathlib import Path

# (phase, what verl 0.9.1 prints when it ends): trainer/ppo/v1/trainer_base.py's _setup, in its order
VERL_LINES = (("trainer workers ready", "actor and ref model engine initialized"),
              ("vLLM engines ready", "checkpoint engine manager initialized"),
              ("ready to fit", "all initialize finished, ready to fit"),
              # not verl's words but Ray's prefix on the first line any of them prints: verl creates its agent-loop
              # workers after `ready to fit`, step 1 waits while each imports vLLM (docs/gpu-runs.md, run 45)
              ("agent-loop workers up", "(AgentLoopWorker"))
STEP_LINE = re.compile(r"\bstep:(\d+) - (.*)$")  # verl's console logger, once per step, SFT and GRPO alike
FIRST_STEP_PHASE = "first step done"


def step_metrics(line: str) -> tuple[int, dict[str, float]] | None:
    """verl's `step:N - key:value - ...` line as (N, {key: value}), None for any other line. verl pprints each
    value, so one of numpy's reads `np.float64(24.2)`; values that are no number are left out."""
    match = STEP_LINE.search(line)
    if not match:
        return None
    metrics = {}
    for part in match.group(2).split(" - "):
        key, _, value = part.partition(":")
        value = value.strip()
        if value.startswith("np.") and value.endswith(")"):
            value = value[value.index("(") + 1:-1]
        try:
            metrics[key.strip()] = float(value)
        except ValueError:
            pass
    return int(match.group(1)), metrics


def started_at() -> float:
    """When this launch's process started (the user's Enter, give or take the interpreter's start)."""
    import psutil

    return psutil.Process().create_time()


class Timeline:
    """One node's phase stamps of one launch; a new launch starts a new file."""

    def __init__(self, path: Path, started: float, new: bool = True):
        self.path, self.started = path, started
        self.summarised = False
        if new:  # else another process's, appended to
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("")

    def stamp(self, phase: str, **detail) -> None:
        """Record `phase` as done now, once (the rank entry of app.rendezvous appends to the same file)."""
        if phase in {p for p, _ in read(self.path)}:
            return
        with open(self.path, "a", encoding="utf-8") as handle:  # one short line, O_APPEND: whole or not at all
            handle.write(json.dumps({"phase": phase, "t": round(time.time() - self.started, 1), **detail}) + "\n")

    def watch(self, line: str) -> None:
        """A line the launch's child printed: stamp the phase it ends; after the first step, the summary with
        where the step went by verl's own timers (GRPO's `timing_s/*`; SFT logs none)."""
        if self.summarised:  # start-up over: later lines are only copied (agent-loop workers print every step)
            return
        for phase, text in VERL_LINES:
            if text in line:
                self.stamp(phase)
        step = step_metrics(line)
        if step and step[0] == 1:
            self.stamp(FIRST_STEP_PHASE, timers={k.removeprefix("timing_s/"): v for k, v in step[1].items()
                                                 if k.startswith("timing_s/")})
            self.summarised = True
            print(summary(self.path), flush=True)


def records(path: Path) -> list[dict]:
    """The file's stamps as written; unreadable lines (a kill mid-write) are left out."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            record = json.loads(line)
            out.append({**record, "phase": str(record["phase"]), "t": float(record["t"])})
        except (ValueError, KeyError, TypeError):
            continue
    return out


def read(path: Path) -> list[tuple[str, float]]:
    """(phase, seconds) in the order they happened."""
    return sorted(((record["phase"], record["t"]) for record in records(path)), key=lambda item: item[1])


def summary(path: Path) -> str:
    """The start-up as one screen: each phase, when it ended, how long it took, its share of the whole."""
    phases = read(path)
    if not phases:
        return f"start-up: no phases recorded in {path}"
    total = phases[-1][1] or 1.0
    rows = [f"start-up on this node, {total:.0f} s to {phases[-1][0]} ({path}):",
            f"  {'phase':<24}{'at s':>8}{'took s':>9}{'share':>8}"]
    before = 0.0
    for phase, at in phases:
        rows.append(f"  {phase:<24}{at:>8.1f}{at - before:>9.1f}{(at - before) / total:>8.0%}")
        before = at
    timers = first_step_timers(path)
    step = timers.pop("step", None)
    if timers:
        parts = [f"{name} {s:.1f}" for name, s in sorted(timers.items(), key=lambda item: -item[1])]
        rest = None if step is None else step - sum(timers.values())  # below 0 where verl's timers nest
        tail = f"; outside them {rest:.1f} of the step's {step:.1f}" if rest is not None and rest >= 0 else ""
        rows += textwrap.wrap(f"step 1 by verl's timers, s: {', '.join(parts)}{tail}", 100, initial_indent="  ",
                              subsequent_indent="    ")
    return "\n".join(rows)


def first_step_timers(path: Path) -> dict[str, float]:
    """verl's own timers of the first step (`timing_s/*` of its `step:1` line), as the launch stamped them."""
    stamped = [record.get("timers") for record in records(path) if record["phase"] == FIRST_STEP_PHASE]
    return dict(stamped[0]) if stamped and isinstance(stamped[0], dict) else {}


def draw(run: Path, out: Path) -> tuple[list[str], str]:
    """`make report`'s part: startup.png (each node's phases as one bar) and the summaries' text, for every
    timeline in <run>/logs; ([], "") where there is none."""
    paths = sorted((run / "logs").glob("timeline-*.jsonl")) if run.is_dir() else []
    nodes = [(path.stem.removeprefix("timeline-"), read(path)) for path in paths]
    nodes = [(name, phases) for name, phases in nodes if phases]
    if not nodes:
        return [], ""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.6 * len(nodes)))
    colours = plt.get_cmap("tab10")
    order = list(dict.fromkeys(phase for _, phases in nodes for phase, _ in phases))
    for row, (name, phases) in enumerate(nodes):
        before = 0.0
        for phase, at in phases:
            ax.barh(row, at - before, left=before, color=colours(order.index(phase) % 10),
                    label=phase if row == 0 or phase not in {p for _, ps in nodes[:row] for p, _ in ps} else None)
            before = at
    ax.set_yticks(range(len(nodes)), [name for name, _ in nodes])
    ax.set_xlabel("seconds since the launch")
    ax.set_title(f"start-up, phase by phase: {run.name}")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=4)
    fig.tight_layout()
    fig.savefig(out / "startup.png", dpi=110)
    plt.close(fig)
    return ["startup.png"], "\n\n".join(summary(path) for path in paths)
