"""Launch on this node: `sft` (torchrun), `grpo-head` (Ray head + wait + verl driver), `grpo-worker`.

Every launch runs preflight first (app.preflight), then either prints the plan (DRY_RUN=1) or runs it.
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

from app import composition, warmup
from app.common import PASS_NAMES, PASS_PREFIXES, UserError, raise_terminated, say, warn
from app.preflight import (Launch, Preflight, preflight, read_launch, refuse_stale_environment,
                           refuse_unusable_run_dir, refuse_without_gpus, report)
from app.runs import latest_step, logs_dir, swanlog_dir, token_file
from app.settings import Settings

SECRET_MARKERS = ("TOKEN", "KEY", "SECRET", "PASSWORD")


# --- pieces shared by the targets --------------------------------------------------------------------
def shown_env(settings: Settings, extra: dict[str, str]) -> dict[str, str]:
    """The environment a plan prints: what we set plus the pass-through variables present here."""
    # empty values are Make's exported-but-unset variables: noise, not settings
    shown = {k: v for k, v in settings.environ().items() if v and (k.startswith(PASS_PREFIXES) or k in PASS_NAMES)}
    shown.update(extra)
    return dict(sorted(shown.items()))


def masked(name: str, value: str) -> str:
    return "***" if any(marker in name for marker in SECRET_MARKERS) and not name.endswith("_PATH") else value


def print_plan(settings: Settings, title: str, extra_env: dict[str, str], steps: list[tuple[str, list[str]]]) -> None:
    """DRY_RUN output: the environment and the exact commands, copy-pasteable."""
    say(f"plan for {title} (DRY_RUN=1: nothing is started)")
    say("environment:")
    for name, value in shown_env(settings, extra_env).items():
        say(f"  export {name}={shlex.quote(masked(name, value))}")
    for what, command in steps:
        say(f"{what}:")
        say(f"  {shlex.join(command)}")


def prepare_run_dir(plan: Preflight, fresh: bool, dry: bool) -> None:
    """FRESH=1 moves the old run aside (never deletes it); otherwise say whether verl will resume."""
    run = plan.launch.run_dir
    resume_mode = plan.config.trainer.get("resume_mode", "auto")
    if fresh and run.exists() and any(run.iterdir()):
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


def run_process(settings: Settings, what: str, command: list[str], extra_env: dict[str, str]) -> int:
    """Run a long foreground process with our environment (its own output is the progress). If we are
    interrupted (Ctrl-C, SIGTERM), it gets SIGTERM and time to stop its own children first."""
    say(f"$ {shlex.join(command)}")
    process = subprocess.Popen(command, env=settings.environ(extra_env))
    try:
        return process.wait()
    finally:
        stop_process(process, what)


def preflight_and_report(job: str, settings: Settings, dry: bool) -> Preflight:
    # verl's validate_config also on a dry run: DRY_RUN=1 refuses what `make check` refuses
    plan = preflight(job, settings, deep=job == "grpo", gpus=not dry)
    # a dry run writes into the run directory too (tracking's directories, removed again): both need write access
    refuse_unusable_run_dir(plan.launch.run_dir)
    report(plan)
    return plan


def tracking(run: Path, settings: Settings, dry: bool) -> dict[str, str]:
    """app.tracking's environment for `run`; on a dry run, without leaving the directories it creates."""
    from app.tracking import tracking_env

    if not dry:
        return tracking_env(run, settings["SWANLAB_MODE"])
    fresh = [d for d in (logs_dir(run), swanlog_dir(run), run) if not d.exists()]
    try:
        return tracking_env(run, settings["SWANLAB_MODE"])
    finally:
        for directory in fresh:  # children first; only the empty ones this call created
            if directory.is_dir() and not any(directory.iterdir()):
                directory.rmdir()


