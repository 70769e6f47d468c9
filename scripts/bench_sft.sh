#!/usr/bin/env bash
# SFT throughput, side by side in one run: verl 0.9.1's stock settings against our profile (`make sft`)
# and any candidate settings, same model shape, same data, same GPU. Prints one BENCH line per config
# and the ratio of each to `stock`.
#
#   scripts/bench_sft.sh [CONFIG...]        (default: stock profile)
#   BENCH_CHECK=1 scripts/bench_sft.sh ...   compose every config on any machine (Hydra, preflight), run
#                                            nothing: a typo costs no GPU call
#
# CONFIG is one of the names in the `case` below. Settings (environment):
#   BENCH_DIR   where the model, data and logs go (default runs/bench-sft; git-ignored)
#   PRESET      model shape from app/tiny.py (default qwen2.5-1.5b, random weights)
#   SEQ_TOKENS  tokens per sample (default 2104)     BATCH  global batch in samples (default 32)
#   STEPS       steps per config (default 6)   WARMUP  first steps not timed (default 2: step 1 compiles,
#               and step 2 recompiles for a second packed length: 4.3-4.8 s against 1.8 s after, GPU run 22)
#   NGPU        GPUs on this node (default 1)        PYTHON interpreter (default python3)
# verl's stock global batch is 256; a smaller one changes only how often the optimizer steps, and keeps
# each config to about a minute. tokens/s is measured here from the time between verl's step lines
# (scripts/bench_run.py); train/mfu is verl's own counter (989 TFLOP/s peak for H100/H200).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
BENCH_DIR=$(mkdir -p "${BENCH_DIR:-runs/bench-sft}" && cd "${BENCH_DIR:-runs/bench-sft}" && pwd)
PRESET=${PRESET:-qwen2.5-1.5b}; SEQ_TOKENS=${SEQ_TOKENS:-2104}; BATCH=${BATCH:-32}; STEPS=${STEPS:-6}
WARMUP=${WARMUP:-2}
NGPU=${NGPU:-1}
configs=("$@"); [ ${#configs[@]} -eq 0 ] && configs=(stock profile)

[ -f "$BENCH_DIR/sft.parquet" ] || $PYTHON scripts/bench_data.py "$BENCH_DIR" --preset "$PRESET" \
    --tokens "$SEQ_TOKENS" --rows $((BATCH * (STEPS + 1)))
model="$BENCH_DIR/model"; data="$BENCH_DIR/sft.parquet"

# What every verl-direct config needs to run at all here: our data and model, no wandb, samples longer
# than verl's max_length default (1024), no resume from an earlier config's directory. sdpa because
# flash-attn is not installed (the stock default asks for flash_attention_2 and fails without it).
common=(model.path="$model" data.train_files="$data" data.max_length=$((SEQ_TOKENS * 2))
        "data.train_batch_size=$BATCH" trainer.total_training_steps=$((STEPS + 1)) "trainer.logger=[console]"
        trainer.resume_mode=disable data.num_workers=2 ++model.override_config.attn_implementation=sdpa)
nogc=(model.enable_gradient_checkpointing=False)
big=(data.max_token_len_per_gpu=32768)
# without the fused loss, 32k tokens of fp32 logits over a 151,936 vocabulary do not fit in 141 GB
fused=(model.use_fused_kernels=True model.fused_kernel_options.impl_backend=triton)
flex=(++model.override_config.attn_implementation=flex_attention)

# NAME-stockopt: NAME with verl's stock optimizer settings (the profile's lr 1e-5 + cosine + warmup suit a
# pretrained model; the same optimizer as stock is what makes the loss per step comparable)
stockopt=(optim.lr=1e-3 optim.lr_scheduler_type=constant optim.lr_warmup_steps_ratio=0.0)

results=(); failed=()
for label in "${configs[@]}"; do
  extra=(); run_env=()
  name=${label%-stockopt}
  case $name in
    stock)      ;;                                          # verl's defaults, nothing else changed
    nogc)       extra=("${nogc[@]}") ;;
    tok32k)     extra=("${big[@]}") ;;
    nogc-32k)   extra=("${nogc[@]}" "${big[@]}") ;;
    fused)      extra=("${nogc[@]}" "${big[@]}" "${fused[@]}") ;;
    fused-16k)  extra=("${nogc[@]}" "${fused[@]}" data.max_token_len_per_gpu=16384) ;;
    flex)       extra=("${nogc[@]}" "${big[@]}" "${fused[@]}" "${flex[@]}") ;;
    flex-16k)   extra=("${nogc[@]}" "${fused[@]}" "${flex[@]}" data.max_token_len_per_gpu=16384) ;;
    nocompile)  extra=("${nogc[@]}" "${big[@]}" engine.use_torch_compile=False) ;;
    bf16-master) extra=("${nogc[@]}" "${big[@]}" engine.model_dtype=bf16) ;;
    profile)    ;;                                          # `make sft` as shipped: preflight's choices
    profile-liger) extra=(model.use_liger=True) ;;           # + Liger's rmsnorm/swiglu/rope kernels
    profile-pad) extra=(engine.pad_to_length=True) ;;        # + packed rows padded to 1k buckets (repeat shapes)
    profile-fsdp2) extra=(engine.strategy=fsdp2) ;;          # + FSDP2 (per-parameter sharding) instead of FSDP1
    profile-nocompile) extra=(engine.use_torch_compile=False) ;;  # verl's torch.compile of its entropy function off
    profile-dl4) extra=(data.num_workers=4) ;;               # 4 DataLoader workers instead of the profile's 2
    profile-flex) extra=("${flex[@]}") ;;                   # FlexAttention instead of the profile's varlen kernel (no flash-attn)
    # + PyTorch's expandable allocator segments, in case a fragmented cache near the card's limit (the profile
    # reserved 135 of 140 GiB in round 2) frees and retries its cudaMallocs: run 22, no faster beyond the spread
    profile-expandable) run_env=(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) ;;
    *) echo "unknown config $name" >&2; exit 2 ;;
  esac
  [ "$name" != "$label" ] && extra+=("${stockopt[@]}")
  name=$label
  log="$BENCH_DIR/$name.log"
  if [[ $name == profile* ]]; then
    # our `make sft`, as a user runs it, with only the benchmark's data/model/length/step count set
    cmd=(env "${run_env[@]}" make sft RUNTIME=local PYTHON="$PYTHON" MODEL_PATH="$model" TRAIN_FILE="$data" NNODES=1 NODE_RANK=0
         GPUS_PER_NODE="$NGPU" CKPT_DIR="$BENCH_DIR/ckpt-profile" FRESH=1
         ARGS="data.max_length=$((SEQ_TOKENS * 2)) data.train_batch_size=$BATCH trainer.total_training_steps=$((STEPS + 1)) trainer.logger=[console] trainer.test_freq=-1 ${extra[*]}")
  else
    cmd=(torchrun --standalone --nnodes 1 --nproc_per_node "$NGPU" -m verl.trainer.sft_trainer "${common[@]}"
         trainer.default_local_dir="$BENCH_DIR/ckpt-$name" "${extra[@]}")
  fi
  echo "== $name: ${cmd[*]}"
  if [ "${BENCH_CHECK:-0}" = 1 ]; then  # compose only: Hydra's --cfg job for verl itself, DRY_RUN for `make sft`
    if [[ $name == profile* ]]; then "${cmd[@]}" DRY_RUN=1 > "$log" 2>&1
    else $PYTHON -m verl.trainer.sft_trainer "${cmd[@]:8}" --cfg job > "$log" 2>&1; fi \
      || { echo "== $name: does not compose; last lines of $log:"; tail -5 "$log"; failed+=("$name"); }
    continue
  fi
  line=$($PYTHON scripts/bench_run.py --label "$name" --steps "$STEPS" --warmup "$WARMUP" --timeout "${BENCH_TIMEOUT:-600}" --log "$log" -- "${cmd[@]}" | tee -a /dev/stderr | grep '^BENCH ' || true)
  [ -n "$line" ] || { echo "== $name: no summary; last lines of $log:"; tail -25 "$log"; }
  results+=("${line#BENCH }")
done

if [ "${BENCH_CHECK:-0}" = 1 ]; then
  [ ${#failed[@]} -eq 0 ] && { echo "== BENCH_CHECK: ${configs[*]} compose"; exit 0; }
  echo "== BENCH_CHECK: ${failed[*]} do not compose (logs in $BENCH_DIR)" >&2; exit 1
fi
echo "== SFT throughput: $PRESET shape, ~$SEQ_TOKENS-token samples, batch $BATCH, $NGPU GPU(s), steps $((WARMUP + 1))..$STEPS timed"
printf '%s\n' "${results[@]}" | $PYTHON scripts/bench_table.py --base stock
