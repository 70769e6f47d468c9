"""Keys verl 0.9.1 renamed or removed since the walkthrough this stack grew from, and the one-line listing
of every unknown key of a config layer (configs/<job>.yaml, the user's CONFIG file), all at once.

The walkthrough's `sft.yaml` was a copy of verl's old `fsdp_sft_trainer` config, its `grpo_trainer.yaml` one
of the old `ppo_trainer` config; the table maps the keys of those that verl 0.9.1 no longer has to their
new names (checked against verl 0.9.1's packaged configs by tests/test_faults_config.py).
"""

from __future__ import annotations

from typing import Callable, Iterable

from app.common import UserError

CONVERT_DATA = ("prompt/response columns are gone, verl 0.9.1 reads one `messages` conversation per row: "
                "convert the data with `make data-check FILE=... FIX=OUT.parquet`")

# job -> {old key or old prefix ending in ".": (new key or prefix, or None where it is gone; why / what to do)}
RENAMED: dict[str, dict[str, tuple[str | None, str]]] = {
    "sft": {
        "model.partial_pretrain": ("model.path", ""),
        "data.prompt_key": ("data.messages_key", CONVERT_DATA),
        "data.response_key": ("data.messages_key", CONVERT_DATA),
        "data.prompt_dict_keys": ("data.messages_key", CONVERT_DATA),
        "data.response_dict_keys": ("data.messages_key", CONVERT_DATA),
        "data.multiturn.messages_key": ("data.messages_key", ""),
        "data.multiturn.enable": (None, "multi-turn `messages` is the only SFT data form now: remove it"),
        "data.micro_batch_size": ("data.micro_batch_size_per_gpu", ""),
        "data.chat_template": ("model.custom_chat_template", ""),
        "ulysses_sequence_parallel_size": ("engine.ulysses_sequence_parallel_size", ""),
        "use_remove_padding": ("model.use_remove_padding", ""),
        "model.fsdp_config.cpu_offload": ("engine.param_offload", "and engine.optimizer_offload"),
        "model.fsdp_config.offload_params": ("engine.param_offload", ""),
        "model.fsdp_config.": ("engine.", ""),
        "optim.warmup_steps_ratio": ("optim.lr_warmup_steps_ratio", ""),
        "optim.lr_scheduler": ("optim.lr_scheduler_type", ""),
        "trainer.resume_path": ("trainer.resume_from_path", "with trainer.resume_mode=resume_path"),
    },
    "grpo": {
        "actor_rollout_ref.actor.checkpoint.contents": ("actor_rollout_ref.actor.checkpoint.save_contents", ""),
        "critic.checkpoint.contents": ("critic.checkpoint.save_contents", ""),
        "critic.model.fsdp_config.": ("critic.fsdp.", ""),
        "actor_rollout_ref.model.use_fused_loss": ("actor_rollout_ref.model.use_fused_kernels", ""),
        "actor_rollout_ref.model.return_last_hidden_state": (None, "remove it"),
        "actor_rollout_ref.rollout.chat_scheduler": (None, "the agent loop replaced it: remove it"),
        "actor_rollout_ref.rollout.use_fire_sampling": (None, "remove it"),
        "actor_rollout_ref.rollout.engine_kwargs.swap_space": (
            "actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space", ""),
        "actor_rollout_ref.rollout.multi_turn.max_turns": (
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns", ""),
        "reward_model.launch_reward_fn_async": (None, "the reward loop is asynchronous now: remove it"),
        "reward_model.": ("reward.reward_model.", "the old reward_model section is gone; a rule reward such as "
                          "GSM8K's needs none, a model reward is set under reward.reward_model"),
        "ray_init.": ("ray_kwargs.ray_init.", ""),
    },
}

# job -> {key: {old value: what to do}}: values verl 0.9.1 refuses only once the run has started
STALE_VALUES: dict[str, dict[str, dict[object, str]]] = {
    "sft": {},
    "grpo": {
        "actor_rollout_ref.rollout.mode": {"sync": "removed in verl 0.9.1, async is the only mode: remove the key"},
        "actor_rollout_ref.rollout.name": {"hf": "the HF rollout is gone: use vllm (or sglang, trtllm)"},
    },
}


def rename_of(job: str, key: str) -> tuple[str | None, str] | None:
    """(new name or None, note) where verl renamed or removed `key` since the walkthrough, else None."""
    table = RENAMED[job]
    if key in table:
        return table[key]
    prefixes = [old for old in table if old.endswith(".") and key.startswith(old)]
    if not prefixes:
        return None
    old = max(prefixes, key=len)
    new, note = table[old]
    return (new + key[len(old):] if new is not None else None), note


def describe_unknown(job: str, key: str, known: Callable[[str], bool] = lambda key: True) -> tuple[str, str]:
    """(key, what to do about it): its new name, that it is gone, or that it is misspelt. A renamed prefix
    whose new key `known` denies counts as gone."""
    renamed = rename_of(job, key)
    if renamed is None:
        return key, "unknown: fix the spelling"
    new, note = renamed
    if new is None or not known(new):
        return key, f"removed in verl 0.9.1: {note or 'remove it'}"
    return key, f"now {new}" + (f": {note}" if note else "")


def _grouped(problems: list[tuple[str, str]]) -> str:
    """`a, b (what to do)`: keys sharing one explanation are listed together, in their order."""
    order: dict[str, list[str]] = {}
    for key, why in problems:
        order.setdefault(why, []).append(key)
    return ", ".join(f"{', '.join(keys)} ({why})" for why, keys in order.items())


def stale_values(job: str, leaves: dict[str, object]) -> list[tuple[str, str]]:
    found = []
    for key, bad in STALE_VALUES[job].items():
        value = leaves.get(key)
        if isinstance(value, (str, int, float, bool)) and value in bad:
            found.append((f"{key}={value}", bad[value]))
    return found


def refuse_unknown(job: str, base_name: str, layers: Iterable[tuple[str, dict[str, object]]],
                   known: Callable[[str], bool]) -> None:
    """One UserError listing every unknown key and stale value of every layer, each with what to do.

    `layers`: (where, {dotted leaf key: value}) per config file; `known(key)`: whether verl's config has it.
    """
    parts, total = [], 0
    for where, leaves in layers:
        problems = [describe_unknown(job, key, known) for key in leaves if not known(key)]
        problems += stale_values(job, leaves)
        total += len(problems)
        if problems:
            parts.append(f"{where}: " + _grouped(problems))
    if parts:
        raise UserError(f"verl 0.9.1's {base_name} does not have {total} setting(s) given here: " + "; ".join(parts)
                        + f": change them as shown (`python -m app config {job}` prints the composed config)")
