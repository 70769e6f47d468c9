"""Composition and preflight of the SFT and GRPO configs (`python -m app config|check sft|grpo`).

configs/sft.yaml and configs/grpo.yaml sit on top of verl 0.9.1's packaged `sft_trainer_engine` and
`ppo_trainer` (Hydra `defaults`). The per-machine values come from the environment and are rendered as
Hydra overrides (`render_overrides`), with the user's ARGS appended last; launch hands the identical
`--config-dir/--config-name/overrides` to verl's entry point, so verl composes the same config we check.

Composition here is in-process with Hydra's compose API over verl's config *directory* (found without
importing verl, whose import pulls in torch and takes seconds): preflight + plan stays fast.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from app import renames, userconfig
from app.common import REPO_ROOT, ArgParser, UserError, verl_dir, env, env_int, run_dir, say, warn

CONFIG_DIR = REPO_ROOT / "configs"

# job -> verl's packaged config it extends, and verl's entry point
BASE_CONFIG = {"sft": "sft_trainer_engine", "grpo": "ppo_trainer"}
ENTRY_POINT = {"sft": "verl.trainer.sft_trainer", "grpo": "verl.trainer.main_ppo"}

# Keys our profiles add on purpose although verl's packaged config does not declare them; any other
# key of configs/*.yaml must exist in verl's config, so that a misspelt key fails as verl would fail.
PROFILE_NEW_KEYS = {
    "sft": {"model.override_config.attn_implementation"},
    "grpo": {
        "actor_rollout_ref.model.override_config.attn_implementation",
        "actor_rollout_ref.rollout.engine_kwargs.vllm.attention_backend",
        "ray_kwargs.ray_init.address",
    },
}

# Where in each job's config the pieces preflight looks at live.
MODEL_KEY = {"sft": "model", "grpo": "actor_rollout_ref.model"}
ROLLOUT_ENGINES = ("vllm", "sglang", "trtllm")
# trainer.logger backends verl imports at start (verl/utils/tracking.py) -> the package that must be here
LOGGER_PACKAGES = {"wandb": "wandb", "vemlp_wandb": "wandb", "swanlab": "swanlab", "mlflow": "mlflow",
                   "clearml": "clearml", "trackio": "trackio", "tensorboard": "tensorboard"}


@functools.lru_cache(maxsize=1)
def verl_config_dir() -> Path:
    """verl's packaged Hydra configs, located without importing verl (its import costs seconds)."""
    package = verl_dir()
    if package is None:
        raise UserError("verl is not importable here: install verl==0.9.1 (make setup) or use the image")
    return package / "trainer" / "config"


def check_job(job: str) -> str:
    if job not in BASE_CONFIG:
        raise UserError(f"unknown job {job!r}: use sft or grpo")
    return job


# --- settings from the environment -----------------------------------------------------------------
@dataclass
class Settings:
    """What a launch on this node needs, read from the environment (Make exports every variable)."""

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
    run_dir: Path
    experiment: str
    args: list[str]
    relative: list[str] = field(default_factory=list)  # NAME=value the user gave as relative paths

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    @property
    def total_gpus(self) -> int:
        return self.nnodes * self.gpus_per_node

    @property
    def ray_address(self) -> str:
        return f"{self.head_ip or '127.0.0.1'}:{self.ray_port}"


