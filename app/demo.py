"""`python -m app demo` (`make demo`): the proof that a run through this stack makes a model better, on one
GPU in minutes, with nothing downloaded. A tiny random model learns the `arith` task (`make prep` writes it:
additions asked in GSM8K's `#### <number>` form, scored by verl's gsm8k scorer, test questions unseen in
training):

    prep -> tiny-model -> sft -> merge -> eval (A0) -> grpo-head from the SFT model -> merge -> eval (A1) -> report

Every stage is the CLI command a user runs (`python -m app sft`, `... grpo-head`, `... merge`, `... eval`),
started as a subprocess with the demo's own settings, as `make smoke` does. Both trainings also save the whole
model at their last step (verl's `hf_model` checkpoint content), so GRPO and the evals start from those at once:
the SFT merge, the eval of the SFT model and the report run beside the next stage, the GRPO merge and the eval of
the GRPO model start with GRPO and go when it saves its last step (their output in DEMO_DIR/<stage>.log). It passes
only if GRPO's reward mean rises over the run and A1 beats A0 by more than noise (see `accuracy_margin`).

Everything lives under DEMO_DIR (default checkpoints/demo): data/, model/, sft/ (run), sft-model/ (merged), grpo/
(run, with report/ plots), grpo-model/ (merged), eval-sft/, eval-grpo/, demo.json (the verdict and its figures).
A rerun resumes: a stage that finished with the same settings (DEMO_DIR/stages/<stage>.json) is skipped, and a
GRPO stage that was cut short continues from its last checkpoint (one every 10 steps), or, where that is its
last step, is not started again.
Settings: DEMO_DIR, DEMO_SFT_STEPS (default 300), DEMO_GRPO_STEPS (default 12), DEMO_UNTIL=<stage> (stop after
it, e.g. eval-sft: the SFT half; a rerun goes on from there), FRESH=1 (rerun every stage), DRY_RUN=1 (print
the plan).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from app import node, runs, timeline
from app.common import UserError, atomic_path, ends_with_us, say
from app.settings import Settings
from app.smoke import Stage, child_env, gpu_count, quarter_means, read_losses, run_stage, stage_failed
from app.tracking import read_run

# SFT of a random 2-layer model on arith: a big constant lr (random weights), short sequences. 300 steps reach
# A0 of 70-80% on 1xH200 (docs/gpu-runs.md runs 14, 17, 18): below 100% on purpose, so that GRPO has room to
# show what it adds (A1 94.0%, run 18). Eager, no Liger: eager trained as sdpa did in 45 s instead of 72 (run 17),
# Flex's and Liger's kernels compile on first use for longer than they save here (runs 5, 11); eager keeps packed
# samples apart (scripts/packing_check.py).
SFT_ARGS = [
    "model.override_config.attn_implementation=eager", "model.use_liger=False",
    "data.train_batch_size=64", "data.micro_batch_size_per_gpu=64", "data.max_length=128", "data.num_workers=2",
    "optim.lr=1e-3", "optim.lr_warmup_steps_ratio=0.0", "optim.lr_scheduler_type=constant",
    "trainer.logger=[console,file]", "trainer.test_freq=-1",
    # the whole model beside the shards (a second on this model): GRPO and the eval start from it while the merge
    # runs beside them, instead of after it
    "checkpoint.save_contents=[model,optimizer,extra,hf_model]",
]

# GRPO from the SFT model, on 1xH200 (docs/gpu-runs.md): 64 prompts x 8 samples a step (rollout time follows
# the sample count: 8 s for 1,024, run 9), two updates a step, short responses (`#### <sum>`), prompts of 48-50
# tokens (preflight counts them, so verl's length filter is off), vLLM eager (compile and CUDA graphs cost minutes
# a tiny model never recovers). verl's 8 + 8 agent-loop and reward workers: 2 + 2 made steps 12.1 s instead of
# 8.9 (run 20). The replay buffer polls every 0.1 s instead of 2 (app/replay.py): steps 7.8 s, not 8.9 (run 21).
GRPO_BATCH = 64
GRPO_ARGS = [
    "actor_rollout_ref.model.override_config.attn_implementation=eager",
    f"data.train_batch_size={GRPO_BATCH}", "data.max_prompt_length=64", "data.max_response_length=16",
    "data.val_max_samples=64",
    "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.ppo_mini_batch_size=32",
    "actor_rollout_ref.actor.optim.lr=1e-4", "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
    "actor_rollout_ref.rollout.enforce_eager=True",
    "trainer.test_freq=-1", "trainer.logger=[console,file]",
    "trainer.v1.sampler.custom_sampler.path=pkg://app.replay",
    "trainer.v1.sampler.custom_sampler.name=QuickPollReplayBuffer",
    "+trainer.v1.sampler.sampler_kwargs.poll_interval=0.1",
    f"+trainer.v1.sampler.sampler_kwargs.train_batch_size={GRPO_BATCH}",
    "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",  # as SFT_ARGS: eval at once
]

# 12 steps: the model of step 10 scored 86.5% where that of step 16 scored 86.9% on the same 1,000 items (A0 72.3%,
# docs/gpu-runs.md run 54); 6-7 s a step. A checkpoint every 10 steps (and at the last), so that a cut-short GRPO
# stage resumes instead of restarting.
GRPO_SAVE_EVERY = 10
# Stages a rerun with the same settings continues from their last checkpoint (GRPO: ~4 minutes of start-up, then
# 7-8 s a step on 1xH200, docs/gpu-runs.md run 11); the others take minutes.
RESUMABLE = ("grpo",)

# Stages that run beside the next stage not listed here: nothing needs their output before that one ends. prep
# (2 s) beside tiny-model (18 s of imports on a fresh node, docs/gpu-runs.md run 21). A0's eval: its ~20 s on the
# GPU are over long before GRPO's vLLM profiles and takes its memory, about 2 minutes into that stage (run 18).
# The SFT merge: 12-20 s, mostly imports (runs 21, 51). Not where the GPU's compute mode is exclusive (gpu_shared).
BESIDE = ("prep", "merge-sft", "eval-sft", "report")

# A1's eval and the GRPO merge start with GRPO, held by app.gate once they have imported torch and transformers (11
# of the eval's 14 s on a fresh node, docs/gpu-runs.md run 54), and go when GRPO's last checkpoint is saved, while
# Ray shuts down (8 s). Run 55: the eval was done 2 s after the checkpoint, the merge beside it 12 s after the stage.
# Not where the GPU's compute mode is exclusive (gpu_shared).
HELD = {name: ("grpo", "DEMO_GRPO_STEPS") for name in ("merge-grpo", "eval-grpo")}  # -> the stage they wait for
PRELOAD = "torch,transformers.models.auto.modeling_auto,transformers.models.auto.tokenization_auto"

# LIMIT empty (= unset): the whole test split whatever LIMIT the caller exports, so that A0 and A1 score the
# same items (a LIMIT left in a shell once cut A1 to 585 rows against A0's 1,000: docs/gpu-runs.md run 11)
EVAL_ENV = {"EVAL_BACKEND": "hf", "MAX_NEW_TOKENS": "16", "EVAL_BATCH": "500", "LIMIT": ""}
MIN_TEST_ITEMS = 500
Z = 3.0  # standard errors: one-sided p of about 0.0013 under "GRPO changed nothing"


def plan(settings: Settings) -> tuple[Path, list[Stage]]:
    root = Path(settings["DEMO_DIR"]).expanduser().resolve()
    # at least 4 each (the registry's minimum), so that the loss and the reward curve can be judged
    sft_steps, grpo_steps = settings["DEMO_SFT_STEPS"], settings["DEMO_GRPO_STEPS"]
    data, model = root / "data", root / "model"
    app = [sys.executable, "-m", "app"]
    one_gpu = {"NNODES": "1", "NODE_RANK": "0", "GPUS_PER_NODE": "1", "FRESH": "1"}
    sft_args = SFT_ARGS + [f"trainer.total_training_steps={sft_steps}", f"trainer.save_freq={sft_steps}"]
    grpo_args = GRPO_ARGS + [f"trainer.total_training_steps={grpo_steps}",
                             f"trainer.save_freq={min(GRPO_SAVE_EVERY, grpo_steps)}"]
    test = str(data / "arith" / "test.parquet")
    # where verl saves the whole model at the last step (hf_model): what GRPO and the evals start from
    sft_model = str(root / "sft" / f"global_step_{sft_steps}" / "huggingface")
    grpo_model = str(root / "grpo" / f"global_step_{grpo_steps}" / "actor" / "huggingface")
    return root, [
        Stage("prep", app + ["prep", "arith"], {"DATA_DIR": str(data)}, "the arith task -> verl parquet"),
        Stage("tiny-model", app + ["tiny-model", str(model), "--force"], {}, "random tiny Qwen2 + tokenizer"),
        Stage("sft", app + ["sft"], {**one_gpu, "MODEL_PATH": str(model), "CKPT_DIR": str(root / "sft"),
                                     "TRAIN_FILE": str(data / "arith_sft" / "train.parquet"),
                                     "VAL_FILE": str(data / "arith_sft" / "test.parquet"),
                                     "ARGS": " ".join(sft_args)}, f"{sft_steps} SFT steps"),
        Stage("merge-sft", app + ["merge"], {"CKPT_DIR": str(root / "sft"), "STEP": str(sft_steps),
                                            "OUT_DIR": str(root / "sft-model"), "FORCE": "1"}, "SFT -> HF model"),
        Stage("eval-sft", app + ["eval", "--data", test], {**EVAL_ENV, "MODEL": sft_model,
                                                           "OUT": str(root / "eval-sft")}, "accuracy A0"),
        Stage("grpo", app + ["grpo-head"], {**one_gpu, "MODEL_PATH": sft_model,
                                            "CKPT_DIR": str(root / "grpo"), "WAIT_TIMEOUT": "120",
                                            "TRAIN_FILE": str(data / "arith" / "train.parquet"), "VAL_FILE": test,
                                            "ARGS": " ".join(grpo_args)}, f"{grpo_steps} GRPO steps"),
        Stage("merge-grpo", app + ["merge"], {"CKPT_DIR": str(root / "grpo"), "STEP": str(grpo_steps),
                                             "OUT_DIR": str(root / "grpo-model"), "FORCE": "1"}, "GRPO -> HF model"),
        Stage("report", app + ["report", str(root / "grpo")], {}, "plots of the GRPO run"),
        Stage("eval-grpo", app + ["eval", "--data", test], {**EVAL_ENV, "MODEL": grpo_model,
                                                            "OUT": str(root / "eval-grpo")}, "accuracy A1"),
    ]


# --- verdicts (pure functions over real files, tested on CPU) -------------------------------------------

def read_rewards(run: Path) -> list[tuple[int, float]]:
    """(step, mean reward) of a GRPO run from verl's JSONL metrics (`critic/score/mean`)."""
    steps, values = read_run(run).series("critic/score/mean")
    if not steps:
        raise UserError(f"no critic/score/mean in {run / 'logs'}: the GRPO run logged no reward; "
                        "check that trainer.logger includes 'file'")
    return list(zip(steps, values))


