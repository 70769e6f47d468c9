"""Every environment variable the stack reads, in one registry, read once per command.

One precedence for all of them: the command line and the shell (`make VAR=value` reaches the app as the
environment) over `.env` (read with python-dotenv, so quotes and `#` comments mean what they mean to compose) over
ARGS' and then CONFIG's keys that a setting owns (ARGS="trainer.experiment_name=x" is EXPERIMENT=x, as verl's own
recipes write it) over the registry's default. An empty value counts as unset: an outer make exports empty
variables. A bad value is one UserError line naming the variable and what is allowed, raised before the command
starts anything.

`python -m app` loads the settings once and hands the frozen `Settings` to the command's main(); no other module
reads os.environ (the few exceptions say why where they are). docs/settings.md, `.env.example` and compose's
pass-through list are rendered from REGISTRY (`python -m app settings --write`; tests/test_settings.py checks).
"""
from __future__ import annotations

import dataclasses
import io
import ipaddress
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from app.common import REPO_ROOT, ArgParser, UserError, refuse_symlink_loop, say

# The commands of `python -m app` (see app/__main__.py), and three readers outside it: the Makefile
# itself, compose's interpolation (image, build arguments) and the processes a launch starts.
LAUNCH = ("sft", "grpo-head", "grpo-worker")
PREFLIGHT = ("check", "config", *LAUNCH, "doctor", "slurm", "k8s")


@dataclass(frozen=True)
class Var:
    """One environment variable: how it is checked, what it means (English, 中文), who reads it."""

    name: str
    kind: str  # text | words | path | paths | step | int | port | ip | ipv4 | host | flag | choice
    default: str | None  # as it would be written in .env; None: unset (the doc says what then)
    doc: str
    zh: str
    commands: tuple[str, ...]
    group: str
    choices: tuple[str, ...] = ()
    minimum: int = 0  # kind int
    example: str | None = None  # .env.example's (commented-out) value; None: not in .env.example
    secret: bool = False  # never printed
    passthrough: bool = True  # listed in compose's `environment:` (reaches the containers)
    make_only: bool = False  # read by make itself: command line or shell only, make reads no .env
    keep_empty: bool = False  # an empty value means something (CUDA_VISIBLE_DEVICES="": no GPU)
    key: str | None = None  # the config key it sets ({model}: the job's model section); ARGS and CONFIG may give it

    @property
    def allowed(self) -> str:
        """What a valid value looks like, as the refusal says it."""
        if self.kind == "int":
            return f"a whole number >= {self.minimum}"
        if self.kind == "port":
            return "a port number 1-65535"
        if self.kind == "ip":
            return "an IP address (IPv4 or IPv6, no port, no hostname)"
        if self.kind == "ipv4":
            return "an IPv4 address, e.g. 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)"
        if self.kind == "host":
            return "an IP address or a hostname (no port)"
        if self.kind == "flag":
            return "1 or 0"
        if self.kind == "choice":
            return " or ".join(", ".join(self.choices).rsplit(", ", 1))
        if self.kind == "words":
            return "words split like a shell line"
        if self.kind == "step":
            return "latest or a step number"
        if self.kind == "portrange":
            return "a port range LOW-HIGH, 1024 <= LOW, at least 50 ports"
        return "any text"


G_CLUSTER, G_RUN, G_ONCE, G_TRACK, G_PASS, G_BUILD, G_MAKE, G_APP = (
    "cluster", "model, data, runs", "one command", "tracking", "passed on", "image", "make", "the app")
GROUP_ZH = {G_CLUSTER: "集群", G_RUN: "模型、数据、运行", G_ONCE: "单次命令", G_TRACK: "记录",
            G_PASS: "透传", G_BUILD: "镜像", G_MAKE: "make", G_APP: "应用本身"}

