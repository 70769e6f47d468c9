"""Preflight (`python -m app check|config sft|grpo`): what a launch on this node needs, checked on the composed
config (app.spec) before anything starts. One line per refusal, naming the setting or key to change.

Checked here only what verl does not check, or checks only once Ray, vLLM or torchrun have started; with
deep=True (make check, a dry grpo-head) verl's own checks run here too: validate_config, and its config dataclasses'
types over their sections (a real grpo-head runs verl_checks while its head starts).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

from app import perf, spec as specs
from app.common import ArgParser, UserError, directory_problem, say, warn
from app.settings import BY_NAME, NODE_FACTS, RAY_ADDRESS_KEY, Settings, owned_in, owned_keys
from app.data import check_prompt_lengths, check_run_data, check_sft_lengths
from app.timeline import started_at
from app.spec import BASE_CONFIG, FILTER_KEY, VLLM_EXECUTOR_KEY, Spec

ROLLOUT_ENGINES = ("vllm", "sglang", "trtllm")
# trainer.logger backends verl imports at start (verl/utils/tracking.py) -> the package that must be here
LOGGER_PACKAGES = {"wandb": "wandb", "vemlp_wandb": "wandb", "swanlab": "swanlab", "mlflow": "mlflow",
                   "clearml": "clearml", "trackio": "trackio", "tensorboard": "tensorboard"}
# Whole numbers that must be >= 1 wherever the job has them (verl takes 0 or -1 and fails, or trains nothing, later)
POSITIVE_KEYS = ("data.train_batch_size", "data.micro_batch_size_per_gpu", "data.max_length", "data.max_prompt_length",
                 "data.max_response_length", "trainer.total_epochs", "actor_rollout_ref.rollout.n",
                 "actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.actor.ppo_epochs")
LEARNING_RATES = ("optim.lr", "actor_rollout_ref.actor.optim.lr")
# verl's int keys that also take this word, by job (its SFT trainer: save / validate at each epoch's end)
WORD_VALUES = {"sft": {"trainer.save_freq": "after_each_epoch", "trainer.test_freq": "after_each_epoch"}, "grpo": {}}


@dataclass
class Preflight:
    """A checked plan: the spec (its overrides and composed config) and what preflight found."""

    spec: Spec
    started: float = 0.0  # when this launch's process started (app.timeline)
    notes: list[str] = field(default_factory=list)  # printed after success (ok: ...)
    warnings: list[str] = field(default_factory=list)  # printed after success (warning: ...)


def _refuse_stale_environment(settings: Settings) -> None:
    if settings["VLLM_ATTENTION_BACKEND"]:
        raise UserError(
            f"VLLM_ATTENTION_BACKEND={settings['VLLM_ATTENTION_BACKEND']} is set, but vLLM 0.24 ignores it "
            "(and has no XFORMERS backend): unset it; the backend is chosen in configs/grpo.yaml "
            "(actor_rollout_ref.rollout.engine_kwargs.vllm.attention_backend, or through ARGS)")


def refuse_without_gpus(spec: Spec, what: str) -> None:
    """A launch that will start GPU work on a node without any GPU fails later in torch/NCCL with a traceback:
    refused here, as `make smoke` does. The tests' CPU stand-in trainers (SFT_TRAINER_MODULE /
    GRPO_TRAINER_MODULE) need none."""
    from app.node import gpu_processes

    busy = gpu_processes(spec.gpus)
    if busy:  # an earlier run's trainer or vLLM engine, left by a kill (the OOM killer's SIGKILL): the new run would hang
        raise UserError(f"this node's GPUs are in use by {', '.join(busy)}, perhaps left by a run that was killed: stop "
                        f"{'it' if len(busy) == 1 else 'them'} (kill PID) before {what}, or set CUDA_VISIBLE_DEVICES "
                        "to free GPUs")
    hook = "SFT_TRAINER_MODULE" if spec.job == "sft" else "GRPO_TRAINER_MODULE"
    if spec.gpus.count or spec.settings[hook] != BY_NAME[hook].default:
        return
    raise UserError(f"{what} needs GPUs, but this node has none ({spec.gpus.source}): run it on a GPU node "
                    "(with docker: the NVIDIA container toolkit, compose `gpus: all`); DRY_RUN=1 prints the plan "
                    f"and `make check JOB={spec.job}` checks the config on any machine")


def refuse_unusable_run_dir(run: Path, writable: bool = True) -> None:
    problem = directory_problem(run, writable)
    if problem:
        raise UserError(f"the run directory {run} {problem}: set CKPT_DIR to a directory you can write "
                        "(created where missing)")


def check_node(spec: Spec, warnings: list[str], notes: list[str]) -> None:
    """This node's place in the run: rank, addresses, GPUs, paths that every node must read alike."""
    settings, gpus = spec.settings, spec.gpus
    leader = "head" if spec.job == "grpo" else "master"
    if not 0 <= spec.node_rank < spec.nnodes:
        raise UserError(f"NODE_RANK={spec.node_rank} is outside [0, NNODES={spec.nnodes}): give each machine its own "
                        f"rank 0..{spec.nnodes - 1} (0 on the {leader})")
    if spec.gpus_per_node < 1:
        raise UserError(f"GPUS_PER_NODE={spec.gpus_per_node}: set it to the number of GPUs each node uses (1 or more)")
    if spec.multi_node and spec.job == "sft" and not settings["MASTER_ADDR"]:
        raise UserError(f"NNODES={spec.nnodes} needs MASTER_ADDR: set it to node 0's IP on every node "
                        "(same MASTER_ADDR and MASTER_PORT everywhere)")
    if spec.multi_node and spec.job == "grpo" and not settings["HEAD_IP"]:
        raise UserError(f"NNODES={spec.nnodes} needs HEAD_IP: set it to the Ray head's IP on every node")
    if gpus.count is None:
        warnings.append(f"cannot count GPUs here ({gpus.source}): GPUS_PER_NODE={spec.gpus_per_node} not checked")
    elif gpus.count != spec.gpus_per_node:
        raise UserError(f"GPUS_PER_NODE={spec.gpus_per_node} but this node sees {gpus.count} GPU(s) ({gpus.source}): "
                        f"set GPUS_PER_NODE={gpus.count} or change CUDA_VISIBLE_DEVICES")
    elif gpus.count:
        notes.append(f"GPUs: {gpus.count} visible ({gpus.source})")
    if spec.job == "grpo" and spec.ray_address != f"{settings['HEAD_IP'] or '127.0.0.1'}:{settings['RAY_PORT']}":
        raise UserError(f"ARGS sets {RAY_ADDRESS_KEY}={spec.ray_address}: the driver would not join the cluster "
                        "make grpo-head starts; set HEAD_IP and RAY_PORT instead")
    relative = specs.relative_paths(settings)
    composed = [f"{key}={path}" for key, paths in (("model path", [spec.model_path]), ("trainer.default_local_dir",
                [spec.run_dir]), ("data.train_files", spec.files("train")), ("data.val_files", spec.files("val")))
                for path in paths if path is not None and not path.is_absolute()]
    if spec.multi_node and (relative or composed):
        raise UserError(f"relative path {(relative or composed)[0]} in a {spec.nnodes}-node run: use absolute paths, "
                        "identical on every node (compose mounts data/, models/, checkpoints/ that way)")
    for name, (override, value) in owned_in(settings.config or {}).items():  # CONFIG's node facts: this machine's
        ours = {"NNODES": spec.nnodes, "GPUS_PER_NODE": spec.gpus_per_node, "HEAD_IP": settings["HEAD_IP"],
                "RAY_PORT": settings["RAY_PORT"]}.get(name)
        if name in NODE_FACTS and ours is not None and str(ours) != value and (spec.job == "grpo" or "ray" not in override):
            warnings.append(f"CONFIG {Path(settings['CONFIG']).name} sets {override}, replaced by {name} ({ours}) "
                            f"of this machine: set {name} to change it")