def reward_rose(rewards: list[tuple[int, float]]) -> tuple[float, float]:
    """Mean reward of the first and the last quarter of the steps; raises unless the last is higher."""
    if len(rewards) < 4:
        raise UserError(f"only {len(rewards)} GRPO steps logged a reward: the demo needs at least 4")
    first, last = quarter_means([v for _, v in rewards])
    if not last > first:
        raise UserError(f"the GRPO reward did not rise (first steps {first:.3f}, last steps {last:.3f}): "
                        "look at its output above (lr, rollout.n) or rerun with more DEMO_GRPO_STEPS")
    return first, last


def accuracy_margin(a0: float, a1: float, n: int) -> float:
    """How far A1 must exceed A0 to count as more than noise: Z standard errors of the difference of two
    accuracies measured on n items each (binomial; conservative for the paired items here)."""
    return Z * math.sqrt(max(a0 * (1 - a0) + a1 * (1 - a1), 1.0 / n) / n)


def scored_items(sft: dict, grpo: dict) -> int:
    """How many test items A0 and A1 share; raises unless both evals scored the same rows of the same file."""
    if (sft["data"], sft["rows"], sft.get("limit")) != (grpo["data"], grpo["rows"], grpo.get("limit")):
        raise UserError(f"A0 and A1 were scored on different rows ({sft['rows']} of {sft['data']} vs "
                        f"{grpo['rows']} of {grpo['data']}): rerun `make demo` (it evaluates the whole test split)")
    return sft["rows"]


