"""One run's spec: the settings become one list of Hydra overrides, Hydra composes verl's config from it, and from
then on the composed config is the only truth: every check and every command reads it.

Order, lowest first: verl 0.9.1's packaged config < configs/<job>.yaml < this node's choices (app.perf, preflight)
< CONFIG < the settings < ARGS. The settings that name paths and node facts (MODEL_PATH, TRAIN_FILE, CKPT_DIR,
NNODES, ...) were resolved once by app.settings, from the shell, .env, ARGS and CONFIG, because in docker mode the
host mounts every path before anything composes. Launch hands verl's entry point the same overrides, so verl
composes the config that preflight checked.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from app import node, renames
from app.common import REPO_ROOT, UserError, hydra_quoted, verl_dir
from app.runs import read_model, run_dir
from app.settings import BY_NAME, RAY_ADDRESS_KEY, Settings, leaves

CONFIG_DIR = REPO_ROOT / "configs"
BASE_CONFIG = {"sft": "sft_trainer_engine", "grpo": "ppo_trainer"}  # verl's packaged config each profile extends
MODEL_KEY = {"sft": "model", "grpo": "actor_rollout_ref.model"}
DATA_SUBDIR = {"sft": "gsm8k_sft", "grpo": "gsm8k"}  # what `make prep` writes under DATA_DIR
FILTER_KEY = "data.filter_overlong_prompts"
VLLM_EXECUTOR_KEY = "actor_rollout_ref.rollout.engine_kwargs.vllm.distributed_executor_backend"
PERF_KEYS_EXTRA = {FILTER_KEY, VLLM_EXECUTOR_KEY}  # preflight's choices, beside app.perf's
# Keys our profiles add although verl's packaged config does not declare them; any other key of configs/*.yaml
# must exist in verl's config, so that a misspelt key fails as verl would fail.
PROFILE_NEW_KEYS = {
    "sft": {"model.override_config.attn_implementation"},
    "grpo": {"actor_rollout_ref.model.override_config.attn_implementation",
             "actor_rollout_ref.rollout.engine_kwargs.vllm.attention_backend", RAY_ADDRESS_KEY},
}


@functools.cache
def verl_config_dir() -> Path:
    """verl's packaged Hydra configs, located without importing verl (its import costs seconds)."""
    package = verl_dir()
    if package is None:
        raise UserError("verl is not importable here: install verl==0.9.1 (make setup) or use the image")
    return package / "trainer" / "config"


def compose(job: str, overrides: list[str]):
    """verl's config for `job` as verl's entry point composes it (struct mode: unknown keys fail)."""
    import yaml
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    search = f"hydra.searchpath=[file://{verl_config_dir()}]"
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            return hydra_compose(config_name=job, overrides=[search, *overrides])
    except (HydraException, OmegaConfBaseException, yaml.YAMLError, ValueError, TypeError) as exc:
        # ValueError / TypeError: Hydra's own, for overrides its grammar parses but cannot apply (ARGS="=5")
        raise UserError(f"the {job} config does not compose: {' '.join(str(exc).split())} (check ARGS and "
                        f"configs/{job}.yaml)") from None


def hydra_value(value: object) -> str:
    """A value as Hydra's override grammar reads it: plain where that is safe, else a quoted string."""
    text = str(value)
    return text if re.fullmatch(r"[A-Za-z0-9_\-./~:@%+]+", text) else hydra_quoted(text)


