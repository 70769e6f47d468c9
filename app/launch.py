"""Launch on this node: `sft` (torchrun), `grpo-head` (Ray head + wait + verl driver), `grpo-worker`.

Every launch runs preflight first (app.preflight), holds its node's lock of the run directory (app.runs), and
then prints the plan (DRY_RUN=1) or runs it. The commands are verl's, torchrun's and Ray's own CLIs, started with
this interpreter (sys.executable), so the same code works in the image, in .venv, and with `PYTHON=python3
PYTHONPATH=...` on a bare GPU box. Before the first step the nodes compare what they run: at torchrun's rendezvous
(app.rendezvous) for SFT; as each Ray node joins the head, for GRPO.

Test hooks (documented, used by the CPU tests only): SFT_TRAINER_MODULE and GRPO_TRAINER_MODULE replace verl's
entry modules with tiny stand-ins; RAY_START_ARGS adds flags to `ray start` (tests declare `--num-gpus 1`).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from app import node, spec as specs, warmup
from app.common import (PASS_NAMES, PASS_PREFIXES, UserError, atomic_path, ends_with_us, mute, repo_first, say,
                        stop_group, warn)
from app.preflight import (Preflight, count_lengths, preflight, refuse_unusable_run_dir, refuse_without_gpus, report,
                           verl_checks)
from app.rendezvous import SAID, mismatch
from app.runs import RunLock, latest_step, live_locks, logs_dir, swanlog_dir, token_file
from app.settings import Settings
from app.timeline import Timeline, started_at

SECRET_MARKERS = ("TOKEN", "KEY", "SECRET", "PASSWORD")  # in a name (not a *_PATH): the plan shows *** for its value


# --- pieces shared by the targets --------------------------------------------------------------------
def print_plan(settings: Settings, title: str, extra_env: dict[str, str], steps: list[tuple[str, list[str]]]) -> None:
    """DRY_RUN output: the environment (what we set plus the pass-through variables here) and the exact commands."""
    say(f"plan for {title} (DRY_RUN=1: nothing is started)")
    say("environment:")
    shown = {k: v for k, v in settings.environ().items() if v and (k.startswith(PASS_PREFIXES) or k in PASS_NAMES)}
    for name, value in sorted({**shown, **extra_env}.items()):
        secret = any(marker in name for marker in SECRET_MARKERS) and not name.endswith("_PATH")
        say(f"  export {name}={shlex.quote('***' if secret else value)}")
    for what, command in steps:
        say(f"{what}:")
        say(f"  {shlex.join(command)}")


@contextlib.contextmanager
def run_dir_held(plan: Preflight, node_name: str, command: str, dry: bool):
    """This node's lock of the run directory while the launch runs; FRESH=1 moves the old run aside first (never
    deletes it), refused while any node of it is live; otherwise say whether verl will resume. Yields this launch's
    timeline of the run (None on a dry run), its preflight stamped."""
    spec = plan.spec
    run, settings = spec.run_dir, spec.settings
    lock = None
    fresh = settings["FRESH"] and run.exists() and any(p.name != ".locks" for p in run.iterdir())
    live = list(live_locks(run).values()) if fresh else []
    if live:
        raise UserError(f"FRESH=1 would move a live run aside: {run} is in use by {live[0]}: stop it first, or set "
                        "CKPT_DIR to a new run directory")
    if not dry:  # a dry run starts nothing: it neither needs write access nor holds the run
        refuse_unusable_run_dir(run)
        lock = RunLock(run, node_name, command)
        lock.acquire()
    try:
        report(plan)  # preflight's notes and warnings, once nothing refuses the launch any more
        if fresh:
            aside = run.with_name(f"{run.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
            if dry:
                say(f"FRESH=1: would move {run} aside to {aside}")
            else:
                lock.release()
                os.replace(run, aside)
                lock = RunLock(run, node_name, command)
                lock.acquire()
                say(f"FRESH=1: moved the previous run aside to {aside}; starting over in {run}")
        elif (step := latest_step(run)) is not None:
            mode = spec.get("trainer.resume_mode", "auto")
            say(f"resuming from global_step_{step} in {run} (FRESH=1 starts over, keeping this run aside)"
                if mode == "auto" else f"{run} holds global_step_{step}, but trainer.resume_mode={mode}")
        else:
            say(f"starting a new run in {run}")
        timeline = None
        if not dry:
            timeline = Timeline(logs_dir(run) / f"timeline-{node_name}.jsonl", plan.started)
            timeline.stamp("preflight done")
        yield timeline
    finally:
        if lock is not None:
            lock.release()


def start_process(settings: Settings, command: list[str], extra_env: dict[str, str], *, piped: bool,
                  log: Path | None = None, held: bool = False) -> subprocess.Popen:
    """A process with our environment, in a process group of its own; its output piped (for the timeline) or going
    to `log`. held: its stdin is a pipe, for app.gate's go (run_process writes it)."""
    pipe = open(log, "a") if log else subprocess.PIPE if piped else None
    process = subprocess.Popen(command, env=settings.environ({**extra_env, "PYTHONUNBUFFERED": "1"}),
                               stdin=subprocess.PIPE if held else None, stdout=pipe,
                               stderr=subprocess.STDOUT if log else pipe, text=True, errors="replace",
                               start_new_session=True, preexec_fn=ends_with_us)
    if log:
        pipe.close()
    return process


