"""Preflight (`python -m app check|config sft|grpo`): what a launch on this node needs, composed and
checked before anything starts.

The per-machine values come from the settings (app/settings.py) and become the stack's own Hydra
overrides (`stack_overrides`); the user's ARGS stay a field of their own and are joined once, last, in
with_user_args(), so that the user has the last word and nothing slices them back off.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from app import perf, userconfig
from app.common import ArgParser, UserError, directory_problem, say, warn
from app.composition import (BASE_CONFIG, LOGGER_PACKAGES, MODEL_KEY, ROLLOUT_ENGINES, check_job,
                             check_profile_keys, compose, hydra_value, verl_validate)
from app.runs import model_dir_problems, run_dir
from app.settings import BY_NAME, Settings

# --- what a launch on this node needs ---------------------------------------------------------------
@dataclass
class Launch:
    """The settings of one job's launch on this node, resolved (paths absolute, GPUs counted)."""

    job: str
    nnodes: int
    node_rank: int
    gpus_per_node: int
    gpus_seen: int | None  # GPUs this node can see; None where they cannot be counted
    gpu_source: str
    master_addr: str | None
    master_port: int
    head_ip: str | None
    ray_port: int
    model_path: Path | None
    train_file: Path
    val_file: Path | None
    val_file_given: bool
    run_dir: Path
    experiment: str
    project: str | None
    args: list[str]  # the user's ARGS, joined last (Preflight.hydra_overrides)
    relative: list[str] = field(default_factory=list)  # NAME=value the user gave as relative paths
    config_layer: list[str] = field(default_factory=list)  # CONFIG's keys as overrides (app/userconfig.py)

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    @property
    def total_gpus(self) -> int:
        return self.nnodes * self.gpus_per_node

    @property
    def ray_address(self) -> str:
        return f"{self.head_ip or '127.0.0.1'}:{self.ray_port}"


def count_gpus(visible: str | None) -> tuple[int | None, str]:
    """GPUs this node can see, and how we know; (None, why) where they cannot be counted.

    nvidia-smi and the driver's /proc entries answer in milliseconds; importing torch for
    torch.cuda.device_count() would cost seconds on every preflight, so it is not used.
    `visible` is CUDA_VISIBLE_DEVICES (None: unset; "" hides every GPU, as CUDA reads it).
    """
    total: int | None = None
    source = ""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
            if out.returncode == 0:
                total = sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
                source = "nvidia-smi -L"
        except (OSError, subprocess.SubprocessError):
            pass
    if total is None:
        proc = Path("/proc/driver/nvidia/gpus")
        if proc.is_dir():
            total = sum(1 for _ in proc.iterdir())
            source = "/proc/driver/nvidia/gpus"
    if visible is not None:
        ids = [part for part in visible.split(",") if part.strip()]
        if visible.strip() in ("", "-1") or not ids:
            return 0, f"CUDA_VISIBLE_DEVICES={visible!r}"
        if total is None:
            return len(ids), f"CUDA_VISIBLE_DEVICES={visible}"
        return min(len(ids), total), f"{source} and CUDA_VISIBLE_DEVICES={visible}"
    if total is None:
        return None, "no nvidia-smi and no NVIDIA driver here"
    return total, source


def _path_setting(settings: Settings, name: str, default: Path | None, relative: list[str]) -> Path | None:
    if not settings.is_set(name):  # the registry's default (DATA_DIR=data), else `default`
        fallback = settings[name] if settings[name] is not None else default
        return Path(fallback).resolve() if fallback is not None else None
    raw = settings[name]
    path = Path(raw).expanduser()
    if not path.is_absolute():
        relative.append(f"{name}={raw}")
    return path.resolve()


def read_launch(job: str, settings: Settings) -> Launch:
    """The launch settings of `job` on this node."""
    check_job(job)
    settings = userconfig.with_file_defaults(job, settings)  # CONFIG's model.path, data, run dir as defaults
    relative: list[str] = []
    gpus_seen, gpu_source = count_gpus(settings["CUDA_VISIBLE_DEVICES"])
    data_dir = _path_setting(settings, "DATA_DIR", None, relative)
    sub = "gsm8k_sft" if job == "sft" else "gsm8k"
    if settings["CKPT_DIR"] and not Path(settings["CKPT_DIR"]).expanduser().is_absolute():
        relative.append(f"CKPT_DIR={settings['CKPT_DIR']}")
    run = run_dir(job, settings)
    return Launch(
        job=job,
        nnodes=settings["NNODES"],
        node_rank=settings["NODE_RANK"],
        gpus_per_node=settings.get("GPUS_PER_NODE", gpus_seen if gpus_seen else 1),
        gpus_seen=gpus_seen,
        gpu_source=gpu_source,
        master_addr=settings["MASTER_ADDR"],
        master_port=settings["MASTER_PORT"],
        head_ip=settings["HEAD_IP"],
        ray_port=settings["RAY_PORT"],
        model_path=_path_setting(settings, "MODEL_PATH", None, relative),
        train_file=_path_setting(settings, "TRAIN_FILE", data_dir / sub / "train.parquet", relative),
        val_file=_path_setting(settings, "VAL_FILE", data_dir / sub / "test.parquet", relative),
        val_file_given=settings.is_set("VAL_FILE"),
        run_dir=run,
        experiment=settings.get("EXPERIMENT", run.name),
        project=settings["PROJECT"],
        args=list(settings.get("ARGS", ())),
        relative=relative,
        config_layer=userconfig.overrides(settings),
    )


