"""CONFIG=my.yaml (`make sft CONFIG=my.yaml`, `python -m app check sft --config my.yaml`): the user's own
verl-style YAML as a config layer between our profile and the overrides.

Order, lowest first: verl 0.9.1's packaged config < configs/<job>.yaml < CONFIG < the per-machine
settings (app/settings.py) < ARGS. The file's keys become Hydra `++key=value` overrides placed before the
environment-derived ones, so launch hands verl the same composition preflight checked. Its keys are
checked against verl's config first (app.renames lists every unknown or renamed key at once).

Where the file sets a path or name the stack derives from a setting (model.path <- MODEL_PATH,
data.train_files <- TRAIN_FILE, ...), the file's value is that setting's default: an explicit setting
still wins, and the stack's own bookkeeping (run directory, preflight's data checks) follows the file.
What describes the machine (trainer.nnodes, trainer.n_gpus_per_node, the Ray address) always comes from
NNODES, GPUS_PER_NODE, HEAD_IP/RAY_PORT; a different value in the file is reported as a warning.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path
from types import MappingProxyType

from app.common import UserError, hydra_quoted

# setting -> the key of each job's config the file may give it through
FILE_SETTINGS: dict[str, dict[str, str]] = {
    "MODEL_PATH": {"sft": "model.path", "grpo": "actor_rollout_ref.model.path"},
    "TRAIN_FILE": {"sft": "data.train_files", "grpo": "data.train_files"},
    "VAL_FILE": {"sft": "data.val_files", "grpo": "data.val_files"},
    "CKPT_DIR": {"sft": "trainer.default_local_dir", "grpo": "trainer.default_local_dir"},
    "EXPERIMENT": {"sft": "trainer.experiment_name", "grpo": "trainer.experiment_name"},
    "PROJECT": {"sft": "trainer.project_name", "grpo": "trainer.project_name"},
}
MACHINE_KEYS = {"trainer.nnodes": "NNODES", "trainer.n_gpus_per_node": "GPUS_PER_NODE",
                "ray_kwargs.ray_init.address": "HEAD_IP and RAY_PORT"}
IGNORED_TOP_KEYS = ("defaults", "hydra")  # a walkthrough file's own Hydra plumbing: we layer it ourselves


def config_path(settings) -> Path | None:
    raw = settings["CONFIG"]
    if raw is None:
        return None
    path = Path(raw).expanduser()
    if not path.exists():
        raise UserError(f"CONFIG={raw} does not exist: point CONFIG at your verl-style YAML file "
                        f"(relative paths start at {Path.cwd()})")
    if not path.is_file():
        raise UserError(f"CONFIG={raw} is not a file: point CONFIG at one YAML file")
    return path.resolve()


@functools.cache
def _load(path: Path) -> dict[str, object]:
    """The file's leaves {dotted key: value}, parsed as Hydra parses config files (OmegaConf's loader:
    `1e-5` is a float), interpolations kept as written."""
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    import yaml

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


def leaves(tree: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(leaves(value, path + "."))
        else:
            out[path] = value
    return out


def user_leaves(settings) -> tuple[Path, dict[str, object]] | None:
    """(CONFIG's path, its leaves), or None without CONFIG."""
    path = config_path(settings)
    return (path, _load(path)) if path is not None else None


def with_values(settings, raw: dict[str, str], source: str):
    """`settings` with the variables of `raw` given those values (parsed and checked as the registry does),
    marked as coming from `source` (`make settings`-style provenance: CONFIG, command line)."""
    from app.settings import BY_NAME, _value

    values = dict(settings.values)
    for name, text in raw.items():
        values[name] = _value(BY_NAME[name], text, source)
    return dataclasses.replace(settings, values=MappingProxyType(values))


def with_file_defaults(job: str, settings):
    """`settings` where each unset setting of FILE_SETTINGS has the file's value (a plain value, not an
    interpolation): an explicit setting wins, the file's value comes next, the stack's default last."""
    found = user_leaves(settings)
    if found is None:
        return settings
    _, values = found
    given = {}
    for name, keys in FILE_SETTINGS.items():
        value = values.get(keys[job])
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if not settings.is_set(name) and isinstance(value, (str, int, float)) and "${" not in str(value):
            given[name] = str(value)
    return with_values(settings, given, "CONFIG") if given else settings


def overrides(settings) -> list[str]:
    """The file as Hydra overrides (`++` also adds keys verl declares as free-form, e.g. override_config)."""
    found = user_leaves(settings)
    return [] if found is None else [f"++{key}={hydra_literal(value)}" for key, value in found[1].items()]


def machine_warnings(job: str, settings, launch) -> list[str]:
    """The file's machine-describing values that the settings replace."""
    found = user_leaves(settings)
    if found is None:
        return []
    path, values = found
    ours = {"trainer.nnodes": launch.nnodes, "trainer.n_gpus_per_node": launch.gpus_per_node,
            "ray_kwargs.ray_init.address": launch.ray_address if job == "grpo" else None}
    out = []
    for key, setting in MACHINE_KEYS.items():
        value = values.get(key)
        if value is not None and ours[key] is not None and value != ours[key]:
            out.append(f"CONFIG {path.name} sets {key}={value}, replaced by {setting} ({ours[key]}) of this "
                       f"machine: set {setting} to change it")
    return out


def hydra_literal(value: object) -> str:
    """A YAML value as Hydra's override grammar reads it back: strings always quoted (so '5' stays text and
    `${...}` stays an interpolation), lists and dicts element by element."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_literal(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{key}:{hydra_literal(item)}" for key, item in value.items()) + "}"
    text = str(value)
    return hydra_quoted(text)