def accuracy_improved(a0: float, a1: float, n: int) -> float:
    """The margin used; raises unless A1 - A0 exceeds it on at least MIN_TEST_ITEMS items."""
    if n < MIN_TEST_ITEMS:
        raise UserError(f"only {n} test items were scored: the demo needs at least {MIN_TEST_ITEMS} to tell an "
                        "improvement from noise")
    margin = accuracy_margin(a0, a1, n)
    if not a1 - a0 > margin:
        raise UserError(f"GRPO did not beat SFT by more than noise: A0 {a0:.1%} -> A1 {a1:.1%} on {n} items, "
                        f"needed +{margin:.1%} ({Z:g} standard errors); look at the reward curve in the report")
    return margin


def read_summary(out: Path) -> dict:
    try:
        return json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        raise UserError(f"{out}/summary.json is missing or unreadable: the eval stage wrote no result") from None


# --- stages: done markers, resuming, the eval beside GRPO ---------------------------------------------

def _record(stage: Stage) -> dict:
    return {"argv": stage.argv[1:], "env": stage.env}


def _finished(marker: Path, record: dict) -> bool:
    """Whether a stage already ran to the end with these exact settings (a rerun resumes after it: the demo
    can be split over several sessions of a borrowed GPU)."""
    try:
        earlier = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return {k: earlier.get(k) for k in record} == record


