"""Preflight (`python -m app check sft|grpo`) and the shipped profiles, on real files and real Hydra/verl.

Most rejections are checked in-process (one Hydra composition each, no interpreter start); a few go
through the real CLI to prove the one-line error contract.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from app import perf
from app import spec as specs
from app import preflight as pf
from app.common import UserError
from app.settings import BY_NAME, load
from conftest import LAUNCH_VARS, REPO, assert_one_line_error, run_app
from stack_files import write_sft


@pytest.fixture
def launch_env(monkeypatch, tmp_path, data_dir, tiny_model_dir) -> dict[str, str]:
    """A clean launch environment: tiny model, small real parquet, a run dir of this test."""
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    values = {"MODEL_PATH": str(tiny_model_dir), "DATA_DIR": str(data_dir), "CKPT_DIR": str(tmp_path / "run")}
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    return values


def plan_of(job: str, deep: bool = False) -> pf.Preflight:
    """Preflight of `job` with the settings of this process's environment, read once, as a command does."""
    return pf.preflight(job, load(), deep=deep)


def rejects(job: str, monkeypatch, match: str, **env: str) -> str:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UserError, match=match) as caught:
        plan_of(job, deep=True)
    return str(caught.value)


@pytest.mark.parametrize("job", ["sft", "grpo"])
def test_a_second_preflight_of_the_same_data_and_model_imports_no_tokenizer(launch_env, tmp_path, job):
    """The lengths preflight counts (SFT conversations, GRPO prompts) come back from the user's cache on the next
    launch: neither transformers nor torch is imported (they were most of a preflight: docs/benchmarks.md), and the
    notes say what the count said."""
    probe = ("import sys; from app.settings import load; from app.preflight import preflight; "
             f"plan = preflight({job!r}, load()); print(sorted(m for m in ('torch', 'transformers') if m in sys.modules)); "
             "print(*plan.notes, *plan.warnings, sep='|')")
    env = {**os.environ, **launch_env, "XDG_CACHE_HOME": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    runs = [subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr[-2000:] + runs[1].stderr[-2000:]
    (first_imports, first_said), (second_imports, second_said) = (r.stdout.splitlines()[:2] for r in runs)
    assert first_imports == "['torch', 'transformers']" and second_imports == "[]"
    assert second_said == first_said and (job == "sft" or "prompt lengths: longest" in second_said)


# --- the shipped profiles ----------------------------------------------------------------------------
def test_shipped_profiles_pass_preflight_and_verls_validate_config(launch_env):
    for job in ("sft", "grpo"):
        result = run_app("check", job, env=launch_env)
        assert result.returncode == 0, result.stderr
        assert f"preflight {job}: passed" in result.stdout
        assert "Traceback" not in result.stderr
    assert "verl's config types and validate_config: passed" in result.stdout


def test_profiles_set_safe_values_where_verls_defaults_bite(launch_env):
    sft = plan_of("sft").spec.cfg
    assert sft.optim.lr <= 1e-4 and "wandb" not in sft.trainer.logger and "swanlab" in sft.trainer.logger
    grpo = plan_of("grpo").spec.cfg
    rollout = grpo.actor_rollout_ref.rollout
    assert grpo.trainer.save_freq > 0 and "wandb" not in grpo.trainer.logger
    assert rollout.name == "vllm" and rollout.n >= 2 and rollout.tensor_model_parallel_size == 1
    assert rollout.engine_kwargs.vllm.attention_backend == "FLASH_ATTN"
    assert grpo.algorithm.adv_estimator == "grpo" and grpo.actor_rollout_ref.actor.use_kl_loss
    for cfg in (sft, grpo):
        assert Path(cfg.trainer.default_local_dir).is_absolute()
        assert Path(cfg.data.train_files) == Path(launch_env["DATA_DIR"]).resolve() / (
            "gsm8k_sft" if cfg is sft else "gsm8k") / "train.parquet"


def test_verls_own_entry_points_compose_the_config_preflight_checked(launch_env, tmp_path):
    """verl's trainers, given launch's exact arguments, print (`--cfg job`) the config preflight checked."""
    for job in ("sft", "grpo"):
        plan = plan_of(job)
        out = subprocess.run(
            [sys.executable, "-m", BY_NAME[f"{job.upper()}_TRAINER_MODULE"].default, "--config-dir",
             str(specs.CONFIG_DIR), "--config-name", job, *plan.spec.overrides, "--cfg", "job"],
            cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        ours = OmegaConf.to_container(plan.spec.cfg)
        lines = out.stdout.splitlines()
        start = next(i for i, line in enumerate(lines) if not line.startswith(" ") and line.split(":")[0] in ours)
        theirs = yaml.safe_load("\n".join(lines[start:]))
        assert theirs == json.loads(json.dumps(ours)), job


@pytest.mark.parametrize("lora", ["", "actor_rollout_ref.model.lora_rank=8 "], ids=["full", "lora"])
def test_check_runs_verls_validate_config_and_its_rejection_is_one_line(launch_env, lora):
    # a mini batch larger than the batch: none of our own checks, verl's validate_config refuses it; also in a
    # LoRA run on a node without vLLM, where verl's LoRA rank check is left out (the test below)
    args = (f"{lora}actor_rollout_ref.actor.use_dynamic_bsz=false actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 "
            "actor_rollout_ref.actor.ppo_mini_batch_size=300")
    line = assert_one_line_error(run_app("check", "grpo", env={**launch_env, "ARGS": args}))
    assert line.startswith("error: verl's validate_config rejects the grpo config:")
    assert "ppo_mini_batch_size (300)" in line


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="about a node without vLLM")
@pytest.mark.parametrize("args, rank", [("actor_rollout_ref.model.lora_rank=8", 8),
                                        ("actor_rollout_ref.model.lora.rank=16", 16),
                                        ("actor_rollout_ref.model.lora.rank=16 actor_rollout_ref.model.lora.merge=true",
                                         None)])
def test_a_lora_run_is_checked_on_a_node_without_vllm_all_but_its_rank(launch_env, monkeypatch, args, rank):
    """verl's validate_config checks a LoRA rank by importing vLLM and, without it, refuses every LoRA config:
    `make check` on a laptop passes, says the rank went unchecked, and the config verl gets keeps the rank."""
    monkeypatch.setenv("ARGS", args)
    plan = pf.preflight("grpo", load(), deep=True)
    unchecked = [note for note in plan.notes if note.startswith("LoRA rank")]
    assert unchecked == ([f"LoRA rank {rank} not checked against vLLM's limits: vLLM is not importable here "
                          "(grpo-head's preflight checks it where vLLM is installed, as in the image)"] if rank else [])
    assert "verl's config types and validate_config: passed" in plan.notes
    model = plan.spec.cfg.actor_rollout_ref.model
    assert (model.lora_rank, model.lora.rank) == ((8, 0) if rank == 8 else (0, 16))


def test_misspelt_key_in_args_fails_as_hydra_fails_in_verl(launch_env, monkeypatch):
    message = rejects("sft", monkeypatch, "does not compose", ARGS="optim.lrr=1e-5")
    assert "optim.lrr" in message


@pytest.mark.parametrize("job, line, typo, key", [
    ("sft", "  lr: 1e-5", "  lrr: 1e-5", "optim.lrr"),
    ("grpo", "    n: 5", "    nn: 5", "actor_rollout_ref.rollout.nn"),
])
def test_misspelt_key_in_a_profile_file_is_refused(launch_env, monkeypatch, tmp_path, job, line, typo, key):
    # Hydra merges a config file's keys without struct checks (verl's lr=1e-3 would silently stay):
    # preflight compares the profile with verl's own config
    configs = tmp_path / "configs"
    shutil.copytree(specs.CONFIG_DIR, configs)
    text = (configs / f"{job}.yaml").read_text()
    assert text.count(line) == 1
    (configs / f"{job}.yaml").write_text(text.replace(line, typo))
    monkeypatch.setattr(specs, "CONFIG_DIR", configs)
    message = rejects(job, monkeypatch, key)
    assert "does not have" in message


@pytest.mark.parametrize("job", ["sft", "grpo"])
def test_broken_yaml_in_a_profile_is_a_one_line_refusal(launch_env, monkeypatch, tmp_path, job):
    configs = tmp_path / "configs"
    shutil.copytree(specs.CONFIG_DIR, configs)
    (configs / f"{job}.yaml").write_text((configs / f"{job}.yaml").read_text() + "\ntrainer: [unclosed\n")
    monkeypatch.setattr(specs, "CONFIG_DIR", configs)
    message = rejects(job, monkeypatch, "not valid YAML")
    assert "\n" not in message and f"configs/{job}.yaml" in message


def test_args_are_appended_last_and_win(launch_env, monkeypatch):
    monkeypatch.setenv("ARGS", "optim.lr=3e-6 model.override_config.attn_implementation=eager")
    plan = plan_of("sft")
    assert plan.spec.cfg.optim.lr == 3e-6
    assert plan.spec.cfg.model.override_config.attn_implementation == "eager"
    # the node's choices, CONFIG and the settings, then the user's ARGS: one list, ARGS last
    assert plan.spec.args == ["optim.lr=3e-6", "model.override_config.attn_implementation=eager"]
    assert plan.spec.overrides[-2:] == plan.spec.args and not set(plan.spec.args) & set(plan.spec.stack)


def test_without_flash_attn_the_trainer_gets_torchs_varlen_kernel_else_flex_attention_and_preflight_says_so(
        launch_env, monkeypatch):
    import importlib.util

    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here: the profile's flash_attention_2 stands")
    assert perf.torch_varlen_installed()  # torch >= 2.10 here
    for job in ("sft", "grpo"):
        plan = plan_of(job)
        model = plan.spec.cfg.model if job == "sft" else plan.spec.cfg.actor_rollout_ref.model
        assert model.override_config.attn_implementation == "varlen_attention"
        assert model.external_lib == "app.attention"  # what verl imports in its workers to know the name
        assert any(n.startswith("attention: varlen_attention (flash-attn is not installed") for n in plan.notes)
        assert not [w for w in plan.warnings if "FlexAttention" in w]
        # no GPU here: the profile's safe budget and checkpointing stand, and preflight says why
        assert any("token budget: the profile's" in n for n in plan.notes)
        assert model.enable_gradient_checkpointing is True
    # remove-padding turned off: padded batches, which the packed-row kernel cannot take
    monkeypatch.setenv("ARGS", "model.use_remove_padding=false")
    assert plan_of("sft").spec.cfg.model.override_config.attn_implementation == "flex_attention"
    monkeypatch.delenv("ARGS")
    # a torch without the kernel: FlexAttention, with the warning of the open comparison against sdpa
    monkeypatch.setattr(perf, "torch_varlen_installed", lambda: False)
    for job, key in (("sft", "model"), ("grpo", "actor_rollout_ref.model")):
        plan = plan_of(job)
        model = plan.spec.cfg.model if job == "sft" else plan.spec.cfg.actor_rollout_ref.model
        assert model.override_config.attn_implementation == "flex_attention" and model.external_lib is None
        assert any(n.startswith("attention: flex_attention (flash-attn is not installed") for n in plan.notes)
        assert [w for w in plan.warnings if "FlexAttention" in w and "runs 15-17" in w
                and f"ARGS='{key}.override_config.attn_implementation=sdpa'" in w]


def test_preflight_says_which_attention_runs_when_args_replace_the_nodes_choice(launch_env, monkeypatch):
    chosen, _ = perf.attention()
    for job, key in (("sft", "model"), ("grpo", "actor_rollout_ref.model")):
        monkeypatch.setenv("ARGS", f"{key}.override_config.attn_implementation=sdpa")
        notes = [n for n in plan_of(job).notes if n.startswith("attention: ")]
        assert notes == [f"attention: {key}.override_config.attn_implementation=sdpa from ARGS or CONFIG "
                         f"(this node's choice: {key}.override_config.attn_implementation={chosen})"]
        assert not [w for w in plan_of(job).warnings if "FlexAttention" in w]  # sdpa chosen: no FlexAttention warning
        # ARGS that repeat the node's own choice leave the note as it was
        monkeypatch.setenv("ARGS", f"{key}.override_config.attn_implementation={chosen}")
        assert [n for n in plan_of(job).notes if n.startswith("attention: ")] == [f"attention: {chosen} ({perf.attention()[1]})"]


@pytest.mark.parametrize("name", ["my data, v2", "back\\slash", "it's", "ends in \\", "\\'both\\\\"])
def test_paths_with_spaces_quotes_and_backslashes_survive_hydra_quoting(launch_env, monkeypatch, tmp_path, name):
    """A backslash is literal in Hydra's quoted strings unless a quote follows it: doubling every one (as
    once) handed verl a path that does not exist. The same through CONFIG and the tracking overrides."""
    from app.tracking import tracking_overrides

    odd = write_sft(tmp_path / name / "train.parquet", rows=64)
    monkeypatch.setenv("TRAIN_FILE", str(odd))
    assert plan_of("sft").spec.cfg.data.train_files == str(odd)
    monkeypatch.delenv("TRAIN_FILE")
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump({"data": {"train_files": str(odd)}}))
    monkeypatch.setenv("CONFIG", str(tmp_path / "mine.yaml"))
    assert plan_of("sft").spec.cfg.data.train_files == str(odd)
    cfg = specs.compose("grpo", tracking_overrides({"SWANLAB_LOG_DIR": str(odd)}))
    assert cfg.ray_kwargs.ray_init.runtime_env.env_vars.SWANLAB_LOG_DIR == str(odd)


# --- one rejection each ------------------------------------------------------------------------------
def test_rejects_node_rank_outside_nnodes_through_the_cli(launch_env):
    line = assert_one_line_error(run_app("check", "sft", env={**launch_env, "NNODES": "2", "NODE_RANK": "2",
                                                               "MASTER_ADDR": "127.0.0.1"}))
    assert "NODE_RANK=2" in line and "[0, NNODES=2)" in line


def test_rejects_multi_node_sft_without_master_addr(launch_env, monkeypatch):
    rejects("sft", monkeypatch, "needs MASTER_ADDR", NNODES="2", NODE_RANK="1")


def test_rejects_multi_node_grpo_without_head_ip(launch_env, monkeypatch):
    rejects("grpo", monkeypatch, "needs HEAD_IP", NNODES="2")


@pytest.fixture
def gpus4(monkeypatch):
    """What nvidia-smi says on a node with four GPUs (this machine has none), read as CUDA_VISIBLE_DEVICES filters it."""
    from app import node

    rows = [{"index": str(i), "uuid": f"GPU-{i}aa", "name": "H200", "memory.total": "143771", "driver_version": "580.1",
             "compute_mode": "Default"} for i in range(4)]
    monkeypatch.setattr(node, "_driver_rows", lambda: (rows, "nvidia-smi"))
    node.gpus.cache_clear()
    yield
    node.gpus.cache_clear()


def test_rejects_gpus_per_node_that_differs_from_the_visible_gpus(launch_env, monkeypatch, gpus4):
    message = rejects("sft", monkeypatch, "sees 2 GPU", CUDA_VISIBLE_DEVICES="0,1", GPUS_PER_NODE="4")
    assert "GPUS_PER_NODE=2" in message


@pytest.mark.parametrize("visible, count", [(None, 4), ("", 0), ("-1", 0), ("2,0", 2), ("GPU-3", 1),
                                            ("0,nonsense,1", 1), ("nonsense", 0), ("0,0", 1)])
def test_cuda_visible_devices_is_read_as_cuda_reads_it(gpus4, visible, count):
    from app import node

    assert node.gpus(visible).count == count


def test_cannot_count_gpus_is_a_warning_and_no_driver_means_no_gpus_whatever_cuda_visible_devices_says(launch_env,
                                                                                                    monkeypatch):
    from app import node

    if node.gpus(None).present:
        pytest.skip("this machine has GPUs")
    plan = plan_of("sft")
    assert any("cannot count GPUs here" in w for w in plan.warnings)
    assert node.gpus("0,1").count is None and node.gpus("nonsense").count is None


def test_rejects_rollout_tp_not_dividing_gpus_per_node(launch_env, monkeypatch):
    rejects("grpo", monkeypatch, "tensor_model_parallel_size=2 does not divide the run's 3 GPUs",
            GPUS_PER_NODE="3", ARGS="actor_rollout_ref.rollout.tensor_model_parallel_size=2")
    # verl 0.9.1 builds a replica across nodes: a tensor-parallel size over one node's GPUs that divides the run's
    monkeypatch.setenv("ARGS", "actor_rollout_ref.rollout.tensor_model_parallel_size=2")
    monkeypatch.setenv("GPUS_PER_NODE", "1")
    monkeypatch.setenv("NNODES", "2")
    monkeypatch.setenv("HEAD_IP", "127.0.0.1")
    assert plan_of("grpo").spec.get("actor_rollout_ref.rollout.tensor_model_parallel_size") == 2


def test_rejects_grpo_with_one_sample_per_prompt(launch_env, monkeypatch):
    rejects("grpo", monkeypatch, "at least 2 samples", ARGS="actor_rollout_ref.rollout.n=1")


def test_rejects_batch_times_n_not_divisible_by_gpus_without_dynamic_batch(launch_env, monkeypatch):
    args = ("actor_rollout_ref.actor.use_dynamic_bsz=false data.train_batch_size=3 actor_rollout_ref.rollout.n=5 "
            "actor_rollout_ref.actor.ppo_mini_batch_size=3")
    # verl's own validate_config checks it (the deep check), in its words
    rejects("grpo", monkeypatch, r"real_train_batch_size \(15\) must be divisible by minimal possible batch size \(2\)",
            GPUS_PER_NODE="2", ARGS=args)
    # the same numbers pass the batch check once dynamic batch size is on
    monkeypatch.setenv("ARGS", args.replace("use_dynamic_bsz=false", "use_dynamic_bsz=true"))
    plan_of("grpo")


def test_rejects_token_budget_below_prompt_plus_response(launch_env, monkeypatch):
    rejects("grpo", monkeypatch, r"ppo_max_token_len_per_gpu=1000 is smaller than .* = 1536",
            ARGS="actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1000")


def test_rejects_sequence_parallel_without_remove_padding(launch_env, monkeypatch):
    rejects("sft", monkeypatch, "needs model.use_remove_padding=true",
            ARGS="engine.ulysses_sequence_parallel_size=2 model.use_remove_padding=false", GPUS_PER_NODE="2")


def test_rejects_sequence_parallel_not_dividing_attention_heads(launch_env, monkeypatch):
    rejects("grpo", monkeypatch, "does not divide the model's 4 attention heads", GPUS_PER_NODE="3",
            ARGS="actor_rollout_ref.actor.ulysses_sequence_parallel_size=3 data.train_batch_size=255")


@pytest.mark.skipif(perf.flash_attn_installed(), reason="about a node without flash-attn")
@pytest.mark.parametrize("job, args", [("sft", "engine.ulysses_sequence_parallel_size=2"),
                                       ("grpo", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2")])
def test_rejects_sequence_parallel_where_verls_ulysses_patch_does_not_reach_the_attention(launch_env, monkeypatch,
                                                                                         job, args):
    rejects(job, monkeypatch, "needs flash-attn's attention", ARGS=args, GPUS_PER_NODE="2")


def test_save_freq_that_saves_nothing_is_verls_own_default_and_said(launch_env, monkeypatch):
    monkeypatch.setenv("ARGS", "trainer.save_freq=-1")  # verl's recipes keep it: no checkpoints, intended
    assert [w for w in plan_of("grpo").warnings if w.startswith("trainer.save_freq=-1: this run writes no checkpoint")]


def test_rejects_a_logger_whose_package_is_not_installed(launch_env, monkeypatch):
    import importlib.util

    if importlib.util.find_spec("mlflow") is not None:
        pytest.skip("mlflow is installed here")
    rejects("sft", monkeypatch, "has mlflow, but mlflow is not installed", ARGS="trainer.logger=[console,mlflow]")


def test_rejects_sft_batch_not_divisible_by_gpus(launch_env, monkeypatch):
    rejects("sft", monkeypatch, "train_batch_size=10 is not divisible by the 4 GPUs",
            GPUS_PER_NODE="4", ARGS="data.train_batch_size=10")


def test_rejects_missing_data_file(launch_env, monkeypatch, tmp_path):
    rejects("sft", monkeypatch, "does not exist: run `make prep`", TRAIN_FILE=str(tmp_path / "nope.parquet"))


def test_rejects_data_in_the_wrong_schema_through_the_data_check(launch_env, monkeypatch, data_dir):
    # SFT messages handed to GRPO, which needs prompt / data_source / reward_model
    rejects("grpo", monkeypatch, "no `prompt` column", TRAIN_FILE=str(data_dir / "gsm8k_sft" / "train.parquet"))


def test_rejects_model_dir_without_config_or_tokenizer(launch_env, monkeypatch, tmp_path, tiny_model_dir):
    rejects("sft", monkeypatch, "has no config.json", MODEL_PATH=str(tmp_path))
    no_tokenizer = tmp_path / "model"
    no_tokenizer.mkdir()
    shutil.copy(tiny_model_dir / "config.json", no_tokenizer)
    rejects("sft", monkeypatch, "has no tokenizer", MODEL_PATH=str(no_tokenizer))
    # a truncated copy of config.json, and one of something else, fail transformers, verl and vLLM minutes in
    corrupt = tmp_path / "corrupt"
    shutil.copytree(tiny_model_dir, corrupt)
    (corrupt / "config.json").write_text((tiny_model_dir / "config.json").read_text()[:40])
    rejects("grpo", monkeypatch, "has an unreadable config.json", MODEL_PATH=str(corrupt))
    (corrupt / "config.json").write_text('{"hidden_size": 8}')
    rejects("sft", monkeypatch, "has a config.json without model_type", MODEL_PATH=str(corrupt))


def test_rejects_unset_model_path_through_the_cli(launch_env):
    env = {k: v for k, v in launch_env.items() if k != "MODEL_PATH"}
    line = assert_one_line_error(run_app("check", "grpo", env={**env, "MODEL_PATH": ""}))
    assert "MODEL_PATH is not set" in line


def test_rejects_relative_paths_in_a_multi_node_run(launch_env, monkeypatch):
    rejects("sft", monkeypatch, "relative path MODEL_PATH=models/tiny", NNODES="2", MASTER_ADDR="127.0.0.1",
            MODEL_PATH="models/tiny")
    monkeypatch.setenv("MODEL_PATH", launch_env["MODEL_PATH"])
    rejects("sft", monkeypatch, "relative path CKPT_DIR=ckpt", CKPT_DIR="ckpt")
    # ARGS naming the run dir relatively: read as CKPT_DIR, so refused the same way
    monkeypatch.chdir(Path(launch_env["CKPT_DIR"]).parent)
    monkeypatch.delenv("CKPT_DIR")
    rejects("sft", monkeypatch, re.escape("relative path CKPT_DIR=run (from ARGS) in a 2-node run"),
            ARGS="trainer.default_local_dir=run")
    # naming the setting's own run dir relatively beside it: the same place, and verl gets the setting's absolute path
    monkeypatch.setenv("CKPT_DIR", launch_env["CKPT_DIR"])
    monkeypatch.setenv("ARGS", "trainer.default_local_dir=run")
    assert plan_of("sft").spec.cfg.trainer.default_local_dir == launch_env["CKPT_DIR"]


@pytest.mark.parametrize("job,args,match", [
    ("sft", "optim.lr=abc", "optim.lr='abc' (text) from ARGS: verl expects a number there, like its default 0.001: fix it in ARGS"),
    ("grpo", "actor_rollout_ref.actor.optim.lr=-1e-6", "a learning rate must be above 0"),
    ("sft", "trainer.total_epochs=two", "trainer.total_epochs='two' (text) from ARGS: verl expects a number there"),
    ("sft", "trainer.total_epochs=2.5", "trainer.total_epochs=2.5 from ARGS: it must be a whole number, at least 1"),
    ("grpo", "data.train_batch_size=abc", "data.train_batch_size='abc' (text) from ARGS: verl expects a number"),
    ("grpo", "data.train_batch_size=0", "data.train_batch_size=0 from ARGS: it must be a whole number, at least 1"),
    ("sft", "data.train_batch_size=-1", "data.train_batch_size=-1 from ARGS: it must be a whole number, at least 1"),
    ("grpo", "actor_rollout_ref.rollout.n=abc", "actor_rollout_ref.rollout.n='abc' (text) from ARGS: verl expects a number"),
    ("sft", "model.enable_gradient_checkpointing=1", "verl expects true or false there"),
    ("grpo", "trainer.save_freq=after_each_epoch", "trainer.save_freq='after_each_epoch' (text) from ARGS: verl expects a number"),
    ("sft", "=5", "the sft config does not compose: Config group override must be a string or a list"),
    ("sft", "optim=[1,2]", "the sft config does not compose"),
    # a whole number by verl's dataclass (RolloutConfig.max_num_seqs: int), though its section's YAML allows floats
    ("grpo", "actor_rollout_ref.rollout.max_num_seqs=0.5", "max_num_seqs=0.5 from ARGS: verl's RolloutConfig takes no "
     "such value (Value '0.5' of type 'float' could not be converted to Integer)"),
    ("grpo", "trainer.save_freq=2.5", "trainer.save_freq=2.5 is not a whole number of steps"),
    ("grpo", "data.val_files=null", "data.val_files is empty, but verl 0.9.1's GRPO always builds its val dataset"),
    ("grpo", "actor_rollout_ref.model.path=${oc.env:NO_SUCH_VARIABLE_HERE}",
     "ARGS sets actor_rollout_ref.model.path to something that does not resolve"),
    ("sft", "model.path=/elsewhere", "ARGS sets model.path=/elsewhere, which is MODEL_PATH, but MODEL_PATH="),
])
def test_rejects_values_of_the_wrong_type_or_range_before_verl_meets_them(launch_env, monkeypatch, job, args, match):
    line = rejects(job, monkeypatch, re.escape(match), ARGS=args)
    assert "\n" not in line


@pytest.mark.parametrize("job,args", [
    # float fields whose default verl's YAML writes as 0 or 1, a verl walkthrough's values
    ("grpo", "actor_rollout_ref.rollout.top_p=0.95 actor_rollout_ref.actor.entropy_coeff=0.001 "
             "actor_rollout_ref.rollout.val_kwargs.temperature=0.6 actor_rollout_ref.rollout.n=8 "
             "trainer.save_freq=20 trainer.test_freq=-1 trainer.logger=[console,swanlab]"),
    ("sft", "optim.lr=1e-5 optim.weight_decay=0 optim.clip_grad=1 trainer.total_training_steps=null "
            "trainer.save_freq=after_each_epoch"),
    ("sft", "data.val_files=null"),  # validation off: no setting says that, so ARGS may
    ("sft", "data.val_files=[]"),
])
def test_common_walkthrough_values_pass_the_value_check(launch_env, monkeypatch, job, args):
    monkeypatch.setenv("ARGS", args)
    plan_of(job)


def test_interpolated_values_are_checked_once_resolved_and_never_an_internal_error(launch_env):
    # oc.env gives text: verl's optimizer would get the string '1e-06'
    line = assert_one_line_error(run_app("check", "grpo", env={
        **launch_env, "ARGS": "actor_rollout_ref.actor.optim.lr=${oc.env:NO_SUCH_VARIABLE_HERE,1e-6}"}))
    assert "actor_rollout_ref.actor.optim.lr='1e-06' (text) from ARGS: verl expects a number there" in line
    result = run_app("check", "grpo", env={**launch_env, "ARGS": "actor_rollout_ref.actor.optim.lr=${oc.env:NO_SUCH_VARIABLE_HERE}"})
    assert "internal error" not in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_a_wrong_value_in_the_config_file_is_named_with_its_file(launch_env, monkeypatch, tmp_path):
    config = tmp_path / "mine.yaml"
    config.write_text("trainer:\n  total_epochs: two\n")
    rejects("sft", monkeypatch, re.escape("trainer.total_epochs='two' (text) from CONFIG: verl expects a number there, "
                                          "like its default 4: fix it in the CONFIG file"), CONFIG=str(config))
    # SFT's own words for "at each epoch's end" pass where verl's SFT trainer takes them
    words = tmp_path / "words.yaml"
    words.write_text("trainer:\n  save_freq: after_each_epoch\n  test_freq: after_each_epoch\n")
    monkeypatch.setenv("CONFIG", str(words))
    assert plan_of("sft").spec.cfg.trainer.save_freq == "after_each_epoch"


def test_deep_check_refuses_an_advantage_estimator_verl_does_not_have(launch_env):
    line = assert_one_line_error(run_app("check", "grpo", env={**launch_env, "ARGS": "algorithm.adv_estimator=nosuch"}))
    assert "algorithm.adv_estimator=nosuch: verl 0.9.1 has no such estimator; choose one of " in line and "grpo" in line


def test_rejects_a_run_directory_that_is_a_file_or_under_one(launch_env, monkeypatch, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    line = rejects("grpo", monkeypatch, "is a file", CKPT_DIR=str(afile))
    assert line == (f"the run directory {afile} is a file: set CKPT_DIR to a directory you can write "
                    "(created where missing)")
    rejects("sft", monkeypatch, f"is under {afile}, which is a file", CKPT_DIR=str(afile / "run" / "x"))
    monkeypatch.setenv("CKPT_DIR", str(tmp_path / "new" / "run"))  # missing: created by the launch
    assert plan_of("sft").spec.run_dir == tmp_path / "new" / "run"


@pytest.mark.parametrize("job,key,value,setting,composed", [
    ("sft", "model.path", "{model}", "MODEL_PATH", "{model}"),
    ("sft", "trainer.nnodes", "3", "NNODES", 3),
    ("grpo", "trainer.n_gpus_per_node", "8", "GPUS_PER_NODE", 8),
    ("grpo", "data.train_files", "[{data}/gsm8k/train.parquet,{data}/gsm8k/train.parquet]", "TRAIN_FILE",
     ["{data}/gsm8k/train.parquet", "{data}/gsm8k/train.parquet"]),
    ("grpo", "trainer.experiment_name", "other", "EXPERIMENT", "other"),
    ("grpo", "ray_kwargs.ray_init.address", "127.0.0.9:6390", "HEAD_IP", "127.0.0.9:6390"),
])
def test_args_keys_that_a_setting_owns_are_read_as_that_setting(launch_env, monkeypatch, job, key, value, setting,
                                                                  composed):
    """verl's own recipes set trainer.experiment_name, data files, node counts in their overrides: taken as the
    setting (the host mounts its paths, every check reads it), not refused; beside a different value of that
    setting, one line names both."""
    fill = {"model": launch_env["MODEL_PATH"], "data": launch_env["DATA_DIR"]}
    value = value.format(**fill)
    composed = [c.format(**fill) for c in composed] if isinstance(composed, list) else \
        composed.format(**fill) if isinstance(composed, str) else composed
    for name in ("MODEL_PATH", "DATA_DIR"):
        monkeypatch.delenv(name) if setting == name else None
    monkeypatch.setenv("ARGS", f"{key}={value}")
    if setting == "NNODES":
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    settings = load()
    assert settings.source(setting) == "ARGS" and settings.args == ()
    spec = specs.read(job, settings)
    got = spec.get(key)
    assert (list(got) if isinstance(got, (list, tuple)) or hasattr(got, "__len__") and not isinstance(got, str)
            else got) == composed
    # the same key beside a different value of the setting: one line naming both
    other = {"MODEL_PATH": str(Path(launch_env["MODEL_PATH"]).parent), "NNODES": "2", "GPUS_PER_NODE": "2",
             "TRAIN_FILE": "/elsewhere.parquet", "EXPERIMENT": "mine", "HEAD_IP": "127.0.0.3"}[setting]
    monkeypatch.setenv(setting, other)
    line = rejects(job, monkeypatch, "ARGS sets")
    assert line.startswith(f"ARGS sets {key}={value}, which is {setting}, but {setting}={other} (from shell): keep one")


def test_args_naming_the_settings_own_path_another_way_pass(launch_env, monkeypatch, tmp_path):
    link = tmp_path / "model-link"
    link.symlink_to(launch_env["MODEL_PATH"])
    monkeypatch.setenv("MODEL_PATH", str(link))
    monkeypatch.setenv("ARGS", f"actor_rollout_ref.model.path={launch_env['MODEL_PATH']}/")  # the link's target
    plan_of("grpo")
    train = launch_env["DATA_DIR"] + "/gsm8k/train.parquet"
    monkeypatch.setenv("ARGS", f"data.train_files=[{train}]")  # verl's list form of the one file
    assert plan_of("grpo").spec.files("train") == [Path(train).resolve()]


def test_rejects_the_stale_vllm_attention_backend_variable(launch_env, monkeypatch):
    rejects("grpo", monkeypatch, "vLLM 0.24 ignores it", VLLM_ATTENTION_BACKEND="XFORMERS")


def test_check_of_an_unknown_job_is_one_line(launch_env):
    line = assert_one_line_error(run_app("check", "ppo", env=launch_env))
    assert "invalid choice: 'ppo'" in line


def test_config_command_prints_the_composed_config(launch_env):
    result = run_app("config", "grpo", env={**launch_env, "ARGS": "trainer.total_epochs=2"})
    assert result.returncode == 0, result.stderr
    cfg = yaml.safe_load(result.stdout)
    assert cfg["trainer"]["total_epochs"] == 2
    assert cfg["actor_rollout_ref"]["model"]["path"] == str(Path(launch_env["MODEL_PATH"]).resolve())


def test_shipped_profiles_only_use_keys_verl_declares():
    for job in ("sft", "grpo"):
        specs.check_keys(job, load())  # raises on a key verl's packaged config lacks
    assert (REPO / "configs" / "sft.yaml").is_file()


# --- prompt lengths: counted once by preflight with the model's chat template ------------------------------
def write_rl_of_lengths(path: Path, words: list[int], start: int = 0) -> Path:
    """An RL parquet whose prompts grow by `words[i]` extra words each (so their token counts differ)."""
    import pandas as pd

    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame({
        "data_source": ["openai/gsm8k"] * len(words),
        "prompt": [[{"role": "user", "content": f"What is {i} + 1?" + " and" * n}]
                   for i, n in enumerate(words, start)],
        "reward_model": [{"style": "rule", "ground_truth": str(i + 1)} for i in range(start, start + len(words))],
    }).to_parquet(path)
    return path


def lengths_of(path: Path, model: Path) -> list[int]:
    from transformers import AutoTokenizer

    from app.data import prompt_lengths

    return prompt_lengths(path, AutoTokenizer.from_pretrained(model))


def test_preflight_turns_verls_length_filter_off_when_every_prompt_fits(launch_env, monkeypatch):
    plan = plan_of("grpo")
    assert "data.filter_overlong_prompts=False" in plan.spec.choices  # under CONFIG and ARGS
    assert plan.spec.cfg.data.filter_overlong_prompts is False
    assert [n for n in plan.notes if n.startswith("prompt lengths: longest ") and "256 train and 8 val prompts" in n
            and "filter at every start skipped" in n]
    # a user who asks for the filter keeps it, and the count is still said
    monkeypatch.setenv("ARGS", "data.filter_overlong_prompts=True")
    plan = plan_of("grpo")
    assert plan.spec.cfg.data.filter_overlong_prompts is True
    assert "data.filter_overlong_prompts=False" not in plan.spec.overrides
    assert [n for n in plan.notes if n.startswith("prompt lengths: longest ") and "skipped" not in n]


def test_preflight_puts_vllms_worker_in_its_engine_core_only_where_a_replica_has_one_gpu(launch_env, monkeypatch):
    key = pf.VLLM_EXECUTOR_KEY
    plan = plan_of("grpo")
    assert f"++{key}=uni" in plan.spec.choices  # under CONFIG and ARGS, like the length filter's choice
    assert OmegaConf.select(plan.spec.cfg, key) == "uni"
    assert "vLLM executor: uni (its model worker runs inside the EngineCore: one process fewer to start)" in plan.notes
    # verl's validate_config and its own composition take it (the deep check imports verl)
    assert run_app("check", "grpo", env=launch_env).returncode == 0
    # a replica over two GPUs keeps verl's mp: vLLM's uni executor runs one worker only
    monkeypatch.setenv("GPUS_PER_NODE", "2")
    monkeypatch.setenv("ARGS", "actor_rollout_ref.rollout.tensor_model_parallel_size=2")
    plan = plan_of("grpo")
    assert OmegaConf.select(plan.spec.cfg, key) is None and not [o for o in plan.spec.overrides if key in o]
    assert "vLLM executor: verl's mp (a rollout replica spans 2 GPUs)" in plan.notes
    # the user's choice stands, and is said
    monkeypatch.setenv("GPUS_PER_NODE", "1")
    monkeypatch.setenv("ARGS", f"+{key}=mp")
    plan = plan_of("grpo")
    assert OmegaConf.select(plan.spec.cfg, key) == "mp" and [o for o in plan.spec.overrides if key in o] == [f"+{key}=mp"]
    assert "vLLM executor: mp (from CONFIG or ARGS)" in plan.notes


def test_preflight_refuses_prompts_verl_would_truncate_with_the_filter_off(launch_env, monkeypatch, tmp_path,
                                                                          tiny_model_dir):
    train = write_rl_of_lengths(tmp_path / "train.parquet", [0, 0, 40, 0, 80, 0])
    write_rl_of_lengths(tmp_path / "val.parquet", [0, 0], start=6)  # as short as the short train rows
    lengths = lengths_of(train, tiny_model_dir)
    limit = sorted(lengths)[3]  # the two long ones are over it
    env = {**launch_env, "TRAIN_FILE": str(train), "VAL_FILE": str(tmp_path / "val.parquet"),
           "ARGS": f"data.max_prompt_length={limit} data.filter_overlong_prompts=False data.train_batch_size=4 "
                   "actor_rollout_ref.actor.ppo_mini_batch_size=4"}
    line = assert_one_line_error(run_app("check", "grpo", env=env))
    assert (f"2 of 6 train prompts are longer than actor_rollout_ref.rollout.prompt_length={limit} (longest "
            f"{max(lengths)} tokens) and data.filter_overlong_prompts is off" in line and "cut off their beginnings" in line
            and f"to {max(lengths)} or ARGS='data.filter_overlong_prompts=True'" in line)
    # the rollout's own limit is what verl cuts at: raised above every prompt, nothing is cut and the check passes
    env["ARGS"] += f" actor_rollout_ref.rollout.prompt_length={max(lengths)}"
    assert run_app("check", "grpo", env=env).returncode == 0
    # with verl's filter on, the same prompts are dropped at start: said, and passed where enough are left
    env["ARGS"] = f"data.max_prompt_length={limit} data.train_batch_size=4 actor_rollout_ref.actor.ppo_mini_batch_size=4"
    result = run_app("check", "grpo", env=env)
    assert result.returncode == 0, result.stderr
    assert "2 of 6 train prompts are longer than" in result.stderr and "verl's filter drops them" in result.stderr
    # and refused where the filter would leave fewer prompts than one batch
    env["ARGS"] = f"data.max_prompt_length={limit} data.train_batch_size=5 actor_rollout_ref.actor.ppo_mini_batch_size=5"
    line = assert_one_line_error(run_app("check", "grpo", env=env))
    assert "would leave 4 train prompts" in line and "fewer than data.train_batch_size=5" in line


# --- verl's own recipes, brought as they are -------------------------------------------------------------
@pytest.mark.parametrize("job, args, said", [
    ("grpo", "critic.ppo_micro_batch_size_per_gpu=8 critic.optim.lr=1e-5",
     "critic.ppo_micro_batch_size_per_gpu=8 from ARGS: algorithm.adv_estimator=grpo trains no critic, so verl ignores "
     "critic.*; for PPO with a critic: ARGS='algorithm.adv_estimator=gae'"),
    ("grpo", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 from ARGS: verl ignores it under "
     "actor_rollout_ref.actor.use_dynamic_bsz=true, where the token budget decides"),
    ("grpo", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",
     "verl ignores it under actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true"),
    ("sft", "data.micro_batch_size_per_gpu=2", "verl ignores it under data.use_dynamic_bsz=true"),
])
def test_a_recipes_keys_that_verl_will_ignore_are_said_not_refused(launch_env, monkeypatch, job, args, said):
    monkeypatch.setenv("ARGS", args)
    warnings = plan_of(job).warnings
    assert [w for w in warnings if said in w], warnings
    monkeypatch.setenv("ARGS", args + (" actor_rollout_ref.actor.use_dynamic_bsz=false" if "actor." in args else ""))
    if "actor." in args:  # with dynamic batching off, verl reads it: nothing to say
        assert not [w for w in plan_of(job).warnings if "verl ignores it" in w]


@pytest.mark.parametrize("truncation, refused", [("right", False), ("left", False), ("error", True)])
def test_sft_conversations_longer_than_max_length_are_said_or_refused_never_cut_silently(launch_env, monkeypatch,
                                                                                         tmp_path, truncation, refused):
    long_one = [{"role": "user", "content": "What is 1 + 1? " + "and " * 400},
                {"role": "assistant", "content": "1 + 1 = 2\n#### 2"}]
    import pandas as pd

    train = write_sft(tmp_path / "train.parquet", rows=64)
    table = pd.read_parquet(train)
    table.at[3, "messages"] = long_one
    table.to_parquet(train)
    monkeypatch.setenv("TRAIN_FILE", str(train))
    monkeypatch.setenv("ARGS", f"data.max_length=256 data.truncation={truncation}")
    said = "1 of 64 train conversations are longer than data.max_length=256 (longest "
    if refused:
        assert said in rejects("sft", monkeypatch, "would stop at the first")
        return
    warnings = plan_of("sft").warnings
    assert [w for w in warnings if w.startswith(said) and f"data.truncation={truncation}" in w], warnings


def test_verls_own_gsm8k_grpo_recipe_passes_as_verl_would_take_it(launch_env, monkeypatch):
    """verl 0.9.1's examples/grpo_trainer GSM8K script (run_qwen2-7b_seq_balance.sh), translated as a user would: the
    model, the data and the node counts as settings, every other override verbatim in ARGS (its wandb logger as
    console: wandb is not installed here, and verl would stop on it too)."""
    recipe = ("algorithm.adv_estimator=grpo data.train_batch_size=256 data.max_prompt_length=512 "
              "data.max_response_length=1024 data.filter_overlong_prompts=True data.truncation='error' "
              "actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.model.use_remove_padding=True "
              "actor_rollout_ref.actor.ppo_mini_batch_size=64 actor_rollout_ref.actor.use_dynamic_bsz=True "
              "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24000 actor_rollout_ref.actor.use_kl_loss=True "
              "actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl "
              "actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.model.enable_gradient_checkpointing=True "
              "actor_rollout_ref.actor.fsdp_config.param_offload=False "
              "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False "
              "actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.name=vllm "
              "actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5 "
              "actor_rollout_ref.ref.fsdp_config.param_offload=True algorithm.use_kl_in_reward=False "
              "trainer.critic_warmup=0 trainer.logger=['console'] trainer.project_name='verl_grpo_example_gsm8k' "
              "trainer.experiment_name='qwen2_7b_function_rm' trainer.n_gpus_per_node=8 trainer.nnodes=1 "
              "trainer.save_freq=20 trainer.test_freq=5 trainer.total_epochs=15")
    monkeypatch.setenv("ARGS", recipe)
    plan = plan_of("grpo", deep=True)
    cfg = plan.spec.cfg
    assert cfg.trainer.experiment_name == "qwen2_7b_function_rm" and cfg.trainer.project_name == "verl_grpo_example_gsm8k"
    assert cfg.trainer.n_gpus_per_node == 8 and cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == 2
    assert load().source("EXPERIMENT") == "ARGS" and load().source("GPUS_PER_NODE") == "ARGS"
