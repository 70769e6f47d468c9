"""Launch on this node: `sft` (torchrun), `grpo-head` (Ray head + wait + verl driver), `grpo-worker`.

Every launch runs preflight first (app.config), then either prints the plan (DRY_RUN=1) or runs it.
The commands are verl's and Ray's own CLIs, started with this interpreter (sys.executable), so the same
code works in the image, in .venv, and with `PYTHON=python3 PYTHONPATH=...` on a bare GPU box.

Test hooks (documented, used by the CPU tests only): SFT_TRAINER_MODULE and GRPO_TRAINER_MODULE replace
verl's entry modules with tiny stand-ins; RAY_START_ARGS adds flags to `ray start` (tests declare
`--num-gpus 1` on a CPU machine; users may add e.g. `--num-cpus 32`).
"""

from __future__ import annotations

import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from app import config as cfgmod
from app.common import PASS_NAMES, PASS_PREFIXES, UserError, env, env_flag, env_int, say, warn

SECRET_MARKERS = ("TOKEN", "KEY", "SECRET", "PASSWORD")


# --- pieces shared by the targets --------------------------------------------------------------------
def shown_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment a plan prints: what we set plus the pass-through variables present here."""
    # empty values are Make's exported-but-unset variables: noise, not settings
    shown = {k: v for k, v in os.environ.items() if v and (k.startswith(PASS_PREFIXES) or k in PASS_NAMES)}
    shown.update(extra)
    return dict(sorted(shown.items()))


def masked(name: str, value: str) -> str:
    return "***" if any(marker in name for marker in SECRET_MARKERS) and not name.endswith("_PATH") else value


def print_plan(title: str, extra_env: dict[str, str], steps: list[tuple[str, list[str]]]) -> None:
    """DRY_RUN output: the environment and the exact commands, copy-pasteable."""
    say(f"plan for {title} (DRY_RUN=1: nothing is started)")
    say("environment:")
    for name, value in shown_env(extra_env).items():
        say(f"  export {name}={shlex.quote(masked(name, value))}")
    for what, command in steps:
        say(f"{what}:")
        say(f"  {shlex.join(command)}")


def latest_step(run: Path) -> int | None:
    """The step verl resumes from in `run` (resume_mode=auto), or None for a fresh start."""
    marker = run / "latest_checkpointed_iteration.txt"
    try:
        return int(marker.read_text().strip())
    except (OSError, ValueError):
        return None


def prepare_run_dir(plan: cfgmod.Preflight, dry: bool) -> None:
    """FRESH=1 moves the old run aside (never deletes it); otherwise say whether verl will resume."""
    run = plan.settings.run_dir
    resume_mode = plan.config.trainer.get("resume_mode", "auto")
    if env_flag("FRESH") and run.exists() and any(run.iterdir()):
        aside = run.with_name(f"{run.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
        if dry:
            say(f"FRESH=1: would move {run} aside to {aside}")
            return
        os.replace(run, aside)
        say(f"FRESH=1: moved the previous run aside to {aside}; starting over in {run}")
        return
    step = latest_step(run)
    if step is not None and resume_mode == "auto":
        say(f"resuming from global_step_{step} in {run} (FRESH=1 starts over, keeping this run aside)")
    elif step is not None:
        say(f"{run} holds global_step_{step}, but trainer.resume_mode={resume_mode}")
    else:
        say(f"starting a new run in {run}")


def run_process(what: str, command: list[str], extra_env: dict[str, str]) -> int:
    """Run a long foreground process with our environment (its own output is the progress). If we are
    interrupted (Ctrl-C, SIGTERM), it gets SIGTERM and time to stop its own children first."""
    say(f"$ {shlex.join(command)}")
    process = subprocess.Popen(command, env={**os.environ, **extra_env})
    try:
        return process.wait()
    finally:
        stop_process(process, what)


def preflight_and_report(job: str, dry: bool) -> cfgmod.Preflight:
    plan = cfgmod.preflight(job, deep=not dry and job == "grpo")
    cfgmod.report(plan)
    return plan


def tracking(run: Path, dry: bool) -> dict[str, str]:
    """app.tracking's environment for `run`; on a dry run, without leaving the directories it creates."""
    from app.tracking import tracking_env

    if not dry:
        return tracking_env(run)
    fresh = [d for d in (run / "logs", run / "swanlog", run) if not d.exists()]
    try:
        return tracking_env(run)
    finally:
        for directory in fresh:  # children first; only the empty ones this call created
            if directory.is_dir() and not any(directory.iterdir()):
                directory.rmdir()


