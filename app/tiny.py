"""Tiny local models: a random-weight Qwen2 built from a config plus a small byte-level BPE tokenizer
with a Qwen-style chat template. No hub downloads anywhere: tests, `make smoke` and the benchmarks
all build their model here (clusters are often air-gapped, and CI has no Hugging Face access)."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

from app.common import REPO_ROOT, ArgParser, UserError, atomic_path, refuse_symlink_loop, say

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen2.5's template, reduced to what verl's SFT and RL datasets use (system/user/assistant turns).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Shapes of real models (random weights): benchmarks need realistic FLOPs and memory, not quality.
PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=False),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                         vocab_size=151936),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True,
                         vocab_size=151936),
}

BUNDLED_GSM8K = REPO_ROOT / "data" / "gsm8k_source" / "train.jsonl.gz"


def _corpus(max_rows: int = 2000) -> list[str]:
    """Text to train the tokenizer on: bundled GSM8K rows, so digits, '####' and math words are cheap."""
    lines = ["<|im_start|>user\nLet's think step by step and output the final answer after \"####\"."]
    with gzip.open(BUNDLED_GSM8K, "rt", encoding="utf-8") as handle:
        for i, line in enumerate(handle):
            if i >= max_rows:
                break
            row = json.loads(line)
            lines += [row["question"], row["answer"]]
    return lines


def build_tokenizer(vocab_size: int = 1024):
    """A byte-level BPE (any text encodes) trained in about a second, wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # one token per digit, as Qwen2's tokenizer does: numbers then have a regular shape arithmetic can be
    # learnt on (the arith task), instead of BPE merges like "20" or "100"
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIAL_TOKENS[1:])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(preset: str = "tiny", vocab_size: int | None = None, seed: int = 0, **overrides):
    """A random-weight Qwen2ForCausalLM of the preset's shape (fp32 weights, config dtype bf16)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if preset not in PRESETS:
        raise UserError(f"unknown preset {preset!r}: choose one of {', '.join(PRESETS)}")
    shape = {**PRESETS[preset], **overrides}
    if vocab_size is not None and "vocab_size" not in PRESETS[preset]:
        shape["vocab_size"] = vocab_size
    config = Qwen2Config(max_position_embeddings=4096, rope_theta=10000.0, **shape)
    config.dtype = "bfloat16"  # torch_dtype: transformers 5 warns on stderr (not one line)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def write_tiny_model(out: Path | str, preset: str = "tiny", seed: int = 0, dtype: str = "bfloat16",
                     setting: str | None = None, **overrides) -> Path:
    """Write model + tokenizer + chat template to `out` (atomically) and return it. `setting` names the
    variable that chose `out` in a refusal (a full disk, a symlink loop)."""
    import torch

    out = Path(out)
    tokenizer = build_tokenizer()
    # Round the vocabulary up to a multiple of 64, as real checkpoints do (tensor-parallel friendly).
    vocab = (len(tokenizer) + 63) // 64 * 64
    model = build_model(preset, vocab_size=vocab, seed=seed, **overrides)
    for config in (model.generation_config, model.config):
        config.eos_token_id, config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    model = model.to(getattr(torch, dtype))
    # parameters() yields a tied embedding once, as save_pretrained writes it
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if not sys.stderr.isatty():  # save_pretrained's bar in a log would make a failure more than one line
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    with atomic_path(out, setting, needed=weights, what=f"the {preset} model",
                     needs="its weights alone need about") as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    return out


def main(command: str, argv: list[str], settings) -> int:
    parser = ArgParser(prog="python -m app tiny-model", description=__doc__)
    parser.add_argument("out", nargs="?", default=settings.get("OUT", "models/tiny"),
                        help="directory to write the model to (default: OUT, else models/tiny)")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--force", action="store_true", default=settings["FORCE"],
                        help="replace an existing directory (default: FORCE)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    refuse_symlink_loop(out, "OUT")  # else a loop reads as absent and the rename replaces the link
    if out.exists() and not args.force:
        raise UserError(f"{out} already exists: FORCE=1 (--force) replaces it, or choose another OUT")
    if out.exists() and not out.is_dir():
        raise UserError(f"OUT={out} is a file, not a model directory: choose a directory path for OUT")
    write_tiny_model(out, preset=args.preset, seed=args.seed, dtype=args.dtype, setting="OUT")
    say(f"wrote {args.preset} model and tokenizer to {out}")
    return 0