def stack_overrides(s: Launch, extra: list[str] | None = None) -> list[str]:
    """The stack's own Hydra overrides for `s` (the user's ARGS are not among them: they come last).
    Later wins: this node's choices (`extra`, app.perf) over the profile, CONFIG's keys over those, the
    settings over CONFIG."""
    out: list[str] = [*(extra or []), *s.config_layer]
    model = MODEL_KEY[s.job]
    if s.model_path is not None:
        out.append(f"{model}.path={hydra_value(s.model_path)}")
    out.append(f"data.train_files={hydra_value(s.train_file)}")
    if s.val_file is not None and (s.val_file.exists() or s.val_file_given or s.job == "grpo"):
        out.append(f"data.val_files={hydra_value(s.val_file)}")
    out += [
        f"trainer.default_local_dir={hydra_value(s.run_dir)}",
        f"trainer.experiment_name={hydra_value(s.experiment)}",
        f"trainer.nnodes={s.nnodes}",
        f"trainer.n_gpus_per_node={s.gpus_per_node}",
    ]
    if s.project:
        out.append(f"trainer.project_name={hydra_value(s.project)}")
    if s.job == "grpo":
        out.append(f"ray_kwargs.ray_init.address={hydra_value(s.ray_address)}")
    return out


def compose_with_choices(s: Launch):
    """This node's choices (app.perf), the stack's overrides and the composed config (ARGS last). Where ARGS or
    CONFIG pick an attention with a dense mask (sdpa, eager), the token budget is chosen again to hold it."""
    from omegaconf import OmegaConf

    choices, notes = perf.overrides(s.job, s)
    stack = stack_overrides(s, choices)
    cfg = compose(s.job, with_user_args(stack, s.args))
    impl = OmegaConf.select(cfg, perf.attention_key(s.job))
    if impl in perf.DENSE_MASK_IMPLS:  # never this node's own choice: it came from ARGS or CONFIG
        dense_choices, dense_notes = perf.overrides(s.job, s, chosen_attention=impl)
        if dense_choices != choices:  # the budget changed (it stays where the GPU or the model is unknown)
            choices, notes = dense_choices, dense_notes
            stack = stack_overrides(s, choices)
            cfg = compose(s.job, with_user_args(stack, s.args))
    return choices, notes, stack, cfg


def with_user_args(stack: list[str], args: list[str], extra: list[str] | None = None) -> list[str]:
    """The one place the two are joined: the stack's overrides, then `extra` (launch's own), then the
    user's ARGS, last, so that Hydra lets them win."""
    return [*stack, *(extra or []), *args]


# --- preflight ---------------------------------------------------------------------------------------
@dataclass
class Preflight:
    """A checked plan: the launch settings, the stack's overrides and the user's ARGS (two fields, joined
    once by hydra_overrides), the composed config, notes."""

    launch: Launch
    overrides: list[str]  # the stack's own
    args: list[str]  # the user's ARGS
    config: object
    notes: list[str] = field(default_factory=list)  # printed after success (ok: ...)
    warnings: list[str] = field(default_factory=list)  # printed after success (warning: ...)

    @property
    def job(self) -> str:
        return self.launch.job

    def hydra_overrides(self, extra: list[str] | None = None) -> list[str]:
        """What verl gets: the stack's overrides, then `extra` (launch's), then ARGS, which win."""
        return with_user_args(self.overrides, self.args, extra)


def model_problem(model: Path) -> str | None:
    """The first thing MODEL_PATH's directory lacks, as a sentence about it; None when complete."""
    problems = model_dir_problems(model)
    if not problems:
        return None
    return f"{model} is not a directory" if problems == ["not a directory"] else f"{model} has {problems[0]}"


def _check_data(path: Path, kind: str, what: str, notes: list[str], warnings: list[str]):
    from app.data import check_parquet

    if not path.exists():
        raise UserError(f"{what} {path} does not exist: run `make prep` (DATA_DIR={path.parent.parent}) "
                        f"or set {'TRAIN_FILE' if what == 'train file' else 'VAL_FILE'} to your parquet")
    report = check_parquet(path, kind)
    notes.append(f"{what}: {path} ({report.rows} rows, {kind})")
    warnings += list(report.notes)
    return report


def _int(cfg, key: str, default: int = 0) -> int:
    from omegaconf import OmegaConf

    value = OmegaConf.select(cfg, key, default=default)
    return default if value is None else value


def _sp_size(cfg, job: str) -> int:
    if job == "sft":
        return _int(cfg, "engine.ulysses_sequence_parallel_size", 1)
    return max(_int(cfg, "actor_rollout_ref.actor.ulysses_sequence_parallel_size", 1),
               _int(cfg, "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size", 1))


def refuse_stale_environment(settings: Settings) -> None:
    """Variables from older walkthroughs that now do nothing (silently): refuse them with what to do."""
    if settings["VLLM_ATTENTION_BACKEND"]:
        raise UserError(
            f"VLLM_ATTENTION_BACKEND={settings['VLLM_ATTENTION_BACKEND']} is set, but vLLM 0.24 ignores it "
            "(and has no XFORMERS backend): unset it; the backend is chosen in configs/grpo.yaml "
            "(actor_rollout_ref.rollout.engine_kwargs.vllm.attention_backend, or through ARGS)")