def hydra_args(job: str, overrides: list[str]) -> list[str]:
    """The arguments that make verl's entry point compose exactly the config preflight checked."""
    return ["--config-dir", str(composition.CONFIG_DIR), "--config-name", job, *overrides]


# --- SFT ---------------------------------------------------------------------------------------------
def sft_command(plan: Preflight, settings: Settings) -> list[str]:
    """torchrun (as `python -m torch.distributed.run`) for this node: standalone on one node, a static
    rendezvous at MASTER_ADDR:MASTER_PORT across nodes; the same line everywhere but --node-rank."""
    s = plan.launch
    module = settings["SFT_TRAINER_MODULE"]  # verl's entry point; a test hook swaps in a tiny CPU stand-in
    # --log-dir: torchrun's per-attempt files (its error.json of a failed rank) stay with the run, not in a
    # fresh /tmp/torchelastic_* for every launch
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(s.nnodes),
               "--nproc-per-node", str(s.gpus_per_node), "--log-dir", str(logs_dir(s.run_dir) / "torchrun")]
    if s.multi_node:
        command += ["--node-rank", str(s.node_rank), "--master-addr", str(s.master_addr),
                    "--master-port", str(s.master_port)]
    else:
        command += ["--standalone"]
    return command + ["-m", module, *hydra_args("sft", plan.hydra_overrides())]


def launch_sft(settings: Settings) -> int:
    dry = settings["DRY_RUN"]
    plan = preflight_and_report("sft", settings, dry)
    s = plan.launch
    command = sft_command(plan, settings)
    prepare_run_dir(plan, settings["FRESH"], dry)  # FRESH first: the tracking directories belong to the new run
    extra = tracking(s.run_dir, settings, dry)
    if dry:
        print_plan(settings, f"sft on node {s.node_rank} of {s.nnodes}", extra, [("train", command)])
        return 0
    if s.multi_node:
        say(f"node {s.node_rank} of {s.nnodes}: waiting at {s.master_addr}:{s.master_port} for the others "
            "(run the same command with their NODE_RANK); this node's shards go to " + str(s.run_dir))
    rc = run_process(settings, "sft", command, extra)
    if rc != 0:
        raise UserError(f"the SFT trainer exited with code {rc} (its output is above): fix the cause and rerun "
                        "the same command; it resumes from the latest checkpoint")
    say(f"SFT finished: checkpoints in {s.run_dir} (next: make merge)")
    return 0


# --- Ray: token, head, wait, worker --------------------------------------------------------------------
def token_path(run: Path, settings: Settings) -> Path:
    """Where the head writes the cluster token (mode 600) for workers that share the run volume."""
    explicit = settings["RAY_AUTH_TOKEN_PATH"]
    return Path(explicit).expanduser().resolve() if explicit else token_file(run)


def ray_auth_env(run: Path, settings: Settings, *, create: bool) -> dict[str, str]:
    """Ray's token authentication settings (RAY_AUTH_MODE=token + RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH).

    A RAY_AUTH_TOKEN from `.env` wins; else the head generates one into token_path() and workers read
    that file. The token is never written into the image or the repository.
    """
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


