"""GPU path: Transformer Engine specs, NCCL, bf16 and FP8 (Hopper+). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _train_step(state, model_cfg, precision):
    from sao_megatron.models import ModelInputs, build_policy, forward_backward
    from sao_megatron.optim import OptimizerConfig, build_optimizer

    policy = build_policy(model_cfg, state, precision)
    assert all(p.is_cuda and p.dtype == precision.torch_dtype for p in policy[0].parameters())
    ts = build_optimizer(policy, state, OptimizerConfig(lr=1e-3), precision)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model_cfg.vocab_size, (2, 32), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 24:] = 0  # right padding only with TE
    batch = ModelInputs(ids, mask)
    losses = []
    for _ in range(3):
        ts.zero_grad()
        rec = forward_backward(
            ts.model,
            state,
            batch,
            kind="policy",
            loss_fn=lambda o, mb: (-(o["logprobs"] * mb.attention_mask[:, 1:]).mean(), {}),
        )
        ok, grad_norm = ts.step()
        assert ok and grad_norm > 0
        losses.append(float(rec[0]["loss"]))
    assert losses[-1] < losses[0]
    return policy


def test_te_spec_bf16_train_step(parallel_1rank, tiny_moe):
    from sao_megatron.optim import PrecisionConfig

    assert parallel_1rank.platform.backend == "nccl"
    if not parallel_1rank.platform.use_te:
        pytest.skip("Transformer Engine not installed (pip install -e '.[gpu]')")
    policy = _train_step(parallel_1rank, tiny_moe, PrecisionConfig(params_dtype="bf16"))
    names = [n for n, _ in policy[0].named_parameters()]
    assert any("layer_norm_weight" in n for n in names)  # TE fused norm+linear


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="FP8 needs Hopper or newer",
)
def test_te_fp8_train_step(parallel_1rank, tiny_moe):
    from sao_megatron.optim import PrecisionConfig

    if not parallel_1rank.platform.use_te:
        pytest.skip("Transformer Engine not installed (pip install -e '.[gpu]')")
    _train_step(parallel_1rank, tiny_moe, PrecisionConfig(params_dtype="bf16", fp8=True))


def test_left_padding_rejected_with_te(parallel_1rank, tiny_moe):
    from sao_megatron.models import ModelInputs, build_policy, compute_policy_logprobs

    if not parallel_1rank.platform.use_te:
        pytest.skip("Transformer Engine not installed")
    policy = build_policy(tiny_moe, parallel_1rank)
    ids = torch.randint(0, 128, (1, 8))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with pytest.raises(ValueError, match="Right-pad"):
        compute_policy_logprobs(policy, parallel_1rank, ModelInputs(ids, mask))