def refuse_without_gpus(s: Launch, settings: Settings, what: str) -> None:
    """A launch that will start GPU work on a node without any GPU fails later in torch/NCCL with a
    traceback: refuse it here, as `make smoke` does. The CPU stand-in trainers of the tests
    (SFT_TRAINER_MODULE / GRPO_TRAINER_MODULE) need none."""
    hook = "SFT_TRAINER_MODULE" if s.job == "sft" else "GRPO_TRAINER_MODULE"
    if s.gpus_seen or settings[hook] != BY_NAME[hook].default:
        return
    raise UserError(f"{what} needs GPUs, but this node has none ({s.gpu_source}): run it on a GPU node "
                    "(with docker: the NVIDIA container toolkit, compose `gpus: all`); DRY_RUN=1 prints the plan "
                    f"and `make check JOB={s.job}` checks the config on any machine")


def preflight(job: str, settings: Settings, *, deep: bool = False, gpus: bool = False) -> Preflight:
    """Compose `job`'s config for this node and reject, with one actionable line, what would fail later.

    deep=True also runs verl's own validate_config (GRPO), which imports verl (seconds, no GPU needed).
    gpus=True (a real launch) refuses a node without GPUs.
    """
    from omegaconf import OmegaConf

    s = read_launch(job, settings)
    notes: list[str] = []
    warnings: list[str] = []

    # -- the environment of this node (each value's type and range: app/settings.py, already checked)
    refuse_stale_environment(settings)
    check_profile_keys(job, settings)  # every unknown key of the profile and CONFIG at once, before anything else
    if not 0 <= s.node_rank < s.nnodes:
        raise UserError(f"NODE_RANK={s.node_rank} is outside [0, NNODES={s.nnodes}): give each machine its own "
                        f"rank 0..{s.nnodes - 1} (0 on the {'head' if job == 'grpo' else 'master'})")
    if s.gpus_per_node < 1:
        raise UserError(f"GPUS_PER_NODE={s.gpus_per_node}: set it to the number of GPUs each node uses (1 or more)")
    if s.multi_node and job == "sft" and not s.master_addr:
        raise UserError(f"NNODES={s.nnodes} needs MASTER_ADDR: set it to node 0's IP on every node "
                        "(same MASTER_ADDR and MASTER_PORT everywhere)")
    if s.multi_node and job == "grpo" and not s.head_ip:
        raise UserError(f"NNODES={s.nnodes} needs HEAD_IP: set it to the Ray head's IP on every node")
    if s.gpus_seen is None:
        warnings.append(f"cannot count GPUs here ({s.gpu_source}): GPUS_PER_NODE={s.gpus_per_node} not checked")
    elif s.gpus_seen != s.gpus_per_node:
        raise UserError(f"GPUS_PER_NODE={s.gpus_per_node} but this node sees {s.gpus_seen} GPU(s) "
                        f"({s.gpu_source}): set GPUS_PER_NODE={s.gpus_seen} or change CUDA_VISIBLE_DEVICES")
    else:
        notes.append(f"GPUs: {s.gpus_seen} visible ({s.gpu_source})")
    if gpus:
        refuse_without_gpus(s, settings, "make sft" if job == "sft" else "make grpo-head")
    if s.multi_node and s.relative:
        raise UserError(f"relative path {s.relative[0]} in a {s.nnodes}-node run: use absolute paths, "
                        "identical on every node (compose mounts data/, models/, checkpoints/ that way)")

    refuse_unusable_run_dir(s.run_dir, writable=False)  # write access: the launch's (`make check` runs anywhere)

    # -- the model
    if s.model_path is None:
        raise UserError("MODEL_PATH is not set: point it at a local Hugging Face model directory "
                        "(config.json + tokenizer; nothing is downloaded)")
    problem = model_problem(s.model_path)
    if problem:
        raise UserError(f"MODEL_PATH: {problem}: point MODEL_PATH at a Hugging Face model directory "
                        "with config.json, the tokenizer files and the weights")

    # -- compose (ARGS included) and check the config itself
    perf_overrides, perf_notes, overrides, cfg = compose_with_choices(s)
    refuse_args_over_settings(s, cfg)
    check_user_values(s, cfg)
    notes += perf.notes_for(perf_notes, perf_overrides, cfg)
    warnings += userconfig.machine_warnings(job, settings, s)
    _check_config(s, cfg, notes, warnings)
    perf.check_budgets(s, cfg)

    # -- data
    kind = "sft" if job == "sft" else "rl"
    train = Path(str(_one_file(OmegaConf.select(cfg, "data.train_files"))))
    train_report = _check_data(train, kind, "train file", notes, warnings)
    val = _one_file(OmegaConf.select(cfg, "data.val_files"))
    if val:
        from app.data import compare_splits

        overlap = compare_splits(train_report, _check_data(Path(str(val)), kind, "val file", notes, warnings))
        if overlap:
            warnings.append(overlap)
    elif job == "sft":
        warnings.append(f"no validation file ({s.val_file} missing): SFT runs without val/loss")
    if job == "grpo":
        chosen = _check_prompt_lengths(s, cfg, [("train", train), *([("val", Path(str(val)))] if val else [])],
                                       notes, warnings)
        if chosen:  # this node's choice: under CONFIG and ARGS, like app.perf's (which left the key alone)
            overrides = [chosen, *overrides]
        executor = _choose_vllm_executor(cfg, notes)
        if executor:  # the same: only where neither CONFIG nor ARGS names an executor
            overrides = [executor, *overrides]

    if deep and job == "grpo":
        notes += verl_validate(cfg)
        notes.append("verl's validate_config: passed")
    return Preflight(launch=s, overrides=overrides, args=s.args, config=cfg, notes=notes, warnings=warnings)


