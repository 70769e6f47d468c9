"""Write real sharded verl checkpoints on CPU, the way verl 0.9.1 writes them on GPUs.

W real processes (torch.multiprocessing spawn) join one gloo group, shard a Qwen2 with FSDP2
`fully_shard` over a device mesh named "fsdp" (verl's `create_device_mesh`), and save through verl's
own `FSDPCheckpointManager`: `model_world_size_W_rank_R.pt` (DTensor state dicts), optimizer and extra
state per rank, and on rank 0 `fsdp_config.json` + `huggingface/` (config, tokenizer; the full weights too
with --hf-model, verl's `hf_model` content).
The trainer's `latest_checkpointed_iteration.txt` goes into the run directory.

    python tests/ckpt_factory.py --model MODEL_DIR --out RUN_DIR --world-size 2 --step 5 [--layout grpo]
    python tests/ckpt_factory.py --preset qwen2.5-1.5b --layers 16 --out RUN_DIR --world-size 8 --step 1

With --preset the model is built on the meta device and each rank fills only its own shard with random
values, so an 8-rank ~1B checkpoint fits in a small machine's memory (used by scripts/bench_merge.sh).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _build_model(args):
    import torch
    from transformers import AutoModelForCausalLM

    if args.model:
        # fp32 master weights, as verl's FSDP engine keeps them (bf16 only for compute).
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        return model, tokenizer
    from app.tiny import PRESETS, build_tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = dict(PRESETS[args.preset])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    config = Qwen2Config(max_position_embeddings=4096, rope_theta=10000.0, **shape)
    config.torch_dtype = "bfloat16"
    config.architectures = ["Qwen2ForCausalLM"]  # what a from_pretrained model's config carries
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config).float()
    return model, build_tokenizer()


def _worker(rank: int, args) -> None:
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    torch.set_num_threads(1)
    # verl's local_mkdir_safe leaves a ckpt_<hash>.lock in the temp dir at every save: keep them in ours
    tempfile.tempdir = os.path.dirname(args.store)
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=rank, world_size=args.world_size)
    model, tokenizer = _build_model(args)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        # init_lora_weights=False: random A and B, so merging the adapter really changes the weights.
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 init_lora_weights=False, task_type="CAUSAL_LM"))
    mesh = init_device_mesh("cpu", mesh_shape=(args.world_size,), mesh_dim_names=["fsdp"])
    decoder = model.base_model.model.model if args.lora else model.model
    for layer in decoder.layers:  # verl's apply_fsdp2: each decoder layer, then the root
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if not args.model:
        # Meta-built model: give each rank's local shard random values (no full copy anywhere).
        model.to_empty(device="cpu")
        generator = torch.Generator().manual_seed(1000 + rank)
        with torch.no_grad():
            for param in model.parameters():
                param.to_local().normal_(0.0, 0.02, generator=generator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5) if args.optimizer else None
    contents = (["model", "optimizer", "extra"] if args.optimizer else ["model"]) + (["hf_model"] if args.hf_model else [])
    manager = FSDPCheckpointManager(model=model, optimizer=optimizer, lr_scheduler=None,
                                    processing_class=tokenizer,
                                    checkpoint_config=OmegaConf.create({"save_contents": contents,
                                                                        "load_contents": contents}))
    step_dir = Path(args.out) / f"global_step_{args.step}"
    local = step_dir / "actor" if args.layout == "grpo" else step_dir
    manager.save_checkpoint(local_path=str(local), global_step=args.step)
    dist.barrier()
    if rank == 0:
        # What verl's trainers write after a save (sft_trainer / ray_trainer).
        (Path(args.out) / "latest_checkpointed_iteration.txt").write_text(str(args.step))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="Hugging Face model directory to shard (weights loaded in fp32)")
    source.add_argument("--preset", help="app.tiny preset built on the meta device, random shard values")
    parser.add_argument("--layers", type=int, default=0, help="override the preset's layer count")
    parser.add_argument("--out", required=True, help="run directory (global_step_N/ goes inside)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--step", type=int, default=1)
    parser.add_argument("--layout", choices=["sft", "grpo"], default="sft")
    parser.add_argument("--lora", action="store_true", help="wrap in a PEFT LoRA (r=4, q_proj/v_proj)")
    parser.add_argument("--hf-model", action="store_true", help="also save the full model in huggingface/")
    parser.add_argument("--no-optimizer", dest="optimizer", action="store_false",
                        help="save the model only (benchmarks: less disk)")
    args = parser.parse_args(argv)

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        args.store = os.path.join(tmp, "store")  # file:// rendezvous: no port to collide with other tests
        mp.spawn(_worker, args=(args,), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