def _mark_done(done: Path, stage: Stage, seconds: float, resumed: bool) -> None:
    with atomic_path(done / f"{stage.name}.json") as tmp:
        tmp.write_text(json.dumps({**_record(stage), "seconds": seconds, "resumed": resumed}) + "\n")


def _run(stage: Stage, done: Path, settings: Settings) -> None:
    """Run a stage and mark it done; a RESUMABLE one that an earlier demo started with the same settings goes
    on from its last checkpoint."""
    started = done / f"{stage.name}.started.json"
    t = time.monotonic()
    resumed = stage.name in RESUMABLE and _finished(started, _record(stage))
    if not resumed:
        if stage.name in RESUMABLE:
            with atomic_path(started) as tmp:
                tmp.write_text(json.dumps(_record(stage)) + "\n")
        run_stage(stage, settings, "demo")
    elif runs.latest_step(Path(stage.env["CKPT_DIR"])) == (last := settings["DEMO_GRPO_STEPS"]):
        # cut short after its last checkpoint (while Ray stopped): a rerun of verl would spend its ~4 minutes
        # of start-up to find nothing left to train (docs/gpu-runs.md run 14)
        say(f"=== {stage.name}: the run an earlier demo started saved its last step ({last}) "
            "before it was cut short; not started again")
    else:  # the same GRPO run was cut short: verl resumes from its last checkpoint (GRPO_SAVE_EVERY)
        say(f"=== {stage.name}: resuming the run an earlier demo started with the same settings")
        run_stage(dataclasses.replace(stage, env={**stage.env, "FRESH": "0"}), settings, "demo")
    seconds = round(time.monotonic() - t, 1)
    _mark_done(done, stage, seconds, resumed)
    say(f"=== {stage.name} took {seconds:.0f}s")


def gpu_shared() -> tuple[bool, str]:
    """Whether two processes can use this node's GPUs at once, and why not: a GPU in exclusive compute mode
    (some clusters set it) refuses a second CUDA context. Where nvidia-smi cannot tell, the answer is no."""
    modes = [row["compute_mode"] for row in node.gpus(None).rows if row["compute_mode"] != "?"]
    if not modes:
        return False, "nvidia-smi (missing or failing here) did not give the GPU's compute mode"
    other = sorted({m for m in modes if m != "Default"})
    return (False, f"the GPU's compute mode is {', '.join(other)}") if other else (True, "")


def _beside_next(stages: list[Stage], i: int, settings: Settings) -> Stage | None:
    """The stage that stages[i - 1] runs beside: the next one not in BESIDE, where stages[i - 1] is in BESIDE
    and this run goes on to it (DEMO_UNTIL does not stop it before)."""
    for stage in stages[i - 1:]:
        if stage.name not in BESIDE:
            return stage if stage is not stages[i - 1] else None
        if settings["DEMO_UNTIL"] == stage.name:
            return None
    return None


def _gpu_allows(stage: Stage, otherwise: str, gpu: Callable[[], tuple[bool, str]]) -> bool:
    """Whether `stage` may share the GPU with the stage it runs beside; where not, says what it does instead."""
    shared, why = gpu()
    if not shared:
        say(f"=== {stage.name}: {otherwise}: {why}")
    return shared


