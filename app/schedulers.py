"""Where the cluster is: a scheduler's node facts, and the files that submit a run to one, from the settings.

Inside a Slurm job, a Kubernetes training job (the Training Operator's PyTorchJob, an Indexed Job, a KubeRay
RayJob) or a SkyPilot task, NNODES, NODE_RANK, MASTER_ADDR, HEAD_IP and NODE_IP come from the scheduler's own
variables unless the user set them (app.settings reads `facts`; `make settings` names the source), so the same
`make sft` / `make grpo-head` / `make grpo-worker` lines run there unchanged.

    python -m app slurm sft|grpo [--submit]   an sbatch script: one task per node, every task the same line
    python -m app k8s sft|grpo                GRPO as a KubeRay RayJob, SFT as a PyTorchJob or an Indexed Job
"""

from __future__ import annotations

import shlex
import socket
import subprocess
from pathlib import Path
from typing import Mapping

from app.common import REPO_ROOT, ArgParser, UserError, atomic_path, say

NODE_FACTS = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "HEAD_IP", "RAY_PORT", "NODE_IP")


def _ip(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host  # the settings' check says what is wrong with it


def _slurm_addresses(env: Mapping[str, str], *names: str) -> list[str]:
    """Each Slurm node's NodeAddr (how Slurm itself reaches it), by `scontrol show node`."""
    out = []
    for name in names:
        shown = subprocess.run(["scontrol", "show", "node", "-o", name], env=dict(env), capture_output=True,
                               text=True, timeout=30).stdout
        fields = dict(part.split("=", 1) for part in shown.split() if "=" in part)
        out.append(_ip(fields.get("NodeAddr", name)))
    return out


def facts(env: Mapping[str, str]) -> tuple[str, dict[str, str]]:
    """(scheduler, {setting: value}) read off a scheduler's variables in `env`; ("", {}) outside one."""
    if env.get("SLURM_JOB_ID") and env.get("SLURM_NODEID"):
        first = subprocess.run(["scontrol", "show", "hostnames", env.get("SLURM_JOB_NODELIST", "")], env=dict(env),
                               capture_output=True, text=True, timeout=30).stdout.split()[:1]
        head, this = _slurm_addresses(env, *first, env.get("SLURMD_NODENAME", ""))
        return "slurm", {"NNODES": env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES", ""),
                         "NODE_RANK": env["SLURM_NODEID"], "MASTER_ADDR": head, "HEAD_IP": head, "NODE_IP": this}
    if env.get("SKYPILOT_NODE_RANK"):
        ips = env.get("SKYPILOT_NODE_IPS", "").split()
        return "skypilot", {"NNODES": env.get("SKYPILOT_NUM_NODES", ""), "NODE_RANK": env["SKYPILOT_NODE_RANK"],
                            "MASTER_ADDR": ips[0] if ips else "", "HEAD_IP": ips[0] if ips else "",
                            "GPUS_PER_NODE": env.get("SKYPILOT_NUM_GPUS_PER_NODE", "")}
    if env.get("KUBERNETES_SERVICE_HOST"):
        if env.get("PET_NNODES"):  # the Training Operator's PyTorchJob, for torchrun (nprocPerNode set)
            return "kubernetes", {"NNODES": env["PET_NNODES"].split(":")[-1], "NODE_RANK": env.get("PET_NODE_RANK", ""),
                                  "MASTER_ADDR": env.get("PET_MASTER_ADDR", ""),
                                  "MASTER_PORT": env.get("PET_MASTER_PORT", "")}
        if env.get("JOB_COMPLETION_INDEX"):  # an Indexed Job: the rank; the rest is in the manifest's env
            return "kubernetes", {"NODE_RANK": env["JOB_COMPLETION_INDEX"]}
        if env.get("RAY_ADDRESS"):  # KubeRay: a RayJob's entrypoint joins the cluster KubeRay started
            host, _, port = env["RAY_ADDRESS"].split("://")[-1].rpartition(":")
            return "kubernetes", {"HEAD_IP": _ip(host), "RAY_PORT": port}
    return "", {}


# --- what is written, from the settings -------------------------------------------------------------------
MEANINGLESS = {  # settings that mean nothing to a target: the scheduler decides them per node
    "slurm": ("NODE_RANK", "MASTER_ADDR", "HEAD_IP", "NODE_IP"),
    "k8s": ("NODE_RANK", "MASTER_ADDR", "HEAD_IP", "NODE_IP", "RUNTIME", "SLURM_CONTAINER", "SLURM_OPTIONS"),
}


def _exports(settings, target: str) -> dict[str, str]:
    """The settings this run was given (shell, .env, ARGS, CONFIG) and the variables a launch passes on (NCCL_*,
    ...), less the scheduler's node facts and secrets (those come from the submitter's environment or a Secret)."""
    from app.common import PASS_NAMES, PASS_PREFIXES
    from app.settings import BY_NAME

    given = {name: value.raw for name, value in settings.values.items() if value.raw is not None
             and value.source in ("shell", ".env", "ARGS", "CONFIG") and not BY_NAME[name].make_only}
    for name in MEANINGLESS[target]:
        if name in given and settings.source(name) in ("shell", ".env"):
            raise UserError(f"{name}={given[name]} means nothing for make {target}: the scheduler gives each node its "
                            f"own; unset it")
    passed = {k: v for k, v in settings.environ().items() if v and (k.startswith(PASS_PREFIXES) or k in PASS_NAMES)
              and k not in ("PYTHONPATH", "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES")}
    out = {**passed, **given}
    return {k: v for k, v in sorted(out.items()) if k not in NODE_FACTS and k not in ("SUBMIT", "OUT", "ENV_FILE")
            and not (k in BY_NAME and BY_NAME[k].secret) and not any(m in k for m in ("TOKEN", "KEY", "SECRET"))}


def _run_paths(spec) -> list[Path]:
    paths = [spec.run_dir, *(p for split in ("train", "val") for p in spec.files(split))]
    if any(not path.is_absolute() for path in paths):
        raise UserError("every node reads the run's paths: set CKPT_DIR, DATA_DIR / TRAIN_FILE and MODEL_PATH to "
                        "absolute paths on the shared filesystem")
    return paths


def slurm_script(job: str, settings) -> str:
    """The sbatch script: one task per node on NNODES nodes, each running the same line; node facts from Slurm."""
    from app import spec as specs

    spec = specs.read(job, settings)
    exports, run = _exports(settings, "slurm"), _run_paths(spec)[0]
    (run / "logs").mkdir(parents=True, exist_ok=True)  # Slurm opens --output before the script runs
    container, image = settings["SLURM_CONTAINER"], settings["IMAGE"]
    mounts = sorted({str(REPO_ROOT), str(run.parent), *(str(p.parent) for p in _run_paths(spec)[1:]),
                     *([str(spec.model_path)] if spec.model_path else [])})
    app = {"none": "make -s --no-print-directory RUNTIME=local {target}",
           "docker": "make -s --no-print-directory RUNTIME=docker {target}",
           "pyxis": "python -m app {target}", "apptainer": "python -m app {target}"}[container]
    prefix = {"pyxis": f"--container-image={image} --container-mounts={','.join(f'{m}:{m}' for m in mounts)} "
                       f"--container-workdir={REPO_ROOT} ",
              "apptainer": ""}.get(container, "")
    inner = "apptainer exec --nv " + " ".join(f"--bind {m}" for m in mounts) + f" {image} " if container == "apptainer" \
        else ""
    task = app.format(target="sft") if job == "sft" else \
        f'if [ "$SLURM_NODEID" = 0 ]; then {app.format(target="grpo-head")}; else {app.format(target="grpo-worker")}; fi'
    gpus = settings["GPUS_PER_NODE"]
    lines = ["#!/bin/bash",
             f"# written by `make slurm JOB={job}` (app/schedulers.py); submit with sbatch, from any node of the cluster.",
             "# Each task's NODE_RANK, MASTER_ADDR, HEAD_IP and NODE_IP come from Slurm (its node records); secrets",
             "# (RAY_AUTH_TOKEN, SWANLAB_API_KEY) from the submitting shell, which sbatch passes on (--export=ALL).",
             f"#SBATCH --job-name=verl-stack-{job}-{spec.experiment}", f"#SBATCH --nodes={spec.nnodes}",
             "#SBATCH --ntasks-per-node=1", *([f"#SBATCH --gpus-per-node={gpus}"] if gpus else []),
             f"#SBATCH --output={run}/logs/slurm-{job}-%j.out",
             *(f"#SBATCH {option}" for option in settings.get("SLURM_OPTIONS", ())),
             "set -euo pipefail", f"cd {shlex.quote(str(REPO_ROOT))}",
             *(f"export {name}={shlex.quote(value)}" for name, value in exports.items()),
             f"srun --kill-on-bad-exit=1 --ntasks-per-node=1 {prefix}{inner}bash -c {shlex.quote(task)}"]
    return "\n".join(lines) + "\n"


def k8s_manifests(job: str, settings) -> str:
    """GRPO: a KubeRay RayJob (head + one worker group); SFT: a Training Operator PyTorchJob, or an Indexed Job with a
    headless Service (K8S_SFT=indexed). The image, GPUs per pod, /dev/shm in memory, the checkpoints PVC mounted at
    K8S_MOUNT in every pod, and the settings as the pods' environment."""
    import yaml

    from app import spec as specs

    spec = specs.read(job, settings)
    mount = Path(settings["K8S_MOUNT"])
    outside = [str(p) for p in _run_paths(spec) + ([spec.model_path] if spec.model_path else [])
               if mount not in (p, *p.parents)]
    if outside:
        raise UserError(f"{outside[0]} is not under K8S_MOUNT={mount}, the volume every pod mounts: put the model, data "
                        f"and run directory on it (MODEL_PATH, DATA_DIR, CKPT_DIR under {mount})")
    name = f"verl-stack-{job}-{spec.experiment}".lower().replace("_", "-")[:47].strip("-")
    env = [{"name": k, "value": v} for k, v in _exports(settings, "k8s").items()]
    gpus = settings.get("GPUS_PER_NODE", 1)

    def pod(container: str, command: list[str] | None, extra_env: list[dict] = ()) -> dict:
        spec_ = {"containers": [{"name": container, "image": settings["IMAGE"], "env": [*env, *extra_env],
                                 "resources": {"limits": {"nvidia.com/gpu": gpus}},
                                 "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"},
                                                  {"name": "run", "mountPath": str(mount)}]}],
                 "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}},
                             {"name": "run", "persistentVolumeClaim": {"claimName": settings["K8S_PVC"]}}]}
        if command:
            spec_["containers"][0]["command"] = command
        return {"spec": spec_}

    if job == "grpo":  # KubeRay gives the entrypoint the head's address, not the node count its wait needs
        nnodes = [{"name": "NNODES", "value": str(spec.nnodes)}]
        worker = pod("ray-worker", None, nnodes)
        docs = [{"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": {"name": name}, "spec": {
            "entrypoint": "python -m app grpo-head", "shutdownAfterJobFinishes": True,
            "rayClusterSpec": {"headGroupSpec": {"rayStartParams": {}, "template": pod("ray-head", None, nnodes)},
                               "workerGroupSpecs": [{"groupName": "gpu", "replicas": spec.nnodes - 1,
                                                     "minReplicas": spec.nnodes - 1, "maxReplicas": spec.nnodes - 1,
                                                     "rayStartParams": {}, "template": worker}]}}}]
    elif settings["K8S_SFT"] == "pytorchjob":
        replica = {"restartPolicy": "Never", "template": pod("pytorch", ["python", "-m", "app", "sft"])}
        docs = [{"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": name}, "spec": {
            "nprocPerNode": str(gpus), "pytorchReplicaSpecs": {
                "Master": {"replicas": 1, **replica},
                **({"Worker": {"replicas": spec.nnodes - 1, **replica}} if spec.nnodes > 1 else {})}}}]
    else:
        port = settings["MASTER_PORT"]
        template = pod("sft", ["python", "-m", "app", "sft"], [
            {"name": "NNODES", "value": str(spec.nnodes)}, {"name": "MASTER_ADDR", "value": f"{name}-0.{name}"},
            {"name": "MASTER_PORT", "value": str(port)}])
        template["spec"].update(subdomain=name, restartPolicy="Never")
        template["metadata"] = {"labels": {"app": name}}
        docs = [{"apiVersion": "v1", "kind": "Service", "metadata": {"name": name},
                 "spec": {"clusterIP": "None", "selector": {"app": name}, "ports": [{"port": port}]}},
                {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
                 "spec": {"completionMode": "Indexed", "completions": spec.nnodes, "parallelism": spec.nnodes,
                          "backoffLimit": 0, "template": template}}]
    head = f"# written by `make k8s JOB={job}` (app/schedulers.py): kubectl apply -f <this file>\n"
    dumper = type("NoAliases", (yaml.SafeDumper,), {"ignore_aliases": lambda self, data: True})  # no &id001 in pods
    return head + yaml.dump_all(docs, Dumper=dumper, sort_keys=False)