def hydra_literal(value: object) -> str:
    """A value as Hydra's override grammar reads it back: strings always quoted (so '5' stays text and `${...}`
    stays an interpolation), lists and dicts element by element."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value) if value == value and abs(value) != float("inf") else str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_literal(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{key}:{hydra_literal(item)}" for key, item in value.items()) + "}"
    return hydra_quoted(str(value))


# --- unknown keys of the profile and of CONFIG ---------------------------------------------------------
@functools.cache
def verl_base(job: str) -> dict:
    """verl's packaged config of `job`, without our profile: verl ships ppo_trainer flattened as
    _generated_ppo_trainer.yaml (one YAML load, not a second Hydra composition); sft_trainer_engine is small."""
    generated = verl_config_dir() / f"_generated_{BASE_CONFIG[job]}.yaml"
    if generated.is_file():
        import yaml

        return yaml.load(generated.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(verl_config_dir()), version_base=None):
        return OmegaConf.to_container(hydra_compose(config_name=BASE_CONFIG[job]), resolve=False)


def known_key(job: str, dotted: str) -> bool:
    """Whether verl's config declares `dotted`, or a parent of it that takes any key (an empty mapping such as
    override_config or engine_kwargs.vllm, or null)."""
    if dotted in PROFILE_NEW_KEYS[job]:
        return True
    node_ = verl_base(job)
    for part in dotted.split("."):
        if node_ is None or (isinstance(node_, dict) and not node_):
            return True
        if not isinstance(node_, dict) or part not in node_:
            return False
        node_ = node_[part]
    return True


def check_keys(job: str, settings: Settings) -> None:
    """Every key of configs/<job>.yaml and of CONFIG must exist in verl's config: Hydra merges a config file's own
    keys without struct checks, so a misspelt one would be carried silently (ARGS' keys Hydra checks itself).
    All unknown keys at once, with verl 0.9.1's new name for the old walkthrough's (app.renames)."""
    import yaml

    try:
        profile = yaml.safe_load((CONFIG_DIR / f"{job}.yaml").read_text()) or {}
    except yaml.YAMLError as exc:
        raise UserError(f"configs/{job}.yaml is not valid YAML: {' '.join(str(exc).split())}: fix it (or restore it "
                        f"with `git checkout configs/{job}.yaml`)") from None
    profile.pop("defaults", None)
    layers = [(f"configs/{job}.yaml", leaves(profile))]
    if settings.config is not None:
        layers.append((f"CONFIG {settings['CONFIG']}", dict(settings.config)))
    renames.refuse_unknown(job, BASE_CONFIG[job], layers, functools.partial(known_key, job))


# --- the spec ---------------------------------------------------------------------------------------------
def _abs(path: str) -> Path:
    return Path(path).expanduser().resolve()


@dataclass
class Spec:
    """One job's run on this node: its overrides in their three layers and the config they compose to.

    Node facts that verl's config does not hold (NODE_RANK, MASTER_ADDR/PORT, HEAD_IP) come from the settings;
    everything else is read from `cfg`."""

    job: str
    settings: Settings
    gpus: node.Gpus
    choices: list[str]  # this node's choices (app.perf, preflight's), under CONFIG and ARGS
    stack: list[str]  # CONFIG's keys, then the settings
    cfg: object = None
    notes: list = field(default_factory=list)  # perf's notes of the choices

    @property
    def args(self) -> list[str]:
        """ARGS, less the overrides app.settings read as settings: last, so that Hydra lets them win."""
        return list(self.settings.args)

    @property
    def overrides(self) -> list[str]:
        """What verl's entry point gets, in order."""
        return [*self.choices, *self.stack, *self.args]

    def compose(self):
        self.cfg = compose(self.job, self.overrides)
        return self.cfg

    def choose(self, key: str, value, add: bool = False) -> None:
        """Add a choice of this node's, under CONFIG and ARGS (the caller knows no layer above sets `key`), and
        apply it to cfg. add: a key verl declares nowhere (`++`)."""
        from omegaconf import OmegaConf

        self.choices.insert(0, f"{'++' if add else ''}{key}={hydra_value(value)}")
        OmegaConf.update(self.cfg, key, value, force_add=True)

    def get(self, key: str, default=None):
        from omegaconf import OmegaConf

        return OmegaConf.select(self.cfg, key, default=default, throw_on_resolution_failure=False)

    # -- the run, as composed
    @property
    def model_key(self) -> str:
        return MODEL_KEY[self.job]

    @property
    def model_path(self) -> Path | None:
        path = self.get(f"{self.model_key}.path")
        return Path(str(path)) if path else None

    @property
    def run_dir(self) -> Path:
        return Path(str(self.get("trainer.default_local_dir")))

    @property
    def experiment(self) -> str:
        return str(self.get("trainer.experiment_name"))

    def files(self, split: str) -> list[Path]:
        """data.<split>_files as a list (verl takes one path or a list)."""
        from omegaconf import OmegaConf

        value = self.get(f"data.{split}_files")
        value = OmegaConf.to_container(value) if OmegaConf.is_list(value) else value
        return [Path(str(v)) for v in (value if isinstance(value, list) else [value] if value else [])]

    @property
    def nnodes(self) -> int:
        return self.get("trainer.nnodes")

    @property
    def gpus_per_node(self) -> int:
        return self.get("trainer.n_gpus_per_node")

    @property
    def total_gpus(self) -> int:
        return self.nnodes * self.gpus_per_node

    @property
    def ray_address(self) -> str | None:
        return self.get(RAY_ADDRESS_KEY)

    # -- this node's place in it
    @property
    def node_rank(self) -> int:
        return self.settings["NODE_RANK"]

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    def fingerprint(self) -> dict[str, str]:
        """What every node of the run must agree on, {what: text}: the composed config less this node's own
        choices and its run directory (each node's own disk), NNODES, the model's and the data's identity, the
        stack's code and verl's version. Compared before the first step (app.rendezvous, app.launch)."""
        from omegaconf import OmegaConf

        own = choosable(self.job) | {"trainer.default_local_dir"}
        flat = leaves(OmegaConf.to_container(self.cfg, resolve=False))
        out = {key: json.dumps(value, sort_keys=True) for key, value in flat.items() if key not in own}
        out["NNODES"] = str(self.nnodes)
        out["model"] = identity(self.model_path)
        for split in ("train", "val"):
            for i, path in enumerate(self.files(split)):
                out[f"data.{split}_files[{i}]"] = identity(path)
        if self.job == "grpo":  # where the driver joins without verl's job environment, every raylet holds it
            out["RAY_WARM_WORKERS"] = str(self.settings["RAY_WARM_WORKERS"])
        out["stack code"] = stack_digest()
        out["verl"] = importlib.metadata.version("verl")
        return out


def choosable(job: str) -> set[str]:
    """The keys each node may choose for itself (app.perf's, preflight's): per node by design, never compared."""
    from app import perf

    keys = PERF_KEYS_EXTRA | set(perf.PERF_KEYS[job]["budgets"])
    return keys | {perf.attention_key(job), f"{MODEL_KEY[job]}.enable_gradient_checkpointing", "model.use_liger"}


def identity(path: Path | None) -> str:
    """A path's identity, cheap to take: the path, its size, and a digest of what names its content (a model's
    config.json and the sizes of its weights; a parquet file's footer, where its metadata lives)."""
    if path is None:
        return "none"
    try:
        if path.is_dir():
            model = read_model(path)
            sizes = sorted((w.name, w.stat().st_size) for w in model.weights)
            digest = hashlib.sha256(json.dumps([model.config, sizes], sort_keys=True).encode()).hexdigest()[:16]
            return f"{path}: config and weights {digest}, {sum(s for _, s in sizes)} bytes"
        size = path.stat().st_size
        with open(path, "rb") as handle:
            handle.seek(max(0, size - 65536))
            digest = hashlib.sha256(handle.read()).hexdigest()[:16]
        return f"{path}: {size} bytes, metadata {digest}"
    except OSError as exc:
        return f"{path}: {exc.strerror or 'unreadable'}"


@functools.cache
def stack_digest() -> str:
    """The stack's own code and profiles, as this node runs them (a checkout or the image)."""
    digest = hashlib.sha256()
    for path in sorted([*(REPO_ROOT / "app").glob("*.py"), *CONFIG_DIR.glob("*.yaml")]):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def setting_overrides(job: str, settings: Settings, gpus: node.Gpus) -> list[str]:
    """The settings that own a config key, as overrides; paths absolute, defaults filled in."""
    data = _abs(settings["DATA_DIR"]) / DATA_SUBDIR[job]

    def files(name: str, default: Path) -> list[Path]:
        return [_abs(p) for p in settings[name]] if settings[name] is not None else [default]

    def value(paths: list[Path]) -> str:
        return hydra_value(paths[0]) if len(paths) == 1 else "[" + ",".join(hydra_value(p) for p in paths) + "]"

    experiment, run = settings["EXPERIMENT"], run_dir(job, settings)
    val = files("VAL_FILE", data / "test.parquet")
    given = {
        BY_NAME["MODEL_PATH"].key.format(model=MODEL_KEY[job]):
            hydra_value(_abs(settings["MODEL_PATH"])) if settings["MODEL_PATH"] else None,
        "data.train_files": value(files("TRAIN_FILE", data / "train.parquet")),
        # SFT trains without validation where no val file was given and the default is absent; GRPO always has one
        "data.val_files": value(val) if settings.is_set("VAL_FILE") or job == "grpo" or val[0].exists() else None,
        "trainer.default_local_dir": hydra_value(run),
        "trainer.experiment_name": hydra_value(experiment or run.name),
        "trainer.project_name": hydra_value(settings["PROJECT"]) if settings["PROJECT"] else None,
        "trainer.nnodes": str(settings["NNODES"]),
        "trainer.n_gpus_per_node": str(settings.get("GPUS_PER_NODE", gpus.count or 1)),
    }
    if job == "grpo":
        given[RAY_ADDRESS_KEY] = hydra_value(f"{settings['HEAD_IP'] or '127.0.0.1'}:{settings['RAY_PORT']}")
    return [f"{key}={text}" for key, text in given.items() if text is not None]


def read(job: str, settings: Settings) -> Spec:
    """The spec of `job` on this node, composed. Where ARGS or CONFIG pick an attention with a dense mask (sdpa,
    eager), the token budget is chosen again to hold it; where they turn remove-padding off, the attention too."""
    from app import perf

    if job not in BASE_CONFIG:
        raise UserError(f"unknown job {job!r}: use sft or grpo")
    gpus = node.gpus(settings["CUDA_VISIBLE_DEVICES"])
    config_layer = [f"++{key}={hydra_literal(value)}" for key, value in (settings.config or {}).items()]
    spec = Spec(job, settings, gpus, [], [*config_layer, *setting_overrides(job, settings, gpus)])
    spec.choices, spec.notes = perf.overrides(spec)
    spec.compose()
    impl = spec.get(perf.attention_key(job))
    again = {}
    if impl in perf.DENSE_MASK_IMPLS:  # never this node's own choice: it came from ARGS or CONFIG
        again["chosen_attention"] = impl
    if impl == perf.VARLEN_ATTENTION and not spec.get(f"{MODEL_KEY[job]}.use_remove_padding"):
        again["packed"] = False  # padded batches from ARGS or CONFIG: the packed-row kernel cannot take them
    if again:
        choices, notes = perf.overrides(spec, **again)
        if choices != spec.choices:  # the budget or attention changed (a budget stays where the GPU or model is unknown)
            spec.choices, spec.notes = choices, notes
            spec.compose()
    return spec


def relative_paths(settings: Settings) -> list[str]:
    """NAME=value of each path setting given as a relative path: it resolves differently per directory."""
    out = []
    for name in ("MODEL_PATH", "DATA_DIR", "TRAIN_FILE", "VAL_FILE", "CKPT_DIR"):
        value = settings.values[name]
        paths = value.value if isinstance(value.value, tuple) else (value.value,)
        if value.raw and not value.error and any(not os.path.isabs(os.path.expanduser(p)) for p in paths):
            out.append(f"{name}={value.raw}" + (f" (from {value.source})" if value.source in ("ARGS", "CONFIG") else ""))
    return out