def refuse_unusable_run_dir(run: Path, writable: bool = True) -> None:
    problem = directory_problem(run, writable)
    if problem:
        raise UserError(f"the run directory {run} {problem}: set CKPT_DIR to a directory you can write "
                        "(created where missing)")


def _one_file(value):
    """verl's data.*_files as one path: ARGS may write the setting's own file as a list of it (refuse_args_over_settings
    refuses longer lists); an empty list is none."""
    from omegaconf import OmegaConf

    if OmegaConf.is_list(value) or isinstance(value, list):
        return value[0] if len(value) else None
    return value


def launch_owned(s: Launch) -> dict[str, tuple[str, object]]:
    """The config keys this launch takes from a setting, with the setting and its value: what preflight checks,
    and what torchrun, Ray and the run directory are set up with."""
    owned = {f"{MODEL_KEY[s.job]}.path": ("MODEL_PATH", s.model_path),
             "data.train_files": ("TRAIN_FILE (or DATA_DIR)", s.train_file),
             "data.val_files": ("VAL_FILE (or DATA_DIR)", s.val_file),
             "trainer.default_local_dir": ("CKPT_DIR", s.run_dir), "trainer.experiment_name": ("EXPERIMENT", s.experiment),
             "trainer.nnodes": ("NNODES", s.nnodes), "trainer.n_gpus_per_node": ("GPUS_PER_NODE", s.gpus_per_node)}
    if s.project:
        owned["trainer.project_name"] = ("PROJECT", s.project)
    if s.job == "grpo":
        owned["ray_kwargs.ray_init.address"] = ("HEAD_IP and RAY_PORT", s.ray_address)
    return owned


def refuse_args_over_settings(s: Launch, cfg) -> None:
    """ARGS come last and would win over these keys too, while preflight checked the setting and torchrun, Ray and
    the run directory follow it (ARGS="trainer.nnodes=3" beside NNODES=1 would start a 1-node torchrun for a 3-node
    verl): one line naming the setting instead. The same value twice is harmless and passes."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    for key, (setting, ours) in launch_owned(s).items():
        if not _sets_key(s.args, key):
            continue
        try:
            value = OmegaConf.select(cfg, key, default=None)
        except OmegaConfBaseException as exc:  # an interpolation that does not resolve (${oc.env:UNSET})
            raise UserError(f"ARGS sets {key} to something that does not resolve ({' '.join(str(exc).split())[:160]}): "
                            f"set {setting} instead") from None
        if OmegaConf.is_list(value) and len(value) <= 1:
            value = _one_file(value)  # [one file] is that file; [] is none
        if key == "data.val_files" and value in (None, ""):
            if s.job == "sft":
                continue  # null or ~data.val_files: SFT without validation, which no setting says
            raise UserError("ARGS turns data.val_files off, but verl 0.9.1's GRPO always builds its val dataset: "
                            "keep a val file (VAL_FILE, or DATA_DIR's test.parquet)")
        if OmegaConf.is_list(value):
            raise UserError(f"ARGS sets {key} to {len(value)} files: the stack trains on one parquet per split; "
                            f"join them into one file and set {setting} to it")
        same = (Path(str(value)).expanduser().resolve() == ours) if isinstance(ours, Path) else str(value) == str(ours)
        if not same:
            raise UserError(f"ARGS sets {key}={value}, but this launch takes it from {setting} ({ours}): set "
                            f"{setting} instead and drop {key} from ARGS")
        if isinstance(ours, Path) and s.multi_node and not str(value).startswith("/"):  # verl gets it as written
            raise UserError(f"{key}={value} is relative in a {s.nnodes}-node run: use an absolute path, "
                            "identical on every node")


# Whole numbers that must be >= 1 wherever the job has them (verl takes 0 or -1 and fails, or trains nothing, later)
POSITIVE_KEYS = ("data.train_batch_size", "data.micro_batch_size_per_gpu", "data.max_length", "data.max_prompt_length",
                 "data.max_response_length", "trainer.total_epochs", "actor_rollout_ref.rollout.n",
                 "actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.actor.ppo_epochs")
LEARNING_RATES = ("optim.lr", "actor_rollout_ref.actor.optim.lr")
# verl's int keys that also take this word, by job (its SFT trainer: save / validate at each epoch's end)
WORD_VALUES = {"sft": {"trainer.save_freq": "after_each_epoch", "trainer.test_freq": "after_each_epoch"}, "grpo": {}}


def _kind(value, annotation: str | None) -> str | None:
    """The kind of value verl's code relies on: its dataclass field's annotation where the section is one (`int`,
    `float | None`), else the YAML default's type, an int there standing for any number (verl's YAML writes float
    fields' defaults as 0 or 1); None where any value may do."""
    if annotation is not None:
        words = set(annotation.replace("Optional[", " ").replace("]", " ").replace("|", " ").split())
        words.discard("None")
        if words == {"bool"}:
            return "true or false"
        if words == {"int"}:
            return "a whole number"
        if words <= {"int", "float"} and "float" in words:
            return "a number"
        return None
    if isinstance(value, bool):
        return "true or false"
    if isinstance(value, (int, float)):
        return "a number"
    return None