class Beside:
    """A stage run in the background while the next one runs. Its output goes to a log file: interleaved
    with verl's it would be unreadable."""

    def __init__(self, stage: Stage, settings: Settings, log: Path, gated: list[str] | None = None):
        """gated: the argv that starts it held by app.gate, which waits for its go on stdin (Held)."""
        self.stage, self.log = stage, log
        self.started = self.ended = time.monotonic()
        self.waited = False  # wait() has reported its outcome (passed or raised)
        with open(log, "w") as out:
            self.process = subprocess.Popen(gated or stage.argv, env=child_env(stage, settings), cwd=os.getcwd(),
                                            stdin=subprocess.PIPE if gated else subprocess.DEVNULL, stdout=out,
                                            stderr=subprocess.STDOUT, preexec_fn=ends_with_us)
        # its own time, not the time until the stage beside it is over and wait() is called
        self.watcher = threading.Thread(target=self._watch, daemon=True)
        self.watcher.start()

    def _watch(self) -> None:
        self.process.wait()
        self.ended = time.monotonic()

    def wait(self, done: Path) -> float:
        """Mark it done and return its seconds; raises the stage's one-line failure unless it exited 0."""
        while self.watcher.is_alive():  # short joins: a signal (SIGTERM -> Terminated) still gets through
            self.watcher.join(0.2)
        self.waited = True
        seconds = round(self.ended - self.started, 1)  # set by the watcher, which has ended
        if self.process.returncode != 0:
            raise stage_failed(self.stage, "demo", self.process.returncode, seconds, output=str(self.log))
        _mark_done(done, self.stage, seconds, False)
        return seconds

    def stop(self) -> None:
        """SIGTERM, on which every app command removes its temporaries, then SIGKILL; nothing if it ended."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def last_line(self) -> str:
        """Its last unindented line: indented ones continue a table or a wrapped line above them."""
        lines = [line for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
        heads = [line for line in lines if not line[0].isspace()] or lines
        return heads[-1].strip() if heads else "(no output)"


class Held(Beside):
    """A stage started before the one it follows ends, held by app.gate after its imports, and let go once that
    stage's last checkpoint is saved (verl writes its tracker after the save). Its time counts from the go."""

    def __init__(self, stage: Stage, settings: Settings, log: Path, run: Path, step: int):
        python, _, module, *rest = stage.argv  # [python, -m, app, command, ...]
        super().__init__(stage, settings, log, [python, "-m", "app.gate", "--preload", PRELOAD, module, *rest])
        self.run, self.step, self.went = run, step, False
        self.lock = threading.Lock()
        threading.Thread(target=self._poll, daemon=True).start()

    def saved(self) -> bool:
        return runs.latest_step(self.run) == self.step

    def _poll(self) -> None:
        while not self.went and self.process.poll() is None:
            if self.saved():
                self.go()
            time.sleep(0.2)

    def go(self) -> None:
        with self.lock:
            if self.went:
                return
            self.went = True
            self.started = time.monotonic()
            with contextlib.suppress(OSError):  # it ended already: wait() reports how
                self.process.stdin.write(b"go\n")
                self.process.stdin.close()


# --- the command ------------------------------------------------------------------------------------

def _print_plan(root: Path, stages: list[Stage], settings: Settings) -> None:
    say(f"demo plan (everything under {root}):")
    for i, stage in enumerate(stages, 1):
        shown = " ".join(f"{k}={v!r}" if " " in v else f"{k}={v}" for k, v in stage.env.items())
        after = _beside_next(stages, i, settings)
        beside_note = f" (beside {after.name}, where the GPU allows two processes)" if after else ""
        if stage.name in HELD:
            beside_note = (f" (starts with {HELD[stage.name][0]}, held after its imports until that saves its last "
                           "step, where the GPU allows two processes)")
        say(f"  [{i}/{len(stages)}] {stage.name}: {stage.what}{beside_note}")
        say(f"      {shown + ' ' if shown else ''}python -m app {' '.join(stage.argv[3:])}")
    if settings["DEMO_UNTIL"]:
        say(f"  (DEMO_UNTIL={settings['DEMO_UNTIL']}: stops after that stage; a rerun goes on from there)")
    say(f"  then check: GRPO reward mean rises; A1 > A0 by more than {Z:g} standard errors on the "
        f">= {MIN_TEST_ITEMS} test items")