def port_open(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def ray_cli() -> list[str]:
    return [sys.executable, "-m", "ray.scripts.scripts"]


def head_command(s: Launch, settings: Settings) -> list[str]:
    """`ray start --head --block`: blocking, so stopping it stops exactly the Ray processes it started.
    The dashboard and job API listen on loopback unless DASHBOARD_HOST asks for an address."""
    return [*ray_cli(), "start", "--head", "--block", "--node-ip-address", s.head_ip or "127.0.0.1",
            "--port", str(s.ray_port), "--dashboard-host", settings["DASHBOARD_HOST"],
            "--disable-usage-stats", *settings.get("RAY_START_ARGS", ())]


def worker_command(s: Launch, settings: Settings) -> list[str]:
    command = [*ray_cli(), "start", "--address", s.ray_address, "--block", "--disable-usage-stats"]
    if settings["NODE_IP"]:
        command += ["--node-ip-address", settings["NODE_IP"]]
    return command + list(settings.get("RAY_START_ARGS", ()))


class ClusterAddressFile:
    """`ray start` (head or worker) records its cluster in `<Ray temp dir>/ray_current_cluster`, and a plain
    `ray.init()` on this node (no address, e.g. `python -m verl.trainer.main_ppo`) joins whatever that file
    names. Stopping `ray start --block` with SIGTERM does not reset it (only `ray stop` does, machine-wide), so
    a later plain program would try to join our dead head and hang. Remembered before our `ray start` and put
    back afterwards: removed, or the previous content restored, unless another cluster has replaced ours since.

    The temp dir is Ray 2.60's (ray/_common/utils.py get_default_ray_temp_dir, mirrored to avoid importing
    Ray): `--temp-dir` of RAY_START_ARGS, else $RAY_TMPDIR/ray, else $TMPDIR/ray (Linux), else /tmp/ray.
    """

    def __init__(self, address: str, settings: Settings):
        self.address = address
        self.path = self.locate(settings)
        self.before = self.read()

    @staticmethod
    def locate(settings: Settings) -> Path:
        """Where the `ray start` we run (with settings.environ()) writes the file."""
        args = list(settings.get("RAY_START_ARGS", ()))
        environ = settings.environ()
        for i, arg in enumerate(args):
            if arg == "--temp-dir" and i + 1 < len(args):
                return Path(args[i + 1]) / "ray_current_cluster"
            if arg.startswith("--temp-dir="):
                return Path(arg.split("=", 1)[1]) / "ray_current_cluster"
        if "RAY_TMPDIR" in environ:
            base = environ["RAY_TMPDIR"]
        elif sys.platform.startswith("linux") and "TMPDIR" in environ:
            base = environ["TMPDIR"]
        else:
            base = "/tmp"
        return Path(base) / "ray" / "ray_current_cluster"

    def read(self) -> str | None:
        try:
            return self.path.read_text().strip()
        except OSError:
            return None

    def ours(self, content: str | None) -> bool:
        """Whether `content` names a cluster at our port. Ray writes the GCS address as it sees it (on a
        head started with --node-ip-address 127.0.0.1 that can be the node's primary address), so the port
        identifies it; whatever listened there is what this launch has just stopped."""
        return content is not None and content.rsplit(":", 1)[-1] == self.address.rsplit(":", 1)[-1]

    def restore(self) -> None:
        now = self.read()
        if not self.ours(now):
            return  # never written by our `ray start`, or another cluster's since: not ours to touch
        try:
            if self.before is not None and not self.ours(self.before):
                self.path.write_text(self.before)
            else:
                self.path.unlink()
        except OSError as exc:
            warn(f"could not reset {self.path} ({exc.strerror}): a plain ray.init() here would try to join "
                 f"{now}; remove the file or run `ray stop`")


def head_ip_problem(head_ip: str | None) -> str | None:
    """Why HEAD_IP cannot be this node's Ray head address, or None. `ray start --head --node-ip-address`
    with a foreign address starts a head that no worker reaches (or fails with a Ray traceback)."""
    if not head_ip:
        return None
    from app.doctor import interface_addresses, is_local_address

    if is_local_address(head_ip):
        return None
    mine = sorted({a for addresses in interface_addresses().values() for a in addresses if ":" not in a})
    return (f"HEAD_IP={head_ip} is not an address of this machine (its addresses: {', '.join(mine) or 'none'}): "
            "run make grpo-head on the head node itself, with HEAD_IP set to one of its addresses (and the same "
            "HEAD_IP on every worker)")


def head_reachable(host: str, port: int, window: float = 10.0) -> str | None:
    """Within `window` seconds, whether anything at host:port can be reached: None when the head answers;
    "refused" when the machine answers but nothing listens there yet (the head may still be starting);
    else why not (timed out, no route, unknown host) - then HEAD_IP is wrong or the network blocks it."""
    deadline = time.monotonic() + window
    reason = "timed out"
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=max(0.5, min(3.0, deadline - time.monotonic()))):
                return None
        except ConnectionRefusedError:
            return "refused"
        except socket.gaierror as exc:
            return f"unknown host: {exc.strerror}"
        except OSError as exc:
            reason = exc.strerror or "timed out"
        time.sleep(0.5)
    return reason


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
    # a pipe, not a multiprocessing Queue: a Queue's semaphores, left behind by Ctrl-C or SIGTERM, make the
    # resource tracker print a "leaked semaphore" warning after our one error line
    receiver, answers = context.Pipe(duplex=False)
    child = context.Process(target=_wait_child, daemon=True,
                            args=(address, nnodes, gpus_per_node, timeout, deadline - time.monotonic(), answers))
    child.start()
    answers.close()
    answered = False
    try:
        while True:
            if receiver.poll(1.0):
                try:
                    kind, payload = receiver.recv()
                except EOFError:
                    raise UserError(f"could not ask the Ray cluster at {address} for its nodes (exit code "
                                    f"{child.exitcode}): see the output above") from None
                answered = True
                break
            if head is not None and head.poll() is not None:
                raise UserError(f"the Ray head stopped (exit code {head.returncode}) while waiting for nodes: "
                                "see its output above")
            if not child.is_alive() and not receiver.poll(0):  # gone without an answer
                raise UserError(f"could not ask the Ray cluster at {address} for its nodes (exit code "
                                f"{child.exitcode}): see the output above")
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