def _fits(kind: str, value) -> bool:
    if kind == "true or false":
        return isinstance(value, bool)
    if kind == "a whole number":
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_user_values(s: Launch, cfg) -> None:
    """The values ARGS and CONFIG set, against the type of verl's own default there and the few ranges verl does not
    check: `optim.lr=abc` or `data.train_batch_size=0` would pass composition and fail (or train nothing) minutes
    into the run, inside verl. One line naming the key, its value and what fits."""
    from omegaconf import OmegaConf

    from app.composition import verl_default

    user = {_override_key(o): "ARGS" for o in s.args if "=" in o}
    for o in s.config_layer:
        user.setdefault(_override_key(o), "CONFIG")
    for key, source in user.items():
        # an interpolation that does not resolve: verl's own composition says so later, in its words
        value = OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=False)
        if value is None or WORD_VALUES[s.job].get(key) == value:
            continue  # null (verl's "unset"), deleted, or the word verl takes there
        found, default, annotation = verl_default(s.job, key)
        kind = _kind(default, annotation) if found else None
        if kind and not _fits(kind, value):
            shown = f"{value!r} (text)" if isinstance(value, str) and kind != "true or false" else value
            raise UserError(f"{key}={shown} from {source}: verl expects {kind} there, like its default {default}: "
                            f"fix it in {'ARGS' if source == 'ARGS' else 'the CONFIG file'}")
        if key in POSITIVE_KEYS and not (_fits("a whole number", value) and value >= 1):
            raise UserError(f"{key}={value} from {source}: it must be a whole number, at least 1")
        if key in LEARNING_RATES and _fits("a number", value) and value <= 0:
            raise UserError(f"{key}={value} from {source}: a learning rate must be above 0, e.g. 1e-5")


def _check_config(s: Launch, cfg, notes: list[str], warnings: list[str]) -> None:
    from omegaconf import OmegaConf

    job = s.job
    sel = functools.partial(OmegaConf.select, cfg)

    loggers = sel("trainer.logger")
    for backend in [loggers] if isinstance(loggers, str) else list(loggers or []):
        package = LOGGER_PACKAGES.get(backend)
        if package and importlib.util.find_spec(package) is None:
            raise UserError(f"trainer.logger has {backend}, but {package} is not installed here (verl imports it at "
                            f"start): install it, or drop it, e.g. ARGS='trainer.logger=[console,file]'")

    model = MODEL_KEY[job]
    if sel(f"{model}.use_fused_kernels"):
        notes.append(f"log-probs: verl's fused {sel(f'{model}.fused_kernel_options.impl_backend')} kernel "
                     "(no tokens x vocabulary logits)")
    elif not perf.flash_attn_installed():
        # verl 0.9.1's fallback (logprobs_from_logits_v2) loops over the tokens in Python: measured on 1xH200
        warnings.append(f"{model}.use_fused_kernels=false and flash-attn is not installed: verl computes the "
                        "log-probs one token at a time (about 5k tokens/s on 1xH200, whatever the model); "
                        "keep the profile's true")

    if sel(perf.attention_key(job)) == "flex_attention":
        # same seed, data and first loss, 300 SFT steps of a 2-layer model on 1xH200: val/loss 0.209 against
        # sdpa's 0.111 and eager's 0.110 (another sampler seed with sdpa: 0.137), although one training step's
        # gradients on a packed row match sdpa's and eager's (docs/gpu-runs.md runs 15-17): unexplained, so said
        warnings.append(f"attention is FlexAttention (no flash-attn here): in one comparison it trained a small "
                        f"model worse than sdpa and eager from the same start, though its gradients match theirs "
                        f"(docs/gpu-runs.md runs 15-17); for sdpa's slower kernel: "
                        f"ARGS='{perf.attention_key(job)}=sdpa'")

    save_freq = sel("trainer.save_freq")
    if isinstance(save_freq, float):
        raise UserError(f"trainer.save_freq={save_freq} is not a whole number of steps: e.g. ARGS='trainer.save_freq=20'")
    if not (save_freq in WORD_VALUES[job].values() or (isinstance(save_freq, int) and save_freq > 0)):
        raise UserError(f"trainer.save_freq={save_freq} writes no checkpoint (verl's default -1): "
                        "set it > 0, e.g. ARGS='trainer.save_freq=20'")

    sp = _sp_size(cfg, job)
    if sp > 1:
        if not sel(f"{MODEL_KEY[job]}.use_remove_padding"):
            raise UserError(f"sequence parallel size {sp} needs {MODEL_KEY[job]}.use_remove_padding=true: "
                            "turn remove-padding on or set the sequence parallel size to 1")
        heads = _attention_heads(s.model_path)
        if heads is not None and heads % sp:
            raise UserError(f"sequence parallel size {sp} does not divide the model's {heads} attention heads: "
                            "choose a divisor of the head count")
        if s.total_gpus % sp:
            raise UserError(f"sequence parallel size {sp} does not divide the {s.total_gpus} GPUs: choose a divisor")

    if job == "sft":
        batch = sel("data.train_batch_size")
        if batch % s.total_gpus:
            raise UserError(f"data.train_batch_size={batch} is not divisible by the {s.total_gpus} GPUs "
                            f"({s.nnodes} node(s) x {s.gpus_per_node}): verl would silently drop the remainder; "
                            "make it a multiple, e.g. ARGS='data.train_batch_size=...'")
        if not sel("data.use_dynamic_bsz") and batch // s.total_gpus < sel("data.micro_batch_size_per_gpu"):
            warnings.append("data.micro_batch_size_per_gpu exceeds the per-GPU batch")
        notes.append(f"SFT: {s.nnodes} node(s) x {s.gpus_per_node} GPU(s), global batch {batch}, "
                     f"lr {sel('optim.lr')}")
        return

    # GRPO
    nnodes, gpn = s.nnodes, s.gpus_per_node  # the composed config has them (refuse_args_over_settings)
    n_gpus = nnodes * gpn
    rollout = "actor_rollout_ref.rollout"
    name = sel(f"{rollout}.name")
    if name not in ROLLOUT_ENGINES:
        raise UserError(f"{rollout}.name={name}: verl 0.9.1 rolls out only with {', '.join(ROLLOUT_ENGINES)}")
    if importlib.util.find_spec(name) is None:
        warnings.append(f"{name} is not importable here: every GPU node needs it for GRPO (the image has it)")
    if sel("algorithm.adv_estimator") == "grpo" and sel(f"{rollout}.n") < 2:
        raise UserError(f"{rollout}.n={sel(f'{rollout}.n')}: GRPO needs at least 2 samples per prompt "
                        "(n=1 is plain REINFORCE without a baseline); set it to 4-8")
    tp = sel(f"{rollout}.tensor_model_parallel_size")
    if tp < 1 or gpn % tp:
        raise UserError(f"{rollout}.tensor_model_parallel_size={tp} does not divide GPUS_PER_NODE={gpn}: "
                        "choose a divisor (1 fits models up to ~7B)")
    n = sel(f"{rollout}.n")
    batch = sel("data.train_batch_size")
    actor = "actor_rollout_ref.actor"
    if not sel(f"{actor}.use_dynamic_bsz") and (batch * n) % n_gpus:
        raise UserError(f"data.train_batch_size x rollout.n = {batch} x {n} = {batch * n} is not divisible by "
                        f"the {n_gpus} GPUs: change the batch or n, or turn on {actor}.use_dynamic_bsz")
    seq = sel("data.max_prompt_length") + sel("data.max_response_length")
    budgets = [(f"{actor}.ppo_max_token_len_per_gpu", True),
               ("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", sel("actor_rollout_ref.ref.log_prob_use_dynamic_bsz")),
               (f"{rollout}.log_prob_max_token_len_per_gpu", sel(f"{rollout}.log_prob_use_dynamic_bsz"))]
    for key, used in budgets:
        value = sel(key)
        if used and value is not None and value < seq:
            raise UserError(f"{key}={value} is smaller than max_prompt_length + max_response_length = {seq}: "
                            f"raise it to at least {seq}")
    _check_quick_poll_sampler(sel, batch)
    notes.append(f"GRPO: {nnodes} node(s) x {gpn} GPU(s), batch {batch} x n={n}, rollout {name} TP={tp}, "
                 f"save every {sel('trainer.save_freq')} steps")