def count_gpus() -> tuple[int | None, str]:
    """GPUs this node can see, and how we know; (None, why) where they cannot be counted.

    nvidia-smi and the driver's /proc entries answer in milliseconds; importing torch for
    torch.cuda.device_count() would cost seconds on every preflight, so it is not used.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
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


def _path_setting(name: str, default: Path | None, relative: list[str]) -> Path | None:
    raw = env(name)
    if raw is None:
        return default.resolve() if default is not None else None
    path = Path(raw).expanduser()
    if not path.is_absolute():
        relative.append(f"{name}={raw}")
    return path.resolve()


def read_settings(job: str) -> Settings:
    """The launch settings of `job` on this node, from the environment."""
    check_job(job)
    userconfig.apply_settings(job)  # CONFIG's model.path, data files, run dir: defaults of those settings
    relative: list[str] = []
    nnodes = env_int("NNODES", 1)
    node_rank = env_int("NODE_RANK", 0)
    gpus_seen, gpu_source = count_gpus()
    gpus_per_node = env_int("GPUS_PER_NODE", gpus_seen if gpus_seen else 1)
    data_dir = _path_setting("DATA_DIR", Path("data"), relative)
    sub = "gsm8k_sft" if job == "sft" else "gsm8k"
    train_file = _path_setting("TRAIN_FILE", data_dir / sub / "train.parquet", relative)
    val_file = _path_setting("VAL_FILE", data_dir / sub / "test.parquet", relative)
    if env("CKPT_DIR") and not Path(env("CKPT_DIR")).expanduser().is_absolute():
        relative.append(f"CKPT_DIR={env('CKPT_DIR')}")
    try:
        args = shlex.split(env("ARGS", "") or "")
    except ValueError as exc:
        raise UserError(f"ARGS cannot be split like a shell line ({exc}): check its quotes") from None
    return Settings(
        job=job,
        nnodes=nnodes,
        node_rank=node_rank,
        gpus_per_node=gpus_per_node,
        gpus_seen=gpus_seen,
        gpu_source=gpu_source,
        master_addr=env("MASTER_ADDR"),
        master_port=env_int("MASTER_PORT", 29500),
        head_ip=env("HEAD_IP"),
        ray_port=env_int("RAY_PORT", 6379),
        model_path=_path_setting("MODEL_PATH", None, relative),
        train_file=train_file,
        val_file=val_file,
        run_dir=run_dir(job),
        experiment=env("EXPERIMENT") or run_dir(job).name,
        args=args,
        relative=relative,
    )


# --- overrides ---------------------------------------------------------------------------------------
_PLAIN_VALUE = re.compile(r"[A-Za-z0-9_\-./~:@%+]+")


def hydra_value(value: object) -> str:
    """A value as Hydra's override grammar reads it: plain when safe, else a quoted string."""
    text = str(value)
    if _PLAIN_VALUE.fullmatch(text):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def attention_overrides(job: str) -> tuple[list[str], str | None]:
    """Overrides that choose the trainer's attention implementation here, and a note for the user.

    verl asks transformers for flash_attention_2 unless told otherwise; without the flash-attn package
    that fails at model load, so where flash-attn is missing we switch to sdpa. sdpa keeps packed samples
    apart under remove-padding with transformers 5.9 (per-sample losses packed == alone, CPU and H200:
    docs/gpu-runs.md, scripts/packing_check.py); should a transformers change break that, this one
    function must also turn remove-padding off or refuse. An attn_implementation in ARGS wins (later).
    """
    if importlib.util.find_spec("flash_attn") is not None:
        return [], None
    return [f"{MODEL_KEY[job]}.override_config.attn_implementation=sdpa"], (
        "flash-attn is not installed here: the trainer uses attn_implementation=sdpa (the image ships flash-attn)")


def render_overrides(s: Settings, extra: list[str] | None = None) -> list[str]:
    """Hydra overrides for `s` (environment-derived first, then ARGS, so the user has the last word)."""
    out: list[str] = userconfig.overrides(s.job)  # CONFIG's keys: above the profile, below the settings
    model = MODEL_KEY[s.job]
    if s.model_path is not None:
        out.append(f"{model}.path={hydra_value(s.model_path)}")
    out.append(f"data.train_files={hydra_value(s.train_file)}")
    if s.val_file is not None and (s.val_file.exists() or env("VAL_FILE") or s.job == "grpo"):
        out.append(f"data.val_files={hydra_value(s.val_file)}")
    out += [
        f"trainer.default_local_dir={hydra_value(s.run_dir)}",
        f"trainer.experiment_name={hydra_value(s.experiment)}",
        f"trainer.nnodes={s.nnodes}",
        f"trainer.n_gpus_per_node={s.gpus_per_node}",
    ]
    if env("PROJECT"):
        out.append(f"trainer.project_name={hydra_value(env('PROJECT'))}")
    out += extra or []
    if s.job == "grpo":
        out.append(f"ray_kwargs.ray_init.address={hydra_value(s.ray_address)}")
    return out + s.args


@functools.cache
def _omegaconf_libyaml_loader():
    """OmegaConf's own YAML loader class (its constructors, float and timestamp resolvers, duplicate-key
    check) parsing with libyaml's C parser instead of PyYAML's pure-Python one; None without libyaml."""
    import yaml
    from omegaconf import _utils

    if not getattr(yaml, "__with_libyaml__", False):
        return None

    class LibyamlOmegaConfLoader(yaml.cyaml.CParser, _utils.get_yaml_loader()):
        def __init__(self, stream):  # as yaml.CSafeLoader: C parser, Python constructor and resolver
            yaml.cyaml.CParser.__init__(self, stream)
            yaml.constructor.SafeConstructor.__init__(self)
            yaml.resolver.Resolver.__init__(self)

    return LibyamlOmegaConfLoader


