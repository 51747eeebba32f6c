"""Each CPU workaround is needed: without it the upstream Megatron-Core call fails on CPU; with
it the same call succeeds. (The two gloo multi-rank workarounds are covered in
tests/parallel/test_layouts.py.)"""

from __future__ import annotations

import pytest
import torch

from sao_megatron.platform import cpu_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only workarounds")


def _policy_train_step(state, model_cfg, params_dtype="fp32"):
    """Build policy + DDP + Megatron optimiser, run forward/backward (alltoall MoE), step."""
    from sao_megatron.models import ModelInputs, build_policy, forward_backward
    from sao_megatron.optim import OptimizerConfig, PrecisionConfig, build_optimizer

    precision = PrecisionConfig(params_dtype=params_dtype)
    policy = build_policy(model_cfg, state, precision)
    ts = build_optimizer(policy, state, OptimizerConfig(lr=1e-3, clip_grad=1.0), precision)
    ids = torch.randint(0, model_cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    batch = ModelInputs(ids, torch.ones_like(ids))
    ts.zero_grad()
    recs = forward_backward(
        ts.model, state, batch, kind="policy", loss_fn=lambda o, mb: (-o["logprobs"].mean(), {})
    )
    ok, grad_norm = ts.step()
    assert ok and grad_norm > 0
    return float(recs[0]["loss"])


@pytest.fixture
def without(parallel_1rank):
    """Context: remove one workaround, restore all afterwards."""
    removed = []

    def remove(name):
        cpu_compat.disable_cpu_compat([name])
        removed.append(name)

    yield remove
    cpu_compat.enable_cpu_compat()
    assert set(cpu_compat.active_workarounds()) == set(cpu_compat.WORKAROUNDS)


def test_all_workarounds_active_and_train_step_runs(parallel_1rank, tiny_moe):
    assert set(cpu_compat.active_workarounds()) == set(cpu_compat.WORKAROUNDS)
    loss = _policy_train_step(parallel_1rank, tiny_moe)
    assert 0 < loss < 10  # -mean log-prob of random tokens, about log(128) = 4.85


@pytest.mark.parametrize(
    "workaround, match",
    [
        ("patch_cuda_device_queries", "CUDA|cuda|accelerator"),
        ("map_cuda_tensors_to_cpu", "CUDA|cuda|accelerator"),
        ("replace_cuda_streams_and_events", "CUDA|cuda|Stream"),
        ("define_missing_te_general_gemm", "te_general_gemm"),
    ],
)
def test_train_step_fails_without(without, parallel_1rank, tiny_moe, workaround, match):
    without(workaround)
    with pytest.raises((RuntimeError, AssertionError, NameError, AttributeError), match=match):
        _policy_train_step(parallel_1rank, tiny_moe)


def test_rng_tracker_needed(without):
    from megatron.core import tensor_parallel

    without("install_cpu_rng_tracker")
    with pytest.raises((RuntimeError, AssertionError), match="CUDA|cuda|accelerator"):
        tensor_parallel.model_parallel_cuda_manual_seed(123, force_reset_rng=True)
    cpu_compat.enable_cpu_compat()
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    with tracker.fork():
        a = torch.rand(3)
    with tracker.fork():
        b = torch.rand(3)
    assert not torch.equal(a, b)  # the forked stream advances
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    with tracker.fork():
        assert torch.equal(torch.rand(3), a)  # and is reproducible from the seed


def test_cuda_tensor_type_report_needed(without, parallel_1rank, tiny_moe):
    without("report_cuda_tensor_types_to_optimizer")
    with pytest.raises(TypeError, match="torch.cuda"):
        _policy_train_step(parallel_1rank, tiny_moe, params_dtype="bf16")


def test_tensor_type_spoof_only_for_megatron_optimizer(parallel_1rank):
    assert "report_cuda_tensor_types_to_optimizer" in cpu_compat.active_workarounds()
    assert torch.zeros(1).type() == "torch.FloatTensor"
    assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.BFloat16Tensor"


def test_device_mapping():
    cpu_compat.enable_cpu_compat()
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.ones(2).cuda().device.type == "cpu"
    assert torch.ones(2).to("cuda").device.type == "cpu"
    assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"


def test_enable_is_idempotent_and_validates_names():
    names = cpu_compat.enable_cpu_compat()
    assert cpu_compat.enable_cpu_compat() == names
    with pytest.raises(ValueError, match="no_such_workaround"):
        cpu_compat.enable_cpu_compat(exclude=["no_such_workaround"])


def test_noop_on_cuda_machine(monkeypatch):
    cpu_compat.disable_cpu_compat()
    try:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        assert cpu_compat.enable_cpu_compat() == ()
        assert cpu_compat.active_workarounds() == ()
    finally:
        monkeypatch.undo()
        cpu_compat.enable_cpu_compat()