def check_model(spec: Spec) -> None:
    from app.runs import read_model

    path = spec.model_path
    if path is None:
        raise UserError("MODEL_PATH is not set: point it at a local Hugging Face model directory "
                        "(config.json + tokenizer; nothing is downloaded)")
    problems = read_model(path).problems
    if problems:
        what = f"{path} is not a directory" if problems == ("not a directory",) else f"{path} has {problems[0]}"
        raise UserError(f"MODEL_PATH: {what}: point MODEL_PATH at a Hugging Face model directory "
                        "with config.json, the tokenizer files and the weights")


def check_values(spec: Spec, warnings: list[str]) -> None:
    """The values ARGS and CONFIG set, against the type of verl's packaged default there (true/false, a number),
    and the few ranges verl does not check: `optim.lr=abc` or `data.train_batch_size=0` would pass composition and
    fail, or train nothing, minutes into the run. The deep check adds verl's dataclasses' own types. What verl will
    ignore (verl's own recipes carry such keys) is said, not refused."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    owned = owned_keys()
    for key, source in user_keys(spec).items():
        if key in owned:  # left in ARGS or CONFIG only where it is no plain value: the launch reads it, so it must resolve
            try:
                OmegaConf.select(spec.cfg, key)
            except OmegaConfBaseException as exc:
                raise UserError(f"{source} sets {key} to something that does not resolve "
                                f"({' '.join(str(exc).split())[:160]}): set {owned[key]} instead") from None
        value = spec.get(key)
        if value is None or WORD_VALUES[spec.job].get(key) == value:
            continue  # null (verl's "unset"), deleted, unresolvable (verl says so itself), or the word verl takes
        default = _verl_default(spec.job, key)
        where = "ARGS" if source == "ARGS" else "the CONFIG file"
        if isinstance(default, bool) and not isinstance(value, bool) or \
                type(default) in (int, float) and not (type(value) in (int, float)):
            kind = "true or false" if isinstance(default, bool) else "a number"
            shown = f"{value!r} (text)" if isinstance(value, str) else value
            raise UserError(f"{key}={shown} from {source}: verl expects {kind} there, like its default {default}: "
                            f"fix it in {where}")
        if key in POSITIVE_KEYS and not (type(value) is int and value >= 1):
            raise UserError(f"{key}={value} from {source}: it must be a whole number, at least 1")
        if key in LEARNING_RATES and type(value) in (int, float) and value <= 0:
            raise UserError(f"{key}={value} from {source}: a learning rate must be above 0, e.g. 1e-5")
        warnings += [f"{key}={value} from {source}: {why}" for why in [ignored_by_verl(spec, key)] if why]


def ignored_by_verl(spec: Spec, key: str) -> str | None:
    """Why verl will not read `key` in this run, as what to do instead; None where it will."""
    if key.startswith("critic.") and spec.job == "grpo" and spec.get("algorithm.adv_estimator") != "gae" \
            and not spec.get("critic.enable"):
        return (f"algorithm.adv_estimator={spec.get('algorithm.adv_estimator')} trains no critic, so verl ignores "
                "critic.*; for PPO with a critic: ARGS='algorithm.adv_estimator=gae'")
    section, _, name = key.rpartition(".")
    if "micro_batch_size" in name:  # under dynamic batching verl packs by the token budget instead
        flag = "data.use_dynamic_bsz" if section == "data" else \
            f"{section}.{'use_dynamic_bsz' if name.startswith('ppo_') else 'log_prob_use_dynamic_bsz'}"
        if spec.get(flag):
            return f"verl ignores it under {flag}=true, where the token budget decides; set {flag}=false to use it"
    return None


def user_keys(spec: Spec) -> dict[str, str]:
    """The keys ARGS and CONFIG set -> where (ARGS wins where both do)."""
    user = {o.lstrip("+~").split("=", 1)[0]: "ARGS" for o in spec.args if "=" in o}
    for key in spec.settings.config or {}:
        user.setdefault(key, "CONFIG")
    return user


def _verl_default(job: str, key: str):
    node = specs.verl_base(job)
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def check_config(spec: Spec, notes: list[str], warnings: list[str]) -> None:
    """What the composed config asks of this node, and what verl would refuse only once running."""
    sel, job = spec.get, spec.job
    loggers = sel("trainer.logger")
    for backend in [loggers] if isinstance(loggers, str) else list(loggers or []):
        package = LOGGER_PACKAGES.get(backend)
        if package and importlib.util.find_spec(package) is None:
            raise UserError(f"trainer.logger has {backend}, but {package} is not installed here (verl imports it at "
                            f"start): install it, or drop it, e.g. ARGS='trainer.logger=[console,file]'")
    model = spec.model_key
    if sel(f"{model}.use_fused_kernels"):
        notes.append(f"log-probs: verl's fused {sel(f'{model}.fused_kernel_options.impl_backend')} kernel "
                     "(no tokens x vocabulary logits)")
    elif not perf.flash_attn_installed():
        # verl 0.9.1's fallback (logprobs_from_logits_v2) loops over the tokens in Python: measured on 1xH200
        warnings.append(f"{model}.use_fused_kernels=false and flash-attn is not installed: verl computes the "
                        "log-probs one token at a time (about 5k tokens/s on 1xH200, whatever the model); "
                        "keep the profile's true")
    attention = sel(perf.attention_key(job))
    if attention == perf.VARLEN_ATTENTION and not sel(f"{model}.use_remove_padding"):
        raise UserError(f"{perf.attention_key(job)}={attention} takes verl's packed rows only: set "
                        f"{model}.use_remove_padding=true, or ARGS='{perf.attention_key(job)}=sdpa'")
    libs = sel(f"{model}.external_lib")  # verl takes one module name or a list of them
    if attention == perf.VARLEN_ATTENTION and "app.attention" not in ([libs] if isinstance(libs, str) else libs or []):
        raise UserError(f"{perf.attention_key(job)}={attention} is registered by app.attention, which verl "
                        f"imports only if told: ARGS='{model}.external_lib=app.attention'")
    if attention == "flex_attention":
        # same seed, data and first loss, 300 SFT steps of a 2-layer model on 1xH200: val/loss 0.209 against
        # sdpa's 0.111 and eager's 0.110, although one step's gradients match (docs/gpu-runs.md runs 15-17)
        warnings.append(f"attention is FlexAttention (no flash-attn here): in one comparison it trained a small "
                        f"model worse than sdpa and eager from the same start, though its gradients match theirs "
                        f"(docs/gpu-runs.md runs 15-17); for sdpa's slower kernel: "
                        f"ARGS='{perf.attention_key(job)}=sdpa'")
    save_freq = sel("trainer.save_freq")
    if isinstance(save_freq, float):
        raise UserError(f"trainer.save_freq={save_freq} is not a whole number of steps: e.g. ARGS='trainer.save_freq=20'")
    if isinstance(save_freq, int) and save_freq <= 0:
        warnings.append(f"trainer.save_freq={save_freq}: this run writes no checkpoint (nothing to resume or merge); "
                        "for checkpoints: ARGS='trainer.save_freq=20'")
    sp = max(sel("engine.ulysses_sequence_parallel_size", 1) if job == "sft" else
             sel("actor_rollout_ref.actor.ulysses_sequence_parallel_size", 1), 1)
    if sp > 1:
        from app.runs import read_model

        heads = read_model(spec.model_path).heads
        if not sel(f"{model}.use_remove_padding"):
            raise UserError(f"sequence parallel size {sp} needs {model}.use_remove_padding=true: "
                            "turn remove-padding on or set the sequence parallel size to 1")
        if heads and heads % sp:
            raise UserError(f"sequence parallel size {sp} does not divide the model's {heads} attention heads: "
                            "choose a divisor of the head count")
        if spec.total_gpus % sp:
            raise UserError(f"sequence parallel size {sp} does not divide the {spec.total_gpus} GPUs: choose a divisor")
        if attention not in ("flash_attention_2", "flash_attention_3"):
            # verl 0.9.1's Ulysses patch replaces flash-attn's attention only: any other attends within its own slice
            raise UserError(f"sequence parallel size {sp} needs flash-attn's attention ({perf.attention_key(job)}="
                            f"{attention}): run it in the image, which has flash-attn, or set the sequence parallel "
                            "size to 1")
    if job == "sft":
        batch = sel("data.train_batch_size")
        if batch % spec.total_gpus:
            raise UserError(f"data.train_batch_size={batch} is not divisible by the {spec.total_gpus} GPUs "
                            f"({spec.nnodes} node(s) x {spec.gpus_per_node}): verl would silently drop the "
                            "remainder; make it a multiple, e.g. ARGS='data.train_batch_size=...'")
        notes.append(f"SFT of {spec.model_path}: {spec.nnodes} node(s) x {spec.gpus_per_node} GPU(s), global batch {batch}, lr {sel('optim.lr')}")
        return
    rollout, actor = "actor_rollout_ref.rollout", "actor_rollout_ref.actor"
    name, n, tp = sel(f"{rollout}.name"), sel(f"{rollout}.n"), sel(f"{rollout}.tensor_model_parallel_size")
    if name not in ROLLOUT_ENGINES:
        raise UserError(f"{rollout}.name={name}: verl 0.9.1 rolls out only with {', '.join(ROLLOUT_ENGINES)}")
    if importlib.util.find_spec(name) is None:
        warnings.append(f"{name} is not importable here: every GPU node needs it for GRPO (the image has it)")
    if sel("algorithm.adv_estimator") == "grpo" and n < 2:
        raise UserError(f"{rollout}.n={n}: GRPO needs at least 2 samples per prompt "
                        "(n=1 is plain REINFORCE without a baseline); set it to 4-8")
    if tp < 1 or spec.total_gpus % tp:  # verl 0.9.1 builds a replica across nodes where it spans them
        raise UserError(f"{rollout}.tensor_model_parallel_size={tp} does not divide the run's {spec.total_gpus} GPUs: "
                        "choose a divisor (1 fits models up to ~7B)")
    seq = sel("data.max_prompt_length") + sel("data.max_response_length")
    for key, used in ((f"{actor}.ppo_max_token_len_per_gpu", sel(f"{actor}.use_dynamic_bsz")),
                      ("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", sel("actor_rollout_ref.ref.log_prob_use_dynamic_bsz")),
                      (f"{rollout}.log_prob_max_token_len_per_gpu", sel(f"{rollout}.log_prob_use_dynamic_bsz"))):
        value = sel(key)
        if used and value is not None and value * sp < seq:  # verl multiplies the budget by the SP size
            raise UserError(f"{key}={value} is smaller than max_prompt_length + max_response_length = {seq}"
                            + (f" over sequence parallel {sp}" if sp > 1 else "") + f": raise it to at least "
                            f"{-(-seq // sp)}")
    notes.append(f"GRPO of {spec.model_path}: {spec.nnodes} node(s) x {spec.gpus_per_node} GPU(s), batch {sel('data.train_batch_size')} "
                 f"x n={n}, rollout {name} TP={tp}, save every {save_freq} steps")


def choose_vllm_executor(spec: Spec, notes: list[str]) -> None:
    """vLLM's model worker inside its EngineCore process (vLLM's `uni` executor, its own default for one GPU) where a
    rollout replica has one GPU and neither CONFIG nor ARGS names an executor. verl 0.9.1 always asks for `mp`: one
    more process that imports vLLM and torch again before the first step (31 s on 1xH200, docs/gpu-runs.md runs
    27-28). `uni` runs one worker only, so a replica over several GPUs keeps verl's `mp`."""
    rollout = "actor_rollout_ref.rollout"
    if spec.get(f"{rollout}.name") != "vllm":
        return
    chosen = spec.get(VLLM_EXECUTOR_KEY)
    if chosen is not None:
        notes.append(f"vLLM executor: {chosen} (from CONFIG or ARGS)")
        return
    gpus = 1
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size"):
        value = spec.get(f"{rollout}.{key}")
        gpus *= value if isinstance(value, int) and value > 0 else 1
    if gpus > 1:
        notes.append(f"vLLM executor: verl's mp (a rollout replica spans {gpus} GPUs)")
        return
    spec.choose(VLLM_EXECUTOR_KEY, "uni", add=True)
    notes.append("vLLM executor: uni (its model worker runs inside the EngineCore: one process fewer to start)")