@contextlib.contextmanager
def libyaml_for_omegaconf(enabled: bool = True):
    """While composing, OmegaConf parses YAML with libyaml (same loader otherwise, same result).

    Why: PyYAML's pure-Python parser is ~40% of Hydra composing verl's ppo_trainer (30 files), the
    largest part of the preflight's 2 s budget; OmegaConf has no option for the C parser, so its loader
    factory is swapped for the duration and restored after. `enabled=False` composes the stock way.
    """
    from omegaconf import _utils

    loader = _omegaconf_libyaml_loader() if enabled else None
    if loader is None:
        yield
        return
    stock = _utils.get_yaml_loader
    _utils.get_yaml_loader = lambda: loader
    try:
        yield
    finally:
        _utils.get_yaml_loader = stock


def compose(job: str, overrides: list[str], *, libyaml: bool = True):
    """verl's config for `job` as verl's entry point will compose it (struct mode: unknown keys fail).

    libyaml=False parses the YAML files with PyYAML's pure-Python parser, as verl's own entry point does
    (the result is the same; scripts/bench_preflight.sh compares both)."""
    import yaml
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    search = f"hydra.searchpath=[file://{verl_config_dir()}]"
    try:
        with libyaml_for_omegaconf(libyaml), initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            return hydra_compose(config_name=job, overrides=[search, *overrides])
    except (HydraException, OmegaConfBaseException, yaml.YAMLError) as exc:
        first = " ".join(str(exc).split())
        raise UserError(f"the {job} config does not compose: {first} (check ARGS and configs/{job}.yaml)") \
            from None


def _leaf_keys(node, prefix: str = "") -> list[str]:
    out = []
    for key, value in node.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out += _leaf_keys(value, path + ".")
        else:
            out.append(path)
    return out


def _has_key(cfg, dotted: str) -> bool:
    """Whether `cfg` (a DictConfig or a plain dict) declares the dotted key, even as ??? or null."""
    from omegaconf import DictConfig

    node = cfg
    for part in dotted.split("."):
        if isinstance(node, DictConfig) and part in node.keys():
            node = node._get_node(part)
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return False
    return True


def _verl_base_config(job: str):
    """verl's packaged config of `job`, without our profile.

    For ppo_trainer verl ships the flattened result as _generated_ppo_trainer.yaml (regenerated and
    checked in verl's CI): one YAML load instead of a second Hydra composition, which keeps preflight
    fast. Elsewhere (sft_trainer_engine, small) Hydra composes it.
    """
    generated = verl_config_dir() / f"_generated_{BASE_CONFIG[job]}.yaml"
    if generated.is_file():
        import yaml

        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        return yaml.load(generated.read_text(), Loader=loader)  # a plain dict: only its keys are read
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with libyaml_for_omegaconf(), initialize_config_dir(config_dir=str(verl_config_dir()), version_base=None):
        return hydra_compose(config_name=BASE_CONFIG[job])


def _known_key(base, dotted: str) -> bool:
    """Whether verl's config declares `dotted`, or a parent of it that is free-form (an empty mapping such as
    override_config or engine_kwargs.vllm, or null), where verl takes any key."""
    from omegaconf import DictConfig

    node = base
    for part in dotted.split("."):
        if node is None or (isinstance(node, (dict, DictConfig)) and len(node) == 0):
            return True
        if isinstance(node, DictConfig) and part in node.keys():
            node = node._get_node(part)
            node = None if node._is_none() else (node if isinstance(node, DictConfig) else node._value())
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return False
    return True


def check_profile_keys(job: str) -> None:
    """Every key of configs/<job>.yaml and of the user's CONFIG file must exist in verl's packaged config
    (except PROFILE_NEW_KEYS and keys under free-form mappings); all unknown keys are refused at once,
    with the new name where verl renamed a key the old walkthrough used (app.renames).

    Hydra merges a primary config file's own keys without struct checks, so a misspelt key there would
    be silently carried; command-line overrides (ARGS) are already checked by Hydra itself.
    """
    import yaml

    try:
        profile = yaml.safe_load((CONFIG_DIR / f"{job}.yaml").read_text()) or {}
    except yaml.YAMLError as exc:
        raise UserError(f"configs/{job}.yaml is not valid YAML: {' '.join(str(exc).split())}: fix it "
                        "(or restore it with `git checkout configs/" + job + ".yaml`)") from None
    profile.pop("defaults", None)
    layers = [(f"configs/{job}.yaml", userconfig.leaves(profile))]
    user = userconfig.user_leaves()
    if user is not None:
        layers.append((f"CONFIG {user[0]}", user[1]))
    base = _verl_base_config(job)
    renames.refuse_unknown(job, BASE_CONFIG[job], layers,
                           lambda key: key in PROFILE_NEW_KEYS[job] or _known_key(base, key))


