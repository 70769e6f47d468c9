#!/usr/bin/env bash
# GRPO throughput, side by side in one run: verl's examples/grpo_trainer GSM8K settings (`stock`)
# against our profile (`make grpo-head`), same model shape, same data, same GPUs. Prints one BENCH line
# per config, then tokens/s/GPU and the step-time breakdown (generation, old log-prob, ref, update).
#
#   scripts/bench_grpo.sh [CONFIG...]       (stock, profile, profile-X, profile-X+Y: see the `case` below;
#                                            default: stock profile)
#   BENCH_CHECK=1 scripts/bench_grpo.sh ... compose every config on any machine (Hydra, preflight,
#                                            verl's validate_config), run nothing: a typo costs no GPU call
#
# Settings (environment):
#   BENCH_DIR  where model, data and logs go (default runs/bench-grpo; git-ignored)
#   PRESET     model shape from app/tiny.py (default qwen2.5-0.5b, random weights)
#   BATCH      prompts per step (default 64; the examples use 1024 on 8 GPUs)   N  samples per prompt (5)
#   RESPONSE   max response tokens (default 1024, as the examples)   STEPS  steps (4)
#   WARMUP     first steps not timed (default 1)
#   NGPU       GPUs on this node (default 1)                          PYTHON interpreter (default python3)
# A random-weight model answers until max length, so generation is the worst case of a real run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
BENCH_DIR=$(mkdir -p "${BENCH_DIR:-runs/bench-grpo}" && cd "${BENCH_DIR:-runs/bench-grpo}" && pwd)
PRESET=${PRESET:-qwen2.5-0.5b}; BATCH=${BATCH:-64}; N=${N:-5}; RESPONSE=${RESPONSE:-1024}; STEPS=${STEPS:-4}
NGPU=${NGPU:-1}; WARMUP=${WARMUP:-1}
configs=("$@"); [ ${#configs[@]} -eq 0 ] && configs=(stock profile)

[ -f "$BENCH_DIR/model/config.json" ] || $PYTHON -m app tiny-model "$BENCH_DIR/model" --preset "$PRESET"
[ -f "$BENCH_DIR/data/gsm8k/train.parquet" ] || DATA_DIR="$BENCH_DIR/data" $PYTHON -m app prep gsm8k
model="$BENCH_DIR/model"; train="$BENCH_DIR/data/gsm8k/train.parquet"; val="$BENCH_DIR/data/gsm8k/test.parquet"

# Shared by both: same data, batch, lengths, group size, steps; no validation, no wandb.
shape=("data.train_batch_size=$BATCH" data.max_prompt_length=512 "data.max_response_length=$RESPONSE"
       "actor_rollout_ref.rollout.n=$N" trainer.total_training_steps=$((STEPS + 1)) trainer.test_freq=-1
       trainer.val_before_train=False "trainer.logger=[console]" trainer.save_freq=-1)
# verl's examples/grpo_trainer GSM8K runs (run_qwen2-7b_seq_balance.sh, run_qwen3_0.6b_fsdp.sh): their
# optimisation settings, on this machine's GPU count and tensor parallel 1. sdpa only because
# flash-attn is not installed here; vLLM picks its own attention kernel.
stock=(algorithm.adv_estimator=grpo data.train_files="$train" data.val_files="$val" data.filter_overlong_prompts=True
       data.truncation=error actor_rollout_ref.model.path="$model" actor_rollout_ref.actor.optim.lr=1e-6
       actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.ppo_mini_batch_size=$((BATCH / 4))
       actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 actor_rollout_ref.actor.use_kl_loss=True
       actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl
       actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.model.enable_gradient_checkpointing=True
       actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 actor_rollout_ref.rollout.tensor_model_parallel_size=1
       actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.gpu_memory_utilization=0.6
       actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4 actor_rollout_ref.ref.fsdp_config.param_offload=True
       algorithm.use_kl_in_reward=False trainer.critic_warmup=0 "trainer.n_gpus_per_node=$NGPU" trainer.nnodes=1
       trainer.resume_mode=disable ++actor_rollout_ref.model.override_config.attn_implementation=sdpa)

results=(); failed=()
for name in "${configs[@]}"; do
  case $name in
    stock)   cmd=("$PYTHON" -m verl.trainer.main_ppo "${stock[@]}" "${shape[@]}"
                  trainer.default_local_dir="$BENCH_DIR/ckpt-stock") ;;
    # the profile (`make grpo-head` as shipped), and candidates on top of it, one change each; `+` stacks them
    # left to right (profile-v0+mp+nocache), so a combination costs no new name
    profile|profile-*) run_env=(); extra=""; mods=${name#profile}; IFS=+ read -ra mods <<< "${mods#-}"
             for mod in "${mods[@]}"; do case $mod in
               v0) extra+=" trainer.use_v1=False" ;;          # verl's RayPPOTrainer, no TransferQueue
               unfused) extra+=" actor_rollout_ref.model.use_fused_kernels=False" ;;  # verl's per-token log-probs
               # vLLM, from verl's performance guide: more KV cache now that the trainer holds ~51 GB, larger
               # prefill chunks (verl's default 8192)
               gmu8) extra+=" actor_rollout_ref.rollout.gpu_memory_utilization=0.8" ;;
               mnbt) extra+=" actor_rollout_ref.rollout.max_num_batched_tokens=32768" ;;
               # verl's own vLLM executor: its model worker a second process (the profile's preflight picks uni,
               # the worker inside the EngineCore, where a replica has one GPU; docs/gpu-runs.md runs 27-28)
               mp) extra+=" ++actor_rollout_ref.rollout.engine_kwargs.vllm.distributed_executor_backend=mp" ;;
               # 2 agent-loop and 2 reward workers instead of verl's 8 + 8 Ray actors, each a Python process that
               # imports verl (and the agent loop's vLLM client) while vLLM starts on the same CPUs
               workers2) extra+=" actor_rollout_ref.rollout.agent.num_workers=2 reward.num_workers=2" ;;
               # vLLM's torch.compile cache off, as verl sets it (the profile keeps it: VLLM_DISABLE_COMPILE_CACHE=0,
               # app/settings.py): only a second start on a node differs
               nocache) run_env+=(VLLM_DISABLE_COMPILE_CACHE=1) ;;
               # torch without its record of which sizes varied (TORCH_COMPILE_JOB_ID, app/settings.py): FlexAttention
               # compiled at its first length, then again for any length, on every start as before
               nopgo) run_env+=(TORCH_DYNAMO_AUTOMATIC_DYNAMIC_LOCAL_PGO=0) ;;
               # Ray's workers import verl before verl starts its actors in them (app/rayworker.py): the profile's
               # default since round 12 (docs/benchmarks.md); `pool` names it as round 11's records do
               pool) run_env+=(RAY_WARM_WORKERS=1) ;;
               nopool) run_env+=(RAY_WARM_WORKERS=0) ;;
               # a fresh node's compile caches on any node: Inductor's (with torch's record of dynamic sizes), Triton's
               # and vLLM's (under XDG_CACHE_HOME) in a new empty directory, so fresh and warm compare on one machine
               cold) run_env+=(XDG_CACHE_HOME="$BENCH_DIR/cold-$name" TORCHINDUCTOR_CACHE_DIR="$BENCH_DIR/cold-$name/inductor"
                               TRITON_CACHE_DIR="$BENCH_DIR/cold-$name/triton"); rm -rf "$BENCH_DIR/cold-$name" ;;
               # vLLM without its torch.compile (mode 0, CompilationMode.NONE) but with full CUDA graphs, which FA3
               # captures without it: its Dynamo and Inductor compile leaves the start-up, the launch-bound decode
               # keeps its graphs (enforce_eager would drop both). verl only fills in cudagraph_mode where unset
               o0) extra+=' +actor_rollout_ref.rollout.engine_kwargs.vllm.compilation_config={mode:0,cudagraph_mode:FULL}' ;;
               # TransferQueue's storage as 2 Ray actors instead of verl's 8, each a process started before the
               # dataloader (its own advice: at least 2 per node)
               tq2) extra+=" transfer_queue.backend.SimpleStorage.num_data_storage_units=2" ;;
               # vLLM captures CUDA graphs for every batch size up to twice max_num_seqs (verl's 256), piecewise and
               # full: nine powers of two instead, a decode batch padded up to the next one
               graphs) extra+=" actor_rollout_ref.rollout.cudagraph_capture_sizes=[1,2,4,8,16,32,64,128,256]" ;;
               # sdpa for the trainer where flash-attn is missing, instead of FlexAttention, whose compile is in
               # step 1: transformers masks packed samples apart from their position_ids, with a dense mask (the
               # token budget shrinks to hold it)
               sdpa) extra+=" ++actor_rollout_ref.model.override_config.attn_implementation=sdpa" ;;
               # FlexAttention for the trainer, as the profile chose where flash-attn is missing before torch's own
               # varlen kernel (app/attention.py): its compile in step 1 is the difference
               flex) extra+=" ++actor_rollout_ref.model.override_config.attn_implementation=flex_attention" ;;
               *) echo "unknown config $name ($mod)" >&2; exit 2 ;;
             esac; done
             cmd=(env "${run_env[@]}" make grpo-head RUNTIME=local PYTHON="$PYTHON" MODEL_PATH="$model" DATA_DIR="$BENCH_DIR/data"
                  NNODES=1 GPUS_PER_NODE="$NGPU" CKPT_DIR="$BENCH_DIR/ckpt-$name" FRESH=1
                  ARGS="${shape[*]} trainer.save_freq=100000 actor_rollout_ref.actor.ppo_mini_batch_size=$((BATCH / 4)) $extra") ;;
    *) echo "unknown config $name" >&2; exit 2 ;;
  esac
  log="$BENCH_DIR/$name.log"
  echo "== $name: ${cmd[*]}"
  if [ "${BENCH_CHECK:-0}" = 1 ]; then  # compose only: Hydra's --cfg job for verl itself, DRY_RUN for our targets
    if [ "$name" = stock ]; then "${cmd[@]}" --cfg job > "$log" 2>&1; else "${cmd[@]}" DRY_RUN=1 > "$log" 2>&1; fi \
      || { echo "== $name: does not compose; last lines of $log:"; tail -5 "$log"; failed+=("$name"); }
    continue
  fi
  line=$($PYTHON scripts/bench_run.py --label "$name" --steps "$STEPS" --warmup "$WARMUP" --log "$log" --timeout "${BENCH_TIMEOUT:-900}" \
           --tokens-key perf/total_num_tokens -- "${cmd[@]}" | tee -a /dev/stderr | grep '^BENCH ' || true)
  [ -n "$line" ] || { echo "== $name: no summary; last lines of $log:"; tail -25 "$log"; }
  results+=("${line#BENCH }")
done

if [ "${BENCH_CHECK:-0}" = 1 ]; then
  [ ${#failed[@]} -eq 0 ] && { echo "== BENCH_CHECK: ${configs[*]} compose"; exit 0; }
  echo "== BENCH_CHECK: ${failed[*]} do not compose (logs in $BENCH_DIR)" >&2; exit 1
fi
echo "== GRPO: $PRESET shape, batch $BATCH x n=$N, responses <= $RESPONSE tokens, $NGPU GPU(s), steps $((WARMUP + 1))..$STEPS timed"
echo "   (tokens/s is per node; perf/throughput is verl's own tokens/s/GPU)"
printf '%s\n' "${results[@]}" | $PYTHON scripts/bench_table.py --base stock \
    --extra perf/throughput timing_s/gen timing_s/old_log_prob timing_s/ref timing_s/update_actor