def preflight(job: str, settings: Settings, *, deep: bool = False, gpus: bool = False, count: bool = True) -> Preflight:
    """Compose `job`'s config for this node and reject, with one actionable line, what would fail later.
    deep=True also runs verl's own checks, which import verl (seconds, no GPU needed). gpus=True (a real
    launch) refuses a node without GPUs. count=False leaves the count of the data's lengths (count_lengths) to the
    caller."""
    _refuse_stale_environment(settings)
    if job not in BASE_CONFIG:
        raise UserError(f"unknown job {job!r}: use sft or grpo")
    specs.check_keys(job, settings)  # every unknown key of the profile and CONFIG at once, before composing
    spec = specs.read(job, settings)
    plan = Preflight(spec, started_at())
    check_node(spec, plan.warnings, plan.notes)
    if gpus:
        refuse_without_gpus(spec, "make sft" if job == "sft" else "make grpo-head")
    check_values(spec, plan.warnings)
    refuse_unusable_run_dir(spec.run_dir, writable=False)  # write access: the launch's (`make check` runs anywhere)
    check_model(spec)
    plan.notes += perf.notes_for(spec.notes, spec)
    check_config(spec, plan.notes, plan.warnings)
    perf.check_budgets(spec)
    check_run_data(spec, plan.notes, plan.warnings)
    if job == "grpo":
        choose_vllm_executor(spec, plan.notes)
    if count:
        count_lengths(spec, plan.notes, plan.warnings)
    if deep:
        plan.notes += verl_checks(spec)
    return plan