# app/replay.py's class and the sampler_kwargs it reads, named here rather than imported: importing it imports
# verl's trainer modules (seconds, and warnings on stderr); tests/test_grpo_startup.py checks that they match
QUICK_POLL_FILE, QUICK_POLL_CLASS = Path(__file__).with_name("replay.py"), "QuickPollReplayBuffer"
QUICK_POLL_KEYS, QUICK_POLL_MIN = ("poll_interval", "train_batch_size"), 0.01


def _sampler_module(path: str) -> tuple[str | None, Path | None]:
    """The module verl's load_module (verl/utils/import_utils.py) reads for a custom sampler path: a package
    path (`pkg://a.b` or `pkg://a/b`) or a file (`file://x.py`, `x.py`), resolved without importing it."""
    if path.startswith("pkg://"):
        name = path[len("pkg://"):].replace("/", ".")
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        return name, Path(spec.origin).resolve() if spec is not None and spec.origin else None
    file = Path(path[len("file://"):] if path.startswith("file://") else path)
    return None, file.resolve() if file.is_file() else None


def _check_quick_poll_sampler(sel, batch: int) -> None:
    """app/replay.py's sampler gets from verl only what a custom sampler gets, so it serves only the case
    verl's own replay buffer serves without the options it would drop. Recognised however its module path is
    spelled (verl accepts several), and without importing it (verl's trainer modules are slow to import)."""
    sampler = "trainer.v1.sampler"
    path, name = sel(f"{sampler}.custom_sampler.path"), sel(f"{sampler}.custom_sampler.name")
    if not (path and name):
        return
    module, origin = _sampler_module(str(path))
    if origin is None:
        raise UserError(f"{sampler}.custom_sampler.path={path}: verl would find no such "
                        f"{'module' if module else 'file'} here; fix the path, or drop the custom_sampler overrides")
    if not (origin == QUICK_POLL_FILE.resolve() and name == QUICK_POLL_CLASS):
        return
    poll_key, batch_key = QUICK_POLL_KEYS
    kwargs_batch, poll = sel(f"{sampler}.sampler_kwargs.{batch_key}"), sel(f"{sampler}.sampler_kwargs.{poll_key}")
    gen_batch = sel("data.gen_batch_size")
    poll_ok = poll is None or (isinstance(poll, (int, float)) and not isinstance(poll, bool) and poll >= QUICK_POLL_MIN)
    problems = [found for found, bad in [
        (f"trainer.v1.trainer_mode={sel('trainer.v1.trainer_mode')}", sel("trainer.v1.trainer_mode") != "sync"),
        ("algorithm.filter_groups.enable=true", bool(sel("algorithm.filter_groups.enable"))),
        (f"{sampler}.sync_refill_failed_groups=true", bool(sel(f"{sampler}.sync_refill_failed_groups"))),
        (f"data.gen_batch_size={gen_batch}", gen_batch not in (None, batch)),
        (f"{sampler}.sampler_kwargs.{batch_key}={kwargs_batch} (data.train_batch_size={batch})", kwargs_batch != batch),
        (f"{sampler}.sampler_kwargs.{poll_key}={poll} (at least {QUICK_POLL_MIN} seconds)", not poll_ok)]
        if bad]
    if problems:
        raise UserError(f"{sampler}.custom_sampler is app.replay's QuickPollReplayBuffer, which serves verl's sync "
                        f"trainer without DAPO filtering or failed-group refill, given sampler_kwargs.train_batch_size "
                        f"= data.train_batch_size; here {'; '.join(problems)}: fix that, or drop the custom_sampler "
                        "overrides (verl's own buffer, polled every 2 s)")


