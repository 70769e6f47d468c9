"""app.perf: the token budget and checkpointing that fit a GPU, for the shapes of real models (their
config.json as app.tiny writes them), and preflight's refusal of a budget that cannot fit."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_config import launch_env  # noqa: F401  (a fixture: tiny model, real parquet)

from app import perf
from app.common import UserError

GIB = perf.GIB
H200, H100_80, A100_40 = 141 * GIB, 80 * GIB, 40 * GIB


def shape_of(preset: str, tmp_path) -> perf.ModelShape:
    """The shape app.perf reads from the config.json of a model of `preset`'s shape."""
    from app.tiny import build_model

    model = build_model(preset, vocab_size=151936, num_hidden_layers=1) if preset == "tiny" else None
    if model is None:  # the real shapes: write only the config (no weights needed)
        from transformers import Qwen2Config

        from app.tiny import PRESETS

        Qwen2Config(**PRESETS[preset]).save_pretrained(tmp_path)
    else:
        model.config.save_pretrained(tmp_path)
    shape = perf.model_shape(tmp_path)
    assert shape is not None
    return shape


def test_param_count_of_the_qwen_shapes_is_close_to_the_real_models(tmp_path):
    assert shape_of("qwen2.5-1.5b", tmp_path / "a").params == pytest.approx(1.54e9, rel=0.08)
    assert shape_of("qwen2.5-0.5b", tmp_path / "b").params == pytest.approx(0.49e9, rel=0.12)


def test_h200_budget_for_the_1_5b_shape_is_the_measured_32k_without_checkpointing(tmp_path):
    budget = perf.token_budget(shape_of("qwen2.5-1.5b", tmp_path), H200, gpus=1)
    assert budget.tokens == 32768 and budget.checkpointing is False


def test_smaller_cards_get_a_smaller_budget_that_fits_the_calibrated_activation_cost(tmp_path):
    shape = shape_of("qwen2.5-1.5b", tmp_path)
    b80 = perf.token_budget(shape, H100_80, gpus=1)
    assert 8192 <= b80.tokens < 32768 and not b80.checkpointing
    # what the budget plans for stays under the usable part of the card
    used = shape.params * perf.TRAIN_BYTES_PER_PARAM + b80.tokens * perf.ACT_BYTES_NO_CKPT * shape.layers * shape.hidden
    assert used + perf.CONTEXT_BYTES <= H100_80 * perf.USABLE
    # 40 GB: too little left for a fast budget, so checkpointing goes back on
    b40 = perf.token_budget(shape, A100_40, gpus=1)
    assert b40.checkpointing is True and b40.tokens >= 4096


def test_more_gpus_shard_the_weights_and_free_room_for_tokens(tmp_path):
    shape = shape_of("qwen2.5-1.5b", tmp_path)
    assert perf.token_budget(shape, A100_40, gpus=8).checkpointing is False


def test_a_model_too_big_for_the_gpus_gets_no_budget(tmp_path):
    big = perf.ModelShape(layers=80, hidden=8192, intermediate=29568, vocab=152064, tied=False)  # ~72B
    assert perf.token_budget(big, H100_80, gpus=1) is None
    assert perf.token_budget(big, H100_80, gpus=64) is not None


def test_grpo_budget_accounts_for_the_reference_model(tmp_path):
    shape = shape_of("qwen2.5-1.5b", tmp_path)
    assert (perf.token_budget(shape, H100_80, 1, ref_model=True).tokens
            < perf.token_budget(shape, H100_80, 1).tokens)


def test_model_shape_of_a_missing_or_broken_config_is_none(tmp_path):
    assert perf.model_shape(tmp_path) is None
    (tmp_path / "config.json").write_text("{not json")
    assert perf.model_shape(tmp_path) is None


