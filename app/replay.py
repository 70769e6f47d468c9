"""verl's replay buffer for GRPO's sync trainer, polled every `poll_interval` seconds instead of every 2.

verl 0.9.1's sync trainer waits for a step's rollouts by polling its replay buffer, every 2.0 s (the
ReplayBuffer's poll_interval, which no config key reaches). A step's generation therefore takes a whole
number of 2-second polls: 2.2 s at every step of the demo (docs/gpu-runs.md runs 18 and 20), whose 512
rollouts of a few tokens took 1.7 s on average when polled every 0.1 s (run 21). verl loads this class through
its own extension point for samplers; everything but the interval is verl's. The demo uses it (app/demo.py):

    trainer.v1.sampler.custom_sampler.path=pkg://app.replay
    trainer.v1.sampler.custom_sampler.name=QuickPollReplayBuffer
    +trainer.v1.sampler.sampler_kwargs.poll_interval=0.1
    +trainer.v1.sampler.sampler_kwargs.train_batch_size=<data.train_batch_size>

verl hands a custom sampler less than its own (no train or generation batch size, no DAPO group filter, no
failed-group refill), so this one takes the batch size from sampler_kwargs and serves only what verl's
default serves without those options: the sync trainer, no filter_groups, no sync_refill_failed_groups, no
other generation batch. It refuses the other cases itself, when verl builds it; the demo never asks for them.
"""

from __future__ import annotations

from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

# keys of sampler_kwargs this class reads; the interval's floor keeps the poll from spinning on TransferQueue
POLL_KEY, BATCH_KEY, DEFAULT_POLL, MIN_POLL = "poll_interval", "train_batch_size", 0.1, 0.01


class QuickPollReplayBuffer(ReplayBuffer):
    def __init__(self, *, sampler_kwargs, trainer_mode, **verl_kwargs):
        options = dict(sampler_kwargs or {})
        if trainer_mode != "sync":
            raise ValueError(f"QuickPollReplayBuffer serves verl's sync trainer only, not trainer_mode={trainer_mode}")
        if BATCH_KEY not in options:
            raise ValueError(f"QuickPollReplayBuffer needs sampler_kwargs.{BATCH_KEY} (= data.train_batch_size)")
        poll, batch = float(options.get(POLL_KEY, DEFAULT_POLL)), int(options[BATCH_KEY])
        if not poll >= MIN_POLL:
            raise ValueError(f"sampler_kwargs.{POLL_KEY}={poll}: give at least {MIN_POLL} seconds")
        # what verl's _build_replay_buffer passes its own ReplayBuffer in sync mode without DAPO
        super().__init__(sampler_kwargs=sampler_kwargs, trainer_mode=trainer_mode, poll_interval=poll,
                         train_batch_size=batch, gen_batch_size=batch, max_inflight_gen_batches=1, **verl_kwargs)