FILTER_KEY = "data.filter_overlong_prompts"
VLLM_EXECUTOR_KEY = "actor_rollout_ref.rollout.engine_kwargs.vllm.distributed_executor_backend"


def _choose_vllm_executor(cfg, notes: list[str]) -> str | None:
    """vLLM's model worker inside its EngineCore process (vLLM's `uni` executor, its own default for one GPU) where a
    rollout replica has one GPU and neither CONFIG nor ARGS names an executor. verl 0.9.1 always asks for `mp`: one
    more process that imports vLLM and torch again before the first step (31 s on 1xH200, docs/gpu-runs.md runs
    27-28). `uni` runs one worker only, so a replica over several GPUs keeps verl's `mp`. Returns that override."""
    from omegaconf import OmegaConf

    sel = functools.partial(OmegaConf.select, cfg)
    rollout = "actor_rollout_ref.rollout"
    if sel(f"{rollout}.name") != "vllm":
        return None
    chosen = sel(VLLM_EXECUTOR_KEY)
    if chosen is not None:
        notes.append(f"vLLM executor: {chosen} (from CONFIG or ARGS)")
        return None
    gpus = 1
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size"):
        value = sel(f"{rollout}.{key}")
        gpus *= value if isinstance(value, int) and value > 0 else 1
    if gpus > 1:
        notes.append(f"vLLM executor: verl's mp (a rollout replica spans {gpus} GPUs)")
        return None
    OmegaConf.update(cfg, VLLM_EXECUTOR_KEY, "uni", force_add=True)
    notes.append("vLLM executor: uni (its model worker runs inside the EngineCore: one process fewer to start)")
    return f"++{VLLM_EXECUTOR_KEY}=uni"


def _override_key(override: str) -> str:
    """The dotted key of a Hydra override (`++a.b=1`, `~a.b`)."""
    return override.lstrip("+~").split("=", 1)[0]


def _sets_key(overrides: list[str], key: str) -> bool:
    return any(_override_key(o) == key for o in overrides)


# apply_chat_template arguments that change how verl tokenizes (its tokenize=True path) or that clash with the
# count's own: where the user passes one, verl's filter decides
_TOKENIZING_KWARGS = {"add_generation_prompt", "truncation", "max_length", "padding", "tokenizer_kwargs",
                      "continue_final_message", "return_assistant_tokens_mask"}


def _selected(lengths: list[int], max_samples, shuffle: bool, seed) -> list[int]:
    """The rows verl's RLHFDataset keeps before its filter (data.train_max_samples / val_max_samples)."""
    if not max_samples or max_samples <= 0 or max_samples >= len(lengths):
        return lengths
    if not shuffle:
        return lengths[:max_samples]
    import numpy as np  # verl's own selection (rl_dataset.py), so that the same rows are counted

    rng = np.random.default_rng(*((seed,) if seed is not None else ()))
    return [lengths[i] for i in rng.choice(len(lengths), size=max_samples, replace=False).tolist()]