def _wait_child(address: str, nnodes: int, gpus_per_node: int, timeout: float, left: float, answers) -> None:
    """wait_for_nodes' driver (runs in a spawned interpreter): reports ("ok", nodes) or ("error", line)."""
    import ray
    from tqdm import tqdm

    deadline = time.monotonic() + left
    host, port = address.rsplit(":", 1)
    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False, configure_logging=False)
    except Exception as exc:  # noqa: BLE001 - Ray raises several kinds; the user needs one line
        answers.send(("error", f"cannot join the Ray cluster at {address}: {' '.join(str(exc).split())[:300]}"))
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


def vllm_env(settings: Settings) -> dict[str, str]:
    """vLLM's settings for this node's Ray processes. verl 0.9.1 sets VLLM_DISABLE_COMPILE_CACHE=1 in the job's
    runtime_env unless the driver's environment sets it (trainer/constants_ppo.py), and the actors of each node
    inherit `ray start`'s environment: so the head, its driver and every worker get it."""
    return {"VLLM_DISABLE_COMPILE_CACHE": settings["VLLM_DISABLE_COMPILE_CACHE"]}


def grpo_driver_command(plan: Preflight, settings: Settings, extra_overrides: list[str]) -> list[str]:
    module = settings["GRPO_TRAINER_MODULE"]  # verl's entry point; a test hook swaps in a tiny stand-in driver
    return [sys.executable, "-m", module, *hydra_args("grpo", plan.hydra_overrides(extra_overrides))]


