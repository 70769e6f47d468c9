"""Tracking: swanlab in local mode and verl's JSONL `file` logger, without touching verl's source.

verl reads SWANLAB_MODE / SWANLAB_LOG_DIR and VERL_FILE_LOGGER_PATH from the environment
(verl/utils/tracking.py). For GRPO the loggers live in Ray actors, which inherit the environment of
`ray start` (and the job's runtime_env), so launch puts these variables in the environment of
`ray start` and of the driver, and passes `tracking_overrides(...)` so the per-attempt JSONL path
reaches the actors of this attempt even when `ray start` ran long before.

Commands:
  report [RUN]   PNG plots + summary.txt of a run from all its JSONL attempts, under <run>/report/
  board  [RUN]   serve swanlab's local dashboard of a run (BOARD_HOST/BOARD_PORT, loopback by default)
"""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from app import timeline
from app.common import ArgParser, UserError, atomic_path, hydra_quoted, resolved, say, warn, writable_dir
from app.runs import default_run_dir, logs_dir, swanlog_dir
from app.settings import Settings

# swanlab 0.10's local mode records into swanboard's database; it checks for exactly this version.
SWANBOARD_VERSION = "0.1.10b2"
LOG_NAME = re.compile(r"^metrics-(\d{8}T\d{6}Z)(?:-(\d+))?\.jsonl$")


def swanboard_problem() -> str | None:
    """Why swanlab's local mode cannot record here (None when it can)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("swanboard") if importlib.util.find_spec("swanboard") else None
    except PackageNotFoundError:
        found = None
    if found is None:
        return "swanboard is not installed"
    if found != SWANBOARD_VERSION:
        return f"swanboard {found} is installed but swanlab needs {SWANBOARD_VERSION}"
    return None


def tracking_env(run: Path, swanlab_mode: str = "local") -> dict[str, str]:
    """Environment that sends a run's metrics to files under `run`. verl's FileLogger opens its file with "wb"
    (truncating it on every restart), so each attempt writes its own logs/metrics-<UTC time>.jsonl."""
    run = Path(run)
    logs = logs_dir(run)
    writable_dir(logs, "CKPT_DIR")  # verl's FileLogger opens VERL_FILE_LOGGER_PATH without creating its directory
    writable_dir(swanlog_dir(run), "CKPT_DIR")
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = logs / f"metrics-{stamp}.jsonl"
    n = 0
    while path.exists():  # two attempts in the same second must not share (and truncate) one file
        n += 1
        path = logs / f"metrics-{stamp}-{n}.jsonl"
    problem = swanboard_problem() if swanlab_mode == "local" else None
    if problem:  # without swanboard, local mode logs an error and records nothing; offline still keeps the run
        warn(f"{problem}, so swanlab records offline (no dashboard): "
             f"pip install 'swanboard=={SWANBOARD_VERSION}' for `make board`")
        swanlab_mode = "offline"
    return {"SWANLAB_MODE": swanlab_mode, "SWANLAB_LOG_DIR": str(swanlog_dir(run)),
            "VERL_FILE_LOGGER_PATH": str(path)}


def tracking_overrides(tracking: dict[str, str]) -> list[str]:
    """Hydra overrides (++: add or replace) that put `tracking` into the Ray job's runtime_env: Ray actors see
    the environment of `ray start`, fixed when the node joined, but runtime_env is per submission, so this
    attempt's settings reach the actors that create verl's loggers, on whichever node they land."""
    return [f"++ray_kwargs.ray_init.runtime_env.env_vars.{key}={hydra_quoted(value)}"
            for key, value in tracking.items()]


# --- reading a run's JSONL ------------------------------------------------------------------------

@dataclass
class Attempt:
    path: Path
    steps: dict[int, dict[str, float]] = field(default_factory=dict)
    bad_lines: int = 0


@dataclass
class RunLog:
    run: Path
    attempts: list[Attempt]
    steps: dict[int, dict[str, float]]  # merged: step -> metric -> value

    def series(self, key: str, finite: bool = False) -> tuple[list[int], list[float]]:
        """(steps, values) of `key`, NaN and infinities included (a diverged run's last value is one of them);
        `finite`: only the finite ones (what a plot can draw and a min/max mean)."""
        xs, ys = [], []
        for step in sorted(self.steps):
            value = self.steps[step].get(key)
            if value is not None and (math.isfinite(value) or not finite):
                xs.append(step)
                ys.append(value)
        return xs, ys

    def non_finite(self, key: str) -> tuple[int, int, bool] | None:
        """(first step whose value is NaN or infinite, how many steps are, whether every later step is too),
        or None where every value is finite."""
        xs, ys = self.series(key)
        bad = [i for i, y in enumerate(ys) if not math.isfinite(y)]
        return (xs[bad[0]], len(bad), len(bad) == len(ys) - bad[0]) if bad else None

    def keys(self) -> set[str]:
        return {k for metrics in self.steps.values() for k in metrics}


def log_files(run: Path) -> list[Path]:
    """The run's JSONL attempts, oldest first (by the UTC time in the name, then its counter)."""
    def order(path: Path):
        if m := LOG_NAME.match(path.name):
            return (m.group(1), int(m.group(2) or 0))
        return (time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(path.stat().st_mtime)), 0)

    return sorted(logs_dir(run).glob("metrics-*.jsonl"), key=order)