def before_args(plan: cfgmod.Preflight, extra: list[str]) -> list[str]:
    """plan.overrides with `extra` inserted before the user's ARGS (which keep the last word)."""
    n = len(plan.settings.args)
    head, tail = (plan.overrides[:-n], plan.overrides[-n:]) if n else (plan.overrides, [])
    return [*head, *extra, *tail]


def hydra_args(job: str, overrides: list[str]) -> list[str]:
    """The arguments that make verl's entry point compose exactly the config preflight checked."""
    return ["--config-dir", str(cfgmod.CONFIG_DIR), "--config-name", job, *overrides]


# --- SFT ---------------------------------------------------------------------------------------------
def sft_command(plan: cfgmod.Preflight) -> list[str]:
    """torchrun (as `python -m torch.distributed.run`) for this node: standalone on one node, a static
    rendezvous at MASTER_ADDR:MASTER_PORT across nodes; the same line everywhere but --node-rank."""
    s = plan.settings
    module = env("SFT_TRAINER_MODULE", cfgmod.ENTRY_POINT["sft"])  # test hook: a tiny CPU stand-in
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(s.nnodes),
               "--nproc-per-node", str(s.gpus_per_node)]
    if s.multi_node:
        command += ["--node-rank", str(s.node_rank), "--master-addr", str(s.master_addr),
                    "--master-port", str(s.master_port)]
    else:
        command += ["--standalone"]
    return command + ["-m", module, *hydra_args("sft", plan.overrides)]


def launch_sft() -> int:
    dry = env_flag("DRY_RUN")
    plan = preflight_and_report("sft", dry)
    s = plan.settings
    command = sft_command(plan)
    prepare_run_dir(plan, dry)  # FRESH first: the tracking directories belong to the new run
    extra = tracking(s.run_dir, dry)
    if dry:
        print_plan(f"sft on node {s.node_rank} of {s.nnodes}", extra, [("train", command)])
        return 0
    if s.multi_node:
        say(f"node {s.node_rank} of {s.nnodes}: waiting at {s.master_addr}:{s.master_port} for the others "
            "(run the same command with their NODE_RANK); this node's shards go to " + str(s.run_dir))
    rc = run_process("sft", command, extra)
    if rc != 0:
        raise UserError(f"the SFT trainer exited with code {rc} (its output is above): fix the cause and rerun "
                        "the same command; it resumes from the latest checkpoint")
    say(f"SFT finished: checkpoints in {s.run_dir} (next: make merge)")
    return 0


# --- Ray: token, head, wait, worker --------------------------------------------------------------------
def token_path(run: Path) -> Path:
    """Where the head writes the cluster token (mode 600) for workers that share the run volume."""
    explicit = env("RAY_AUTH_TOKEN_PATH")
    return Path(explicit).expanduser().resolve() if explicit else run / ".ray_auth_token"


def ray_auth_env(run: Path, *, create: bool) -> dict[str, str]:
    """Ray's token authentication settings (RAY_AUTH_MODE=token + RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH).

    A RAY_AUTH_TOKEN from `.env` wins; else the head generates one into token_path() and workers read
    that file. The token is never written into the image or the repository.
    """
    if env("RAY_AUTH_TOKEN"):
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": env("RAY_AUTH_TOKEN")}
    path = token_path(run)
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