REGISTRY: tuple[Var, ...] = (
    # --- the cluster: the lines of .env that describe this node -----------------------------------
    Var("NNODES", "int", "1", "machines in the run", "机器数", PREFLIGHT, G_CLUSTER, minimum=1, example="1",
        key="trainer.nnodes"),
    Var("NODE_RANK", "int", "0", "this machine's rank, 0..NNODES-1 (0 on the head): the only line that differs "
        "between nodes", "本机序号 0..NNODES-1（head 为 0），各节点唯一不同的一行", PREFLIGHT, G_CLUSTER, example="0"),
    Var("GPUS_PER_NODE", "int", None, "GPUs each machine uses (default: the GPUs this node sees, else 1)",
        "每台机器使用的 GPU 数（默认：本机可见的 GPU 数，否则 1）", PREFLIGHT, G_CLUSTER, example="8",
        key="trainer.n_gpus_per_node"),
    Var("MASTER_ADDR", "host", None, "node 0's address for SFT across machines (torchrun)",
        "多机 SFT 时 0 号节点的地址（torchrun）", ("sft", "check", "config", "doctor"), G_CLUSTER,
        example="<node 0 IP>"),
    Var("MASTER_PORT", "port", "29500", "node 0's rendezvous port (SFT)", "0 号节点的会合端口（SFT）",
        ("sft", "check", "config"), G_CLUSTER, example="29500"),
    Var("HEAD_IP", "ip", None, "the Ray head's IP as the other nodes reach it (GRPO)",
        "其他节点访问 Ray head 所用的 IP（GRPO）", ("grpo-head", "grpo-worker", "check", "config", "doctor"),
        G_CLUSTER, example="<head node IP>"),
    Var("RAY_PORT", "port", "6379", "the Ray head's port (GRPO)", "Ray head 的端口（GRPO）",
        ("grpo-head", "grpo-worker", "check", "config", "doctor"), G_CLUSTER, example="6379"),
    Var("RAY_PORTS", "portrange", None, "the range Ray's other ports stay in on every node (a firewall's opening), "
        "e.g. 30000-30999: its node and object managers, agents, dashboard, workers", "Ray 其余端口在每个节点上所用的"
        "范围（防火墙开放的范围），如 30000-30999", ("grpo-head", "grpo-worker"), G_CLUSTER),
    Var("NODE_IP", "ip", None, "this node's IP for Ray (worker; default: Ray's guess)",
        "本节点给 Ray 用的 IP（worker；默认由 Ray 推断）", ("grpo-worker",), G_CLUSTER, example="<this node's IP>"),
    Var("DASHBOARD_HOST", "ip", "127.0.0.1", "where the Ray dashboard listens", "Ray 仪表盘监听地址",
        ("grpo-head",), G_CLUSTER),
    Var("RAY_START_ARGS", "words", None, "extra `ray start` flags, e.g. `--num-cpus 32`",
        "追加给 `ray start` 的参数，如 `--num-cpus 32`", ("grpo-head", "grpo-worker"), G_CLUSTER),
    Var("RAY_AUTH_TOKEN", "text", None, "the same Ray token on every node, instead of the head's token file "
        "in the run directory", "各节点使用同一个 Ray 令牌，代替 head 写在运行目录中的令牌文件",
        ("grpo-head", "grpo-worker"), G_CLUSTER, example="", secret=True),
    Var("RAY_AUTH_TOKEN_PATH", "path", None, "where the head writes (and workers read) the token file "
        "(default <run>/.ray_auth_token)", "head 写入、worker 读取令牌文件的位置（默认 <运行目录>/.ray_auth_token）",
        ("grpo-head", "grpo-worker"), G_CLUSTER),
    Var("WAIT_TIMEOUT", "int", "600", "seconds the head waits for the workers (and a worker for the head)",
        "head 等待 worker（及 worker 等待 head）的秒数", ("grpo-head", "grpo-worker"), G_CLUSTER),
    Var("NCCL_SOCKET_IFNAME", "text", None, "the interface NCCL uses between nodes (`make doctor` suggests one)",
        "NCCL 节点间使用的网卡（`make doctor` 会给出建议）", ("doctor", *LAUNCH), G_CLUSTER, example="<interface>"),
    Var("GLOO_SOCKET_IFNAME", "text", None, "the interface Gloo uses between nodes",
        "Gloo 节点间使用的网卡", ("doctor", *LAUNCH), G_CLUSTER, example="<interface>"),
    Var("CUDA_VISIBLE_DEVICES", "text", None, "the GPUs this node uses (default: all)",
        "本节点使用哪些 GPU（默认全部）", ("check", *LAUNCH, "doctor", "eval", "smoke"), G_CLUSTER,
        passthrough=False, keep_empty=True),
    # --- model, data, runs -------------------------------------------------------------------------
    Var("MODEL_PATH", "path", None, "local Hugging Face model directory (required for training; nothing is "
        "downloaded)", "本地 Hugging Face 模型目录（训练必填，不会下载）", PREFLIGHT, G_RUN,
        example="<absolute path of a local model directory>", key="{model}.path"),
    Var("CONFIG", "path", None, "your own verl-style YAML, layered over the profile and under the settings and "
        "ARGS (every unknown key is listed at once, with verl 0.9.1's new name for the old walkthrough's keys)",
        "你自己的 verl 风格 YAML，叠加在 profile 之上、设置与 ARGS 之下（所有未知键一次列出，旧教程中改名的键给出新名）",
        PREFLIGHT, G_RUN),
    Var("DATA_DIR", "path", "data", "where `make prep` writes and training reads",
        "`make prep` 输出与训练读取的数据目录", ("prep", *PREFLIGHT, "eval"), G_RUN,
        example="<absolute path, the same on every node>"),
    Var("TRAIN_FILE", "paths", None, "training parquet, or several as [a,b] (default DATA_DIR/gsm8k_sft or "
        "gsm8k/train.parquet)", "训练 parquet，多个写作 [a,b]（默认 DATA_DIR/gsm8k_sft 或 gsm8k/train.parquet）",
        PREFLIGHT, G_RUN, key="data.train_files"),
    Var("VAL_FILE", "paths", None, "validation parquet, or several as [a,b] (default .../test.parquet)",
        "验证 parquet，多个写作 [a,b]（默认 .../test.parquet）", PREFLIGHT, G_RUN, key="data.val_files"),
    Var("GSM8K_SOURCE", "text", None, "GSM8K to prepare: a directory of .jsonl/.jsonl.gz/.parquet, or hf "
        "(default: the bundled copy)", "要准备的 GSM8K：含 .jsonl/.jsonl.gz/.parquet 的目录，或 hf（默认：仓库自带）",
        ("prep",), G_RUN),
    Var("CKPT_DIR", "path", None, "the run directory (default checkpoints/EXPERIMENT)",
        "运行目录（默认 checkpoints/EXPERIMENT）", (*PREFLIGHT, "gather", "merge", "eval", "report", "board"), G_RUN,
        key="trainer.default_local_dir"),
    Var("EXPERIMENT", "text", None, "the run's name (default sft-gsm8k, grpo-gsm8k)",
        "运行名（默认 sft-gsm8k、grpo-gsm8k）", (*PREFLIGHT, "gather", "merge", "eval", "report"), G_RUN,
        key="trainer.experiment_name"),
    Var("JOB", "choice", None, "which job's run merge/gather/report/eval use, and `make check` checks "
        "(default: the one run present; check: sft)", "merge/gather/report/eval 用哪个任务的运行、`make check` 检查哪个"
        "（默认：现有的那个运行；check 默认 sft）", ("check", "doctor", "gather", "merge", "eval", "report", "slurm", "k8s"),
        G_RUN, choices=("sft", "grpo")),
    Var("ARGS", "words", None, "Hydra overrides appended last: ARGS=\"optim.lr=2e-5 trainer.total_epochs=1\" "
        "(a key that a setting owns, e.g. model.path or trainer.experiment_name, is taken as that setting)",
        "追加在最后的 Hydra 覆盖项：ARGS=\"optim.lr=2e-5 trainer.total_epochs=1\"（属于某个设置的键，如 model.path、"
        "trainer.experiment_name，按该设置读取）", ("check", "config", "sft",
        "grpo-head", "smoke"), G_RUN, example="optim.lr=1e-5 trainer.total_epochs=2"),
    Var("VLLM_ATTENTION_BACKEND", "text", None, "refused: vLLM 0.24 ignores it; configs/grpo.yaml picks the "
        "backend", "会被拒绝：vLLM 0.24 忽略它；注意力后端在 configs/grpo.yaml 中选择", ("check", *LAUNCH),
        G_RUN, passthrough=False),
    Var("VLLM_DISABLE_COMPILE_CACHE", "choice", "0", "vLLM's torch.compile cache: 0 keeps it, so a node's next "
        "start loads what the last one compiled (20 s less on 1xH200); verl 0.9.1 sets 1 unless this is set, for a "
        "corruption that torch >= 2.10 fixed", "vLLM 的 torch.compile 缓存：0 保留，节点下次启动直接加载上次的编译结果"
        "（1xH200 上快 20 秒）；未设置时 verl 0.9.1 会设为 1（针对 torch >= 2.10 已修复的缓存损坏）",
        ("grpo-head", "grpo-worker"), G_RUN, choices=("0", "1")),
    Var("RAY_WARM_WORKERS", "flag", "1", "Ray's workers on GRPO nodes import verl before they are given work "
        "(app/rayworker.py): the actors verl starts one after another then find a process that has imported (GRPO's "
        "first step 42 s sooner on 1xH100); verl's job environment is set on `ray start` instead, since Ray prestarts "
        "workers (one per core, at most 32, ~0.5 GB each) only for a job without one; 0 turns it off",
        "GRPO 节点上 Ray 的 worker 在接到任务前先导入 verl（app/rayworker.py）：verl 依次启动的 actor 直接使用已完成导入的进程"
        "（1xH100 上 GRPO 第一步提前 42 秒）；verl 的作业环境变量改在 `ray start` 时设置，因为 Ray 只为没有 runtime_env 的作业"
        "预启动 worker（每核一个，最多 32 个，每个约 0.5 GB）；设为 0 关闭",
        ("grpo-head", "grpo-worker"), G_RUN),
    Var("TORCH_COMPILE_JOB_ID", "text", "verl-stack", "torch.compile's job id: with one, PyTorch keeps beside "
        "Inductor's cache which input sizes changed between calls, and the next run on the node compiles those "
        "dynamic from its first call (FlexAttention in the first step: once per grad mode, not twice; 34 s less of "
        "GRPO's first step on 1xH200); TORCH_DYNAMO_AUTOMATIC_DYNAMIC_LOCAL_PGO=0 turns that off",
        "torch.compile 的 job id：设置后 PyTorch 在 Inductor 缓存旁记录哪些输入尺寸在调用间变化过，节点上的下一次运行"
        "从第一次调用起就按动态尺寸编译（第一步的 FlexAttention 每种梯度模式编译一次而非两次；1xH200 上 GRPO 第一步快 34 秒）；"
        "TORCH_DYNAMO_AUTOMATIC_DYNAMIC_LOCAL_PGO=0 可关闭", LAUNCH, G_RUN),
    # --- one command: set on the command line ------------------------------------------------------
    Var("DRY_RUN", "flag", "0", "print the exact commands and environment after preflight, start nothing",
        "预检后只打印确切的命令和环境变量，不启动", (*LAUNCH, "smoke", "demo"), G_ONCE),
    Var("FRESH", "flag", "0", "move the previous run aside (never deleted) and start over; otherwise a rerun "
        "resumes (demo: rerun every stage)", "把旧运行目录移到一旁（不删除）后重新开始；否则重跑会续训（demo：所有阶段重跑）",
        ("sft", "grpo-head", "demo"), G_ONCE),
    Var("STEP", "step", None, "which step: merge/gather (default latest), eval (the merged step)",
        "哪一步：merge/gather（默认最新）、eval（已合并的步）", ("gather", "merge", "eval"), G_ONCE),
    Var("OUT_DIR", "path", None, "merge's output (default models/<run>-step<N>); eval reads it",
        "merge 的输出目录（默认 models/<运行名>-step<N>）；eval 也读取", ("merge", "eval"), G_ONCE),
    Var("FORCE", "flag", "0", "replace an existing output (merge, data check --fix, tiny-model)",
        "覆盖已有输出（merge、data check --fix、tiny-model）", ("merge", "data", "tiny-model"), G_ONCE),
    Var("NODES", "text", None, "gather's sources: \"host1 host2\" ([user@]host[:RUN_DIR])",
        "gather 的来源：\"host1 host2\"（[user@]host[:运行目录]）", ("gather",), G_ONCE),
    Var("RSYNC_RSH", "text", None, "rsync's own: ssh port/key for gather, e.g. \"ssh -p 2222 -i ~/.ssh/key\"",
        "rsync 自己的变量：gather 用的 ssh 端口/密钥", ("gather",), G_ONCE),
    Var("MODEL", "path", None, "eval: the model directory (instead of STEP)", "eval：模型目录（代替 STEP）",
        ("eval",), G_ONCE),
    Var("EVAL_FILE", "path", None, "eval: the RL parquet to score (default DATA_DIR/gsm8k/test.parquet)",
        "eval：要评测的 RL parquet（默认 DATA_DIR/gsm8k/test.parquet）", ("eval",), G_ONCE),
    Var("LIMIT", "int", None, "eval: the first N test rows (default all)", "eval：只取前 N 行（默认全部）",
        ("eval",), G_ONCE, minimum=1),
    Var("OUT", "path", None, "eval's output (default <model>/eval); tiny-model's (default models/tiny); slurm's and "
        "k8s's file (default slurm-JOB.sbatch, k8s-JOB.yaml)", "eval 的输出（默认 <模型>/eval）；tiny-model 的输出（默认 "
        "models/tiny）；slurm、k8s 写出的文件（默认 slurm-JOB.sbatch、k8s-JOB.yaml）", ("eval", "tiny-model", "slurm", "k8s"),
        G_ONCE),
    Var("SUBMIT", "flag", "0", "make slurm: also submit the script (sbatch)", "make slurm：写出后直接提交（sbatch）",
        ("slurm",), G_ONCE),
    Var("SLURM_CONTAINER", "choice", "none", "make slurm: how each task runs the stack: none (this checkout's .venv or "
        "PYTHON on every node), docker (make's compose), pyxis (srun --container-image=IMAGE), apptainer (IMAGE, a .sif)",
        "make slurm：每个任务如何运行：none（各节点上本仓库的 .venv 或 PYTHON）、docker（compose）、pyxis（srun "
        "--container-image=IMAGE）、apptainer（IMAGE 为 .sif 文件）", ("slurm",), G_CLUSTER,
        choices=("none", "docker", "pyxis", "apptainer")),
    Var("SLURM_OPTIONS", "words", None, "make slurm: more #SBATCH lines, e.g. \"--partition=gpu --time=8:00:00\"",
        "make slurm：追加的 #SBATCH 选项，如 \"--partition=gpu --time=8:00:00\"", ("slurm",), G_CLUSTER),
    Var("K8S_PVC", "text", "verl-stack", "make k8s: the PersistentVolumeClaim every pod mounts (model, data, runs)",
        "make k8s：每个 pod 挂载的 PVC（模型、数据、运行目录）", ("k8s",), G_CLUSTER),
    Var("K8S_MOUNT", "path", "/workspace", "make k8s: where the PVC is mounted in every pod; MODEL_PATH, DATA_DIR and "
        "CKPT_DIR lie under it", "make k8s：PVC 在每个 pod 中的挂载点；MODEL_PATH、DATA_DIR、CKPT_DIR 须在其下",
        ("k8s",), G_CLUSTER),
    Var("K8S_SFT", "choice", "pytorchjob", "make k8s JOB=sft: a Training Operator PyTorchJob, or an Indexed Job with a "
        "headless Service where the operator is absent", "make k8s JOB=sft：Training Operator 的 PyTorchJob，或集群中"
        "没有该 operator 时的 Indexed Job 加 headless Service", ("k8s",), G_CLUSTER, choices=("pytorchjob", "indexed")),
    Var("EVAL_BACKEND", "choice", "auto", "eval's generator (auto: vLLM on a GPU, else transformers)",
        "eval 的生成后端（auto：有 GPU 用 vLLM，否则 transformers）", ("eval",), G_ONCE,
        choices=("auto", "vllm", "hf", "reference")),
    Var("EVAL_BATCH", "int", None, "eval's batch with transformers (default 32 on a GPU, 8 on CPU)",
        "eval 使用 transformers 时的批大小（默认 GPU 32、CPU 8）", ("eval",), G_ONCE, minimum=1),
    Var("MAX_NEW_TOKENS", "int", "1024", "eval: new tokens per answer", "eval：每个回答的最大新 token 数",
        ("eval",), G_ONCE),
    Var("EVAL_TP", "int", "1", "eval: vLLM tensor parallel size", "eval：vLLM 张量并行数", ("eval",), G_ONCE,
        minimum=1),
    Var("FILE", "path", None, "data-check: the parquet to check", "data-check：要检查的 parquet", ("data",), G_ONCE),
    Var("KIND", "choice", None, "data-check: rl or sft (default: from the columns)", "data-check：rl 或 sft"
        "（默认按列判断）", ("data",), G_ONCE, choices=("rl", "sft")),
    Var("FIX", "path", None, "data-check: write a fixed copy here", "data-check：修复后的副本写到这里",
        ("data",), G_ONCE),
    Var("RUN", "path", None, "report/board: the run directory", "report/board：运行目录", ("report", "board"),
        G_ONCE),
    Var("SMOKE_DIR", "path", "checkpoints/smoke", "where `make smoke` works", "`make smoke` 的工作目录",
        ("smoke",), G_ONCE),
    Var("SMOKE_STEPS", "int", "12", "SFT steps of `make smoke`", "`make smoke` 的 SFT 步数", ("smoke",), G_ONCE),
    Var("DEMO_DIR", "path", "checkpoints/demo", "where `make demo` works", "`make demo` 的工作目录", ("demo",), G_ONCE),
    Var("DEMO_SFT_STEPS", "int", "300", "SFT steps of `make demo`", "`make demo` 的 SFT 步数", ("demo",), G_ONCE,
        minimum=4),
    Var("DEMO_GRPO_STEPS", "int", "12", "GRPO steps of `make demo`", "`make demo` 的 GRPO 步数", ("demo",), G_ONCE,
        minimum=4),
    Var("DEMO_UNTIL", "choice", None, "stop `make demo` after this stage (a rerun goes on from there)",
        "`make demo` 在此阶段后停下（再次运行从那里继续）", ("demo",), G_ONCE, example="eval-sft",
        choices=("prep", "tiny-model", "sft", "merge-sft", "eval-sft", "grpo", "merge-grpo", "report")),
    # --- tracking ----------------------------------------------------------------------------------
    Var("SWANLAB_MODE", "choice", "local", "swanlab: local (no account), offline, cloud (with SWANLAB_API_KEY), "
        "disabled", "swanlab：local（无需账号）、offline、cloud（需 SWANLAB_API_KEY）、disabled",
        ("sft", "grpo-head", "grpo-worker"), G_TRACK, choices=("local", "offline", "cloud", "disabled"),
        example="local"),
    Var("SWANLAB_API_KEY", "text", None, "swanlab's own: the key for SWANLAB_MODE=cloud", "swanlab 自己的变量：cloud 模式的密钥",
        LAUNCH, G_TRACK, secret=True),
    Var("PROJECT", "text", None, "tracking project name (trainer.project_name)", "记录用的项目名（trainer.project_name）",
        PREFLIGHT, G_TRACK, key="trainer.project_name"),
    Var("BOARD_HOST", "ipv4", "127.0.0.1", "where `make board` listens", "`make board` 监听地址", ("board",), G_TRACK),
    Var("BOARD_PORT", "port", "5092", "`make board`'s port", "`make board` 的端口", ("board",), G_TRACK),
    # --- passed on to verl, NCCL, transformers (read by them, not by us) ---------------------------
    Var("NCCL_IB_HCA", "text", None, "NCCL's own: InfiniBand adapters when there are several (`ibv_devices`)",
        "NCCL 自己的变量：有多块 InfiniBand 网卡时选用哪些（`ibv_devices`）", LAUNCH, G_PASS, example="mlx5_0,mlx5_1"),
    Var("NCCL_DEBUG", "text", None, "NCCL's own: INFO to see which interface and transport it picks",
        "NCCL 自己的变量：设为 INFO 查看所选网卡与传输方式", LAUNCH, G_PASS, example="INFO"),
    Var("HF_HUB_OFFLINE", "text", None, "Hugging Face's own: 1 = never reach the hub (air-gapped nodes)",
        "Hugging Face 自己的变量：1 = 从不访问 hub（离线集群）", (*LAUNCH, "eval", "prep"), G_PASS, example="1"),
    # --- the image (compose reads these itself, from .env too) -------------------------------------
    Var("IMAGE", "text", "verl-stack:0.1.0", "the image every service runs (`make build` tags it)",
        "所有服务运行的镜像（`make build` 打的标签）", ("compose", "slurm", "k8s"), G_BUILD, example="verl-stack:0.1.0",
        passthrough=False),
    Var("FLASH_ATTN_CUDA_ARCHS", "text", "80;90", "GPU archs flash-attn is built for (80 = A100, 90 = H100/H200)",
        "flash-attn 编译的 GPU 架构（80 = A100，90 = H100/H200）", ("compose",), G_BUILD, passthrough=False),
    Var("MAX_JOBS", "int", "8", "parallel jobs of the flash-attn build", "flash-attn 编译的并行任务数",
        ("compose",), G_BUILD, minimum=1, passthrough=False),
    # --- make itself: the command line or the shell only -------------------------------------------
    Var("RUNTIME", "choice", "auto", "auto (docker where an engine answers and the image is on this node, else "
        "local; it says which), docker, local", "auto（Docker 引擎可用且本节点有镜像时用 docker，否则 local，并说明）、docker、local", ("make",), G_MAKE, choices=("auto", "docker", "local"),
        passthrough=False, make_only=True),
    Var("PYTHON", "text", None, "the interpreter of RUNTIME=local (default .venv/bin/python, else python3)",
        "RUNTIME=local 使用的解释器（默认 .venv/bin/python，否则 python3）", ("make",), G_MAKE, passthrough=False,
        make_only=True),
    Var("IB", "choice", "auto", "docker: the InfiniBand overlay compose.ib.yaml (auto: where /dev/infiniband exists)",
        "docker：InfiniBand 覆盖文件 compose.ib.yaml（auto：存在 /dev/infiniband 时）", ("make",), G_MAKE,
        choices=("auto", "0", "1"),
        passthrough=False, make_only=True),
    Var("GPU", "choice", "auto", "docker: the GPU overlay compose.gpu.yaml (auto: where the engine has the NVIDIA "
        "runtime)", "docker：GPU 覆盖文件 compose.gpu.yaml（auto：引擎有 NVIDIA runtime 时）", ("make",), G_MAKE,
        choices=("auto", "0", "1"), passthrough=False, make_only=True),
    Var("MOUNTS", "words", None, "docker: more host directories mounted at the same path", "docker：额外按相同路径挂载的目录",
        ("make",), G_MAKE, passthrough=False, make_only=True),
    Var("STACK_HOME", "path", None, "docker: the containers' HOME on the host (default ~/.cache/verl-stack/home)",
        "docker：容器 HOME 在主机上的位置（默认 ~/.cache/verl-stack/home）", ("make",), G_MAKE, passthrough=False,
        make_only=True),
    Var("COMPOSE_PROJECT_NAME", "text", None, "docker: compose's project name (default: the checkout's name)",
        "docker：compose 项目名（默认：仓库目录名）", ("make",), G_MAKE, passthrough=False, make_only=True),
    Var("FLAVOR", "choice", "gpu", "make build: gpu (the pinned CUDA image) or cpu (tests, laptops)",
        "make build：gpu（固定的 CUDA 镜像）或 cpu（测试、笔记本）", ("build",), G_BUILD, choices=("gpu", "cpu"),
        passthrough=False, make_only=True),
    Var("BASE_IMAGE", "text", None, "make build: the base image (required for cpu; never pulled)",
        "make build：基础镜像（cpu 必填；从不拉取）", ("build",), G_BUILD, passthrough=False, make_only=True),
    Var("BUILDER", "choice", "buildkit", "make build: buildkit or legacy", "make build：buildkit 或 legacy", ("build",),
        G_BUILD, choices=("buildkit", "legacy"), passthrough=False, make_only=True),
    Var("SITE_CA", "path", None, "make build: a CA bundle for pip behind a TLS-inspecting proxy (not kept in the image)",
        "make build：pip 所需的站点 CA（不留在镜像里）", ("build",), G_BUILD, passthrough=False, make_only=True),
    Var("WHEELS", "path", None, "make build: a directory of wheels pip may use (e.g. the CPU torch)",
        "make build：pip 可用的 wheel 目录（如 CPU 版 torch）", ("build",), G_BUILD, passthrough=False, make_only=True),
    Var("TORCH_INDEX_URL", "text", None, "make build FLAVOR=cpu: an index with CPU torch wheels",
        "make build FLAVOR=cpu：含 CPU torch 的索引", ("build",), G_BUILD, passthrough=False, make_only=True),
    Var("PIP_INDEX_URL", "text", None, "make build: pip's package index inside the build",
        "make build：构建中 pip 使用的索引", ("build",), G_BUILD, passthrough=False, make_only=True),
    Var("PIP_EXTRA_INDEX_URL", "text", None, "make build: pip's extra index inside the build",
        "make build：构建中 pip 的额外索引", ("build",), G_BUILD, passthrough=False, make_only=True),
    Var("BUILD_FILES_PORT", "port", "45871", "make build: the loopback port SITE_CA and WHEELS are served on",
        "make build：SITE_CA 与 WHEELS 在回环地址上的端口", ("build",), G_BUILD, passthrough=False, make_only=True),
    # --- the app itself --------------------------------------------------------------------------------
    Var("ENV_FILE", "path", ".env", "the dotenv file to read (shell only)", "要读取的 dotenv 文件（仅限 shell 设置）",
        ("all",), G_APP, passthrough=False),
    Var("APP_DEBUG", "flag", "0", "1: a traceback instead of the one-line internal error",
        "1：内部错误时打印完整 traceback", ("all",), G_APP),
    Var("SFT_TRAINER_MODULE", "text", "verl.trainer.sft_trainer", "test hook: the SFT entry module",
        "测试钩子：SFT 入口模块", ("sft",), G_APP),
    Var("GRPO_TRAINER_MODULE", "text", "verl.trainer.main_ppo", "test hook: the GRPO entry module",
        "测试钩子：GRPO 入口模块", ("grpo-head",), G_APP),
)
BY_NAME: Mapping[str, Var] = MappingProxyType({var.name: var for var in REGISTRY})
assert len(BY_NAME) == len(REGISTRY), "a variable is registered twice"