def main(command: str, argv: list[str], settings) -> int:
    parser = ArgParser(prog=f"python -m app {command}", description=__doc__)
    parser.add_argument("job", nargs="?", choices=("sft", "grpo"), help="sft or grpo (default: JOB, else sft)")
    args = parser.parse_args(argv)
    job = args.job or settings.get("JOB", "sft")
    text = slurm_script(job, settings) if command == "slurm" else k8s_manifests(job, settings)
    out = Path(settings["OUT"] or f"{command}-{job}.{'sbatch' if command == 'slurm' else 'yaml'}").resolve()
    with atomic_path(out, "OUT") as tmp:
        tmp.write_text(text)
    say(f"wrote {out}")
    if command == "slurm" and settings["SUBMIT"]:
        result = subprocess.run(["sbatch", "--parsable", str(out)], env=settings.environ(), capture_output=True,
                                text=True, timeout=60)
        if result.returncode != 0:
            raise UserError(f"sbatch refused {out}: {' '.join(result.stderr.split())[:300]}")
        say(f"submitted as Slurm job {result.stdout.strip()}: its output goes to the run's logs/slurm-{job}-*.out")
    elif command == "slurm":
        say(f"next: sbatch {out} (or make slurm SUBMIT=1)")
    else:
        say(f"next: kubectl apply -f {out}")
    return 0
