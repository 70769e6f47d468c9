"""The trainer's attention where flash-attn is missing: torch's own FlashAttention kernel for packed samples
(`torch.nn.attention.varlen.varlen_attn`), registered with transformers as `varlen_attention`. verl imports
this module in its workers through `model.external_lib` (app/perf.py sets both keys). Unlike FlexAttention it
compiles nothing in the first step, and it is the FlashAttention-2 math (docs/benchmarks.md, GRPO round 10).
transformers has no such implementation of its own, hence these lines."""

from __future__ import annotations

import inspect

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from app.perf import VARLEN_ATTENTION as NAME


def _segments(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Cumulative sample lengths (int32) and the longest sample of a packed row: a sample starts where its
    position is 0, as in transformers' prepare_fa_kwargs_from_position_ids, which is not called because its
    lengths would start at the first 0, leaving a row's leading part of a sample out of the kernel's reach."""
    positions = position_ids.reshape(-1)
    starts = (positions == 0).nonzero().view(-1)
    if starts.numel() == 0 or starts[0] != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    cu = torch.cat([starts, starts.new_tensor([positions.numel()])]).to(torch.int32)
    return cu, int(cu.diff().max())


def _sdpa_per_sample(q, k, v, cu, scale):
    """The same attention, one sample at a time with sdpa: where the kernel is missing (CPU tests)."""
    def heads_first(t, a, b):
        return t[a:b].transpose(0, 1)[None]  # (1, heads, length, dim)
    return torch.cat([torch.nn.functional.scaled_dot_product_attention(
        heads_first(q, a, b), heads_first(k, a, b), heads_first(v, a, b), is_causal=True, scale=scale,
        enable_gqa=True)[0].transpose(0, 1) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])


def varlen_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention signature: query/key/value (1, heads, tokens, dim), one packed row whose samples
    `position_ids` delimit; returns (1, tokens, heads, dim)."""
    position_ids = kwargs.get("position_ids")
    if query.shape[0] != 1 or position_ids is None or attention_mask is not None or dropout or kwargs.get("sliding_window"):
        raise ValueError(f"{NAME} takes one packed row with position_ids: no padding, dropout or sliding window "
                         "(verl's use_remove_padding=True); otherwise use attn_implementation=sdpa")
    cu, longest = _segments(position_ids)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (tokens, heads, dim)
    if q.device.type != "cuda":
        return _sdpa_per_sample(q, k, v, cu, scaling)[None], None
    out = _KERNEL(q, k, v, cu, cu, longest, longest, scale=scaling, **_CAUSAL)
    return out[None], None


def _kernel_and_causal():
    """The kernel and its causal switch, by what its signature names: is_causal (its first release), else
    window_size=(-1, 0) (torch 2.11 on the GPU, 2.13 here); grouped keys and values are shared by the kernel
    itself where it takes enable_gqa (2.13), else expanded here (2.11)."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "enable_gqa" in params:
        return varlen_attn, {**causal, "enable_gqa": True}

    def expanded(q, k, v, *args, **kw):
        repeat = q.shape[1] // k.shape[1]
        return varlen_attn(q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1), *args, **kw)
    return expanded, causal


_KERNEL, _CAUSAL = _kernel_and_causal()
AttentionInterface.register(NAME, varlen_attention_forward)
# flash-attn's mask rule: None unless a token is padding, which then reaches the check above
AttentionMaskInterface.register(NAME, flash_attention_mask)
