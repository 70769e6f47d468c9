"""app.attention: `varlen_attention` keeps verl's packed samples apart and trains as eager attention does, verl's
own model config imports it through external_lib, and it refuses what it cannot do. Here it runs its CPU path
(sdpa one sample at a time: torch's varlen kernel is CUDA-only); the kernel itself is checked on the GPU by
scripts/packing_check.py (docs/gpu-runs.md)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import REPO

import app.attention as attention
from app.tiny import build_model


def packed_row(lengths, vocab=1024, seed=0):
    gen = torch.Generator().manual_seed(seed)
    samples = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    return samples, torch.cat(samples)[None], torch.cat([torch.arange(n) for n in lengths])[None]


def test_a_packed_row_gives_each_sample_the_logits_it_has_alone():
    model = build_model("tiny", vocab_size=1024).eval()
    samples, ids, positions = packed_row([37, 120, 5, 64])
    alone = torch.cat([model(input_ids=s[None]).logits for s in samples], dim=1)
    model.set_attn_implementation(attention.NAME)
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions).logits
        # the control: the same row read as one sample mixes them, so the check can fail
        mixed = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None]).logits
    assert (packed - alone).abs().max() < 1e-4
    assert (mixed - alone).abs().max() > 1e-2


def test_a_slice_of_a_packed_row_that_starts_mid_sample_keeps_its_first_part_apart():
    cu, longest = attention._segments(torch.tensor([[7, 8, 9, 0, 1, 0, 1, 2, 3]]))
    assert cu.tolist() == [0, 3, 5, 9] and cu.dtype == torch.int32 and longest == 4


def test_padding_in_a_batch_is_refused_with_what_to_use_instead():
    model = build_model("tiny", vocab_size=1024).eval()
    model.set_attn_implementation(attention.NAME)
    ids = torch.randint(0, 1024, (2, 6))
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    with pytest.raises(ValueError, match="attn_implementation=sdpa"):
        model(input_ids=ids, attention_mask=mask)


def test_verls_model_config_with_the_profiles_external_lib_loads_a_model_with_varlen_attention(tiny_model_dir):
    # a fresh interpreter: verl's HFModelConfig imports the module named by external_lib, which registers the name
    def load(external_lib):
        code = ("from verl.workers.config import HFModelConfig\n"
                "from transformers import AutoModelForCausalLM\n"
                f"cfg = HFModelConfig(path={str(tiny_model_dir)!r}, external_lib={external_lib!r})\n"
                "m = AutoModelForCausalLM.from_pretrained(cfg.local_path, attn_implementation='varlen_attention')\n"
                "print(m.config._attn_implementation)\n")
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)

    result = load("app.attention")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-1] == "varlen_attention"
    assert load(None).returncode != 0  # the control: without external_lib transformers does not know the name


def test_the_kernel_is_called_causal_and_shares_grouped_keys_as_this_torch_names_it():
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    assert attention._CAUSAL.get("window_size", (-1, 0)) == (-1, 0) and attention._CAUSAL.get("is_causal", True)
    assert ("window_size" in attention._CAUSAL) == ("window_size" in params)
    assert (attention._KERNEL is varlen_attn) == ("enable_gqa" in params)