def launch_grpo_head(settings: Settings) -> int:
    from app.tracking import tracking_overrides

    dry = settings["DRY_RUN"]
    problem = head_ip_problem(settings["HEAD_IP"])
    if problem and not dry:  # before preflight's notes: the one line is the refusal
        raise UserError(problem)
    plan = preflight_and_report("grpo", settings, dry)
    s = plan.launch
    if problem:  # a plan may be printed anywhere; starting the head may not
        warn(problem)
    timeout = settings["WAIT_TIMEOUT"]
    prepare_run_dir(plan, settings["FRESH"], dry)  # FRESH first: the token and tracking directories belong to the new run
    track = tracking(s.run_dir, settings, dry)
    auth = ray_auth_env(s.run_dir, settings, create=not dry)
    head_cmd = head_command(s, settings)
    # this attempt's tracking settings also travel in the job's runtime_env, to actors on every node
    # so does vLLM's cache setting: it then holds even under a Ray head this command did not start
    driver_cmd = grpo_driver_command(plan, settings, tracking_overrides({**track, **vllm_env(settings)}))
    extra = {**track, **auth, **vllm_env(settings)}
    if dry:
        print_plan(settings, f"grpo-head at {s.ray_address} ({s.nnodes} node(s) x {s.gpus_per_node} GPU(s))",
                   {**extra, "RAY_ADDRESS": s.ray_address}, [
                       ("start the Ray head (stopped again when GRPO ends)", head_cmd),
                       (f"then wait up to {timeout}s for {s.nnodes} node(s) with {s.gpus_per_node} GPU(s) each "
                        "(ray.nodes()), then run GRPO against that cluster", driver_cmd)])
        return 0
    # A write, not a read: the wait's driver (a spawned interpreter) inherits os.environ and joins with
    # the same token.
    os.environ.update(auth)
    head: subprocess.Popen | None = None
    address_file: ClusterAddressFile | None = None
    warm: subprocess.Popen | None = None
    try:
        warm = warmup.start(s.model_path, s.run_dir / "logs" / "vllm-warmup.log", settings.environ(extra))
        if port_open(s.head_ip or "127.0.0.1", s.ray_port):
            say(f"a Ray head already answers at {s.ray_address}: using it (it was not started by this command)")
        else:
            say(f"$ {shlex.join(head_cmd)}")
            address_file = ClusterAddressFile(s.ray_address, settings)
            head = subprocess.Popen(head_cmd, env=settings.environ(extra))
        nodes = wait_for_nodes(s.ray_address, s.nnodes, s.gpus_per_node, timeout, head)
        say(f"cluster ready: {describe_nodes(nodes)}")
        rc = run_process(settings, "grpo", driver_cmd, {**extra, "RAY_ADDRESS": s.ray_address})
    finally:
        warmup.stop(warm)
        if head is not None:
            say("stopping the Ray head (workers leave when it goes away)")
            stop_process(head, "the Ray head")
            address_file.restore()  # leave the node as found: no plain ray.init() joins our dead head
    if rc != 0:
        raise UserError(f"the GRPO driver exited with code {rc} (its output is above): fix the cause and rerun "
                        "`make grpo-head`; it resumes from the latest checkpoint")
    say(f"GRPO finished: checkpoints in {s.run_dir} on each node (next: make gather, make merge)")
    return 0