@pytest.fixture
def sft_plan(launch_env, tmp_path, monkeypatch):
    """A composed SFT config for a 1.5B-shaped model directory (config + tokenizer, no weights needed)."""
    import shutil

    model = tmp_path / "m15"
    shape_of("qwen2.5-1.5b", model)
    for name in ("tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        # the tiny model's weights: preflight checks that weights are there; the budget reads config.json
        shutil.copy(Path(launch_env["MODEL_PATH"]) / name, model / name)
    monkeypatch.setenv("MODEL_PATH", str(model))
    return model


def _preflight_sft():
    from app.preflight import preflight
    from app.settings import load

    return preflight("sft", load())  # no GPU here: preflight itself has nothing to check against


def test_preflight_refuses_a_budget_that_cannot_fit_and_says_the_largest(sft_plan, monkeypatch):
    monkeypatch.setenv("ARGS", "data.max_token_len_per_gpu=65536 model.enable_gradient_checkpointing=false")
    plan = _preflight_sft()
    with pytest.raises(UserError, match=r"data.max_token_len_per_gpu=65536 does not fit .* at most 16384"):
        perf.check_budgets(plan.spec, gpu=H100_80)
    perf.check_budgets(plan.spec, gpu=H200 * 2)  # a card twice an H200's size holds it


def test_a_dense_mask_attention_gets_a_budget_that_holds_its_tokens_x_tokens_mask(tmp_path):
    shape = shape_of("qwen2.5-1.5b", tmp_path)
    for gpu in (H200, H100_80):
        flex = perf.token_budget(shape, gpu, gpus=1)
        dense = perf.token_budget(shape, gpu, gpus=1, dense_mask=True)
        assert dense.tokens < flex.tokens and not dense.checkpointing
        per_token = perf.ACT_BYTES_NO_CKPT * shape.layers * shape.hidden
        static = shape.params * perf.TRAIN_BYTES_PER_PARAM
        used = static + dense.tokens * per_token + perf.DENSE_MASK_BYTES * shape.layers * dense.tokens**2
        assert used + perf.CONTEXT_BYTES <= gpu * perf.USABLE


def test_sdpa_from_args_or_config_gets_the_smaller_budget_and_an_oversized_one_is_refused(sft_plan, monkeypatch):
    """ARGS pick sdpa: preflight chooses the budget again with sdpa's mask in it (without a GPU here the
    profile's budget stands, so the check is called with an H200's memory), and refuses one that cannot hold it."""
    monkeypatch.setenv("ARGS", "model.override_config.attn_implementation=sdpa data.max_token_len_per_gpu=32768 "
                               "model.enable_gradient_checkpointing=false")
    plan = _preflight_sft()
    with pytest.raises(UserError, match=r"32768 does not fit .* and sdpa's tokens x tokens mask .* at most \d+"):
        perf.check_budgets(plan.spec, gpu=H200)
    monkeypatch.setenv("ARGS", "model.override_config.attn_implementation=flex_attention "
                               "data.max_token_len_per_gpu=32768 model.enable_gradient_checkpointing=false")
    perf.check_budgets(_preflight_sft().spec, gpu=H200)  # the same budget holds without the mask


def test_preflight_chooses_the_budget_again_when_args_pick_sdpa(sft_plan, monkeypatch):
    from app import node

    # the card preflight would read with nvidia-smi, which this machine lacks
    h200 = node.Gpus(1, "a test's H200", ({"memory.total": str(H200 // 2**20)},), 1)
    monkeypatch.setattr(node, "gpus", lambda visible: h200)
    plan = _preflight_sft()
    node_choice = plan.spec.cfg.data.max_token_len_per_gpu
    monkeypatch.setenv("ARGS", "model.override_config.attn_implementation=sdpa")
    plan = _preflight_sft()
    dense = perf.token_budget(perf.model_shape(sft_plan), H200, gpus=1, dense_mask=True)
    assert plan.spec.cfg.data.max_token_len_per_gpu == dense.tokens < node_choice
    assert any(n.startswith(f"token budget: {dense.tokens} tokens per GPU") for n in plan.notes)
    perf.check_budgets(plan.spec, gpu=H200)  # and the check agrees that it fits


def test_preflight_refuses_a_model_that_cannot_train_on_the_gpus(sft_plan):
    plan = _preflight_sft()
    with pytest.raises(UserError, match="does not fit 1 GPU"):
        perf.check_budgets(plan.spec, gpu=16 * GIB)


# --- log-probs: verl's fused kernel, not its per-token fallback ------------------------------------------
@pytest.mark.parametrize("job", ["sft", "grpo"])
def test_shipped_profiles_take_log_probs_from_verls_fused_kernel(launch_env, job):
    from test_config import plan_of

    plan = plan_of(job)
    assert any(note.startswith("log-probs: verl's fused triton kernel") for note in plan.notes)
    assert not any("one token at a time" in w for w in plan.warnings)


@pytest.mark.skipif(perf.flash_attn_installed(),
                    reason="with flash-attn installed verl takes its cross-entropy kernel instead: nothing to warn")
def test_preflight_warns_that_turning_fused_kernels_off_without_flash_attn_is_per_token(launch_env, monkeypatch):
    from test_config import plan_of

    monkeypatch.setenv("ARGS", "actor_rollout_ref.model.use_fused_kernels=false")
    plan = plan_of("grpo")
    assert any("one token at a time" in w and "keep the profile's true" in w for w in plan.warnings)
    assert not any(note.startswith("log-probs:") for note in plan.notes)


def test_verls_fused_log_probs_match_the_plain_ones_on_the_pinned_transformers():
    """The profiles rely on verl's patched forward (use_fused_kernels) working with the pinned transformers:
    on a packed row of three samples its log-probs and gradients equal log_softmax of the plain logits.
    The torch backend runs here; the triton one (the profiles') shares the patch and needs a GPU."""
    import torch
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    from app.tiny import build_model

    torch.manual_seed(0)
    model = build_model("tiny").float()
    model.config._attn_implementation = "sdpa"
    lengths = [7, 12, 5]
    ids = torch.randint(0, model.config.vocab_size, (1, sum(lengths)))
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)  # verl's packed (remove-padding) row
    labels = torch.roll(ids, -1, dims=1)

    logits = model(input_ids=ids, position_ids=positions).logits.squeeze(0)
    plain = torch.log_softmax(logits, -1).gather(-1, labels.squeeze(0).unsqueeze(-1)).squeeze(-1)
    plain.sum().backward()
    plain_grad = model.lm_head.weight.grad.clone()
    model.zero_grad()

    model_class, forward = type(model), type(model).forward
    try:  # verl patches the class: put it back for the rest of this process
        apply_monkey_patch(model, use_remove_padding=True, use_fused_kernels=True, fused_kernels_backend="torch")
        assert model_class.forward is not forward
        out = model(input_ids=ids, position_ids=positions, return_dict=True, temperature=1.0, shift_labels=labels)
        fused = out.log_probs.squeeze(0)
        fused.sum().backward()
    finally:
        model_class.forward = forward
    assert fused.shape == plain.shape
    torch.testing.assert_close(fused, plain, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(model.lm_head.weight.grad, plain_grad, atol=1e-5, rtol=1e-4)