def run_process(settings: Settings, what: str, command: list[str], extra_env: dict[str, str],
                timeline: Timeline | None = None, log: Path | None = None,
                held: subprocess.Popen | None = None) -> int:
    """Run a long foreground process (or let `held`, started by start_process, go): its output is the progress,
    copied through line by line for the timeline to read, or goes to `log`. Interrupted (Ctrl-C, SIGTERM), it and
    its children get SIGTERM and time to stop."""
    say(f"$ {shlex.join(command)}" + (f" (its output: {log})" if log else ""))
    process = held or start_process(settings, command, extra_env, piped=timeline is not None, log=log)
    if held and held.stdin:  # its go, with the arguments `command` has beyond those it was started with (app.gate)
        with contextlib.suppress(BrokenPipeError):  # it ended already: its exit code says how
            held.stdin.write(json.dumps(command[len(held.args):]) + "\n")
            held.stdin.close()
    copies = [threading.Thread(target=_copy, args=(source, sink, timeline), daemon=True)
              for source, sink in ((process.stdout, sys.stdout), (process.stderr, sys.stderr)) if source and timeline]
    for copy in copies:
        copy.start()
    try:
        code = process.wait()
        for copy in copies:
            copy.join(timeout=10)
        return code
    finally:
        stop_group(process, what)


def _copy(source, sink, timeline: Timeline) -> None:
    for line in source:
        try:
            sink.write(line)
            sink.flush()
        except BrokenPipeError:  # what reads our output is gone (`| head`): the run stops as on SIGTERM, instead of
            mute(sink)  # ending this copy and leaving the driver blocked on its full pipe for ever (gpu-runs.md run 58)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        timeline.watch(line)


def tracking(run: Path, settings: Settings, dry: bool) -> dict[str, str]:
    """app.tracking's environment for `run`; on a dry run, without leaving the directories it creates."""
    from app.tracking import tracking_env

    fresh = [d for d in (logs_dir(run), swanlog_dir(run), run) if not d.exists()] if dry else []
    try:
        return tracking_env(run, settings["SWANLAB_MODE"])
    finally:
        for directory in fresh:  # children first; only the empty ones this call created
            if directory.is_dir() and not any(directory.iterdir()):
                directory.rmdir()


def last_line(log: Path) -> str:
    """The last line a process wrote to `log`, and where the rest is: for a one-line error about it."""
    try:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        lines = []
    return f"{lines[-1].strip()[:200] if lines else 'no output'}; all of it in {log}"


def hydra_args(job: str, overrides: list[str]) -> list[str]:
    """The arguments that make verl's entry point compose exactly the config preflight checked."""
    return ["--config-dir", str(specs.CONFIG_DIR), "--config-name", job, *overrides]


def write_fingerprint(plan: Preflight, node_name: str) -> Path:
    """This node's fingerprint of the run, for the other nodes to compare: <run>/logs/run-<node>.json."""
    path = logs_dir(plan.spec.run_dir) / f"run-{node_name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(plan.spec.fingerprint(), indent=1, sort_keys=True))
    return path


# --- SFT ---------------------------------------------------------------------------------------------
def sft_command(plan: Preflight) -> list[str]:
    """torchrun (its own CLI, through app.rendezvous) for this node: standalone on one node, a static rendezvous
    at MASTER_ADDR:MASTER_PORT across nodes; the same line everywhere but --node-rank."""
    spec, settings = plan.spec, plan.spec.settings
    # --log-dir: torchrun's per-attempt files stay with the run, not in a fresh /tmp/torchelastic_* per launch
    command = [sys.executable, "-m", "app.rendezvous", "torchrun", "--nnodes", str(spec.nnodes), "--nproc-per-node",
               str(spec.gpus_per_node), "--log-dir", str(logs_dir(spec.run_dir) / "torchrun")]
    if spec.multi_node:
        command += ["--node-rank", str(spec.node_rank), "--master-addr", str(settings["MASTER_ADDR"]),
                    "--master-port", str(settings["MASTER_PORT"])]
    else:
        command += ["--standalone"]
    # the rank entry compares the nodes, then runs verl's trainer (a test hook swaps in a tiny CPU stand-in)
    return command + ["-m", "app.rendezvous", "rank", settings["SFT_TRAINER_MODULE"], *hydra_args("sft", spec.overrides)]