def _wait_beside(pending: list[Beside], done: Path, after: str) -> None:
    """Wait for every stage that ran beside `after`; one line naming each that failed."""
    failures = []
    for beside in pending:
        try:
            took = beside.wait(done)
            say(f"=== {beside.stage.name} (beside {after}) took {took:.0f}s: {beside.last_line()}")
        except UserError as failed:
            failures.append(str(failed))
    if failures:
        raise UserError("; and ".join(failures))


def _hold(stages: list[Stage], i: int, done: Path, settings: Settings,
          gpu: Callable[[], tuple[bool, str]]) -> dict[str, Held]:
    """The HELD stages that wait for stages[i - 1] and this run goes on to, started now where the GPU allows."""
    names = [s.name for s in stages]
    last = names.index(settings["DEMO_UNTIL"]) if settings["DEMO_UNTIL"] else len(stages)
    held = {}
    for stage in stages[i:last + 1]:
        follows, steps = HELD.get(stage.name, (None, None))
        if follows != stages[i - 1].name or _finished(done / f"{stage.name}.json", _record(stage)):
            continue
        if _gpu_allows(stage, f"runs after {follows}, not with it", gpu):
            run = Path(stages[i - 1].env["CKPT_DIR"])
            held[stage.name] = Held(stage, settings, done.parent / f"{stage.name}.log", run, settings[steps])
            say(f"=== {stage.name}: starts now, held until {follows} saves step {settings[steps]}; its output goes "
                f"to {held[stage.name].log}")
    return held


def _let_go(held: dict[str, Held], stage: Stage) -> None:
    """After `stage` ended well: its last checkpoint is there, so what waits for it goes (at once, if the poll has
    not seen it yet)."""
    for waiting in (held[name] for name in held if HELD[name][0] == stage.name):
        if not waiting.saved():
            raise UserError(f"{stage.name} ended without saving its step {waiting.step} in {waiting.run}: "
                            f"read its output above and rerun `make demo`")
        waiting.go()


def _run_stages(root: Path, stages: list[Stage], settings: Settings, began: float) -> list[str] | None:
    """Run every stage not done yet with the same settings; returns those an earlier demo did, or None where
    DEMO_UNTIL stopped this run."""
    done = root / "stages"
    skipped: list[str] = []
    pending: list[Beside] = []  # started beside the next stage not in BESIDE
    held: dict[str, Held] = {}  # started with the stage whose checkpoint they wait for
    gpu = functools.cache(gpu_shared)  # one nvidia-smi answer for the run
    try:
        for i, stage in enumerate(stages, 1):
            say(f"\n=== demo [{i}/{len(stages)}] {stage.name}: {stage.what}")
            after = _beside_next(stages, i, settings)
            if _finished(done / f"{stage.name}.json", _record(stage)):
                skipped.append(stage.name)
                say(f"=== {stage.name}: done in an earlier run with the same settings, skipped (FRESH=1 reruns all)")
            elif stage.name in held:
                took = held[stage.name].wait(done)
                say(f"=== {stage.name} took {took:.0f}s after {HELD[stage.name][0]}'s last checkpoint: "
                    f"{held.pop(stage.name).last_line()}")
            elif (after is not None and not _finished(done / f"{after.name}.json", _record(after))
                  and _gpu_allows(stage, f"runs before {after.name}, not beside it", gpu)):
                pending.append(Beside(stage, settings, root / f"{stage.name}.log"))
                say(f"=== {stage.name}: runs beside {after.name}; its output goes to {pending[-1].log}")
                continue
            else:
                held.update(_hold(stages, i, done, settings, gpu))
                _run(stage, done, settings)
                _let_go(held, stage)
            if pending and stage.name not in BESIDE:  # the stage they ran beside is over
                running, pending = pending, []
                try:
                    _wait_beside(running, done, stage.name)
                finally:
                    pending = [b for b in running if not b.waited]
            if stage.name == settings["DEMO_UNTIL"]:
                so_far = sum(json.loads((done / f"{s.name}.json").read_text())["seconds"] for s in stages[:i])
                say(f"=== demo stopped after {stage.name} (DEMO_UNTIL={stage.name}): `make demo` without DEMO_UNTIL "
                    f"goes on from here ({time.monotonic() - began:.0f}s in this run, {so_far:.0f}s of stages so far)")
                return None
    except UserError as failed:
        if left := [b for b in pending if not b.waited]:
            # the stage they ran beside failed: keep their own results if they end well, so that a rerun skips them
            say(f"=== waiting for {', '.join(f'{b.stage.name} (its output in {b.log})' for b in left)} before stopping")
            try:
                _wait_beside(left, done, stage.name)
            except UserError as also:
                raise UserError(f"{failed}; and {also}") from None
        raise
    finally:  # any other way out (Ctrl-C, SIGTERM as app.common.Terminated, a crash): no orphan left running
        for beside in pending + list(held.values()):  # a held one whose stage failed never goes: stopped unrun
            beside.stop()
    return skipped


