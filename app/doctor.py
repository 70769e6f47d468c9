"""`python -m app doctor` (`make doctor`): is this node ready? One screen, one line per check, and for
every red line what to do. Runs anywhere, GPUs or not; exits non-zero when any line is red.
Settings: the same as sft/grpo (JOB=sft|grpo limits the data check to one job).
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

from app import node
from app.common import UserError, existing_parent, human_bytes
from app.runs import read_model
from app.settings import REGISTRY, Settings

GiB = 2**30
MIN_DRIVER = 580  # the image's CUDA 13.0 needs an R580+ driver


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail
    detail: str
    fix: str = ""


# --- checks ---------------------------------------------------------------------------------------

def check_gpus(settings: Settings) -> list[Check]:
    want = settings["GPUS_PER_NODE"]
    gpus = node.gpus(settings["CUDA_VISIBLE_DEVICES"])  # honours CUDA_VISIBLE_DEVICES, as launch does
    if gpus.present == 0:
        return [Check("GPUs", "fail" if want else "warn", f"no GPU on this node ({gpus.source})",
                      "fine for prep, merge, report and a small eval on CPU; for sft/grpo use a GPU node with "
                      "the NVIDIA driver and nvidia-container-toolkit, and start the container with GPUs "
                      "(compose `gpus: all`)")]
    if not shutil.which("nvidia-smi"):
        return [Check("GPUs", "fail", "the NVIDIA driver is loaded but nvidia-smi is missing or failing",
                      "start the container with GPUs (compose `gpus: all`, nvidia-container-toolkit installed); "
                      "after a driver update, reboot")]
    if want and gpus.count < want:
        visible = Check("GPUs", "fail", f"GPUS_PER_NODE={want} but only {gpus.count} GPU(s) visible ({gpus.source})",
                        f"set GPUS_PER_NODE={gpus.count}, or fix CUDA_VISIBLE_DEVICES / the container's GPU list")
    elif gpus.count == 0:
        visible = Check("GPUs", "fail", f"{gpus.present} GPU(s) present but none visible ({gpus.source})",
                        "unset CUDA_VISIBLE_DEVICES or list the GPUs to use")
    else:
        names = ", ".join(sorted({row["name"] for row in gpus.rows}))
        memory = (gpus.memory_bytes or 0) // GiB
        visible = Check("GPUs", "ok", f"{gpus.count} visible of {gpus.present}: {names}, {memory} GiB each")
    driver = gpus.rows[0]["driver_version"] if gpus.rows else "?"
    major = driver.split(".")[0]
    if not major.isdigit() or int(major) < MIN_DRIVER:
        return [visible, Check("driver", "fail", f"NVIDIA driver {driver}: the image's CUDA 13.0 needs {MIN_DRIVER}+",
                               f"upgrade the host driver to R{MIN_DRIVER} or newer")]
    return [visible, Check("driver", "ok", f"NVIDIA driver {driver} (CUDA 13.0 needs {MIN_DRIVER}+)")]


def check_shm() -> Check:
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return Check("/dev/shm", "fail", "no /dev/shm", "start the container with `ipc: host` or `shm_size: 32g`")
    size = stat.f_blocks * stat.f_frsize
    text = f"{size / GiB:.1f} GiB"
    fix = "compose: `ipc: host` (or `shm_size: 32g`); docker run: --ipc=host or --shm-size=32g"
    if size < 1 * GiB:
        return Check("/dev/shm", "fail", f"{text}: NCCL, Ray's object store and the dataloaders need GiBs", fix)
    if size < 8 * GiB:
        return Check("/dev/shm", "warn", f"{text}: tight for Ray's object store and vLLM", fix)
    return Check("/dev/shm", "ok", text)


def check_memlock() -> Check:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return Check("memlock", "ok", "unlimited")
    text = f"{soft // 1024} KiB"
    infiniband = Path("/sys/class/infiniband")
    if not (infiniband.is_dir() and any(infiniband.iterdir())):
        return Check("memlock", "ok", f"{text} (matters only for InfiniBand/RDMA, none here)")
    return Check("memlock", "fail", f"{text} with InfiniBand present: NCCL's RDMA cannot pin its buffers",
                 "make: compose.ib.yaml (added where /dev/infiniband exists, IB=1 forces it); docker run: --ulimit "
                 "memlock=-1; bare metal: /etc/security/limits.conf")


def check_node_rank(settings: Settings) -> Check:
    rank, nnodes = settings["NODE_RANK"], settings["NNODES"]
    if rank >= nnodes:
        return Check("node rank", "fail", f"NODE_RANK={rank} but NNODES={nnodes}: the ranks are 0..{nnodes - 1}",
                     f"give each machine its own NODE_RANK 0..{nnodes - 1} (0 on the head / master) and the same "
                     "NNODES on all of them")
    return Check("node rank", "ok", f"NODE_RANK={rank} of NNODES={nnodes}")


def check_network(settings: Settings) -> list[Check]:
    head = settings["HEAD_IP"]
    target, what = (head, "HEAD_IP") if head else (settings["MASTER_ADDR"], "MASTER_ADDR")
    nnodes = settings["NNODES"]
    if not target and nnodes == 1:
        return [Check("network", "ok", "one node (NNODES=1): no inter-node network to check")]
    if not target:
        return [Check("network", "warn", "HEAD_IP (GRPO) / MASTER_ADDR (multi-node SFT) not set: cannot tell "
                      "which interface NCCL and Gloo should use",
                      "set HEAD_IP=<the head node's address>, the same on every node (one node alone needs none)")]
    try:
        source, name = node.route_interface(target)
    except OSError as exc:
        return [Check("network", "fail", f"no route to {what}={target} ({exc.strerror or exc})",
                      f"check {what} (an address every node can reach) and this node's network")]
    if name is None:
        return [Check("interface", "warn", f"route to {target} leaves from {source}, on no interface found",
                      "set NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME to the interface holding " + source)]
    if name == "lo" and nnodes != 1:
        checks = [Check("interface", "fail", f"{what}={target} is this node's loopback: other nodes cannot reach it",
                        f"set {what} to this node's address on the cluster network")]
    else:
        checks = [Check("interface", "ok", f"route to {what}={target} leaves via {name} ({source})"
                        + (": this node is the head" if node.is_local_address(target) else ""))]
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        value = settings[var]
        if value is None and nnodes == 1:
            continue  # one node: NCCL talks over NVLink/shared memory, Gloo over loopback
        if value is None:
            checks.append(Check(var, "warn", f"not set: {var.split('_')[0]} may pick another interface "
                                "(docker0, a second NIC) and hang", f"export {var}={name} (in .env on every node)"))
        elif not node.ifname_matches(value, name, nccl=var.startswith("NCCL")):
            checks.append(Check(var, "fail", f"{var}={value} does not select {name}, the interface that "
                                f"reaches {target}", f"set {var}={name}"))
        else:
            checks.append(Check(var, "ok", f"{value} selects {name}"))
    return checks


def check_head(settings: Settings) -> Check | None:
    head = settings["HEAD_IP"]
    if not head:
        return None
    port = settings["RAY_PORT"]  # a port 1-65535: app/settings.py refused anything else
    try:
        with socket.create_connection((head, port), timeout=3):
            return Check("Ray head", "ok", f"{head}:{port} answers")
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
    if node.is_local_address(head):
        return Check("Ray head", "ok", f"nothing on {head}:{port} yet: this node is the head "
                     "(normal before `make grpo-head`)")
    return Check("Ray head", "fail", f"{head}:{port} does not answer ({reason})",
                 f"start the head first (`make grpo-head` on {head}); if it runs, open TCP {port} and Ray's "
                 "other ports between the nodes (host networking, no firewall between them)")


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file (no weights read); ValueError saying what is wrong with it."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        if size < 8:
            raise ValueError(f"{path.name} is empty ({size} bytes)" if size == 0 else f"{path.name} is truncated "
                             f"({size} bytes)")
        length = struct.unpack("<Q", handle.read(8))[0]
        if length > size - 8:
            raise ValueError(f"{path.name} is truncated (header of {length} bytes in a {size}-byte file)")
        try:
            header = json.loads(handle.read(length))
        except (ValueError, UnicodeDecodeError):
            raise ValueError(f"{path.name} has a damaged header (not safetensors JSON)") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path.name} has a damaged header (not a JSON object)")
    return header


def human_parameters(count: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.2f}{unit}"
    return str(count)


def model_parameters(model: Path) -> int | None:
    """Parameter count from the safetensors headers (no weights read); None where there are none or one
    is unreadable (check_model reports that)."""
    shapes = []
    for path in model.glob("*.safetensors"):
        try:
            header = safetensors_header(path)
        except (OSError, ValueError):
            return None
        shapes += [meta["shape"] for name, meta in header.items() if name != "__metadata__"]
    return sum(map(math.prod, shapes)) if shapes else None


def check_disk(run: Path, model: Path | None) -> Check:
    where = existing_parent(run)
    if not os.access(where, os.W_OK):
        return Check("disk", "fail", f"{where} is not writable: checkpoints and logs of {run} cannot be saved",
                     "fix the mount/permissions, or set CKPT_DIR to a writable path (the same on every node)")
    free = shutil.disk_usage(where).free
    text = f"{free / GiB:.0f} GiB free at {where}"
    larger = "free space, or set CKPT_DIR to a larger disk (the same path on every node)"
    params = model_parameters(model) if model and not read_model(model).problems else None
    if not params:
        if free < 20 * GiB:
            return Check("disk", "fail", f"{free / GiB:.1f} GiB free at {where}: too little for checkpoints", larger)
        return Check("disk", "ok", f"{text} (set MODEL_PATH for an estimate)")
    # FSDP checkpoint: fp32 weights + Adam's two fp32 moments = 12 bytes per parameter; 3 are kept
    one = params * 12
    need = f"one checkpoint of this {human_parameters(params)} model is ~{human_bytes(one)}, 3 are kept"
    if free < one:
        return Check("disk", "fail", f"{text}: {need}", larger)
    if free < 3 * one:
        return Check("disk", "warn", f"{text}: {need}",
                     "free space or lower trainer.max_actor_ckpt_to_keep / max_ckpt_to_keep via ARGS")
    return Check("disk", "ok", f"{text} ({need})")


def check_model(model: Path | None) -> Check:
    if model is None:
        return Check("MODEL_PATH", "fail", "not set", "set MODEL_PATH to a local Hugging Face model directory "
                     "(absolute, the same on every node; no hub downloads on air-gapped nodes)")
    if not model.is_dir():
        return Check("MODEL_PATH", "fail", f"{model} does not exist on this node",
                     "copy the model there (the same absolute path on every node) or fix MODEL_PATH")
    problems = read_model(model).problems
    if problems:
        return Check("MODEL_PATH", "fail", f"{model} has {', '.join(problems)}",
                     "point MODEL_PATH at a complete Hugging Face model directory (config, weights, tokenizer)")
    for path in sorted(model.glob("*.safetensors")):
        try:
            safetensors_header(path)
        except (OSError, ValueError) as exc:
            return Check("MODEL_PATH", "fail", f"{model}: {exc}",
                         "copy the model again (an interrupted download or copy leaves such files), or fix MODEL_PATH")
    return Check("MODEL_PATH", "ok", str(model))


def check_data(jobs: list[str], settings: Settings) -> tuple[list[Check], Path, Path | None]:
    from app import spec as specs

    checks, run, model = [], Path.cwd() / "checkpoints", None
    seen: set[Path] = set()
    for job in jobs:
        spec = specs.read(job, settings)
        run, model = spec.run_dir, spec.model_path
        for what, path in [(split, p) for split in ("train", "val") for p in spec.files(split)]:
            if path in seen:
                continue
            seen.add(path)
            if path.is_file():
                checks.append(Check(f"{job} {what} data", "ok", str(path)))
            else:
                checks.append(Check(f"{job} {what} data", "fail", f"{path} does not exist on this node",
                                    "run `make prep` (same DATA_DIR on every node) or set TRAIN_FILE/VAL_FILE"))
    for name in specs.relative_paths(settings):
        checks.append(Check("paths", "warn", f"{name} is relative: it resolves differently per directory",
                            "use absolute paths, identical on every node"))
    return checks, run, model


def check_packages(gpu: bool) -> list[Check]:
    from importlib.metadata import PackageNotFoundError, version

    from app.tracking import SWANBOARD_VERSION, swanboard_problem

    def have(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    checks = []
    verl = have("verl")
    if verl != "0.9.1":
        checks.append(Check("verl", "fail", f"verl {verl or 'missing'} (this stack is built on 0.9.1)",
                            "use the image (make build), or pip install verl==0.9.1"))
    else:
        checks.append(Check("verl", "ok", "0.9.1"))
    vllm = have("vllm")
    if vllm and not vllm.startswith("0.24."):
        checks.append(Check("vLLM", "warn", f"{vllm}: verl 0.9.1 is pinned with vLLM 0.24.0",
                            "use the image (make build), or pip install vllm==0.24.0"))
    elif vllm:
        checks.append(Check("vLLM", "ok", vllm))
    else:
        checks.append(Check("vLLM", "fail" if gpu else "warn", "not installed: GRPO's rollout needs it; eval "
                            "falls back to transformers (slow)", "use the GPU image (make build)"))
    problem = swanboard_problem()
    if problem:
        checks.append(Check("swanboard", "warn", f"{problem}: swanlab records offline, no `make board`",
                            f"pip install 'swanboard=={SWANBOARD_VERSION}' (in the image already)"))
    else:
        checks.append(Check("swanboard", "ok", f"{SWANBOARD_VERSION}: swanlab local mode and `make board` work"))
    return checks


def check_settings(settings: Settings) -> list[Check]:
    """Where this node's settings come from, which of .env.example's are unset (their defaults apply), and a red
    line for each that cannot be read (doctor lists them all, where a command refuses the first)."""
    bad = [Check("settings", "fail", *value.error.split(": ", 1)) for value in settings.values.values() if value.error]
    expected = [var.name for var in REGISTRY if var.example is not None]  # the lines of .env.example
    sources = [settings.source(name) for name in expected]
    unset = [name for name in expected if not settings.is_set(name)]
    where = settings.env_file if settings.env_file.is_file() else f"no {settings.env_file}"
    detail = (f"{sources.count('.env')} from {where}, {sources.count('shell')} from the shell"
              + (f"; unset (defaults apply): {', '.join(unset)}" if unset else ""))
    found = [(f"{problem}: {', '.join(names)}", fix) for names, problem, fix in (
        (settings.repeated, f"set twice in {settings.env_file}, the last counts", "keep one line each"),
        (settings.misspelt, f"in {settings.env_file} but no setting",
         "rename it (`make settings` lists every setting)"),
        (settings.ignored, "in .env but read by make only",
         "set those on the make command line or in the shell (`make settings` shows all)")) if names]
    return [Check("settings", "warn" if found else "ok", "; ".join([detail, *(p for p, _ in found)]),
                  "; ".join(fix for _, fix in found)), *bad]


def run_checks(settings: Settings) -> list[Check]:
    checks = check_settings(settings)
    gpus = guarded("GPUs", lambda: check_gpus(settings))
    checks += gpus + guarded("/dev/shm", check_shm) + guarded("memlock", check_memlock)
    checks += guarded("node rank", lambda: check_node_rank(settings))
    checks += guarded("network", lambda: check_network(settings))
    checks += guarded("Ray head", lambda: check_head(settings))
    found = None if any(c.status == "fail" for c in checks if c.name == "settings") else \
        guarded("settings", lambda: check_data([settings["JOB"]] if settings["JOB"] else ["sft", "grpo"], settings))
    if isinstance(found, tuple):
        data, run, model = found
        checks += guarded("MODEL_PATH", lambda: check_model(model))
    else:  # the settings could not be read (e.g. CONFIG): "MODEL_PATH not set" would be a second, wrong line
        data, run, model = found or [], Path.cwd() / "checkpoints", None
        checks.append(Check("MODEL_PATH", "warn", "not checked: the settings could not be read (see settings)",
                            "fix the settings line, then run make doctor again"))
    checks += data
    checks += guarded("disk", lambda: check_disk(run, model))
    checks += guarded("packages", lambda: check_packages(gpus[0].status == "ok"))
    said = {c.detail for c in checks if c.name == "settings"}  # a bad value that another check also tripped on
    return [c for c in checks if c.name == "settings" or c.detail not in said]


def guarded(name: str, check):
    """Run one check; a check that crashes is its own red line, so doctor still prints all the others.
    Returns a list of Checks, or a check_data tuple unchanged."""
    try:
        result = check()
    except UserError as exc:
        return [Check(name, "fail", str(exc).split(": ", 1)[0], str(exc).split(": ", 1)[-1])]
    except Exception as exc:  # noqa: BLE001 - a bug in one check must not hide the other checks
        return [Check(name, "fail", f"this check failed: {type(exc).__name__}: {exc}",
                      "rerun with APP_DEBUG=1 for the traceback and report it")]
    if result is None:
        return []
    return result if isinstance(result, (list, tuple)) else [result]


STYLE = {"ok": ("OK", "green"), "warn": ("WARN", "yellow"), "fail": ("FAIL", "bold red")}


def main(command: str, argv: list[str], settings: Settings) -> int:
    from rich.console import Console
    from rich.markup import escape

    if argv:
        raise UserError(f"doctor takes no arguments (got {' '.join(argv)}): settings come from the environment")
    console = Console(highlight=False, soft_wrap=True)  # soft_wrap: one check, one line, even in logs
    console.print(f"[bold]doctor[/] {socket.gethostname()}: is this node ready?")
    checks = run_checks(settings)
    width = max(len(c.name) for c in checks)
    for c in checks:
        label, style = STYLE[c.status]
        console.print(f"  [{style}]{label:<4}[/]  {c.name:<{width}}  {escape(c.detail)}")
        if c.fix and c.status != "ok":
            console.print(f"        {'':<{width}}  [{style}]->[/] {escape(c.fix)}")
    red = [c for c in checks if c.status == "fail"]
    warn = [c for c in checks if c.status == "warn"]
    if red:
        console.print(f"[bold red]NOT READY[/]: {len(red)} red line(s) above, each with what to do"
                      + (f"; {len(warn)} warning(s)" if warn else ""))
        return 1
    console.print("[green]ready[/]" + (f", with {len(warn)} warning(s) above" if warn else ""))
    return 0