def launch_sft(settings: Settings) -> int:
    dry = settings["DRY_RUN"]
    # the count of the conversations' lengths runs in series on a dry run, and while torchrun starts on a real one:
    # its ranks import verl's trainer meanwhile and are held until it passes (app.rendezvous); a refusal stops them
    plan = preflight("sft", settings, gpus=not dry, count=dry)
    spec = plan.spec
    if spec.multi_node and spec.node_rank == 0 and not dry:
        holder = node.port_holder(settings["MASTER_PORT"])
        if holder:
            raise UserError(f"MASTER_PORT {settings['MASTER_PORT']} is already in use on this node by {holder}: set "
                            "MASTER_PORT to a free port, the same on every node")
    command = sft_command(plan)
    name = f"node{spec.node_rank}"
    with run_dir_held(plan, name, "make sft", dry) as timeline:  # FRESH first: tracking belongs to the new run
        extra = {**tracking(spec.run_dir, settings, dry), **compile_env(settings, vllm=False)}
        if dry:
            print_plan(settings, f"sft on node {spec.node_rank} of {spec.nnodes}", extra, [("train", command)])
            return 0
        # the rank entry stamps the nodes' meeting there
        go = logs_dir(spec.run_dir) / f"go-{name}"
        go.unlink(missing_ok=True)  # an earlier attempt's
        extra.update(STACK_TIMELINE=str(timeline.path), STACK_STARTED=str(timeline.started), STACK_GO=str(go))
        if spec.multi_node:
            extra["STACK_RUN"] = str(write_fingerprint(plan, name))
            say(f"node {spec.node_rank} of {spec.nnodes}: waiting at {settings['MASTER_ADDR']}:{settings['MASTER_PORT']} "
                f"for the others (run the same command with their NODE_RANK); this node's shards go to {spec.run_dir}")
        trainer = start_process(settings, command, extra, piped=True)
        timeline.stamp("torchrun started")
        try:
            counted = Preflight(spec)
            count_lengths(spec, counted.notes, counted.warnings)
            report(counted)
            timeline.stamp("lengths counted")
            go.touch()
            rc = run_process(settings, "sft", command, extra, timeline, held=trainer)
        finally:
            stop_group(trainer, "the SFT trainer")
            go.unlink(missing_ok=True)
    if rc == SAID:
        raise UserError("")  # empty: the rank printed the one line already
    if rc != 0:
        raise UserError(f"the SFT trainer exited with code {rc} (its output is above): fix the cause and rerun "
                        "the same command; it resumes from the latest checkpoint")
    say(f"SFT finished: checkpoints in {spec.run_dir} (next: make merge)")
    return 0


# --- Ray: token, head, wait, worker --------------------------------------------------------------------
def token_path(run: Path, settings: Settings) -> Path:
    """Where the head writes the cluster token (mode 600) for workers that share the run volume."""
    explicit = settings["RAY_AUTH_TOKEN_PATH"]
    return Path(explicit).expanduser().resolve() if explicit else token_file(run)


def ray_auth_env(run: Path, settings: Settings, *, create: bool) -> dict[str, str]:
    """Ray's token authentication (RAY_AUTH_MODE=token + RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH): a RAY_AUTH_TOKEN
    from `.env` wins; else the head generates one into token_path() and workers read that file."""
    if settings["RAY_AUTH_TOKEN"]:
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": settings["RAY_AUTH_TOKEN"]}
    path = token_path(run, settings)
    if create and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_hex(32))  # what `ray get-auth-token --generate` writes
        os.replace(tmp, path)
        say(f"generated the Ray cluster token in {path} (mode 600); workers read it there or from "
            "RAY_AUTH_TOKEN in .env")
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(path)}


def ray_ports(settings: Settings, head: bool) -> list[str]:
    """`ray start` flags that keep every port of this node's Ray in RAY_PORTS (the head's GCS is RAY_PORT)."""
    if settings["RAY_PORTS"] is None:
        return []
    low, high = settings["RAY_PORTS"]
    fixed = ["--node-manager-port", "--object-manager-port", "--runtime-env-agent-port", "--dashboard-agent-grpc-port",
             "--dashboard-agent-listen-port", "--metrics-export-port", *(["--dashboard-port", "--ray-client-server-port"]
                                                                          if head else [])]
    return [arg for i, flag in enumerate(fixed) for arg in (flag, str(low + i))] + \
        ["--min-worker-port", str(low + 10), "--max-worker-port", str(high)]