def _number(value) -> float | None:
    if value is None:
        # verl's FileLogger writes with orjson, which writes NaN and +-inf as null: a metric that is null is
        # one that went non-finite (a diverged loss), not one that is absent
        return math.nan
    # bools too; NaN and Infinity as json writers other than orjson log them
    return float(value) if isinstance(value, (int, float)) else None


def read_attempt(path: Path) -> Attempt:
    attempt = Attempt(path)
    with open(path, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                step = int(record["step"])
                data = record["data"]
                if not isinstance(data, dict):
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                attempt.bad_lines += 1  # e.g. the last line of a run killed mid-write
                continue
            # verl logs several lines for one step (SFT: train metrics, then val/loss): merge them.
            merged = attempt.steps.setdefault(step, {})
            for key, value in data.items():
                number = _number(value)
                if number is not None:
                    merged[key] = number
    return attempt


def read_run(run: Path, files: list[Path] | None = None) -> RunLog:
    """All attempts of a run merged in time order. A later attempt resumed from a checkpoint re-runs every step
    after it: the earlier attempts' steps past its first step belong to an abandoned trajectory and are dropped;
    at that first step the later values win key by key."""
    from tqdm import tqdm

    files = log_files(run) if files is None else files
    if not files:
        raise UserError(f"no metrics logs under {run / 'logs'}: pass RUN=<run directory> "
                        "(CKPT_DIR of the run, e.g. checkpoints/grpo-gsm8k) of a run that has started")
    attempts = [read_attempt(p) for p in tqdm(files, desc="reading logs", unit="file", disable=len(files) < 5)]
    steps: dict[int, dict[str, float]] = {}
    for attempt in attempts:
        if not attempt.steps:
            continue
        first = min(attempt.steps)
        steps = {s: m for s, m in steps.items() if s <= first}
        for step, metrics in attempt.steps.items():
            steps.setdefault(step, {}).update(metrics)
    if not steps:
        where = f"{run} holds" if run.is_file() else f"the logs under {run / 'logs'} hold"
        raise UserError(f"{where} no metrics yet: wait for the first step to finish, then rerun")
    return RunLog(run, attempts, steps)


# --- plots ----------------------------------------------------------------------------------------
# Metric names as verl 0.9.1 logs them: SFT in verl/trainer/sft_trainer.py (+ workers/engine_workers.py),
# GRPO in verl/trainer/ppo/metric_utils.py and the trainer (actor/* from workers/utils/losses.py).
TIMING = ["gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "update_weights", "testing",
          "save_checkpoint"]
FIGURES: list[tuple[str, str, list[tuple[str, list[str]]]]] = [
    ("loss.png", "Loss", [
        ("loss", ["train/loss", "val/loss"]),
        ("policy loss", ["actor/pg_loss"]),
        ("KL loss", ["actor/kl_loss"]),
        ("entropy", ["actor/entropy"]),
        ("grad norm", ["train/grad_norm", "actor/grad_norm"]),
    ]),
    ("reward.png", "Reward", [  # the title says what is drawn: _title
        ("training reward (mean over responses)", ["critic/rewards/mean", "critic/score/mean"]),
        ("validation", ["val-core/*"]),
    ]),
    ("response_length.png", "Response length", [
        ("response length (tokens)", ["response_length/mean", "response_length/max", "response_length/min"]),
        ("share cut at max_response_length", ["response_length/clip_ratio"]),
    ]),
    ("throughput.png", "Throughput and time", [
        ("tokens / s / GPU", ["perf/throughput"]),
        ("seconds per step", ["perf/time_per_step"] + [f"timing_s/{t}" for t in TIMING]),
        ("tokens per step", ["train/global_tokens", "perf/total_num_tokens"]),
        ("MFU", ["train/mfu", "perf/mfu/actor"]),
        ("GPU memory (GB)", ["perf/max_memory_allocated_gb", "perf/max_memory_reserved_gb"]),
    ]),
]
# What summary.txt lists, in this order, when present.
HEADLINE = ["train/loss", "val/loss", "critic/rewards/mean", "critic/score/mean", "actor/pg_loss",
            "actor/kl_loss", "actor/entropy", "response_length/mean", "response_length/clip_ratio",
            "perf/throughput", "perf/time_per_step", "timing_s/gen", "timing_s/update_actor",
            "train/global_tokens", "train/mfu"]


def _expand(keys: list[str], present: set[str]) -> list[str]:
    """The present `keys`, in order; one ending in * stands for every present key it begins."""
    out = []
    for key in keys:
        if key.endswith("*"):
            out += sorted(k for k in present if k.startswith(key[:-1]))
        elif key in present:
            out.append(key)
    return out


def _title(title: str, keys: list[str]) -> str:
    """A figure's title that promises only what it draws. The reward figure: training reward (critic/*) and
    validation (val-core/<data_source>/<name>/<stat>, where <name> is the reward, or the accuracy only where
    a custom reward function returns an `acc`)."""
    if title != "Reward":
        return title
    validation = {key.split("/")[-2] for key in keys if key.startswith("val-core/")}
    parts = (["training"] if any(key.startswith("critic/") for key in keys) else []) + (
        ["validation"] if validation else [])
    what = "Reward and accuracy" if "acc" in validation else "Reward"
    return f"{what}: {' and '.join(parts)}" if parts else what


def render(log: RunLog, out: Path) -> list[str]:
    """Write one PNG per figure that has data into `out`; return the names written."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display (servers, containers)
    import matplotlib.pyplot as plt

    present = log.keys()
    written = []
    for name, title, panels in FIGURES:
        filled = [(label, found) for label, keys in panels if (found := _expand(keys, present))]
        if not filled:
            continue
        cols = min(2, len(filled))
        rows = math.ceil(len(filled) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 3.6 * rows), squeeze=False)
        for ax in axes.flat[len(filled):]:
            ax.set_visible(False)
        for ax, (label, keys) in zip(axes.flat, filled):
            for key in keys:
                xs, ys = log.series(key, finite=True)
                sparse = len(xs) < max(2, len(log.steps) // 4)  # validation: a point every test_freq steps
                line, = ax.plot(xs, ys, marker="o" if sparse else None, markersize=3, linewidth=1.2, label=key)
                if bad := log.non_finite(key):  # a line cannot draw NaN or inf: mark where the values stop
                    ax.axvline(bad[0], color=line.get_color(), linestyle="--", linewidth=1,
                               label=f"{key}: non-finite from step {bad[0]}")
            ax.set_title(label, fontsize=10)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        heading = f"{_title(title, [key for _, keys in filled for key in keys])}: {log.run.name}"
        fig.suptitle(heading)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110, metadata={"Title": heading})  # the PNG's tEXt says it too
        plt.close(fig)
        written.append(name)
    return written


def _summary_keys(log: RunLog) -> list[str]:
    present = log.keys()
    return [k for k in HEADLINE + sorted(k for k in present if k.startswith("val-core/"))
            if k in present and log.series(k)[1]]


def summary_text(log: RunLog, plots: list[str]) -> str:
    steps = sorted(log.steps)
    present = log.keys()
    kind = "GRPO" if "critic/rewards/mean" in present else "SFT" if "train/loss" in present else "unknown"
    lines = [f"run: {log.run}", f"kind: {kind} (from the metric names)",
             f"steps: {steps[0]}..{steps[-1]} ({len(steps)} logged)", f"attempts: {len(log.attempts)}"]
    for attempt in log.attempts:
        span = f"steps {min(attempt.steps)}..{max(attempt.steps)}" if attempt.steps else "no steps"
        lines.append(f"  {attempt.path.name}: {span}" + (f", {attempt.bad_lines} unreadable lines"
                                                         if attempt.bad_lines else ""))
    keys = _summary_keys(log)
    width = max([len("metric")] + [len(k) for k in keys])
    lines += ["", f"{'metric':<{width}} {'first':>11} {'last':>11} {'min':>11} {'max':>11}  (step of last)"]
    diverged = []
    for key in keys:
        xs, ys = log.series(key)  # first and last as logged: a NaN last value is the news
        finite = [y for y in ys if math.isfinite(y)]
        low, high = (f"{min(finite):>11.4g}", f"{max(finite):>11.4g}") if finite else (f"{'-':>11}", f"{'-':>11}")
        row = f"{key:<{width}} {ys[0]:>11.4g} {ys[-1]:>11.4g} {low} {high}  ({xs[-1]})"
        if bad := log.non_finite(key):
            step, count, to_the_end = bad
            row += f"  non-finite from step {step}" if to_the_end else f"  non-finite at {count} steps from step {step}"
            diverged.append(f"{key} from step {step}")
        lines.append(row)
    if diverged:
        lines += ["", "non-finite values (NaN or infinite; verl's file logger writes both as null): "
                  + ", ".join(diverged) + "; min and max are over the finite values"]
    if "perf/time_per_step" in present:
        total = sum(log.series("perf/time_per_step", finite=True)[1])
        lines.append(f"\ntraining time over the logged steps: {total / 3600:.2f} h")
    if "train/global_tokens" in present:
        lines.append(f"\ntokens trained on: {sum(log.series('train/global_tokens', finite=True)[1]):,.0f}")
    lines += ["", "plots: " + (", ".join(plots) if plots else "none (no plottable metrics)")]
    return "\n".join(lines) + "\n"


def report(run: Path) -> Path:
    """Render <run>/report/ (PNGs + summary.txt) atomically and return it. RUN may also be one JSONL log
    (verl's own file logger output, wherever it was written): its report goes to <stem>-report/ beside it."""
    if run.is_file():
        if run.suffix != ".jsonl":
            raise UserError(f"RUN={run} is a file but not a .jsonl metrics log: pass the run directory or "
                            "verl's metrics .jsonl file")
        log = read_run(run, [run])
        out = run.with_name(f"{run.stem}-report")
    elif not run.exists():
        raise UserError(f"run directory {run} does not exist: pass RUN=<run directory> "
                        "(CKPT_DIR of the run, e.g. checkpoints/grpo-gsm8k) or RUN=<metrics .jsonl file>")
    elif not run.is_dir():
        raise UserError(f"RUN={run} is neither a run directory nor a .jsonl metrics log: pass one of those")
    else:
        log = read_run(run)
        out = run / "report"
    with atomic_path(out, "RUN") as tmp:
        tmp.mkdir()
        plots = render(log, tmp)
        startup, text = timeline.draw(run, tmp)  # ([], "") for a JSONL file
        (tmp / "summary.txt").write_text(summary_text(log, plots + startup) + (f"\n{text}\n" if text else ""),
                                         encoding="utf-8")
    if bad_lines := sum(attempt.bad_lines for attempt in log.attempts):
        warn(f"skipped {bad_lines} unreadable log lines (a run killed mid-write leaves one)")
    diverged = [f"{key} from step {bad[0]}" for key in _summary_keys(log) if (bad := log.non_finite(key))]
    if diverged:
        warn(f"non-finite values (NaN or infinite) in {', '.join(diverged)}: the run diverged there; see "
             f"{out / 'summary.txt'}")
    return out


# --- board ----------------------------------------------------------------------------------------

def find_swanlog(run: str | None, ckpt_dir: str | None) -> Path:
    """The swanlog directory to serve: RUN's, else CKPT_DIR's, else the newest under checkpoints/."""
    if run:
        candidates = [swanlog_dir(Path(run)), Path(run)]
    elif ckpt_dir:
        candidates = [swanlog_dir(Path(ckpt_dir))]
    else:
        dbs = sorted((Path.cwd() / "checkpoints").glob("*/swanlog/runs.swanlab"), key=lambda p: p.stat().st_mtime)
        candidates = [db.parent for db in reversed(dbs)]
        if len(candidates) > 1:
            say("runs with dashboards: " + ", ".join(c.parent.name for c in candidates)
                + f"; serving the newest ({candidates[0].parent.name}), choose another with RUN=<run directory>")
    for candidate in candidates:
        if (candidate / "runs.swanlab").is_file():
            return candidate.resolve()
    where = run or ckpt_dir or "checkpoints/*"
    if (run or ckpt_dir) and not Path(where).exists():
        raise UserError(f"{where} does not exist: point {'RUN' if run else 'CKPT_DIR'} at a run directory "
                        "(one that make sft or make grpo-head wrote)")
    raise UserError(f"no swanlab logs yet under {where}: start a run with SWANLAB_MODE=local "
                    "(make sft or make grpo-head), or pass RUN=<run directory>")


def board(run: str | None, ckpt_dir: str | None, host: str, port: int, environ: dict[str, str]) -> int:
    try:
        ipaddress.IPv4Address(host)  # swanboard accepts IPv4 only, and fails silently otherwise
    except ValueError:
        raise UserError(f"BOARD_HOST={host!r} is not an IPv4 address: use 127.0.0.1 (this machine only) "
                        "or 0.0.0.0 (every interface)") from None
    if not 1 <= port <= 65535:
        raise UserError(f"BOARD_PORT={port} is not a port: choose one in 1..65535")
    logdir = find_swanlog(run, ckpt_dir)
    problem = swanboard_problem()
    if problem:
        raise UserError(f"{problem}: pip install 'swanboard=={SWANBOARD_VERSION}' (swanlab's dashboard), "
                        "then rerun make board")
    say(f"serving the swanlab dashboard of {logdir} on http://{host}:{port} (Ctrl-C stops it; "
        "if the port is taken swanlab picks another and prints it)")
    # exec, not a child: Ctrl-C and `kill` reach the server itself, no orphan keeps the port
    os.execve(sys.executable, [sys.executable, "-m", "swanlab", "watch", str(logdir), "--host", host,
                               "--port", str(port)], environ)


def main(command: str, argv: list[str], settings: Settings) -> int:
    parser = ArgParser(prog=f"python -m app {command}", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", nargs="?", default=settings["RUN"], help="run directory (default: RUN)")
    if command == "board":
        parser.add_argument("--host", default=settings["BOARD_HOST"], help="BOARD_HOST")
        parser.add_argument("--port", type=int, default=settings["BOARD_PORT"], help="BOARD_PORT")
    args = parser.parse_args(argv)
    if command == "board":
        return board(args.run, settings["CKPT_DIR"], args.host, args.port, settings.environ())
    if args.run:
        run = resolved(args.run, "RUN")
    else:
        try:  # CKPT_DIR, JOB's run, or the one run present
            run = default_run_dir(settings)
        except UserError:
            raise UserError("which run? pass RUN=<run directory>, e.g. make report RUN=checkpoints/grpo-gsm8k"
                            ) from None
    out = report(run)
    say(f"wrote {out}: " + ", ".join(sorted(p.name for p in out.iterdir())))
    say((out / "summary.txt").read_text(encoding="utf-8").rstrip())
    return 0