_FLAGS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
_HOSTNAME = re.compile(r"(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}"
                       r"[A-Za-z0-9])?)*\.?")


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


def parse(var: Var, raw: str) -> Any:
    """`raw` as `var`'s type; ValueError when it is not allowed (the caller names the variable)."""
    kind = var.kind
    if kind in ("text", "path"):
        return raw
    if kind == "words":
        return tuple(shlex.split(raw))
    if kind == "paths":  # one path, or Hydra's list of them: [a.parquet,b.parquet]
        text = raw.strip()
        if text.startswith("[") and text.endswith("]"):
            return tuple(_unquoted(item) for item in text[1:-1].split(",") if item.strip())
        return (raw,)
    if kind == "portrange":  # LO-HI: room for a node's fixed ports and a worker port each
        low, _, high = raw.partition("-")
        if not (low.strip().isdigit() and high.strip().isdigit() and 1024 <= int(low) and int(low) + 50 <= int(high)
                <= 65535):
            raise ValueError(raw)
        return int(low), int(high)
    if kind == "step":
        if raw.strip() == "latest":
            return "latest"
        if not raw.strip().isdigit():
            raise ValueError(raw)
        return int(raw)
    if kind in ("int", "port"):
        if not re.fullmatch(r"\s*\d+\s*", raw):
            raise ValueError(raw)
        number = int(raw)
        if kind == "port" and not 1 <= number <= 65535 or kind == "int" and number < var.minimum:
            raise ValueError(raw)
        return number
    if kind == "ip":
        return str(ipaddress.ip_address(raw))
    if kind == "ipv4":
        return str(ipaddress.IPv4Address(raw))
    if kind == "host":
        # A hostname has a letter in its last label: 300.1.1.1 is a broken IPv4 address, not a name.
        if _is_ip(raw) or (_HOSTNAME.fullmatch(raw) and not raw.rstrip(".").rsplit(".", 1)[-1].isdigit()):
            return raw
        raise ValueError(raw)
    if kind == "flag":
        if raw.strip().lower() not in _FLAGS:
            raise ValueError(raw)
        return _FLAGS[raw.strip().lower()]
    if kind == "choice":
        if raw not in var.choices:
            raise ValueError(raw)
        return raw
    raise AssertionError(f"unknown kind {kind} of {var.name}")


