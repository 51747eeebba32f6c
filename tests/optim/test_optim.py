"""Megatron DDP + optimiser on CPU: frozen params untouched, bf16 with fp32 master weights,
fp16 overflow handling (skip + halve loss scale), LR warmup."""

from __future__ import annotations

import pytest
import torch

from sao_megatron.models import (
    VALUE_DEFAULT_FREEZE_PATTERNS,
    ModelInputs,
    apply_freeze,
    build_policy,
    build_value_model,
    forward_backward,
)
from sao_megatron.optim import OptimizerConfig, PrecisionConfig, build_optimizer


def _batch(b=2, t=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (b, t), generator=g)
    return ModelInputs(
        ids, torch.ones_like(ids), extras={"returns": torch.randn(b, t, generator=g)}
    )


def _value_loss(out, mb):
    return ((out["values"] - mb.extras["returns"]) ** 2).mean(), {}


def _policy_loss(out, mb):
    return -out["logprobs"].mean(), {}


def test_value_step_leaves_frozen_bit_identical(parallel_1rank, tiny_moe):
    value = build_value_model(tiny_moe, parallel_1rank)
    report = apply_freeze(value, VALUE_DEFAULT_FREEZE_PATTERNS)
    ts = build_optimizer(value, parallel_1rank, OptimizerConfig(lr=1e-3), PrecisionConfig())
    before = {n: p.detach().clone() for n, p in value[0].named_parameters()}
    ts.zero_grad()
    forward_backward(ts.model, parallel_1rank, _batch(), kind="value", loss_fn=_value_loss)
    ok, grad_norm = ts.step()
    assert ok and grad_norm > 0
    for name, p in value[0].named_parameters():
        if name in report.frozen_names:
            assert torch.equal(p, before[name]), f"frozen {name} changed"
        else:
            assert not torch.equal(p, before[name]), f"trainable {name} did not change"
    assert len(report.frozen_names) == 5 and len(report.trainable_names) > 20


def test_all_frozen_is_an_error(parallel_1rank, tiny_moe):
    value = build_value_model(tiny_moe, parallel_1rank)
    apply_freeze(value, ["."])
    with pytest.raises(ValueError, match="no trainable parameter"):
        build_optimizer(value, parallel_1rank, OptimizerConfig(), PrecisionConfig())


def _loss_after_one_step(state, model_cfg, params_dtype, weights):
    precision = PrecisionConfig(params_dtype=params_dtype)
    policy = build_policy(model_cfg, state, precision)
    policy[0].load_state_dict(weights)  # cast to params_dtype on copy
    ts = build_optimizer(policy, state, OptimizerConfig(lr=1e-2, clip_grad=1.0), precision)
    ts.zero_grad()
    rec = forward_backward(ts.model, state, _batch(), kind="policy", loss_fn=_policy_loss)
    ok, _ = ts.step()
    assert ok
    ts.zero_grad()
    rec2 = forward_backward(ts.model, state, _batch(), kind="policy", loss_fn=_policy_loss)
    return float(rec[0]["loss"]), float(rec2[0]["loss"]), ts, policy


def test_bf16_step_with_fp32_master_weights_matches_fp32(parallel_1rank, tiny_moe):
    weights = build_policy(tiny_moe, parallel_1rank)[0].state_dict()
    f0, f1, _, _ = _loss_after_one_step(parallel_1rank, tiny_moe, "fp32", weights)
    b0, b1, ts, policy = _loss_after_one_step(parallel_1rank, tiny_moe, "bf16", weights)
    assert f1 < f0 and b1 < b0  # the step lowers the loss in both
    assert abs(b0 - f0) <= 2e-2 * abs(f0) and abs(b1 - f1) <= 2e-2 * abs(f1)
    # fp32 master copies exist for every bf16 param, and the bf16 params are their rounding
    params = [p for p in policy[0].parameters()]
    assert all(p.dtype == torch.bfloat16 for p in params)
    masters = []
    for opt in getattr(ts.optimizer, "chained_optimizers", [ts.optimizer]):
        for group in opt.fp32_from_float16_groups:
            masters.extend(group)
    assert len(masters) == len(params) and all(m.dtype == torch.float32 for m in masters)
    models = [
        p
        for opt in getattr(ts.optimizer, "chained_optimizers", [ts.optimizer])
        for g in opt.float16_groups
        for p in g
    ]
    for p, m in zip(models, masters, strict=True):
        assert torch.equal(p, m.bfloat16())


def test_fp16_overflow_skips_update_and_halves_loss_scale(parallel_1rank, tiny_moe):
    precision = PrecisionConfig(params_dtype="fp16", initial_loss_scale=2.0**16, hysteresis=1)
    policy = build_policy(tiny_moe, parallel_1rank, precision)
    ts = build_optimizer(policy, parallel_1rank, OptimizerConfig(lr=1e-3), precision)
    before = {n: p.detach().clone() for n, p in policy[0].named_parameters()}
    ts.zero_grad()
    forward_backward(  # x1e6 on top of the 2^16 loss scale overflows fp16 gradients
        ts.model,
        parallel_1rank,
        _batch(),
        kind="policy",
        loss_fn=lambda o, mb: (_policy_loss(o, mb)[0] * 1e6, {}),
    )
    ok, grad_norm = ts.step()
    assert not ok and grad_norm is None
    assert float(ts.optimizer.get_loss_scale()) == 2.0**15
    assert all(torch.equal(p, before[n]) for n, p in policy[0].named_parameters())
    ts.zero_grad()
    forward_backward(ts.model, parallel_1rank, _batch(), kind="policy", loss_fn=_policy_loss)
    ok, grad_norm = ts.step()
    assert ok and grad_norm > 0
    assert float(ts.optimizer.get_loss_scale()) == 2.0**15
    assert any(not torch.equal(p, before[n]) for n, p in policy[0].named_parameters())


def test_lr_warmup_then_cosine(parallel_1rank, tiny_moe):
    policy = build_policy(tiny_moe, parallel_1rank)
    cfg = OptimizerConfig(lr=1e-3, min_lr=1e-4, warmup_steps=4, decay_steps=8, decay_style="cosine")
    ts = build_optimizer(policy, parallel_1rank, cfg, PrecisionConfig())
    lrs = []
    for _ in range(12):
        lrs.append(ts.optimizer.param_groups[0]["lr"])
        ts.scheduler.step(increment=1)
    # update k (1-based) during warmup uses lr * k / warmup
    assert lrs[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert lrs[7] == pytest.approx(
        1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + torch.cos(torch.tensor(0.5 * torch.pi)).item())
    )
    assert lrs[-1] == pytest.approx(1e-4)


@pytest.mark.parametrize("params_dtype", ["bf16", "fp16"])
def test_mixed_precision_with_distributed_optimizer(parallel_1rank, tiny_moe, params_dtype):
    precision = PrecisionConfig(params_dtype=params_dtype)
    policy = build_policy(tiny_moe, parallel_1rank, precision)
    cfg = OptimizerConfig(lr=1e-2, distributed_optimizer=True)
    ts = build_optimizer(policy, parallel_1rank, cfg, precision)
    losses = []
    for _ in range(2):
        ts.zero_grad()
        rec = forward_backward(
            ts.model, parallel_1rank, _batch(), kind="policy", loss_fn=_policy_loss
        )
        ok, _ = ts.step()
        assert ok
        losses.append(float(rec[0]["loss"]))
    assert losses[1] < losses[0]
    assert all(p.dtype == precision.torch_dtype for p in policy[0].parameters())
