"""Composition of the SFT and GRPO configs: Hydra over verl 0.9.1's packaged configs.

configs/sft.yaml and configs/grpo.yaml sit on top of verl's packaged `sft_trainer_engine` and
`ppo_trainer` (Hydra `defaults`). Launch hands the identical `--config-dir/--config-name/overrides` to
verl's entry point, so verl composes the same config preflight checks (app/preflight.py).

Composition here is in-process with Hydra's compose API over verl's config *directory* (found without
importing verl, whose import pulls in torch and takes seconds): preflight + plan stays fast.
"""

from __future__ import annotations

import contextlib
import functools
import re
from pathlib import Path

from app.common import REPO_ROOT, UserError, hydra_quoted, verl_dir
from app.settings import BY_NAME

CONFIG_DIR = REPO_ROOT / "configs"

# job -> verl's packaged config it extends, and verl's entry point
BASE_CONFIG = {"sft": "sft_trainer_engine", "grpo": "ppo_trainer"}
# verl's entry points: the defaults of SFT_TRAINER_MODULE / GRPO_TRAINER_MODULE (test hooks swap them)
ENTRY_POINT = {"sft": BY_NAME["SFT_TRAINER_MODULE"].default, "grpo": BY_NAME["GRPO_TRAINER_MODULE"].default}

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



# --- overrides ---------------------------------------------------------------------------------------
_PLAIN_VALUE = re.compile(r"[A-Za-z0-9_\-./~:@%+]+")


def hydra_value(value: object) -> str:
    """A value as Hydra's override grammar reads it: plain when safe, else a quoted string."""
    text = str(value)
    if _PLAIN_VALUE.fullmatch(text):
        return text
    return hydra_quoted(text)


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
    except (HydraException, OmegaConfBaseException, yaml.YAMLError, ValueError, TypeError) as exc:
        # ValueError / TypeError: Hydra's own, for overrides its grammar parses but cannot apply (ARGS="=5")
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


@functools.cache  # read by the key check and the value check of one preflight: composed once
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


@functools.cache
def _verl_defaults(job: str) -> dict:
    from omegaconf import DictConfig, OmegaConf

    base = _verl_base_config(job)
    return OmegaConf.to_container(base, resolve=False) if isinstance(base, DictConfig) else base


def verl_default(job: str, dotted: str):
    """(found, value, annotation): verl's packaged default of `dotted` for `job`, and where the section is one of
    verl's config dataclasses (its `_target_`), the field's annotation as written (`float`, `int | None`), else None."""
    node, parent = _verl_defaults(job), None
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None, None
        parent, node = node, node[part]
    target = parent.get("_target_") if isinstance(parent, dict) else None
    annotation = _dataclass_fields(target).get(dotted.rsplit(".", 1)[-1]) if isinstance(target, str) else None
    return True, node, annotation


@functools.cache
def _dataclass_fields(target: str) -> dict[str, str]:
    """Field -> annotation text of verl's config dataclass `target` (a `_target_` such as
    verl.workers.config.RolloutConfig) and its bases, read from verl's source with ast: importing
    verl.workers.config imports torch (seconds), and YAML writes a float field's default as 0 or 1."""
    root = verl_dir()
    module, _, name = target.rpartition(".")
    if root is None or not module.startswith("verl."):
        return {}
    folder = root.joinpath(*module.split(".")[1:])
    files = sorted(folder.glob("*.py")) if folder.is_dir() else [folder.with_suffix(".py")]
    classes: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {}
    for path in [*files, root / "base_config.py"]:
        for cls, found in _source_classes(path).items():
            classes.setdefault(cls, found)

    def fields(cls: str, seen: frozenset) -> dict[str, str]:
        if cls not in classes or cls in seen:
            return {}
        bases, own = classes[cls]
        out: dict[str, str] = {}
        for base in bases:
            out.update(fields(base, seen | {cls}))
        return {**out, **own}

    return fields(name, frozenset())


@functools.cache
def _source_classes(path: Path) -> dict[str, tuple[tuple[str, ...], dict[str, str]]]:
    """The top-level classes of one Python file: name -> (base names, field -> annotation text); parsed once."""
    import ast

    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return {}
    out = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            own = {item.target.id: ast.unparse(item.annotation) for item in node.body
                   if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)}
            out.setdefault(node.name, (tuple(ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases), own))
    return out


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