def launch_grpo_worker(settings: Settings) -> int:
    """Join the head (retrying while it is not up yet) and stay in the foreground until it goes away."""
    from tqdm import tqdm

    dry = settings["DRY_RUN"]
    s = read_launch("grpo", settings)
    if not s.head_ip:
        raise UserError("HEAD_IP is not set: set it to the Ray head's IP (the same HEAD_IP as on the head)")
    refuse_stale_environment(settings)  # Ray actors on this node inherit its environment
    if s.gpus_seen is not None and s.gpus_seen != s.gpus_per_node:
        raise UserError(f"GPUS_PER_NODE={s.gpus_per_node} but this node sees {s.gpus_seen} GPU(s) ({s.gpu_source}): "
                        f"set GPUS_PER_NODE={s.gpus_seen} or change CUDA_VISIBLE_DEVICES")
    if not dry:
        refuse_without_gpus(s, settings, "make grpo-worker")
    command = worker_command(s, settings)
    timeout = settings["WAIT_TIMEOUT"]
    extra = {**tracking(s.run_dir, settings, dry), **vllm_env(settings)}
    if dry:
        auth = ray_auth_env(s.run_dir, settings, create=False)
        print_plan(settings, f"grpo-worker joining {s.ray_address}", {**extra, **auth}, [
            (f"wait up to {timeout}s for the head, then join it and stay until it goes away", command)])
        return 0
    reach = head_reachable(s.head_ip, s.ray_port)
    if reach not in (None, "refused"):
        raise UserError(f"no Ray head answers at {s.ray_address} ({reach}): start make grpo-head there first, or "
                        "fix HEAD_IP / RAY_PORT (the head's address and port, reachable from this node)")
    if reach == "refused":  # the machine is there, its head not (yet): say so now, not after WAIT_TIMEOUT
        warn(f"nothing answers at {s.ray_address} yet: waiting up to {timeout}s for make grpo-head there "
             "(if HEAD_IP or RAY_PORT is wrong, stop this and fix it)")
    deadline = time.monotonic() + timeout
    # this node's vLLM servers inspect the model too (the head's warm-up fills only the head's cache)
    log = s.run_dir / "logs" / f"vllm-warmup-{settings['NODE_IP'] or 'worker'}.log"
    warm: subprocess.Popen | None = None
    try:
        warm = warmup.start(s.model_path, log, settings.environ(extra))
        with tqdm(desc=f"waiting for the Ray head at {s.ray_address}", unit="s", total=None) as bar:
            while True:
                auth = _worker_auth(s, settings)
                if auth is not None and port_open(s.head_ip, s.ray_port):
                    break
                if time.monotonic() > deadline:
                    missing = "the token (RAY_AUTH_TOKEN in .env, or " + str(token_path(s.run_dir, settings)) + ")" \
                        if auth is None else f"{s.ray_address} answering"
                    raise UserError(f"no head within {timeout}s (still missing: {missing}): start `make grpo-head` "
                                    "there, check HEAD_IP / RAY_PORT and the firewall, or raise WAIT_TIMEOUT")
                time.sleep(2.0)
                bar.update(2)
        address_file = ClusterAddressFile(s.ray_address, settings)
        try:
            return _run_worker(s, settings, command, {**extra, **auth}, deadline)
        finally:
            address_file.restore()  # leave the node as found: no plain ray.init() joins the departed head
    finally:
        warmup.stop(warm)


def _run_worker(s: Launch, settings: Settings, command: list[str], environment: dict[str, str],
                deadline: float) -> int:
    """`ray start --address ... --block` until the head goes away; retried while the head is still starting."""
    while True:
        started = time.monotonic()
        rc = run_process(settings, "grpo-worker", command, environment)
        if not port_open(s.head_ip, s.ray_port):
            say(f"the Ray head at {s.ray_address} went away: worker stopped")
            return 0
        if time.monotonic() - started < 30 and time.monotonic() < deadline:
            warn(f"`ray start` exited with code {rc} right away; retrying in 5s (head still starting?)")
            time.sleep(5)
            continue
        raise UserError(f"`ray start` exited with code {rc} while the head still answers (output above): "
                        "check the token (RAY_AUTH_TOKEN / token file) is the head's, then rerun")


def _worker_auth(s: Launch, settings: Settings) -> dict[str, str] | None:
    if settings["RAY_AUTH_TOKEN"]:
        return ray_auth_env(s.run_dir, settings, create=False)
    return ray_auth_env(s.run_dir, settings, create=False) if token_path(s.run_dir, settings).is_file() else None


def main(command: str, argv: list[str], settings: Settings) -> int:
    # SIGTERM from docker/kill raises Terminated (a KeyboardInterrupt), so that `finally` stops what
    # this launch started
    signal.signal(signal.SIGTERM, raise_terminated)
    if argv and argv[0] in ("-h", "--help"):
        say(__doc__ or "")
        return 0
    if argv:
        raise UserError(f"`{command}` takes no arguments: settings come from the environment (see make help)")
    return {"sft": launch_sft, "grpo-head": launch_grpo_head, "grpo-worker": launch_grpo_worker}[command](settings)