def setting_type(name: str):
    """An argparse `type` that reads a flag as the setting `name` reads its value: one rule for both."""
    def read(text: str):
        value = _value(BY_NAME[name], text, "command line")
        if value.error:
            raise UserError(value.error)
        return value.value
    return read


def _unquoted(text: str) -> str:
    text = text.strip()
    return text[1:-1] if len(text) > 1 and text[0] == text[-1] and text[0] in "'\"" else text


# --- the settings that ARGS and CONFIG may give through their config keys -----------------------------
RAY_ADDRESS_KEY = "ray_kwargs.ray_init.address"  # HEAD_IP:RAY_PORT
NODE_FACTS = ("NNODES", "GPUS_PER_NODE", "HEAD_IP", "RAY_PORT")  # CONFIG's are replaced by this machine's
_OVERRIDE = re.compile(r"\+{0,2}([A-Za-z_][\w.]*)=(.*)", re.S)


def owned_keys() -> dict[str, str]:
    """config key -> the setting that owns it (the model's path as either job spells it)."""
    return {var.key.format(model=model): var.name for var in REGISTRY if var.key
            for model in ("model", "actor_rollout_ref.model")}


def _plain(value: object) -> str | None:
    """A config value as a setting's text where it is a plain value or list; None where it is null, an
    interpolation or a mapping (those stay with Hydra, and preflight checks what they compose to)."""
    if isinstance(value, (list, tuple)):
        items = [_plain(item) for item in value]
        return None if None in items else "[" + ",".join(items) + "]"
    if value is None or isinstance(value, (dict, bool)):
        return None
    text = _unquoted(str(value))
    if text in ("", "null", "~") or "${" in text or text.startswith("{"):
        return None
    if text.startswith("[") and text.endswith("]"):
        return _plain([_unquoted(item) for item in text[1:-1].split(",") if item.strip()])
    return text


