"""Does verl's remove-padding (packed) forward keep each sample's attention to itself?

verl 0.9.1's FSDP engine, with use_remove_padding=True, concatenates a micro batch into one row and
calls the model with input_ids (1, total), position_ids (1, total) restarting at 0 per sample and
attention_mask=None (workers/engine/fsdp/transformer_impl.py, prepare_model_inputs). Its monkey patch
only touches the flash-attention path, so with attn_implementation=sdpa/eager/flex_attention it is up
to transformers to notice the packing. This script feeds the model exactly that call and compares
each sample's loss with the same sample run alone; a leak across sample boundaries shows up as a
difference in every sample but the first.

    python scripts/packing_check.py [--device cuda] [--impl sdpa eager] [--preset tiny]
    python scripts/packing_check.py --grads --impl eager sdpa varlen_attention flex_attention --device cuda --dtype bfloat16

Prints one line per implementation and exits 1 if any implementation leaks. --grads compares the gradients of
one training step on the packed row instead (the backward pass verl's update takes), each implementation's
against the first one's, same weights and tokens: the demo's SFT learned less with FlexAttention than with
sdpa from identical step-1 losses (docs/gpu-runs.md run 15), and FlexAttention has no backward on CPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def packed_sample_losses(model, samples, device, position_ids_mode: str = "restart", reduction: str = "mean"):
    """verl's packed call (one row, position_ids restarting per sample, attention_mask=None) and each
    sample's next-token loss from it, as tensors."""
    import torch
    import torch.nn.functional as F

    x = torch.cat(samples).unsqueeze(0).to(device)
    pos = torch.cat([torch.arange(len(s)) for s in samples]).unsqueeze(0).to(device)
    # verl passes attention_mask=None; the control passes an all-ones mask, which turns off
    # transformers' packed-sequence detection and so shows what a leak looks like
    mask = None if position_ids_mode == "restart" else torch.ones_like(x)
    logits = model(input_ids=x, attention_mask=mask, position_ids=pos, use_cache=False).logits.float()
    losses, start = [], 0
    for ids in samples:
        end = start + len(ids)
        losses.append(F.cross_entropy(logits[0, start:end - 1], x[0, start + 1:end], reduction=reduction))
        start = end
    return losses


def per_sample_losses(model, samples, device, packed: bool, position_ids_mode: str = "restart"):
    """Mean next-token loss of each sample, run packed into one row (verl's call) or one by one."""
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        if packed:
            return [loss.item() for loss in packed_sample_losses(model, samples, device, position_ids_mode)]
        losses = []
        for ids in samples:
            x = ids.unsqueeze(0).to(device)
            logits = model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False).logits.float()
            losses.append(F.cross_entropy(logits[0, :-1], x[0, 1:]).item())
        return losses


def packed_grads(model, samples, device, position_ids_mode: str = "restart") -> tuple[float, dict]:
    """Loss and parameter gradients of one training step on the packed row (verl's call), mean over tokens."""
    model.zero_grad(set_to_none=True)
    sums = packed_sample_losses(model, samples, device, position_ids_mode, reduction="sum")
    loss = sum(sums) / sum(len(ids) - 1 for ids in samples)
    loss.backward()
    return loss.item(), {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def worst_grad_diff(grads: dict, reference: dict) -> tuple[float, str]:
    """The largest difference of one parameter's gradient, relative to that gradient's largest entry."""
    return max(((grads[n] - ref).abs().max().item() / (ref.abs().max().item() or 1.0), n)
               for n, ref in reference.items())


def check_grads(args, dtype) -> int:
    import torch

    from app.tiny import build_model

    gen = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in args.lengths.split(",")]
    # relative to each gradient's largest entry: fp32 roundoff reaches ~1e-4 (eager vs sdpa on CPU), bf16 ~1e-2;
    # a leak across samples is of order 1 (the control)
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    reference = None
    differs = False
    for impl in args.impl:
        model = build_model(args.preset, vocab_size=1024, seed=0).to(device=args.device, dtype=dtype).train()
        model.config._attn_implementation = impl
        if reference is None:
            samples = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in lengths]
        loss, grads = packed_grads(model, samples, args.device)
        if reference is None:
            reference = (impl, loss, grads)
            _, control = packed_grads(model, samples, args.device, position_ids_mode="mask")
            leak, _ = worst_grad_diff(control, grads)
            print(f"{impl:15s} reference: loss {loss:.6f}; (control, the same call with an all-ones "
                  f"attention_mask, i.e. leaking across samples: worst grad diff {leak:.2e})", flush=True)
            continue
        worst, name = worst_grad_diff(grads, reference[2])
        ok = worst <= tol
        differs |= not ok
        print(f"{impl:15s} device={args.device} dtype={args.dtype} preset={args.preset} loss {loss:.6f} "
              f"(vs {reference[0]} {reference[1]:.6f}) worst grad diff {worst:.2e} in {name} -> "
              f"{'SAME GRADIENTS' if ok else 'GRADIENTS DIFFER'} (tolerance {tol:g})", flush=True)
    return 1 if differs else 0


def main() -> int:
    import torch

    import app.attention  # noqa: F401  (registers varlen_attention with transformers)
    from app.tiny import build_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--impl", nargs="+", default=["sdpa", "eager"])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--lengths", default="37,120,64,211", help="sample lengths, comma-separated")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--grads", action="store_true", help="compare one training step's gradients instead")
    args = parser.parse_args()

    dtype = getattr(torch, args.dtype)
    if args.grads:
        return check_grads(args, dtype)
    gen = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in args.lengths.split(",")]
    leaks = False
    for impl in args.impl:
        model = build_model(args.preset, vocab_size=1024, seed=0).to(device=args.device, dtype=dtype).eval()
        model.config._attn_implementation = impl
        vocab = model.config.vocab_size
        samples = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
        alone = per_sample_losses(model, samples, args.device, packed=False)
        packed = per_sample_losses(model, samples, args.device, packed=True)
        naive = per_sample_losses(model, samples, args.device, packed=True, position_ids_mode="mask")
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        diff = max(abs(a - b) for a, b in zip(alone, packed))
        naive_diff = max(abs(a - b) for a, b in zip(alone, naive))
        ok = diff <= tol
        leaks |= not ok
        print(f"{impl:15s} device={args.device} dtype={args.dtype} preset={args.preset} "
              f"alone={[round(v, 4) for v in alone]} packed={[round(v, 4) for v in packed]} "
              f"max|diff|={diff:.2e} -> {'ISOLATED' if ok else 'LEAKS ACROSS SAMPLES'}; "
              f"(control, same call with an all-ones attention_mask: max|diff|={naive_diff:.2e})", flush=True)
    return 1 if leaks else 0


if __name__ == "__main__":
    sys.exit(main())