def ray_start(spec: specs.Spec, head: bool) -> list[str]:
    """`ray start --block`: blocking, so stopping it stops exactly the Ray processes it started; through app.raystart,
    which leaves the node's record of its current cluster as found. The head's dashboard and job API listen on
    loopback unless DASHBOARD_HOST asks for an address."""
    settings = spec.settings
    command = [sys.executable, "-m", "app.raystart", "start"]
    if head:
        command += ["--head", "--block", "--node-ip-address", settings["HEAD_IP"] or "127.0.0.1", "--port",
                    str(settings["RAY_PORT"]), "--dashboard-host", settings["DASHBOARD_HOST"], "--disable-usage-stats"]
    else:
        command += ["--address", spec.ray_address, "--block", "--disable-usage-stats"]
        if settings["NODE_IP"]:
            command += ["--node-ip-address", settings["NODE_IP"]]
    return command + ray_ports(settings, head) + list(settings.get("RAY_START_ARGS", ()))


def head_ip_problem(head_ip: str | None) -> str | None:
    """Why HEAD_IP cannot be this node's Ray head address, or None: `ray start --head --node-ip-address` with a
    foreign address starts a head that no worker reaches (or fails with a Ray traceback)."""
    if not head_ip or node.is_local_address(head_ip):
        return None
    mine = sorted({a for addresses in node.interface_addresses().values() for a in addresses if ":" not in a})
    return (f"HEAD_IP={head_ip} is not an address of this machine (its addresses: {', '.join(mine) or 'none'}): "
            "run make grpo-head on the head node itself, with HEAD_IP set to one of its addresses (and the same "
            "HEAD_IP on every worker)")


def describe_nodes(nodes: list[dict]) -> str:
    return ", ".join(f"{n['NodeManagerAddress']} ({int(n['Resources'].get('GPU', 0))} GPU)" for n in nodes) or "none"


def wait_for_nodes(address: str, nnodes: int, gpus_per_node: int, timeout: float, run: Path,
                   head: subprocess.Popen | None = None, on_up=lambda: None, also=lambda: None) -> list[dict]:
    """Block until `nnodes` alive Ray nodes with >= `gpus_per_node` GPUs each are in the cluster, each running the
    same run as this head (its fingerprint file `run`, compared with the one every node's `ray start` was given).
    `also` is called while waiting, to refuse at once for a reason of the caller's (a failed check).

    Ray's own view (ray.nodes()) through a short-lived driver in a fresh interpreter: Ray reads its token
    settings once per process, and this one may have imported Ray (through verl) before they were set."""
    import multiprocessing

    deadline = time.monotonic() + timeout
    host, port = address.rsplit(":", 1)
    while not node.port_open(host, int(port)):
        also()
        if head is not None and head.poll() is not None:
            raise UserError(f"`ray start --head` exited with code {head.returncode} ({last_line(run.parent / 'ray-head.log')}"
                            f"): is {address} already in use or not this machine's address? set HEAD_IP / RAY_PORT")
        if time.monotonic() > deadline:
            raise UserError(f"the Ray head at {address} did not come up within {timeout:.0f}s: see its output above")
        time.sleep(0.5)
    on_up()
    context = multiprocessing.get_context("spawn")
    # a pipe, not a multiprocessing Queue: a Queue's semaphores, left behind by Ctrl-C or SIGTERM, make the
    # resource tracker print a "leaked semaphore" warning after our one error line
    receiver, answers = context.Pipe(duplex=False)
    child = context.Process(target=_wait_child, daemon=True, args=(
        address, nnodes, gpus_per_node, timeout, deadline - time.monotonic(), str(run), answers))
    child.start()
    answers.close()
    answered = False
    try:
        while not receiver.poll(1.0):
            also()
            if head is not None and head.poll() is not None:
                raise UserError(f"the Ray head stopped (exit code {head.returncode}) while waiting for nodes: "
                                "see its output above")
            if not child.is_alive():
                break  # it ended without an answer: recv() below finds the pipe closed
        try:
            kind, payload = receiver.recv()
        except EOFError:
            raise UserError(f"could not ask the Ray cluster at {address} for its nodes (exit code "
                            f"{child.exitcode}): see the output above") from None
        answered = True
    finally:
        if not answered and child.is_alive():
            child.terminate()  # interrupted: the waiting driver goes too, at once
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
        receiver.close()
    if kind == "error":
        raise UserError(payload)
    return payload