def owned_in(leaves: Mapping[str, object]) -> dict[str, tuple[str, str]]:
    """The settings that config keys give, with the override that gave each: {"MODEL_PATH": ("model.path=/m", "/m"),
    "HEAD_IP": ("ray_kwargs.ray_init.address=127.0.0.1:6379", "127.0.0.1"), ...}."""
    keys, out = owned_keys(), {}
    for key, value in leaves.items():
        text = _plain(value)
        if text is None:
            continue
        if key == RAY_ADDRESS_KEY and ":" in text:
            host, port = text.rsplit(":", 1)
            out["HEAD_IP"], out["RAY_PORT"] = (f"{key}={text}", host.strip("[]")), (f"{key}={text}", port)
        elif key in keys:
            out[keys[key]] = (f"{key}={text}", text)
    return out


def split_args(words: tuple[str, ...]) -> tuple[dict[str, tuple[str, str]], tuple[str, ...]]:
    """ARGS' overrides of keys that a setting owns (read as that setting, as `make settings` shows) and the rest,
    in order, which go to Hydra last."""
    owned: dict[str, str] = {}
    rest = []
    for word in words:
        match = _OVERRIDE.fullmatch(word)
        given = owned_in({match.group(1): match.group(2)}) if match else {}
        if given:
            owned.update(given)
        else:
            rest.append(word)
    return owned, tuple(rest)