def _check_prompt_lengths(s: Launch, cfg, files: list[tuple[str, Path]], notes: list[str],
                          warnings: list[str]) -> str | None:
    """Count the RL prompts' tokens with the tokenizer and chat template verl will use. verl 0.9.1 left-truncates
    a prompt longer than actor_rollout_ref.rollout.prompt_length (agent_loop._cap_text_prompt_length;
    data.truncation is read but unused on the RL path), so a prompt that would reach the rollout that long is
    refused. Its filter drops rows over data.max_prompt_length: said, and refused where less than a batch (or no
    val row) is left. With the filter on and every prompt fitting, the filter (row by row at every start) is
    turned off: returns that override."""
    from omegaconf import OmegaConf

    sel = functools.partial(OmegaConf.select, cfg)
    model = MODEL_KEY[s.job]
    limit = sel("data.max_prompt_length")
    cut_at = sel("actor_rollout_ref.rollout.prompt_length") or limit
    filtering = bool(sel(FILTER_KEY))
    template_kwargs = sel("data.apply_chat_template_kwargs")
    kwargs = OmegaConf.to_container(template_kwargs) if template_kwargs is not None else {}
    tokenizer_dir = Path(str(sel(f"{model}.tokenizer_path") or sel(f"{model}.path") or s.model_path))
    skip = ("data.tool_config_path" if sel("data.tool_config_path") else
            "data.function_tool_path" if sel("data.function_tool_path") else
            "data.custom_cls.path" if sel("data.custom_cls.path") else
            "a multimodal processor" if (tokenizer_dir / "preprocessor_config.json").exists() else
            "data.apply_chat_template_kwargs" if _TOKENIZING_KWARGS & set(kwargs) else None)
    if skip:
        notes.append(f"prompt lengths: not counted ({skip} changes how verl counts): verl's filter decides")
        return None
    from transformers import AutoTokenizer

    from app.data import prompt_lengths

    key = sel("data.prompt_key") or "prompt"
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=bool(sel(f"{model}.trust_remote_code")))
        if sel(f"{model}.custom_chat_template"):
            tokenizer.chat_template = sel(f"{model}.custom_chat_template")
        counts = [(what, prompt_lengths(path, tokenizer, key, kwargs, failed=limit + 1)) for what, path in files]
    except Exception as exc:  # noqa: BLE001 - whatever a tokenizer raises, verl meets it too and says so itself
        warnings.append(f"prompt lengths not counted ({type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}): "
                        f"verl's filter ({FILTER_KEY}={filtering}) decides")
        return None
    shuffle, seed = bool(sel("data.shuffle")), sel("data.seed")
    counts = [(what, _selected(lengths, sel(f"data.{what}_max_samples"), shuffle, seed)) for what, lengths in counts]
    longest = max(max(lengths, default=0) for _, lengths in counts)
    summary = " and ".join(f"{len(lengths)} {what}" for what, lengths in counts)
    kept = [(what, [n for n in lengths if n <= limit] if filtering else lengths) for what, lengths in counts]
    cut = ", ".join(f"{sum(n > cut_at for n in lengths)} of {len(lengths)} {what}" for what, lengths in kept
                    if any(n > cut_at for n in lengths))
    if cut:
        drop = "" if filtering else f" or ARGS='{FILTER_KEY}=True' to drop them"
        raise UserError(f"{cut} prompts are longer than actor_rollout_ref.rollout.prompt_length={cut_at} (longest "
                        f"{longest} tokens){'' if filtering else f' and {FILTER_KEY} is off'}: verl 0.9.1 would cut "
                        f"off their beginnings; raise data.max_prompt_length (and rollout.prompt_length where set) "
                        f"to {longest}{drop}")
    dropped = [(what, len(lengths) - len(k)) for (what, lengths), (_, k) in zip(counts, kept)]
    if not any(n for _, n in dropped):
        note = f"prompt lengths: longest {longest} tokens of {summary} prompts, within data.max_prompt_length={limit}"
        if filtering and not _sets_key([*s.args, *s.config_layer], FILTER_KEY):
            notes.append(f"{note}: verl's length filter at every start skipped ({FILTER_KEY}=False)")
            OmegaConf.update(cfg, FILTER_KEY, False)
            return f"{FILTER_KEY}=False"
        notes.append(note)
        return None
    batch = sel("data.train_batch_size")
    left = {what: len(k) for what, k in kept}
    if left["train"] < batch or left.get("val", 1) == 0:
        what = "train" if left["train"] < batch else "val"
        raise UserError(f"verl's length filter would leave {left[what]} {what} prompts (data.max_prompt_length={limit}, "
                        f"longest {longest} tokens)"
                        f"{f', fewer than data.train_batch_size={batch}: no step would run' if what == 'train' else ''}; "
                        f"raise data.max_prompt_length to {longest}")
    gone = ", ".join(f"{n} of {len(lengths)} {what}" for (what, lengths), (_, n) in zip(counts, dropped) if n)
    warnings.append(f"{gone} prompts are longer than data.max_prompt_length={limit} (longest {longest} tokens): "
                    f"verl's filter drops them at start; raise data.max_prompt_length to keep them")
    return None


def _attention_heads(model_path: Path | None) -> int | None:
    try:
        config = json.loads((model_path / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return None
    return config.get("num_attention_heads") or (config.get("text_config") or {}).get("num_attention_heads")




def report(plan: Preflight) -> None:
    """Print what preflight found: notes on stdout, warnings on stderr (only once everything passed)."""
    for note in plan.notes:
        say(f"ok: {note}")
    for message in plan.warnings:
        warn(message)


# --- CLI ---------------------------------------------------------------------------------------------
def main(command: str, argv: list[str], settings: Settings) -> int:
    parser = ArgParser(prog=f"python -m app {command}")
    # make check JOB=grpo: the job may come from JOB (default sft)
    parser.add_argument("job", nargs="?" if command == "check" else None, choices=sorted(BASE_CONFIG),
                        help="sft or grpo" + (" (default: JOB, else sft)" if command == "check" else ""))
    parser.add_argument("--config", metavar="FILE", help="your own verl-style YAML over the profile (CONFIG)")
    if command == "config":
        parser.add_argument("--resolve", action="store_true", help="resolve ${...} interpolations")
    args = parser.parse_args(argv)
    if args.config:  # --config FILE: as CONFIG=FILE
        settings = userconfig.with_values(settings, {"CONFIG": args.config}, "command line")
    if command == "check":
        job = args.job or settings.get("JOB", "sft")
        plan = preflight(job, settings, deep=True)
        report(plan)
        say(f"preflight {job}: passed (run dir {plan.launch.run_dir})")
        return 0
    # config: print what verl will see, without the checks (MODEL_PATH may still be unset); the one data-dependent
    # choice, data.filter_overlong_prompts=False where every prompt fits, is made by preflight and said there
    from omegaconf import OmegaConf

    s = read_launch(args.job, settings)
    check_profile_keys(args.job, settings)
    cfg = compose_with_choices(s)[3]
    print(OmegaConf.to_yaml(cfg, resolve=args.resolve), end="")
    return 0