def _wait_child(address: str, nnodes: int, gpus_per_node: int, timeout: float, left: float, run: str,
                answers) -> None:
    """wait_for_nodes' driver (runs in a spawned interpreter): reports ("ok", nodes) or ("error", line). Each node
    that joins is asked, by a task placed on it, for the fingerprint its `ray start` was given (STACK_RUN); a node
    that runs another run is told so (its STACK_VERDICT file, which its grpo-worker reads once the head is gone)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    from tqdm import tqdm

    deadline = time.monotonic() + left
    host, port = address.rsplit(":", 1)
    mine = json.loads(Path(run).read_text())
    # Ray's core logs to this process's stderr (a head that refuses our token: a warning a second): into a log,
    # the progress bar to the terminal
    terminal = os.fdopen(os.dup(2), "w")
    with open(Path(run).parent / "ray-wait.log", "a") as log:
        os.dup2(log.fileno(), 2)
    try:
        # a runtime_env of its own: its tasks get a worker of their own that imports nothing (app.rayworker)
        ray.init(address=address, logging_level="ERROR", log_to_driver=False, configure_logging=False,
                 runtime_env={"env_vars": {"STACK_NODE_CHECK": "1"}})
    except Exception as exc:  # noqa: BLE001 - Ray raises several kinds; the user needs one line
        answers.send(("error", f"cannot join the Ray cluster at {address} ({' '.join(str(exc).split())[:200]}): if "
                               "a Ray head that this run did not start answers there, e.g. one left by a run that was "
                               "killed, stop it (`ray stop` on that node) or set RAY_PORT to a free port"))
        return

    @ray.remote(num_cpus=0)
    def node_run(verdict: str | None = None):
        # a task on that node: what its `ray start` was given (STACK_RUN, STACK_VERDICT) is its environment
        given = {name: Path(os.environ[name]) for name in ("STACK_RUN", "STACK_VERDICT") if os.environ.get(name)}
        if verdict is not None and "STACK_VERDICT" in given:
            given["STACK_VERDICT"].write_text(verdict)
        return json.loads(given["STACK_RUN"].read_text()) if given.get("STACK_RUN", Path()).is_file() else None

    def on(n):
        return node_run.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))

    compared: set[str] = set()
    try:
        with tqdm(total=nnodes, desc=f"nodes with {gpus_per_node} GPU(s) joined", unit="node", file=terminal) as bar:
            while True:
                alive = [n for n in ray.nodes() if n.get("Alive")]
                ready = [n for n in alive if n["Resources"].get("GPU", 0) >= gpus_per_node]
                for n in [n for n in ready if n["NodeID"] not in compared]:
                    theirs = ray.get(on(n).remote())
                    compared.add(n["NodeID"])
                    line = mismatch(f"the node at {n['NodeManagerAddress']}", theirs, "the head", mine) \
                        if theirs is not None else None
                    if line:
                        ray.get([on(m).remote(f"error: {line}") for m in alive])
                        answers.send(("error", line))
                        return
                if min(len(ready), nnodes) != bar.n:
                    bar.update(min(len(ready), nnodes) - bar.n)
                    bar.set_postfix_str(", ".join(n["NodeManagerAddress"] for n in ready))
                if len(ready) >= nnodes:
                    answers.send(("ok", [{k: n[k] for k in ("NodeManagerAddress", "Resources")} for n in ready]))
                    return
                if time.monotonic() > deadline:
                    short = [n for n in alive if n not in ready]
                    extra = f"; too few GPUs on: {describe_nodes(short)}" if short else ""
                    answers.send(("error", (
                        f"only {len(ready)} of {nnodes} nodes joined within {timeout:.0f}s "
                        f"({describe_nodes(ready)}){extra}: run `make grpo-worker HEAD_IP={host}` on the others "
                        f"(same token, port {port} reachable), check GPUS_PER_NODE, or raise WAIT_TIMEOUT")))
                    return
                time.sleep(1.0)
    finally:
        ray.shutdown()


class Background:
    """fn() on a thread; its caller joins it before exiting (see launch_grpo_head)."""

    def __init__(self, fn):
        self.value, self.error = None, None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn) -> None:
        try:
            self.value = fn()
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            self.error = exc

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def result(self):
        self.thread.join()
        self.raise_if_failed()
        return self.value


def compile_env(settings: Settings, *, vllm: bool) -> dict[str, str]:
    """The compile caches' settings for this node's processes: torchrun's ranks, or `ray start`, whose environment
    every actor of the node inherits. TORCH_COMPILE_JOB_ID: without a job id torch keeps no record of which sizes
    varied (its profile-guided dynamic shapes), so each run compiles FlexAttention at its first length, then again
    for any length. VLLM_DISABLE_COMPILE_CACHE: verl 0.9.1 sets 1 in the job's runtime_env unless the driver's
    environment sets it (trainer/constants_ppo.py)."""
    env = {"TORCH_COMPILE_JOB_ID": settings["TORCH_COMPILE_JOB_ID"]}
    if vllm:
        env["VLLM_DISABLE_COMPILE_CACHE"] = settings["VLLM_DISABLE_COMPILE_CACHE"]
    return env


# verl 0.9.1's job runtime_env for the configs warm_workers accepts (trainer/constants_ppo.py PPO_RAY_RUNTIME_ENV, the
# flags get_ppo_ray_runtime_env forwards, main_ppo's TRANSFER_QUEUE_ENABLE); tests/test_launch.py holds it to verl's own
VERL_JOB_ENV = {"TOKENIZERS_PARALLELISM": "true", "NCCL_DEBUG": "WARN", "VLLM_LOGGING_LEVEL": "WARN",
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true", "VLLM_DISABLE_COMPILE_CACHE": "1",
                "HCCL_HOST_SOCKET_PORT_RANGE": "auto", "HCCL_NPU_SOCKET_PORT_RANGE": "auto", "HSA_NO_SCRATCH_RECLAIM": "1",
                "VERL_FULL_DETERMINISM": "0", "VLLM_BATCH_INVARIANT": "0", "VERL_RL_INSIGHT_ENABLE": "0"}


# Ray prestarts min(num_cpus, its startup concurrency: one per core) workers; verl 0.9.1 places 27 actors in them on a
# one-node run, and each worker holds ~0.5 GB once it has imported (docs/benchmarks.md): no more on a node of 200 cores
PRESTARTED_WORKERS = 32


def warm_workers(spec: specs.Spec) -> tuple[dict[str, str], str]:
    """RAY_WARM_WORKERS: `ray start`'s extra environment (app.rayworker preloaded; verl's job environment less what
    the shell or the launch itself sets, as verl leaves out what the driver's environment has), or ({}, why not)
    where verl would give its job more than VERL_JOB_ENV: Ray prestarts its workers only for a job without a
    runtime_env, so the driver joins without one."""
    if not spec.settings["RAY_WARM_WORKERS"]:
        return {}, ""
    logger = spec.get("trainer.logger") or []
    other = [why for why, found in (
        ("full_determinism", spec.get("actor_rollout_ref.rollout.full_determinism")
         or spec.get("reward.reward_model.rollout.full_determinism")),
        ("the rl_insight logger", "rl_insight" in ([logger] if isinstance(logger, str) else logger)),
        ("a profiler", spec.get("global_profiler.tool") not in (None, "null")),
        ("megatron", "megatron" in (spec.get("actor_rollout_ref.actor.strategy"), spec.get("critic.strategy"))),
        ("ray_kwargs.ray_init.runtime_env", any(v is not None for v in dict(
            spec.get("ray_kwargs.ray_init.runtime_env") or {}).values()))) if found]
    if other:
        return {}, f"verl gives the job its own environment with {other[0]}"
    shell = spec.settings.environ()
    driver = {**shell, **compile_env(spec.settings, vllm=True)}  # VLLM_DISABLE_COMPILE_CACHE: ours, not verl's 1
    job = {**VERL_JOB_ENV, **({"TRANSFER_QUEUE_ENABLE": "1"} if spec.get("transfer_queue.enable") else {})}
    job["RAY_worker_maximum_startup_concurrency"] = str(min(os.cpu_count() or 1, PRESTARTED_WORKERS))
    # a worker imports app.rayworker before it knows its job's paths: `python -m app` from a checkout that is not
    # installed would otherwise leave each worker a "Failed to preload" traceback
    return {"RAY_preload_python_modules": "app.rayworker", "PYTHONPATH": repo_first(shell.get("PYTHONPATH", "")),
            **{k: v for k, v in job.items() if k not in driver}}, ""


def launch_grpo_head(settings: Settings) -> int:
    from app.tracking import tracking_overrides

    dry = settings["DRY_RUN"]
    problem = head_ip_problem(settings["HEAD_IP"])
    if problem and not dry:  # before preflight's notes: the one line is the refusal
        raise UserError(problem)
    # the prompts' count and verl's own checks (validate_config; their imports are most of preflight) run in series
    # on a dry run, and while the head starts on a real one: a refusal there stops what started (FRESH's move aside
    # stays, the old run whole)
    plan = preflight("grpo", settings, deep=dry, gpus=not dry, count=dry)
    spec = plan.spec
    if problem:  # a plan may be printed anywhere; starting the head may not
        warn(problem)
    timeout = settings["WAIT_TIMEOUT"]
    with run_dir_held(plan, "head", "make grpo-head", dry) as timeline:  # FRESH first: token, tracking: the new run
        track = tracking(spec.run_dir, settings, dry)
        existing = not dry and node.port_open(settings["HEAD_IP"] or "127.0.0.1", settings["RAY_PORT"])
        if existing:  # a head this command does not start (KubeRay's, a user's): its own authentication stands
            holder = node.port_holder(settings["RAY_PORT"])
            if holder and "gcs_server" not in holder:
                raise UserError(f"RAY_PORT {settings['RAY_PORT']} is in use by {holder}, which is not a Ray head: "
                                "stop it, or set RAY_PORT to a free port (the same on every node)")
        auth = ray_auth_env(spec.run_dir, settings, create=not dry) if settings["RAY_AUTH_TOKEN"] or not existing else {}
        head_cmd = ray_start(spec, head=True)
        workers_env, cold = warm_workers(spec) if not existing else ({}, "a Ray head this command did not start")
        if settings["RAY_WARM_WORKERS"] and cold:  # a warning where the user asked for it, a note where it is the default
            (say if settings.source("RAY_WARM_WORKERS") == "default" else warn)(
                f"RAY_WARM_WORKERS: not for this run ({cold}); verl's processes import as they start")
        # this attempt's tracking and compile settings also travel in the job's runtime_env, to actors on every
        # node, even under a Ray head this command did not start
        extra_overrides = tracking_overrides({**track, **compile_env(settings, vllm=True)})
        # verl's driver, held by app.gate: it imports verl, torch and Ray while the head starts and the nodes join,
        # and runs once they have (its imports are most of its start: docs/benchmarks.md), its module's arguments
        # sent with the go: the prompts' count, beside the head's start, may still choose one
        driver_cmd = [sys.executable, "-m", "app.gate", *(["--ray"] if workers_env else []), settings["GRPO_TRAINER_MODULE"]]

        def driver_args() -> list[str]:
            return hydra_args("grpo", [*spec.overrides, *extra_overrides])

        extra = {**track, **auth, **compile_env(settings, vllm=True)}
        if dry:
            print_plan(settings, f"grpo-head at {spec.ray_address} ({spec.nnodes} node(s) x {spec.gpus_per_node} "
                       "GPU(s))", {**workers_env, **extra, "RAY_ADDRESS": spec.ray_address}, [
                           ("start the Ray head (stopped again when GRPO ends)", head_cmd),
                           (f"and GRPO's driver, which imports meanwhile and runs against that cluster once "
                            f"{spec.nnodes} node(s) with {spec.gpus_per_node} GPU(s) each, every one running this run "
                            f"(ray.nodes()), have joined (waiting up to {timeout}s)", driver_cmd + driver_args())])
            return 0
        fingerprint = write_fingerprint(plan, "head")
        extra["STACK_RUN"] = str(fingerprint)
        # a write, not a read: the wait's driver (a spawned interpreter) inherits os.environ, joins with the token
        os.environ.update(auth)
        warm = warmup.start(spec.model_path, spec.run_dir / "logs" / "vllm-warmup.log", settings.environ(extra))
        head = driver = checks = None
        # Ray's failure handler in the driver prints "*** SIGTERM received ... PC: @ ..." when the launch stops it
        driver_env = {**extra, "RAY_ADDRESS": spec.ray_address, "RAY_DISABLE_FAILURE_SIGNAL_HANDLER": "1"}
        try:
            driver = start_process(settings, driver_cmd, driver_env, piped=True, held=True)
            if existing:
                say(f"a Ray head already answers at {spec.ray_address}: using it (it was not started by this command)")
            else:
                say(f"$ {shlex.join(head_cmd)} (its output: {logs_dir(spec.run_dir) / 'ray-head.log'})")
                with open(logs_dir(spec.run_dir) / "ray-head.log", "a") as log:  # Ray's banner and tracebacks
                    head = subprocess.Popen(head_cmd, env=settings.environ({**workers_env, **extra}), stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True, preexec_fn=ends_with_us)

            def checked() -> Preflight:
                found = Preflight(spec)
                count_lengths(spec, found.notes, found.warnings)
                timeline.stamp("prompts counted")
                found.notes += verl_checks(spec)
                timeline.stamp("verl's checks passed")
                return found

            checks = Background(checked)
            nodes = wait_for_nodes(spec.ray_address, spec.nnodes, spec.gpus_per_node, timeout, fingerprint, head,
                                   on_up=lambda: timeline.stamp("Ray head up"), also=checks.raise_if_failed)
            report(checks.result())
            timeline.stamp("all nodes joined")
            say(f"cluster ready: {describe_nodes(nodes)}")
            timeline.stamp("driver started")
            rc = run_process(settings, "grpo", driver_cmd + driver_args(), driver_env, timeline, held=driver)
        finally:
            stop_group(driver, "the GRPO driver")
            warmup.stop(warm)
            if head is not None:
                say("stopping the Ray head (workers leave when it goes away)")
                stop_group(head, "the Ray head")
            if checks is not None:  # a thread still importing verl at exit would print past our last line, or
                checks.thread.join()  # abort the interpreter's shutdown (CPython's lock on stderr)
    if rc != 0:
        raise UserError(f"the GRPO driver exited with code {rc} (its output is above): fix the cause and rerun "
                        "`make grpo-head`; it resumes from the latest checkpoint")
    say(f"GRPO finished: checkpoints in {spec.run_dir} on each node (next: make gather, make merge)")
    return 0


def launch_grpo_worker(settings: Settings) -> int:
    """Join the head (retrying while it is not up yet) and stay in the foreground until it goes away."""
    from tqdm import tqdm

    from app.preflight import check_model, check_node, _refuse_stale_environment

    dry = settings["DRY_RUN"]
    if not settings["HEAD_IP"]:
        raise UserError("HEAD_IP is not set: set it to the Ray head's IP (the same HEAD_IP as on the head)")
    _refuse_stale_environment(settings)  # Ray actors on this node inherit its environment
    spec = specs.read("grpo", settings)
    plan = Preflight(spec, started_at())
    check_node(spec, plan.warnings, plan.notes)
    check_model(spec)
    if not dry:
        refuse_without_gpus(spec, "make grpo-worker")
    command = ray_start(spec, head=False)
    timeout = settings["WAIT_TIMEOUT"]
    name = f"worker-{settings['NODE_IP'] or socket.gethostname()}"
    extra = {**warm_workers(spec)[0], **tracking(spec.run_dir, settings, dry), **compile_env(settings, vllm=True)}
    if dry:
        print_plan(settings, f"grpo-worker joining {spec.ray_address}", {**extra, **ray_auth_env(
            spec.run_dir, settings, create=False)}, [
            (f"wait up to {timeout}s for the head, then join it and stay until it goes away", command)])
        return 0
    reach = node.reachable(settings["HEAD_IP"], settings["RAY_PORT"])
    if reach not in (None, "refused"):
        raise UserError(f"no Ray head answers at {spec.ray_address} ({reach}): start make grpo-head there first, or "
                        "fix HEAD_IP / RAY_PORT (the head's address and port, reachable from this node)")
    if reach == "refused":  # the machine is there, its head not (yet): say so now, not after WAIT_TIMEOUT
        warn(f"nothing answers at {spec.ray_address} yet: waiting up to {timeout}s for make grpo-head there "
             "(if HEAD_IP or RAY_PORT is wrong, stop this and fix it)")
    deadline = time.monotonic() + timeout
    with run_dir_held(plan, name, "make grpo-worker", dry) as timeline, \
            tempfile.TemporaryDirectory(prefix="verl-stack-") as tmp:
        extra.update(STACK_RUN=str(write_fingerprint(plan, name)), STACK_VERDICT=str(Path(tmp) / "verdict"))
        # this node's vLLM servers inspect the model too (the head's warm-up fills only the head's cache)
        warm = warmup.start(spec.model_path, logs_dir(spec.run_dir) / f"vllm-warmup-{settings['NODE_IP'] or 'worker'}.log",
                            settings.environ(extra))
        try:
            with tqdm(desc=f"waiting for the Ray head at {spec.ray_address}", unit="s", total=None) as bar:
                while (auth := _worker_auth(spec, settings)) is None or \
                        not node.port_open(settings["HEAD_IP"], settings["RAY_PORT"]):
                    if time.monotonic() > deadline:
                        missing = f"the token (RAY_AUTH_TOKEN in .env, or {token_path(spec.run_dir, settings)})" \
                            if auth is None else f"{spec.ray_address} answering"
                        raise UserError(f"no head within {timeout}s (still missing: {missing}): start `make grpo-head` "
                                        "there, check HEAD_IP / RAY_PORT and the firewall, or raise WAIT_TIMEOUT")
                    time.sleep(2.0)
                    bar.update(2)
            timeline.stamp("the head answers")
            _run_worker(spec, command, {**extra, **auth}, deadline)
        finally:
            warmup.stop(warm)
        verdict = Path(extra["STACK_VERDICT"])
        if verdict.is_file():  # the head refused this node: its line, here too
            raise UserError(verdict.read_text().strip().removeprefix("error: "))
    say(f"the Ray head at {spec.ray_address} went away: worker stopped")
    return 0


def _run_worker(spec: specs.Spec, command: list[str], environment: dict[str, str], deadline: float) -> None:
    """`ray start --address ... --block` until the head goes away; retried while the head is still starting."""
    settings = spec.settings
    while True:
        started = time.monotonic()
        log = logs_dir(spec.run_dir) / f"ray-worker-{settings['NODE_IP'] or socket.gethostname()}.log"
        rc = run_process(settings, "grpo-worker", command, environment, log=log)
        if not node.port_open(settings["HEAD_IP"], settings["RAY_PORT"]):
            return
        if time.monotonic() - started < 30 and time.monotonic() < deadline:
            warn(f"`ray start` exited with code {rc} right away; retrying in 5s (head still starting?)")
            time.sleep(5)
            continue
        raise UserError(f"`ray start` exited with code {rc} while the head still answers ({last_line(log)}): "
                        "check the token (RAY_AUTH_TOKEN / token file) is the head's, then rerun")


def _worker_auth(spec: specs.Spec, settings: Settings) -> dict[str, str] | None:
    if settings["RAY_AUTH_TOKEN"] or token_path(spec.run_dir, settings).is_file():
        return ray_auth_env(spec.run_dir, settings, create=False)
    return None


def main(command: str, argv: list[str], settings: Settings) -> int:
    if argv and argv[0] in ("-h", "--help"):
        say(__doc__ or "")
        return 0
    if argv:
        raise UserError(f"`{command}` takes no arguments: settings come from the environment (see make help)")
    return {"sft": launch_sft, "grpo-head": launch_grpo_head, "grpo-worker": launch_grpo_worker}[command](settings)