# --- preflight ---------------------------------------------------------------------------------------
@dataclass
class Preflight:
    """A checked plan: the settings, the overrides verl will get, the composed config, notes."""

    settings: Settings
    overrides: list[str]
    config: object
    notes: list[str] = field(default_factory=list)  # printed after success (ok: ...)
    warnings: list[str] = field(default_factory=list)  # printed after success (warning: ...)

    @property
    def job(self) -> str:
        return self.settings.job


def _model_dir_problem(path: Path) -> str | None:
    if not path.is_dir():
        return f"{path} is not a directory"
    if not (path / "config.json").is_file():
        return f"{path} has no config.json"
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((path / name).is_file() for name in tokenizer_files):
        return f"{path} has no tokenizer (tokenizer.json / tokenizer_config.json)"
    return None


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


def refuse_stale_environment() -> None:
    """Variables from older walkthroughs that now do nothing (silently): refuse them with what to do."""
    if os.environ.get("VLLM_ATTENTION_BACKEND"):
        raise UserError(
            f"VLLM_ATTENTION_BACKEND={os.environ['VLLM_ATTENTION_BACKEND']} is set, but vLLM 0.24 ignores it "
            "(and has no XFORMERS backend): unset it; the backend is chosen in configs/grpo.yaml "
            "(actor_rollout_ref.rollout.engine_kwargs.vllm.attention_backend, or through ARGS)")


def refuse_without_gpus(s: Settings, what: str) -> None:
    """A launch that will start GPU work on a node without any GPU fails later in torch/NCCL with a
    traceback: refuse it here, as `make smoke` does. The CPU stand-in trainers of the tests
    (SFT_TRAINER_MODULE / GRPO_TRAINER_MODULE) need none."""
    hook = "SFT_TRAINER_MODULE" if s.job == "sft" else "GRPO_TRAINER_MODULE"
    if s.gpus_seen or env(hook):
        return
    raise UserError(f"{what} needs GPUs, but this node has none ({s.gpu_source}): run it on a GPU node "
                    "(with docker: the NVIDIA container toolkit, compose `gpus: all`); DRY_RUN=1 prints the plan "
                    f"and `make check JOB={s.job}` checks the config on any machine")


def preflight(job: str, *, deep: bool = False, gpus: bool = False) -> Preflight:
    """Compose `job`'s config for this node and reject, with one actionable line, what would fail later.

    deep=True also runs verl's own validate_config (GRPO), which imports verl (seconds, no GPU needed).
    gpus=True (a real launch) refuses a node without GPUs.
    """
    from omegaconf import OmegaConf

    s = read_settings(job)
    notes: list[str] = []
    warnings: list[str] = []

    # -- the environment of this node
    refuse_stale_environment()
    check_profile_keys(job)  # every unknown key of the profile and CONFIG at once, before anything else
    if s.nnodes < 1:
        raise UserError(f"NNODES={s.nnodes}: set NNODES to the number of machines (1 or more)")
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
        refuse_without_gpus(s, "make sft" if job == "sft" else "make grpo-head")
    if s.multi_node and s.relative:
        raise UserError(f"relative path {s.relative[0]} in a {s.nnodes}-node run: use absolute paths, "
                        "identical on every node (compose mounts data/, models/, checkpoints/ that way)")

    # -- the model
    if s.model_path is None:
        raise UserError("MODEL_PATH is not set: point it at a local Hugging Face model directory "
                        "(config.json + tokenizer; nothing is downloaded)")
    problem = _model_dir_problem(s.model_path)
    if problem:
        raise UserError(f"MODEL_PATH: {problem}: point MODEL_PATH at a Hugging Face model directory "
                        "with config.json and the tokenizer files")

    # -- compose (ARGS included) and check the config itself
    attn, attn_note = attention_overrides(job)
    overrides = render_overrides(s, attn)
    cfg = compose(job, overrides)
    if attn_note:
        warnings.append(attn_note)
    warnings += userconfig.machine_warnings(job, s)
    _check_config(s, cfg, notes, warnings)

    # -- data
    kind = "sft" if job == "sft" else "rl"
    train = Path(str(OmegaConf.select(cfg, "data.train_files")))
    train_report = _check_data(train, kind, "train file", notes, warnings)
    val = OmegaConf.select(cfg, "data.val_files")
    if val:
        from app.data import compare_splits

        overlap = compare_splits(train_report, _check_data(Path(str(val)), kind, "val file", notes, warnings))
        if overlap:
            warnings.append(overlap)
    elif job == "sft":
        warnings.append(f"no validation file ({s.val_file} missing): SFT runs without val/loss")

    if deep and job == "grpo":
        verl_validate(cfg)
        notes.append("verl's validate_config: passed")
    return Preflight(settings=s, overrides=overrides, config=cfg, notes=notes, warnings=warnings)