def _same(var: Var, a: Any, b: Any) -> bool:
    """Two parsed values of `var` name the same thing (paths: the same place here)."""
    if var.kind in ("path", "paths"):
        def where(x):
            return tuple(os.path.realpath(os.path.expanduser(p)) for p in (x if isinstance(x, tuple) else (x,)))
        return where(a) == where(b)
    return a == b


@dataclass(frozen=True)
class Value:
    raw: str | None  # the text as given; None when unset
    source: str  # shell | .env | ARGS | CONFIG | default
    value: Any = None  # parsed (the default's when unset); None when unset without a default
    error: str | None = None  # the refusal, when `raw` is not allowed


def _refusal(var: Var, raw: str, source: str, detail: str = "") -> str:
    where = " (from .env)" if source == ".env" else ""
    if var.kind == "words":
        return f"{var.name} cannot be split like a shell line ({detail}){where}: check its quotes"
    unset = f", or unset it (default {var.default})" if var.default is not None else ", or unset it"
    return f"{var.name}={raw!r}{where} is not {var.allowed}: set {var.name} to {var.allowed}{unset}"


def _value(var: Var, raw: str | None, source: str) -> Value:
    if raw is None:
        return Value(None, "default", None if var.default is None else parse(var, var.default))
    try:
        value = parse(var, raw)
        for path in (value if var.kind == "paths" else [value] if var.kind == "path" else []):
            refuse_symlink_loop(path, var.name)  # pathlib would read a loop as absent, or raise
        return Value(raw, source, value)
    except ValueError as exc:
        return Value(raw, source, error=_refusal(var, raw, source, str(exc)))
    except UserError as exc:
        return Value(raw, source, error=str(exc))