def port_open(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def ray_cli() -> list[str]:
    return [sys.executable, "-m", "ray.scripts.scripts"]


def extra_ray_args() -> list[str]:
    try:
        return shlex.split(env("RAY_START_ARGS", "") or "")
    except ValueError as exc:
        raise UserError(f"RAY_START_ARGS cannot be split like a shell line ({exc}): check its quotes") from None


def head_command(s: cfgmod.Settings) -> list[str]:
    """`ray start --head --block`: blocking, so stopping it stops exactly the Ray processes it started.
    The dashboard and job API listen on loopback unless DASHBOARD_HOST asks for an address."""
    return [*ray_cli(), "start", "--head", "--block", "--node-ip-address", s.head_ip or "127.0.0.1",
            "--port", str(s.ray_port), "--dashboard-host", env("DASHBOARD_HOST", "127.0.0.1"),
            "--disable-usage-stats", *extra_ray_args()]


def worker_command(s: cfgmod.Settings) -> list[str]:
    command = [*ray_cli(), "start", "--address", s.ray_address, "--block", "--disable-usage-stats"]
    if env("NODE_IP"):
        command += ["--node-ip-address", env("NODE_IP")]
    return command + extra_ray_args()


def describe_nodes(nodes: list[dict]) -> str:
    return ", ".join(f"{n['NodeManagerAddress']} ({int(n['Resources'].get('GPU', 0))} GPU)" for n in nodes) or "none"


def wait_for_nodes(address: str, nnodes: int, gpus_per_node: int, timeout: float,
                   head: subprocess.Popen | None = None) -> list[dict]:
    """Block until `nnodes` alive Ray nodes with >= `gpus_per_node` GPUs each are in the cluster.

    Uses Ray's own view (ray.nodes()) through a short-lived driver in a fresh interpreter: Ray reads its
    token settings once per process, and this one may have imported Ray (through verl) before they were
    set. Progress bar while waiting; on the deadline, a UserError saying how many joined, from which IPs.
    """
    import multiprocessing
    import queue

    deadline = time.monotonic() + timeout
    host, port = address.rsplit(":", 1)
    while not port_open(host, int(port)):
        if head is not None and head.poll() is not None:
            raise UserError(f"`ray start --head` exited with code {head.returncode} (its output is above): "
                            f"is {address} already in use or not this machine's address? set HEAD_IP / RAY_PORT")
        if time.monotonic() > deadline:
            raise UserError(f"the Ray head at {address} did not come up within {timeout:.0f}s: see its output above")
        time.sleep(0.5)
    context = multiprocessing.get_context("spawn")
    answers = context.Queue()
    child = context.Process(target=_wait_child, daemon=True,
                            args=(address, nnodes, gpus_per_node, timeout, deadline - time.monotonic(), answers))
    child.start()
    try:
        while True:
            try:
                kind, payload = answers.get(timeout=1.0)
                break
            except queue.Empty:
                if head is not None and head.poll() is not None:
                    raise UserError(f"the Ray head stopped (exit code {head.returncode}) while waiting for nodes: "
                                    "see its output above") from None
                if not child.is_alive():
                    raise UserError(f"could not ask the Ray cluster at {address} for its nodes (exit code "
                                    f"{child.exitcode}): see the output above") from None
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    if kind == "error":
        raise UserError(payload)
    return payload


def _wait_child(address: str, nnodes: int, gpus_per_node: int, timeout: float, left: float, answers) -> None:
    """wait_for_nodes' driver (runs in a spawned interpreter): reports ("ok", nodes) or ("error", line)."""
    import ray
    from tqdm import tqdm

    deadline = time.monotonic() + left
    host, port = address.rsplit(":", 1)
    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False, configure_logging=False)
    except Exception as exc:  # noqa: BLE001 - Ray raises several kinds; the user needs one line
        answers.put(("error", f"cannot join the Ray cluster at {address}: {' '.join(str(exc).split())[:300]}"))
        return
    try:
        with tqdm(total=nnodes, desc=f"nodes with {gpus_per_node} GPU(s) joined", unit="node") as bar:
            while True:
                alive = [n for n in ray.nodes() if n.get("Alive")]
                ready = [n for n in alive if n["Resources"].get("GPU", 0) >= gpus_per_node]
                if min(len(ready), nnodes) != bar.n:
                    bar.update(min(len(ready), nnodes) - bar.n)
                    bar.set_postfix_str(", ".join(n["NodeManagerAddress"] for n in ready))
                if len(ready) >= nnodes:
                    answers.put(("ok", [{k: n[k] for k in ("NodeManagerAddress", "Resources")} for n in ready]))
                    return
                if time.monotonic() > deadline:
                    short = [n for n in alive if n not in ready]
                    extra = f"; too few GPUs on: {describe_nodes(short)}" if short else ""
                    answers.put(("error", (
                        f"only {len(ready)} of {nnodes} nodes joined within {timeout:.0f}s "
                        f"({describe_nodes(ready)}){extra}: run `make grpo-worker HEAD_IP={host}` on the others "
                        f"(same token, port {port} reachable), check GPUS_PER_NODE, or raise WAIT_TIMEOUT")))
                    return
                time.sleep(1.0)
    finally:
        ray.shutdown()


