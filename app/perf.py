"""The fast settings for what this node has, chosen once in preflight and said there (issue: "fast by
default"): the attention kernel, gradient checkpointing, and the token budget per GPU (verl's dynamic
batch: tokens packed into one micro batch).

- Attention: flash-attn's kernel where the package is installed (the image), else torch's own FlashAttention
  kernel for packed rows (app/attention.py, torch >= 2.10), else PyTorch's FlexAttention. With verl's
  remove-padding every micro batch is one packed row; sdpa then gets a dense total x total mask (83 ms for
  one 32k row of the 1.5B shape, forward + backward) where FlexAttention uses a document mask (3 ms) but
  compiles in the first step; all keep samples apart (docs/gpu-runs.md, scripts/packing_check.py).
- Memory: without gradient checkpointing, and with verl's fused (triton) loss that never materialises
  the logits, a GPU holds the FSDP-sharded fp32 master weights, gradients and Adam state (16 bytes a
  parameter, over the GPUs) plus the activations of the tokens of one micro batch. The activation cost
  per token is calibrated on a measurement (docs/benchmarks.md: the 1.5B shape, 32,768 tokens,
  FlexAttention, fused loss, no checkpointing: 95.1 GB peak on 1xH200) and kept with a margin.
  Where the budget that fits is too small to be fast, checkpointing goes back on (its activations
  are ~20x smaller); where even that cannot hold one sample of max_length, preflight refuses.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from app.common import UserError

GIB = 1024**3
# Bytes a parameter costs on the GPUs that shard it: fp32 weights + fp32 gradients + Adam's two moments.
TRAIN_BYTES_PER_PARAM = 16
# GRPO keeps a reference model beside the actor (fp32 weights, no optimizer).
REF_BYTES_PER_PARAM = 4
# Activation bytes per token, per layer and hidden unit, without checkpointing: measured 2.15 MB/token on
# the 1.5B shape (28 layers x 1536) = 50 bytes; 56 keeps a margin for other shapes.
ACT_BYTES_NO_CKPT = 56
# With checkpointing each layer keeps its bf16 input (2 bytes/hidden unit) and one layer is recomputed.
ACT_BYTES_CKPT_KEPT = 2
# sdpa and eager get a dense tokens x tokens mask under remove-padding, held per layer: +31.7 GB at 32k tokens
# on the 1.5B shape (28 layers; 126.8 GB against FlexAttention's 95.1 GB, the table) = 1.05 bytes a
# token pair a layer. FlexAttention and flash-attn hold no such mask.
DENSE_MASK_BYTES = 1.1
DENSE_MASK_IMPLS = ("sdpa", "eager")
VARLEN_ATTENTION = "varlen_attention"  # registered with transformers by app/attention.py
# Fraction of the card the budget may plan for (the allocator's fragmentation, CUDA context, NCCL buffers).
USABLE = 0.80
CONTEXT_BYTES = 2 * GIB
# Budgets are multiples of this (repeatable shapes for torch.compile) and capped: past 32k tokens a
# micro batch is no faster per token, and the measured point is 32k.
BUDGET_STEP = 1024
MAX_BUDGET = 32768
# Below this many tokens per micro batch, the no-checkpointing budget is slower than checkpointing.
MIN_FAST_BUDGET = 8192


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    tied: bool
    heads: int | None = None
    kv_heads: int | None = None

    @property
    def params(self) -> int:
        """Parameters of a dense decoder (Qwen2/Llama): q and o projections h^2 each, k and v h x kv_dim
        each (grouped-query attention), MLP 3 h i, embeddings (twice unless tied)."""
        kv_dim = self.hidden * (self.kv_heads or self.heads or 1) // (self.heads or 1)
        per_layer = 2 * self.hidden**2 + 2 * self.hidden * kv_dim + 3 * self.hidden * self.intermediate
        return self.layers * per_layer + self.vocab * self.hidden * (1 if self.tied else 2)


def model_shape(model_path: Path | None) -> ModelShape | None:
    """The shape of a Hugging Face model from its config.json (app.runs.read_model); None where it cannot be read."""
    from app.runs import read_model

    config = read_model(Path(model_path)).text if model_path is not None else {}
    try:
        hidden = int(config["hidden_size"])
        return ModelShape(layers=int(config["num_hidden_layers"]), hidden=hidden,
                          intermediate=int(config.get("intermediate_size") or 4 * hidden),
                          vocab=int(config.get("vocab_size") or 32000),
                          tied=bool(config.get("tie_word_embeddings", False)),
                          heads=config.get("num_attention_heads"),
                          kv_heads=config.get("num_key_value_heads"))
    except (KeyError, TypeError, ValueError):
        return None


def flash_attn_installed() -> bool:
    """Whether flash-attn is importable here: its attention kernel, and verl's cross-entropy log-prob kernel
    (without it verl 0.9.1 takes log-probs one token at a time unless use_fused_kernels is on)."""
    return importlib.util.find_spec("flash_attn") is not None


def torch_varlen_installed() -> bool:
    """Whether torch has its FlashAttention kernel for packed rows (torch.nn.attention.varlen, 2.10 on), found
    without importing torch (seconds)."""
    spec = importlib.util.find_spec("torch")
    return bool(spec and spec.origin) and (Path(spec.origin).parent / "nn" / "attention" / "varlen.py").is_file()


def attention(packed: bool = True) -> tuple[str, str]:
    """(attn_implementation, why) for the trainer on this node; `packed`: verl's remove-padding is on."""
    if flash_attn_installed():
        return "flash_attention_2", "flash-attn is installed"
    if packed and torch_varlen_installed():
        return VARLEN_ATTENTION, ("flash-attn is not installed here (the image has it); torch's own FlashAttention "
                                  "kernel for packed samples, nothing to compile")
    return "flex_attention", "flash-attn is not installed here (the image has it); FlexAttention keeps packed samples apart"