@dataclass(frozen=True, eq=False)
class Settings:
    """The settings of one command: every registered variable's value and where it came from, plus the
    environment handed on to the processes the command starts."""

    values: Mapping[str, Value]
    shell: Mapping[str, str]  # the process environment when the command started
    dotenv: Mapping[str, str]  # the lines of the .env file (every name, ours or not)
    env_file: Path
    ignored: tuple[str, ...] = ()  # names in .env that only make reads (make reads no .env)
    misspelt: tuple[str, ...] = ()  # names in .env close to a setting's but none: "NNODE (did you mean NNODES?)"
    args: tuple[str, ...] = ()  # ARGS less the overrides read as settings: what Hydra gets, last
    config: Mapping[str, object] | None = None  # CONFIG's leaves {dotted key: value}, read once
    repeated: tuple[str, ...] = ()  # names .env sets twice to different values: "NNODES (line 2: 1, line 9: 2)"

    def __getitem__(self, name: str) -> Any:
        value = self.values[name]
        if value.error:
            raise UserError(value.error)
        return value.value

    def get(self, name: str, default: Any = None) -> Any:
        value = self[name]
        return default if value is None else value

    def raw(self, name: str) -> str | None:
        """The text as given (ARGS as written, to hand on to a child command), None when unset."""
        self[name]  # a bad value is refused here too
        return self.values[name].raw

    def source(self, name: str) -> str:
        return self.values[name].source

    def is_set(self, name: str) -> bool:
        return self.values[name].raw is not None

    def environ(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of the processes a command starts: the shell's, plus the lines of .env it does not
        set (as compose hands .env to containers: NCCL_SOCKET_IFNAME in .env must reach NCCL), plus `extra`."""
        out = dict(self.shell)
        for name, value in self.dotenv.items():
            var = BY_NAME.get(name)
            if var is not None and (var.make_only or (var.keep_empty and name in out)):
                continue  # as load() reads them: make's own are not the app's; CUDA_VISIBLE_DEVICES="" stands
            if value and not out.get(name):
                out[name] = value
        for name, value in self.values.items():  # what ARGS, CONFIG, a scheduler gave: compose mounts, passes them
            if value.source not in ("shell", ".env", "default"):
                out[name] = value.raw
        out.update(extra or {})
        return out

    def check(self, command: str) -> None:
        """Refuse, one line, the first bad value among the variables `command` reads; a launch also refuses a
        misspelt name in .env (doctor warns of it)."""
        if self.repeated and command in LAUNCH:
            raise UserError(f"{self.env_file} sets {', '.join(self.repeated)}: only the last counts; keep one line each")
        if self.misspelt and command in LAUNCH:
            many = len(self.misspelt) > 1
            raise UserError(f"{self.env_file}: {', '.join(self.misspelt)} {'are' if many else 'is'} not a setting, so "
                            f"the stack would not read {'them' if many else 'it'}: rename (`make settings` lists "
                            "every setting)")
        for var in REGISTRY:
            error = self.values[var.name].error
            if error and (command in var.commands or "all" in var.commands):
                raise UserError(error)


def read_dotenv(path: Path) -> dict[str, str]:
    """The NAME=value lines of `path` as python-dotenv reads them (quotes removed, `#` comments skipped,
    no ${VAR} expansion: the value is what is written); a line it cannot read is a one-line refusal."""
    from dotenv import dotenv_values
    from dotenv.parser import parse_stream

    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"cannot read {path} ({exc.strerror}): fix its permissions, or point ENV_FILE at "
                        "another file") from None
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[:exc.start].count(b"\n") + 1
        raise UserError(f"{path} line {line} is not UTF-8 text: save the file as UTF-8 (compose reads it as "
                        "UTF-8 too)") from None
    for binding in parse_stream(io.StringIO(text)):
        if binding.error:
            line = binding.original.string.strip().splitlines()[0]
            raise UserError(f"{path} line {binding.original.line}: cannot read {line!r}: write NAME=value "
                            "(quote a value with spaces: NAME=\"a b\")")
    values = dotenv_values(stream=io.StringIO(text), interpolate=False)
    return {name: value for name, value in values.items() if value is not None}


def repeated(path: Path) -> list[str]:
    """`NAME (line 3: a, line 9: b)` for each name that `path` sets twice to different values: compose and dotenv
    keep the last without a word, which is rarely what the one who wrote the first meant."""
    from dotenv.parser import parse_stream

    seen: dict[str, list[tuple[int, str]]] = {}
    for binding in parse_stream(io.StringIO(path.read_text(encoding="utf-8"))):
        if binding.key:
            seen.setdefault(binding.key, []).append((binding.original.line, binding.value))
    return [f"{name} ({', '.join(f'line {line}: {value}' for line, value in lines)})" for name, lines in seen.items()
            if len({value for _, value in lines}) > 1]


def load(environ: Mapping[str, str] | None = None) -> Settings:
    """Read the settings once: `environ` (default: this process's environment) over ENV_FILE (default
    ./.env, where make and compose run) over the defaults. Bad values are kept as errors;
    Settings.check(command) refuses them."""
    # The one read of the process environment: everything else gets it from here.
    shell = dict(os.environ if environ is None else environ)
    env_file = Path(shell.get("ENV_FILE") or ".env")
    if shell.get("ENV_FILE") and not env_file.is_file() and str(env_file) != os.devnull:
        # asked for by name: silence would run on the defaults
        raise UserError(f"ENV_FILE={shell['ENV_FILE']} {'is not a file' if env_file.exists() else 'does not exist'}: "
                        "point it at your dotenv file, or unset it to read ./.env")
    dotenv = read_dotenv(env_file) if env_file.is_file() else {}
    values, ignored = {}, []
    for var in REGISTRY:
        if shell.get(var.name) or (var.keep_empty and var.name in shell):
            values[var.name] = _value(var, shell[var.name], "shell")
        elif dotenv.get(var.name) and var.make_only:
            ignored.append(var.name)
            values[var.name] = _value(var, None, "default")
        elif dotenv.get(var.name) and var.name != "ENV_FILE":
            values[var.name] = _value(var, dotenv[var.name], ".env")
        else:
            values[var.name] = _value(var, None, "default")
    args, config = _owned_by_args_and_config(values)
    from app.schedulers import facts

    scheduler, given = facts(shell)  # a Slurm job, a Kubernetes pod, SkyPilot: node facts the user did not set
    for name, text in given.items():
        if text and values[name].raw is None:
            values[name] = _value(BY_NAME[name], text, scheduler)
    return Settings(MappingProxyType(values), MappingProxyType(shell), MappingProxyType(dict(dotenv)), env_file,
                    tuple(ignored), tuple(misspelt(dotenv)), args, config, tuple(repeated(env_file) if dotenv else ()))


def _owned_by_args_and_config(values: dict[str, Value]) -> tuple[tuple[str, ...], Mapping[str, object] | None]:
    """The settings given through config keys, in `values`: ARGS' below the shell and .env (a different value in
    both is refused: keep one), CONFIG's below ARGS and above the defaults, except this machine's facts (NNODES,
    GPUS_PER_NODE, the Ray address), which preflight warns of instead. Returns ARGS' rest and CONFIG's leaves."""
    arguments, config = values["ARGS"], values["CONFIG"]
    owned, rest = split_args(arguments.value) if arguments.value and not arguments.error else ({}, ())
    leaves = None
    if config.value and not config.error:
        try:
            leaves = read_config(Path(config.value))
        except UserError as exc:
            values["CONFIG"] = dataclasses.replace(config, error=str(exc))
        except ModuleNotFoundError:  # app.containers on a bare host: the app reads CONFIG again, inside
            pass
    for source, given in (("ARGS", owned), ("CONFIG", owned_in(leaves or {}))):
        for name, (override, text) in given.items():
            var, before = BY_NAME[name], values[name]
            taken = _value(var, text, source)
            if before.raw is None and (source == "ARGS" or name not in NODE_FACTS):
                values[name] = taken
            elif source == "ARGS" and before.source != "ARGS" and not (before.error or taken.error) \
                    and not _same(var, before.value, taken.value):
                values[name] = dataclasses.replace(before, error=(
                    f"ARGS sets {override}, which is {name}, but {name}={before.raw} (from {before.source}): keep "
                    f"one (ARGS' keys that a setting owns are read as that setting)"))
    return rest, (MappingProxyType(leaves) if leaves is not None else None)


IGNORED_TOP_KEYS = ("defaults", "hydra")  # a walkthrough file's own Hydra plumbing: we layer it ourselves


def read_config(path: Path) -> dict[str, object]:
    """CONFIG's leaves {dotted key: value}, parsed as Hydra parses config files (OmegaConf: `1e-5` is a float),
    interpolations kept as written."""
    from omegaconf import DictConfig, OmegaConf  # ModuleNotFoundError on a bare host: the caller knows
    from omegaconf.errors import OmegaConfBaseException
    import yaml

    path = path.expanduser()
    if not path.is_file():
        what = "is not a file: point CONFIG at one YAML file" if path.exists() else \
            f"does not exist: point CONFIG at your verl-style YAML file (relative paths start at {Path.cwd()})"
        raise UserError(f"CONFIG={path} {what}")
    try:
        loaded = OmegaConf.load(path)
    except (yaml.YAMLError, OmegaConfBaseException, UnicodeDecodeError) as exc:
        raise UserError(f"CONFIG={path} is not valid YAML ({' '.join(str(exc).split())[:200]}): fix it") from None
    if not isinstance(loaded, DictConfig):
        raise UserError(f"CONFIG={path} holds a list, not a mapping of verl settings (`data: {{...}}`): fix it")
    tree = OmegaConf.to_container(loaded, resolve=False)
    for key in IGNORED_TOP_KEYS:
        tree.pop(key, None)
    return leaves(tree)


def leaves(tree: Mapping, prefix: str = "") -> dict[str, object]:
    """{dotted key: value} of a nested mapping's leaves (an empty mapping is a leaf)."""
    out: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            out.update(leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def misspelt(dotenv: Mapping[str, str]) -> list[str]:
    """`NAME (did you mean SETTING?)` for each .env name that is no setting but one of ours written with another
    case, an underscore more or less, or without its plural S (NNODE, DATADIR, model_path): .env hands it on to
    the processes, but the stack itself would not read it, and NNODE=2 would train on one node. Anything else in
    .env (WANDB_API_KEY, NVIDIA_VISIBLE_DEVICES, a proxy) is the user's and passes."""
    import difflib

    def shape(name: str) -> str:
        return name.upper().replace("_", "")

    # ours as written, and those ending in S without it (NNODE); not the other way: STEPS or MODELS may be anyone's
    ours = {shape(name): name for name in BY_NAME}
    ours.update({shape(name)[:-1]: name for name in BY_NAME if name.endswith("S") and shape(name)[:-1] not in ours})
    out = []
    for name in dotenv:
        if name in BY_NAME or len(name) < 5:  # too short to tell a typo from a name of one's own
            continue
        # one letter more, less or other in a longer name (GPU_PER_NODE, MASTER_ADR); NVIDIA_VISIBLE_DEVICES is not
        close = ours.get(shape(name))
        if not close and len(shape(name)) >= 8:
            close = next(iter(difflib.get_close_matches(shape(name), ours, 1, 0.9)), None)
        if close:
            out.append(f"{name} (did you mean {ours.get(close, close)}?)")
    return out


# --- what the registry renders: compose's list, .env.example, docs/settings.md ----------------------

def passthrough_names() -> list[str]:
    """The variables handed to every container by name (`docker compose run -e NAME`, app.containers)."""
    return [var.name for var in REGISTRY if var.passthrough]


ENV_EXAMPLE_HEAD = """\
# Copy to .env on every node (`cp .env.example .env`) and edit. `.env` is git-ignored and never goes into
# the image; the app reads it (and compose passes it to every container); the shell and `make VAR=...`
# override any line of it. Every line is commented out: uncomment what this node needs.
# 复制为 .env（每个节点各一份）并修改；.env 不进 git、不进镜像；shell 与命令行 `make VAR=...` 优先。
# 每一行都已注释掉：取消注释并填写本节点需要的设置。
# Written by `python -m app settings --write` from app/settings.py; `make settings` shows what is in effect.
"""


def render_env_example() -> str:
    """`.env.example`: the settings that belong to a node, each commented out, with its meaning."""
    out = [ENV_EXAMPLE_HEAD]
    group = None
    for var in REGISTRY:
        if var.example is None:
            continue
        if var.group != group:
            group = var.group
            out.append(f"\n# --- {group} / {GROUP_ZH[group]} " + "-" * max(3, 90 - len(group) - len(GROUP_ZH[group])))
        out.append(f"# {var.doc}")
        value = f'"{var.example}"' if " " in var.example else var.example
        out.append(f"# {var.name}={value}")
    out.append("\n# Do NOT set VLLM_ATTENTION_BACKEND: vLLM 0.24 ignores it and the preflight refuses it.")
    out.append("# 不要设置 VLLM_ATTENTION_BACKEND：vLLM 0.24 会忽略它，预检会拒绝。")
    return "\n".join(out) + "\n"


def _default_text(var: Var) -> str:
    return f"`{var.default}`" if var.default is not None else ""


def _allowed_text(var: Var, zh: bool) -> str:
    if var.kind == "choice":
        return " / ".join(f"`{c}`" for c in var.choices)
    words = {"int": ("integer ≥ {m}", "整数 ≥ {m}"), "port": ("port 1-65535", "端口 1-65535"),
             "ip": ("IP address", "IP 地址"), "ipv4": ("IPv4 address", "IPv4 地址"),
             "host": ("IP address or hostname", "IP 地址或主机名"), "flag": ("`1` / `0`", "`1` / `0`"),
             "words": ("shell words", "shell 词"), "path": ("path", "路径"), "text": ("text", "文本"),
             "paths": ("path or [a,b]", "路径或 [a,b]"), "step": ("latest or a number", "latest 或数字"),
             "portrange": ("ports LOW-HIGH", "端口范围 LOW-HIGH")}
    return words[var.kind][zh].format(m=var.minimum)


def render_table(zh: bool = False) -> str:
    """The table of every variable (English, or 中文 with zh=True)."""
    head = ("| 变量 | 默认值 | 取值 | 用于 | 含义 |" if zh else "| Variable | Default | Allowed | Used by | Meaning |")
    rows = [head, "|---|---|---|---|---|"]
    for var in REGISTRY:
        used = ", ".join(var.commands).replace("all", "全部" if zh else "all")
        rows.append(f"| `{var.name}` | {_default_text(var)} | {_allowed_text(var, zh)} | {used} | "
                    f"{(var.zh if zh else var.doc).replace('|', '/')} |")
    return "\n".join(rows) + "\n"


SETTINGS_DOC_HEAD = """\
# Settings / 设置

Every variable the stack reads, in English and 中文. Written by `python -m app settings --write` from the registry in
`app/settings.py` (tests/test_settings.py checks that they agree); `make settings` prints each value in effect on a node
and where it came from. One precedence for all: the command line and the shell over `.env` over ARGS' and CONFIG's
keys that a setting owns (`model.path`, `trainer.experiment_name`, ...) over the default.

由 `python -m app settings --write` 根据 `app/settings.py` 中的登记表生成；`make settings` 打印本节点的实际取值及来源。
优先级：命令行与 shell > `.env` > ARGS 与 CONFIG 中属于某个设置的键（`model.path`、`trainer.experiment_name` 等）> 默认值。
"""


def render_settings_doc() -> str:
    """docs/settings.md: the table of every variable, in English and 中文."""
    return f"{SETTINGS_DOC_HEAD}\n## English\n\n{render_table(zh=False)}\n## 中文\n\n{render_table(zh=True)}"


def write_derived(root: Path = REPO_ROOT) -> list[Path]:
    """Rewrite docs/settings.md and .env.example from the registry."""
    changed = []
    for path, text in ((root / "docs" / "settings.md", render_settings_doc()), (root / ".env.example", render_env_example())):
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            changed.append(path)
    return changed


# --- `python -m app settings` ---------------------------------------------------------------------------

def shown(var: Var, value: Value) -> str:
    if value.raw is None:
        return "" if var.default is None else var.default
    return "***" if var.secret else value.raw


def main(command: str, argv: list[str], settings: Settings) -> int:
    parser = ArgParser(prog="python -m app settings", description="Every variable, its value here and where it "
                       "came from (shell, .env, default).")
    parser.add_argument("--compose-env", action="store_true", help="print the names passed into the containers")
    parser.add_argument("--write", action="store_true",
                        help="rewrite docs/settings.md and .env.example from the registry")
    args = parser.parse_args(argv)
    if args.compose_env:
        print("\n".join(passthrough_names()))
        return 0
    if args.write:
        changed = write_derived()
        say("rewrote " + ", ".join(str(p.relative_to(REPO_ROOT)) for p in changed) if changed else "up to date")
        return 0
    width = max(len(var.name) for var in REGISTRY)
    env_file = settings.env_file if settings.env_file.is_file() else f"{settings.env_file} (absent)"
    say(f"settings (shell > {env_file} > ARGS > CONFIG > default):")
    for var in REGISTRY:
        value = settings.values[var.name]
        text = shown(var, value)
        where = value.source if value.raw is not None or var.default is not None else "unset"
        note = f"  <- error: {value.error}" if value.error else ""
        say(f"  {var.name:<{width}}  {where:<7}  {text}{note}")
    for name in settings.ignored:
        say(f"note: {name} in {settings.env_file} is not read: make reads {name} from the command line or shell only")
    return 0


def user_cache() -> Path:
    """The user's persistent cache: $XDG_CACHE_HOME or ~/.cache (in a container, under the mounted HOME)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