def stop_process(process: subprocess.Popen, what: str, grace: float = 60.0) -> None:
    """SIGTERM, then SIGKILL after `grace` seconds: `ray start --block` stops its own Ray processes on
    SIGTERM, so only what this launch started is stopped (never a machine-wide `ray stop`)."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        warn(f"{what} did not stop within {grace:.0f}s: killing it")
        process.kill()
        process.wait()


def grpo_driver_command(plan: cfgmod.Preflight, extra_overrides: list[str]) -> list[str]:
    module = env("GRPO_TRAINER_MODULE", cfgmod.ENTRY_POINT["grpo"])  # test hook: a tiny stand-in driver
    return [sys.executable, "-m", module, *hydra_args("grpo", before_args(plan, extra_overrides))]


def launch_grpo_head() -> int:
    from app.tracking import tracking_overrides

    dry = env_flag("DRY_RUN")
    plan = preflight_and_report("grpo", dry)
    s = plan.settings
    timeout = env_int("WAIT_TIMEOUT", 600)
    prepare_run_dir(plan, dry)  # FRESH first: the token and tracking directories belong to the new run
    track = tracking(s.run_dir, dry)
    auth = ray_auth_env(s.run_dir, create=not dry)
    head_cmd = head_command(s)
    # this attempt's tracking settings also travel in the job's runtime_env, to actors on every node
    driver_cmd = grpo_driver_command(plan, tracking_overrides(track))
    extra = {**track, **auth}
    if dry:
        print_plan(f"grpo-head at {s.ray_address} ({s.nnodes} node(s) x {s.gpus_per_node} GPU(s))",
                   {**extra, "RAY_ADDRESS": s.ray_address}, [
                       ("start the Ray head (stopped again when GRPO ends)", head_cmd),
                       (f"then wait up to {timeout}s for {s.nnodes} node(s) with {s.gpus_per_node} GPU(s) each "
                        "(ray.nodes()), then run GRPO against that cluster", driver_cmd)])
        return 0
    os.environ.update(auth)  # the wait's driver (a spawned interpreter) joins with the same token
    head: subprocess.Popen | None = None
    if port_open(s.head_ip or "127.0.0.1", s.ray_port):
        say(f"a Ray head already answers at {s.ray_address}: using it (it was not started by this command)")
    else:
        say(f"$ {shlex.join(head_cmd)}")
        head = subprocess.Popen(head_cmd, env={**os.environ, **extra})
    try:
        nodes = wait_for_nodes(s.ray_address, s.nnodes, s.gpus_per_node, timeout, head)
        say(f"cluster ready: {describe_nodes(nodes)}")
        rc = run_process("grpo", driver_cmd, {**extra, "RAY_ADDRESS": s.ray_address})
    finally:
        if head is not None:
            say("stopping the Ray head (workers leave when it goes away)")
            stop_process(head, "the Ray head")
    if rc != 0:
        raise UserError(f"the GRPO driver exited with code {rc} (its output is above): fix the cause and rerun "
                        "`make grpo-head`; it resumes from the latest checkpoint")
    say(f"GRPO finished: checkpoints in {s.run_dir} on each node (next: make gather, make merge)")
    return 0


def launch_grpo_worker() -> int:
    """Join the head (retrying while it is not up yet) and stay in the foreground until it goes away."""
    from tqdm import tqdm

    dry = env_flag("DRY_RUN")
    s = cfgmod.read_settings("grpo")
    if not s.head_ip:
        raise UserError("HEAD_IP is not set: set it to the Ray head's IP (the same HEAD_IP as on the head)")
    cfgmod.refuse_stale_environment()  # Ray actors on this node inherit its environment
    if s.gpus_seen is not None and s.gpus_seen != s.gpus_per_node:
        raise UserError(f"GPUS_PER_NODE={s.gpus_per_node} but this node sees {s.gpus_seen} GPU(s) ({s.gpu_source}): "
                        f"set GPUS_PER_NODE={s.gpus_seen} or change CUDA_VISIBLE_DEVICES")
    command = worker_command(s)
    timeout = env_int("WAIT_TIMEOUT", 600)
    extra = tracking(s.run_dir, dry)
    if dry:
        auth = ray_auth_env(s.run_dir, create=False)
        print_plan(f"grpo-worker joining {s.ray_address}", {**extra, **auth}, [
            (f"wait up to {timeout}s for the head, then join it and stay until it goes away", command)])
        return 0
    deadline = time.monotonic() + timeout
    with tqdm(desc=f"waiting for the Ray head at {s.ray_address}", unit="s", total=None) as bar:
        while True:
            auth = _worker_auth(s)
            if auth is not None and port_open(s.head_ip, s.ray_port):
                break
            if time.monotonic() > deadline:
                missing = "the token (RAY_AUTH_TOKEN in .env, or " + str(token_path(s.run_dir)) + ")" \
                    if auth is None else f"{s.ray_address} answering"
                raise UserError(f"no head within {timeout}s (still missing: {missing}): start `make grpo-head` "
                                "there, check HEAD_IP / RAY_PORT and the firewall, or raise WAIT_TIMEOUT")
            time.sleep(2.0)
            bar.update(2)
    while True:
        started = time.monotonic()
        rc = run_process("grpo-worker", command, {**extra, **auth})
        if not port_open(s.head_ip, s.ray_port):
            say(f"the Ray head at {s.ray_address} went away: worker stopped")
            return 0
        if time.monotonic() - started < 30 and time.monotonic() < deadline:
            warn(f"`ray start` exited with code {rc} right away; retrying in 5s (head still starting?)")
            time.sleep(5)
            continue
        raise UserError(f"`ray start` exited with code {rc} while the head still answers (output above): "
                        "check the token (RAY_AUTH_TOKEN / token file) is the head's, then rerun")


def _worker_auth(s: cfgmod.Settings) -> dict[str, str] | None:
    if env("RAY_AUTH_TOKEN"):
        return ray_auth_env(s.run_dir, create=False)
    return ray_auth_env(s.run_dir, create=False) if token_path(s.run_dir).is_file() else None


def _terminate(signum, frame) -> None:
    raise KeyboardInterrupt  # so that `finally` stops what this launch started (SIGTERM from docker/kill)


def main(command: str, argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, _terminate)
    if argv and argv[0] in ("-h", "--help"):
        say(__doc__ or "")
        return 0
    if argv:
        raise UserError(f"`{command}` takes no arguments: settings come from the environment (see make help)")
    return {"sft": launch_sft, "grpo-head": launch_grpo_head, "grpo-worker": launch_grpo_worker}[command]()
