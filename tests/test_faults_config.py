"""CONFIG=my.yaml and the keys verl 0.9.1 renamed (issue 13): the old walkthrough's own config files
(tests/fixtures/walkthrough) through `make`/`python -m app`, verl's entry point as the judge of the
composition; and preflight refusing what used to pass it and fail later (no GPUs, DRY_RUN vs check)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import FIXTURES, REPO, assert_one_line_error, make, run_app

from app import spec as specs
from app import renames

WALKTHROUGH = FIXTURES / "walkthrough"


@pytest.fixture
def env(base_env) -> dict[str, str]:
    return {**base_env, "PYTHONPATH": str(REPO)}  # the checkout only: these tests start no stand-in


def write_yaml(path: Path, tree: dict) -> Path:
    path.write_text(yaml.safe_dump(tree))
    return path


def composed(result) -> dict:
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


# --- the old walkthrough's files ---------------------------------------------------------------------
def test_walkthrough_sft_yaml_lists_every_renamed_key_at_once_with_its_new_name(env, tmp_path):
    result = make("check", "JOB=sft", f"CONFIG={WALKTHROUGH / 'sft.yaml'}", env=env)
    line = assert_one_line_error(result)
    assert line.startswith("error: verl 0.9.1's sft_trainer_engine does not have 18 setting(s) given here: CONFIG ")
    for fragment in ["model.partial_pretrain (now model.path)",
                     "data.prompt_key, data.response_key, data.prompt_dict_keys, data.response_dict_keys "
                     "(now data.messages_key: prompt/response columns are gone",
                     "FIX=OUT.parquet", "ulysses_sequence_parallel_size (now engine.ulysses_sequence_parallel_size)",
                     "use_remove_padding (now model.use_remove_padding)",
                     "optim.warmup_steps_ratio (now optim.lr_warmup_steps_ratio)",
                     "model.fsdp_config.model_dtype (now engine.model_dtype)",
                     "data.micro_batch_size (now data.micro_batch_size_per_gpu)"]:
        assert fragment in line, fragment
    assert not (tmp_path / "run").exists()


def test_walkthrough_grpo_yaml_lists_every_renamed_key_and_the_removed_sync_mode(env):
    line = assert_one_line_error(make("check", "JOB=grpo", f"CONFIG={WALKTHROUGH / 'grpo_trainer.yaml'}", env=env))
    assert "ppo_trainer does not have 8 setting(s)" in line
    for fragment in ["ray_init.num_cpus (now ray_kwargs.ray_init.num_cpus)",
                     "actor_rollout_ref.actor.checkpoint.contents (now actor_rollout_ref.actor.checkpoint.save_contents)",
                     "actor_rollout_ref.rollout.mode=sync (removed in verl 0.9.1, async is the only mode",
                     "reward_model.launch_reward_fn_async (removed in verl 0.9.1"]:
        assert fragment in line, fragment


@pytest.mark.parametrize("job", ["sft", "grpo"])
def test_every_new_name_in_the_rename_table_exists_in_verls_config(job):
    for old, (new, _) in renames.RENAMED[job].items():
        assert not specs.known_key(job, old.rstrip(".")) or old.endswith("."), old  # really gone
        if new is not None and not new.endswith("."):
            assert specs.known_key(job, new), (old, new)


def test_unknown_keys_of_the_profile_and_the_config_file_are_listed_in_one_line(env, tmp_path):
    configs = tmp_path / "configs"
    shutil.copytree(REPO / "configs", configs)
    text = (configs / "sft.yaml").read_text()
    (configs / "sft.yaml").write_text(text.replace("  lr: 1e-5", "  lrr: 1e-5"))
    mine = write_yaml(tmp_path / "my.yaml", {"trainer": {"totl_epochs": 2}, "model": {"partial_pretrain": "/m"}})
    code = (f"import sys; from pathlib import Path; import app.spec as c; c.CONFIG_DIR = Path({str(configs)!r}); "
            "from app.__main__ import main; sys.exit(main(['check', 'sft']))")
    result = subprocess.run([sys.executable, "-c", code], env={**env, "CONFIG": str(mine)}, cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    line = assert_one_line_error(result)
    assert "does not have 3 setting(s)" in line
    assert "configs/sft.yaml: optim.lrr (unknown: fix the spelling)" in line
    assert "model.partial_pretrain (now model.path)" in line and "trainer.totl_epochs (unknown: fix the" in line


# --- composition -------------------------------------------------------------------------------------------
def test_config_file_sits_over_the_profile_and_under_args(env, tmp_path):
    mine = write_yaml(tmp_path / "my.yaml", {"optim": {"lr": 2e-5, "betas": [0.9, 0.95]},
                                             "data": {"max_length": 2048},
                                             "trainer": {"total_epochs": 1}})
    cfg = composed(run_app("config", "sft", "--config", str(mine), env={**env, "ARGS": "trainer.total_epochs=7"}))
    assert cfg["optim"]["lr"] == 2e-5 and cfg["optim"]["betas"] == [0.9, 0.95]  # file over profile (1e-5)
    assert cfg["data"]["max_length"] == 2048 and cfg["data"]["truncation"] == "right"  # profile keys kept
    assert cfg["trainer"]["total_epochs"] == 7  # ARGS last
    assert cfg["optim"]["lr_scheduler_type"] == "cosine"


def test_config_file_replaces_this_nodes_choices_and_preflight_says_what_runs(env, tmp_path):
    """preflight's choices (attention, Liger, budget) sit under CONFIG: a file that picks sdpa gets sdpa, and no
    FlexAttention warning."""
    mine = write_yaml(tmp_path / "my.yaml", {"model": {"override_config": {"attn_implementation": "sdpa"}}})
    cfg = composed(run_app("config", "sft", "--config", str(mine), env=env))
    assert cfg["model"]["override_config"]["attn_implementation"] == "sdpa"
    result = run_app("check", "sft", env={**env, "CONFIG": str(mine)})
    assert result.returncode == 0, result.stderr
    assert "ok: attention: model.override_config.attn_implementation=sdpa from ARGS or CONFIG" in result.stdout
    assert "FlexAttention" not in result.stderr


@pytest.mark.parametrize("job, model", [("sft", "model"), ("grpo", "actor_rollout_ref.model")])
def test_varlen_attention_without_packed_rows_or_without_its_module_is_refused_before_verl_starts(env, job, model):
    key = f"{model}.override_config.attn_implementation"
    for args, says in ((f"{key}=varlen_attention {model}.use_remove_padding=false", "use_remove_padding=true"),
                       (f"{key}=varlen_attention {model}.external_lib=null", f"{model}.external_lib=app.attention")):
        line = assert_one_line_error(run_app("check", job, env={**env, "ARGS": args}))
        assert "varlen_attention" in line and says in line
    # verl imports every module of a list: one that names app.attention among others passes
    result = run_app("check", job, env={**env, "ARGS": f"{key}=varlen_attention {model}.external_lib=[json,app.attention]"})
    assert result.returncode == 0 and "varlen_attention" in result.stdout, result.stderr[-2000:]


def test_verls_own_sft_entry_point_composes_the_config_file_layer_as_preflight_did(env, tmp_path):
    """The plan's exact arguments, given to verl.trainer.sft_trainer (`--cfg job`), yield the file's values."""
    mine = write_yaml(tmp_path / "my.yaml", {"optim": {"lr": 2e-5}, "model": {"override_config": {"rope_theta": 5e5}},
                                             "trainer": {"save_freq": 7}})
    result = run_app("sft", env={**env, "CONFIG": str(mine), "DRY_RUN": "1", "ARGS": "trainer.test_freq=3"})
    assert result.returncode == 0, result.stderr
    train = next(line for line in result.stdout.splitlines() if "rank verl.trainer.sft_trainer" in line)
    args = train.split("rank verl.trainer.sft_trainer", 1)[1].split()
    assert args[-1] == "trainer.test_freq=3" and "++optim.lr=2e-05" in args
    out = subprocess.run([sys.executable, "-m", "verl.trainer.sft_trainer", *args, "--cfg", "job"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split(":")[0] in ("data", "model", "optim", "trainer"))
    theirs = yaml.safe_load("\n".join(lines[start:]))
    assert theirs["optim"]["lr"] == 2e-5 and theirs["trainer"]["save_freq"] == 7
    assert theirs["model"]["override_config"]["rope_theta"] == 5e5 and theirs["trainer"]["test_freq"] == 3


def test_config_files_model_path_and_data_are_the_settings_defaults(env, tmp_path, data_dir, tiny_model_dir):
    train = data_dir / "gsm8k_sft" / "train.parquet"
    mine = write_yaml(tmp_path / "my.yaml", {"model": {"path": str(tiny_model_dir)},
                                             "data": {"train_files": str(train)},
                                             "trainer": {"default_local_dir": str(tmp_path / "from-file")}})
    plain = {k: v for k, v in env.items() if k not in ("MODEL_PATH", "CKPT_DIR", "DATA_DIR")}
    result = run_app("check", "sft", env={**plain, "CONFIG": str(mine)}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"ok: train file: {train}" in result.stdout and f"run dir {tmp_path / 'from-file'}" in result.stdout
    # an explicit setting still wins over the file
    result = run_app("check", "sft", env={**plain, "CONFIG": str(mine), "CKPT_DIR": str(tmp_path / "mine")})
    assert f"run dir {tmp_path / 'mine'}" in result.stdout
    assert not (tmp_path / "from-file").exists() and not (tmp_path / "mine").exists()


def test_config_files_gpu_count_is_replaced_by_this_machines_with_a_warning(env, tmp_path):
    mine = write_yaml(tmp_path / "my.yaml", {"trainer": {"n_gpus_per_node": 8}})
    result = run_app("check", "sft", "--config", str(mine), env=env)
    assert result.returncode == 0, result.stderr
    assert "trainer.n_gpus_per_node=8, replaced by GPUS_PER_NODE (1) of this machine" in result.stderr


@pytest.mark.parametrize("content, expected", [
    (None, "does not exist: point CONFIG at your verl-style YAML file"),
    ("optim: [unclosed\n", "is not valid YAML"),
    ("- a\n- b\n", "holds a list, not a mapping"),
])
def test_a_missing_or_broken_config_file_is_one_line(env, tmp_path, content, expected):
    path = tmp_path / "my.yaml"
    if content is not None:
        path.write_text(content)
    line = assert_one_line_error(run_app("sft", env={**env, "CONFIG": str(path), "DRY_RUN": "1"}))
    assert f"CONFIG={path}" in line and expected in line


# --- preflight refuses what used to fail later ---------------------------------------------------------
no_gpus = pytest.mark.skipif(shutil.which("nvidia-smi") is not None or Path("/proc/driver/nvidia/gpus").is_dir(),
                             reason="this machine has GPUs")


@no_gpus
def test_make_sft_on_a_machine_without_gpus_is_refused_in_preflight_like_smoke(env, tmp_path):
    line = assert_one_line_error(make("sft", env=env))
    assert line.startswith("error: make sft needs GPUs, but this node has none (no nvidia-smi")
    assert "DRY_RUN=1 prints the plan" in line and "make check JOB=sft" in line
    assert not (tmp_path / "run").exists()  # no run directory, no torchrun started


@no_gpus
def test_make_grpo_head_without_gpus_is_refused_before_ray_starts(env, tmp_path):
    result = make("grpo-head", env={**env, "HEAD_IP": "127.0.0.1"})
    line = assert_one_line_error(result)
    assert line.startswith("error: make grpo-head needs GPUs") and "ray start" not in result.stdout
    assert not (tmp_path / "run").exists()  # no token written


@no_gpus
def test_make_grpo_worker_without_gpus_is_refused_before_it_waits(env, tmp_path):
    result = make("grpo-worker", env={**env, "HEAD_IP": "127.0.0.1", "WAIT_TIMEOUT": "600"}, timeout=60)
    line = assert_one_line_error(result)
    assert line.startswith("error: make grpo-worker needs GPUs")


def test_grpo_dry_run_refuses_what_make_check_refuses_through_verls_validate_config(env):
    args = ("actor_rollout_ref.actor.use_dynamic_bsz=false actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 "
            "actor_rollout_ref.actor.ppo_mini_batch_size=300")
    check = assert_one_line_error(make("check", "JOB=grpo", env={**env, "ARGS": args}))
    dry = assert_one_line_error(make("grpo-head", env={**env, "ARGS": args, "DRY_RUN": "1", "HEAD_IP": "127.0.0.1"}))
    assert dry == check and dry.startswith("error: verl's validate_config rejects the grpo config:")
    assert "ppo_mini_batch_size (300)" in dry