def count_lengths(spec: Spec, notes: list[str], warnings: list[str]) -> None:
    """The train conversations (SFT) or prompts (GRPO) counted as verl counts them; for GRPO, verl's length filter
    off where they all fit. Its import of transformers and the count are most of a preflight on a new node (10-16 s
    on 1xH100 without the cache, 1.4 s with it: docs/gpu-runs.md runs 62-66, 73): the launches run it while torchrun
    or the Ray head starts."""
    if spec.job == "sft":
        check_sft_lengths(spec, spec.files("train"), warnings)
    elif check_prompt_lengths(spec, notes, warnings):
        spec.choose(FILTER_KEY, False)  # under CONFIG and ARGS, which the count saw leave it alone


def verl_checks(spec: Spec) -> list[str]:
    """verl's own checks, which it runs only once its trainer starts: for each value ARGS or CONFIG set in a section
    that is one of verl's config dataclasses (`_target_`), the field's annotation (OmegaConf validates it as verl's
    omega_conf_to_dataclass does: `rollout.max_num_seqs=0.5` is not an int); for GRPO, its validate_config
    (main_ppo's, once Ray is up). They import verl and torch: seconds. Returns notes."""
    import contextlib
    import dataclasses
    import io
    import warnings

    import typing

    from hydra.utils import get_class
    from omegaconf import MISSING, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    for key, source in user_keys(spec).items():
        section, _, name = key.rpartition(".")
        target, value = spec.get(f"{section}._target_"), spec.get(key)
        if not (isinstance(target, str) and target.startswith("verl.")) or value is None or OmegaConf.is_config(value):
            continue
        try:  # the one field as OmegaConf types it (a whole instance may not build without its runtime parts)
            hint = typing.get_type_hints(get_class(target))[name]
            probe = OmegaConf.structured(dataclasses.make_dataclass("Probe", [(name, hint, dataclasses.field(default=MISSING))]))
        except (KeyError, NameError, TypeError, OmegaConfBaseException):
            continue  # no such field, or a type OmegaConf does not handle: verl's own code decides
        try:
            setattr(probe, name, value)
        except OmegaConfBaseException as exc:
            raise UserError(f"{key}={value!r} from {source}: verl's {target.rsplit('.', 1)[-1]} takes no such value "
                            f"({str(exc).splitlines()[0]}): fix it in {'ARGS' if source == 'ARGS' else 'the CONFIG file'}") from None
    if spec.job != "grpo":
        return ["verl's config types: passed"]
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    cfg = spec.cfg
    # validate_config takes any name; the trainer looks it up only when step 1's advantages are computed
    estimator = cfg.algorithm.adv_estimator
    if estimator not in ADV_ESTIMATOR_REGISTRY:
        raise UserError(f"algorithm.adv_estimator={estimator}: verl 0.9.1 has no such estimator; choose one of "
                        f"{', '.join(sorted(ADV_ESTIMATOR_REGISTRY))}")
    notes = []
    rank = _lora_rank_for_vllm(cfg)
    if rank and importlib.util.find_spec("vllm") is None:
        # verl checks a LoRA rank by importing vLLM's limits, and without vLLM it refuses every LoRA config
        # ("vllm version None not supported"): on a CPU node everything else is checked, the rank where vLLM is
        cfg = OmegaConf.create(OmegaConf.to_container(cfg))
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
    return [*notes, "verl's config types and validate_config: passed"]


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


def report(plan: Preflight) -> None:
    """Print what preflight found: notes on stdout, warnings on stderr (only once everything passed)."""
    for note in plan.notes:
        say(f"ok: {note}")
    for message in plan.warnings:
        warn(message)


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
        from app.settings import load

        settings = load({**settings.shell, "CONFIG": args.config})
        settings.check(command)
    job = args.job or settings.get("JOB", "sft")
    if command == "check":
        plan = preflight(job, settings, deep=True)
        report(plan)
        say(f"preflight {job}: passed (run dir {plan.spec.run_dir})")
        return 0
    # config: what verl will see, without the checks (MODEL_PATH may still be unset); the data-dependent choice
    # (data.filter_overlong_prompts=False where every prompt fits) is preflight's and said there
    from omegaconf import OmegaConf

    specs.check_keys(job, settings)
    print(OmegaConf.to_yaml(specs.read(job, settings).cfg, resolve=args.resolve), end="")
    return 0