def liger() -> bool:
    """Whether Liger's kernels (rmsnorm, swiglu, rope; verl's `model.use_liger`) can be used here: measured
    1.08-1.14x on top of the rest for SFT on 1xH200, with 20 GB less memory (docs/benchmarks.md)."""
    return importlib.util.find_spec("liger_kernel") is not None


@dataclass(frozen=True)
class Budget:
    tokens: int  # tokens per GPU per micro batch
    checkpointing: bool
    why: str


def token_budget(shape: ModelShape, gpu_bytes: int, gpus: int, *, ref_model: bool = False,
                 min_tokens: int = 1, cap: int | None = MAX_BUDGET, dense_mask: bool = False) -> Budget | None:
    """The largest token budget per GPU that fits (a multiple of BUDGET_STEP, at most `cap`), with
    checkpointing off where that budget is at least MIN_FAST_BUDGET; None where not even min_tokens fit.
    dense_mask: the attention holds a tokens x tokens mask per layer (sdpa, eager)."""
    static = shape.params * (TRAIN_BYTES_PER_PARAM + (REF_BYTES_PER_PARAM if ref_model else 0)) / max(gpus, 1)
    free = gpu_bytes * USABLE - CONTEXT_BYTES - static
    where = (f"{shape.params / 1e9:.2f}B parameters over {gpus} GPU(s) of {gpu_bytes / GIB:.0f} GiB: "
             f"{static / GIB:.1f} GiB of weights, gradients and optimizer per GPU")
    for checkpointing, per_token in (
            (False, ACT_BYTES_NO_CKPT * shape.layers * shape.hidden),
            (True, ACT_BYTES_CKPT_KEPT * shape.layers * shape.hidden + ACT_BYTES_NO_CKPT * shape.hidden)):
        if free <= 0:
            break
        tokens = int(free // per_token) // BUDGET_STEP * BUDGET_STEP
        tokens = min(cap, tokens) if cap else tokens
        while dense_mask and tokens > 0 and tokens * per_token + DENSE_MASK_BYTES * shape.layers * tokens**2 > free:
            tokens -= BUDGET_STEP
        if tokens >= (min_tokens if checkpointing else max(MIN_FAST_BUDGET, min_tokens)):
            return Budget(tokens, checkpointing, where)
    return None


# --- what preflight applies ------------------------------------------------------------------------
# The keys of each job that app.perf's choices set: attention, checkpointing, and the token budgets.
PERF_KEYS = {
    "sft": {"model": "model", "budgets": {"data.max_token_len_per_gpu": 1}},
    "grpo": {"model": "actor_rollout_ref.model",
             # forward-only passes (old log-prob, ref) hold no gradients: twice the training budget
             "budgets": {"actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 1,
                         "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": 2,
                         "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": 2}},
}


def attention_key(job: str) -> str:
    """The config key of the trainer's attention implementation for `job`."""
    return f"{PERF_KEYS[job]['model']}.override_config.attn_implementation"


@dataclass(frozen=True)
class Note:
    text: str  # "attention: flex_attention (why)"
    keys: tuple[str, ...] = ()  # the overrides it describes


def overrides(spec, chosen_attention: str | None = None, packed: bool = True) -> tuple[list[str], list[Note]]:
    """The fast settings for this node (app.perf) as overrides, and notes saying which were chosen.

    Attention: flash-attn's kernel where installed, else torch's varlen kernel or FlexAttention (all keep packed
    samples apart under remove-padding; sdpa would too, but gets a dense total x total mask). Where the GPU's memory and
    the model's shape are known, gradient checkpointing and the token budget per GPU follow from them.
    `spec` is app.spec's, before it composes: the model and the node's size are the settings' (which the config
    then gets). The user's ARGS and CONFIG come later and win (`notes_for` then says what runs instead);
    `chosen_attention` is the implementation they chose, for a budget that holds its mask; `packed` False: they
    turned remove-padding off, which torch's packed-row kernel needs.
    `check_budgets` refuses a budget that cannot fit.
    """
    job, settings = spec.job, spec.settings
    keys = PERF_KEYS[job]
    impl, why = attention(packed)
    attn_key = attention_key(job)
    out = [f"{attn_key}={impl}"]
    notes = [Note(f"attention: {impl} ({why})", (attn_key,))]
    if impl == VARLEN_ATTENTION:  # verl imports it in each worker, which registers the kernel with transformers
        out.append(f"{keys['model']}.external_lib=app.attention")
    if job == "sft" and liger():  # measured for SFT only (docs/benchmarks.md)
        out.append("model.use_liger=True")
        notes.append(Note("Liger kernels: on (liger-kernel is installed)", ("model.use_liger",)))
    shape = model_shape(Path(settings["MODEL_PATH"]).expanduser()) if settings["MODEL_PATH"] else None
    gpu = spec.gpus.memory_bytes
    if shape is None or gpu is None:
        notes.append(Note("token budget: the profile's (GPU memory or model shape unknown here)"))
        return out, notes
    gpus = settings.get("GPUS_PER_NODE", spec.gpus.count or 1) * settings["NNODES"]
    budget = token_budget(shape, gpu, gpus, ref_model=job == "grpo",
                          dense_mask=(chosen_attention or impl) in DENSE_MASK_IMPLS)
    if budget is None:
        return out, notes  # check_budgets refuses with what to do
    chosen = {f"{keys['model']}.enable_gradient_checkpointing": budget.checkpointing,
              **{key: budget.tokens * factor for key, factor in keys["budgets"].items()}}
    out += [f"{key}={value}" for key, value in chosen.items()]
    notes.append(Note(f"token budget: {budget.tokens} tokens per GPU, gradient checkpointing "
                      f"{'on' if budget.checkpointing else 'off'} ({budget.why})", tuple(chosen)))
    return out, notes


def notes_for(notes: list[Note], spec) -> list[str]:
    """The notes of this node's choices as they stand in the composed config: where ARGS or CONFIG set one
    of a note's keys otherwise, the note says what runs and what preflight would have chosen."""
    chosen = dict(choice.lstrip("+").split("=", 1) for choice in spec.choices)
    out = []
    for note in notes:
        composed = {key: spec.get(key) for key in note.keys}
        replaced = [key for key in note.keys if key in chosen and str(composed[key]).lower() != chosen[key].lower()]
        if not replaced:
            out.append(note.text)
            continue
        topic = note.text.split(":", 1)[0]
        out.append(f"{topic}: " + ", ".join(f"{key}={composed[key]}" for key in replaced)
                   + " from ARGS or CONFIG (this node's choice: "
                   + ", ".join(f"{key}={chosen[key]}" for key in replaced) + ")")
    return out


def check_budgets(spec, gpu: int | None = None) -> None:
    """Refuse a token budget (ARGS or profile) that cannot fit this node's GPUs, before verl runs out of
    memory minutes into the run; nothing to check where the GPU memory or the model shape is unknown."""
    shape = model_shape(spec.model_path)
    gpu = gpu if gpu is not None else spec.gpus.memory_bytes
    if shape is None or gpu is None:
        return
    keys = PERF_KEYS[spec.job]
    checkpointing = bool(spec.get(f"{keys['model']}.enable_gradient_checkpointing"))
    impl = spec.get(attention_key(spec.job))
    dense = impl in DENSE_MASK_IMPLS
    gpus = spec.total_gpus
    # what fits, not what is fast
    fits = token_budget(shape, gpu, gpus, ref_model=spec.job == "grpo", cap=None, dense_mask=dense)
    if fits is None:
        raise UserError(f"the model ({shape.params / 1e9:.1f}B parameters) does not fit {gpus} GPU(s) of "
                        f"{gpu / GIB:.0f} GiB for training (weights, gradients and Adam state alone): use "
                        "more GPUs (NNODES, GPUS_PER_NODE) or a smaller model")
    key, factor = next(iter(keys["budgets"].items()))
    asked = spec.get(key)
    limit = fits.tokens * factor
    if fits.checkpointing and not checkpointing:
        limit = 0  # only checkpointing fits any budget
    if isinstance(asked, int) and asked > limit and (not checkpointing or fits.checkpointing):
        raise UserError(f"{key}={asked} does not fit this node's {gpu / GIB:.0f} GiB GPU(s) with "
                        f"gradient checkpointing {'on' if checkpointing else 'off'}"
                        + (f" and {impl}'s tokens x tokens mask" if dense else "") + f" ({fits.why}): "
                        f"set it to at most {fits.tokens * factor}"
                        + (f" with {keys['model']}.enable_gradient_checkpointing=true" if fits.checkpointing else "")
                        + ", or drop it from ARGS to let preflight choose")
