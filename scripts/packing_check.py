"""Does verl's remove-padding (packed) forward keep each sample's attention to itself?

verl 0.9.1's FSDP engine, with use_remove_padding=True, concatenates a micro batch into one row and
calls the model with input_ids (1, total), position_ids (1, total) restarting at 0 per sample and
attention_mask=None (workers/engine/fsdp/transformer_impl.py, prepare_model_inputs). Its monkey patch
only touches the flash-attention path, so with attn_implementation=sdpa/eager/flex_attention it is up
to transformers to notice the packing. This script feeds the model exactly that call and compares
each sample's loss with the same sample run alone; a leak across sample boundaries shows up as a
difference in every sample but the first.

    python scripts/packing_check.py [--device cuda] [--impl sdpa eager] [--preset tiny]

Prints one line per implementation and exits 1 if any implementation leaks.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def per_sample_losses(model, samples, device, packed: bool, position_ids_mode: str = "restart"):
    """Mean next-token loss of each sample, run packed into one row (verl's call) or one by one."""
    import torch
    import torch.nn.functional as F

    losses = []
    with torch.no_grad():
        if not packed:
            for ids in samples:
                x = ids.unsqueeze(0).to(device)
                logits = model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False).logits.float()
                losses.append(F.cross_entropy(logits[0, :-1], x[0, 1:]).item())
            return losses
        x = torch.cat(samples).unsqueeze(0).to(device)
        pos = torch.cat([torch.arange(len(s)) for s in samples]).unsqueeze(0).to(device)
        # verl passes attention_mask=None; the control passes an all-ones mask, which turns off
        # transformers' packed-sequence detection and so shows what a leak looks like
        mask = None if position_ids_mode == "restart" else torch.ones_like(x)
        logits = model(input_ids=x, attention_mask=mask, position_ids=pos, use_cache=False).logits.float()
        start = 0
        for ids in samples:
            end = start + len(ids)
            losses.append(F.cross_entropy(logits[0, start:end - 1], x[0, start + 1:end]).item())
            start = end
        return losses


def main() -> int:
    import torch

    from app.tiny import build_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--impl", nargs="+", default=["sdpa", "eager"])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--lengths", default="37,120,64,211", help="sample lengths, comma-separated")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()

    dtype = getattr(torch, args.dtype)
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