def check_profile_keys(job: str, settings=None) -> None:
    """Every key of configs/<job>.yaml and of the user's CONFIG file (settings["CONFIG"]) must exist in
    verl's packaged config (except PROFILE_NEW_KEYS and keys under free-form mappings); all unknown keys
    are refused at once, with the new name where verl renamed a key the old walkthrough used (app.renames).

    Hydra merges a primary config file's own keys without struct checks, so a misspelt key there would
    be silently carried; command-line overrides (ARGS) are already checked by Hydra itself.
    """
    import yaml

    from app import renames, userconfig

    try:
        profile = yaml.safe_load((CONFIG_DIR / f"{job}.yaml").read_text()) or {}
    except yaml.YAMLError as exc:
        raise UserError(f"configs/{job}.yaml is not valid YAML: {' '.join(str(exc).split())}: fix it "
                        "(or restore it with `git checkout configs/" + job + ".yaml`)") from None
    profile.pop("defaults", None)
    layers = [(f"configs/{job}.yaml", userconfig.leaves(profile))]
    user = userconfig.user_leaves(settings) if settings is not None else None
    if user is not None:
        layers.append((f"CONFIG {user[0]}", user[1]))
    base = _verl_base_config(job)
    renames.refuse_unknown(job, BASE_CONFIG[job], layers,
                           lambda key: key in PROFILE_NEW_KEYS[job] or _known_key(base, key))


def verl_validate(cfg) -> list[str]:
    """verl's own validate_config (GRPO), which main_ppo runs only once the driver starts; what it could not
    check here, as notes.

    It imports verl (and torch): seconds, so only `check` and the real grpo-head launch run it.
    """
    import contextlib
    import copy
    import importlib.util
    import io
    import warnings

    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    # validate_config takes any name; the trainer looks it up only when step 1's advantages are computed
    estimator = cfg.algorithm.adv_estimator
    if estimator not in ADV_ESTIMATOR_REGISTRY:
        raise UserError(f"algorithm.adv_estimator={estimator}: verl 0.9.1 has no such estimator; choose one of "
                        f"{', '.join(sorted(ADV_ESTIMATOR_REGISTRY))}")

    notes = []
    rank = _lora_rank_for_vllm(cfg)
    if rank and importlib.util.find_spec("vllm") is None:
        # verl checks a LoRA rank by importing vLLM's limits, and without vLLM it refuses every LoRA config
        # ("vllm version None not supported"): on a laptop or a CPU node (preflight warns that GPU nodes need
        # vLLM) everything else is checked, the rank where vLLM is installed (the image, grpo-head's preflight)
        cfg = copy.deepcopy(cfg)
        cfg.actor_rollout_ref.model.lora_rank = 0
        if "rank" in (cfg.actor_rollout_ref.model.get("lora") or {}):
            cfg.actor_rollout_ref.model.lora.rank = 0
        notes.append(f"LoRA rank {rank} not checked against vLLM's limits: vLLM is not importable here "
                     "(grpo-head's preflight checks it where vLLM is installed, as in the image)")
    try:
        # its "all checks passed" print and the critic-disabled notice would drown our one-line summary
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    except (AssertionError, ValueError, TypeError) as exc:
        raise UserError(f"verl's validate_config rejects the grpo config: {' '.join(str(exc).split())}") from None
    return notes


def _lora_rank_for_vllm(cfg) -> int:
    """The LoRA rank verl's validate_config checks against vLLM (0: none), read as verl 0.9.1 reads it:
    model.lora.rank, else model.lora_rank; none where model.lora.merge folds the adapter before rollout."""
    model, rollout = cfg.actor_rollout_ref.model, cfg.actor_rollout_ref.rollout
    if rollout.get("name") != "vllm":
        return 0
    lora = model.get("lora") or {}
    if lora.get("merge", False):
        return 0
    rank = lora.get("rank", 0) or 0
    return rank if rank > 0 else (model.get("lora_rank", 0) or 0)