def _check_config(s: Settings, cfg, notes: list[str], warnings: list[str]) -> None:
    from omegaconf import OmegaConf

    job = s.job
    sel = functools.partial(OmegaConf.select, cfg)

    # paths verl reads must be absolute on every node (ARGS may have put relative ones back)
    path_keys = [f"{MODEL_KEY[job]}.path", "data.train_files", "data.val_files", "trainer.default_local_dir"]
    if s.multi_node:
        for key in path_keys:
            value = sel(key)
            if value and not str(value).startswith("/"):
                raise UserError(f"{key}={value} is relative in a {s.nnodes}-node run: use an absolute path, "
                                "identical on every node")

    loggers = sel("trainer.logger")
    for backend in [loggers] if isinstance(loggers, str) else list(loggers or []):
        package = LOGGER_PACKAGES.get(backend)
        if package and importlib.util.find_spec(package) is None:
            raise UserError(f"trainer.logger has {backend}, but {package} is not installed here (verl imports it at "
                            f"start): install it, or drop it, e.g. ARGS='trainer.logger=[console,file]'")

    save_freq = sel("trainer.save_freq")
    if not (save_freq == "after_each_epoch" or (isinstance(save_freq, int) and save_freq > 0)):
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
    nnodes, gpn = sel("trainer.nnodes"), sel("trainer.n_gpus_per_node")
    n_gpus = nnodes * gpn
    if (nnodes, gpn) != (s.nnodes, s.gpus_per_node):
        raise UserError(f"trainer.nnodes={nnodes} / trainer.n_gpus_per_node={gpn} (from ARGS) disagree with "
                        f"NNODES={s.nnodes} / GPUS_PER_NODE={s.gpus_per_node}: set NNODES and GPUS_PER_NODE instead")
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
    notes.append(f"GRPO: {nnodes} node(s) x {gpn} GPU(s), batch {batch} x n={n}, rollout {name} TP={tp}, "
                 f"save every {sel('trainer.save_freq')} steps")


def _attention_heads(model_path: Path | None) -> int | None:
    try:
        config = json.loads((model_path / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return None
    return config.get("num_attention_heads") or (config.get("text_config") or {}).get("num_attention_heads")


def verl_validate(cfg) -> None:
    """verl's own validate_config (GRPO), which main_ppo runs only once the driver starts.

    It imports verl (and torch): seconds, so only `check` and the real grpo-head launch run it.
    """
    import contextlib
    import io
    import warnings

    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    try:
        # its "all checks passed" print and the critic-disabled notice would drown our one-line summary
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    except (AssertionError, ValueError, TypeError) as exc:
        raise UserError(f"verl's validate_config rejects the grpo config: {' '.join(str(exc).split())}") from None


def report(plan: Preflight) -> None:
    """Print what preflight found: notes on stdout, warnings on stderr (only once everything passed)."""
    for note in plan.notes:
        say(f"ok: {note}")
    for message in plan.warnings:
        warn(message)


# --- CLI ---------------------------------------------------------------------------------------------
def main(command: str, argv: list[str]) -> int:
    parser = ArgParser(prog=f"python -m app {command}")
    parser.add_argument("job", choices=sorted(BASE_CONFIG), help="sft or grpo")
    parser.add_argument("--config", metavar="FILE", help="your own verl-style YAML over the profile (CONFIG)")
    if command == "config":
        parser.add_argument("--resolve", action="store_true", help="resolve ${...} interpolations")
    args = parser.parse_args(argv)
    if args.config:
        os.environ["CONFIG"] = args.config
    if command == "check":
        plan = preflight(args.job, deep=True)
        report(plan)
        say(f"preflight {args.job}: passed (run dir {plan.settings.run_dir})")
        return 0
    # config: print what verl will see, without the checks (MODEL_PATH may still be unset)
    from omegaconf import OmegaConf

    s = read_settings(args.job)
    check_profile_keys(args.job)
    cfg = compose(args.job, render_overrides(s, attention_overrides(args.job)[0]))
    print(OmegaConf.to_yaml(cfg, resolve=args.resolve), end="")
    return 0