def _verdict(root: Path, stages: list[Stage], skipped: list[str], wall: float) -> None:
    """Judge the files the stages left (over earlier demo runs too), write demo.json and say the verdict."""
    marks = {s.name: json.loads((root / "stages" / f"{s.name}.json").read_text()) for s in stages}
    seconds = {name: mark["seconds"] for name, mark in marks.items()}
    resumed = [name for name, mark in marks.items() if mark.get("resumed")]  # cut-short attempts not in seconds
    losses = read_losses(root / "sft")
    rewards = read_rewards(root / "grpo")
    first, last = reward_rose(rewards)
    sft, grpo = read_summary(root / "eval-sft"), read_summary(root / "eval-grpo")
    a0, a1, n = sft["accuracy"], grpo["accuracy"], scored_items(sft, grpo)
    margin = accuracy_improved(a0, a1, n)
    startup = root / "grpo" / "logs" / "timeline-head.jsonl"
    figures = {
        "passed": True, "a0": a0, "a1": a1, "test_items": n, "margin": margin, "z": Z,
        "sft_loss_first": losses[0][1], "sft_loss_last": losses[-1][1],
        "reward_first_quarter": first, "reward_last_quarter": last, "reward_per_step": rewards,
        "seconds": seconds, "total_seconds": round(sum(seconds.values()), 1),  # over earlier demo runs too
        "wall_seconds": wall, "skipped": skipped, "resumed": resumed,  # this run's, and what it went on from
        "report": str(root / "grpo" / "report"),
        "grpo_startup": dict(timeline.read(startup)), "grpo_first_step_timers": timeline.first_step_timers(startup),
    }
    with atomic_path(root / "demo.json") as tmp:
        tmp.write_text(json.dumps(figures, indent=2) + "\n")
    say(f"GRPO reward mean rose: {first:.3f} (first quarter of steps) -> {last:.3f} (last quarter)")
    if startup.is_file():  # where GRPO's first minutes went (app.timeline; the stage's own output printed it too)
        say(timeline.summary(startup).replace("start-up on this node", "GRPO's start-up"))
    earlier = [text for names, text in ((skipped, f"{', '.join(skipped)} done by an earlier run"),
               (resumed, f"the cut-short earlier attempts of {', '.join(resumed)} not counted")) if names]
    earlier_note = f" (this run only: {'; '.join(earlier)})" if earlier else ""
    say(f"demo passed in {wall:.0f}s{earlier_note}: accuracy after SFT A0 = {a0:.1%}, after GRPO "
        f"A1 = {a1:.1%} on {n} unseen test items (+{a1 - a0:.1%}, above the noise margin {margin:.1%} = "
        f"{Z:g} standard errors); plots in {root / 'grpo' / 'report'}, figures in {root / 'demo.json'}")


def main(command: str, argv: list[str], settings: Settings) -> int:
    began = time.monotonic()  # this run's wall time (the interpreter's and make's start-up not in it)
    if argv and argv[0] in ("-h", "--help"):
        say(__doc__)
        return 0
    if argv:
        raise UserError(f"demo takes no arguments (got {' '.join(argv)}): use DEMO_DIR, DEMO_SFT_STEPS, "
                        "DEMO_GRPO_STEPS, DEMO_UNTIL")
    root, stages = plan(settings)
    if settings["DRY_RUN"]:
        _print_plan(root, stages, settings)
        return 0
    if gpu_count(settings) == 0:
        raise UserError("demo needs a GPU: no CUDA device is visible here; run `make demo` on a GPU node "
                        "(DRY_RUN=1 prints the plan anywhere)")
    root.mkdir(parents=True, exist_ok=True)
    if settings["FRESH"]:
        for marker in (root / "stages").glob("*.json"):
            marker.unlink()
    skipped = _run_stages(root, stages, settings, began)
    if skipped is not None:  # not stopped at DEMO_UNTIL
        _verdict(root, stages, skipped, round(time.monotonic() - began, 1))
    return 0
