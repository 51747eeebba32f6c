"""tools/bench_mfu.py: the analytic FLOP counter against torch's FlopCounterMode on real Megatron
models (1 rank), and a hand count for a tiny config."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from sao_megatron.models import (
    VALUE_DEFAULT_FREEZE_PATTERNS,
    ModelInputs,
    apply_freeze,
    build_policy,
    build_value_model,
    forward_backward,
)

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_mfu", ROOT / "tools" / "bench_mfu.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_mfu"] = bench  # dataclasses look their module up there
_spec.loader.exec_module(bench)

ROWS, SEQ, MBS = 4, 12, 2


def _inputs() -> ModelInputs:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 100, (ROWS, SEQ), generator=g)
    return ModelInputs(input_ids=ids, attention_mask=torch.ones(ROWS, SEQ, dtype=torch.bool))


def _counted(model, parallel, kind: str, forward_only: bool) -> int:
    """Matmul FLOPs torch counts for one forward (+ backward) over the batch in micro-batches."""
    key = "logprobs" if kind == "policy" else "values"

    def loss_fn(outputs, mb):
        return outputs[key].sum(), {}

    with FlopCounterMode(display=False) as counter:
        forward_backward(
            model,
            parallel,
            _inputs(),
            kind=kind,
            loss_fn=None if forward_only else loss_fn,
            micro_batch_size=MBS,
            forward_only=forward_only,
        )
    return counter.get_total_flops()


def _named(chunks):
    return [(n, p) for c in chunks for n, p in c.named_parameters()]


def _check_model(cfg, parallel):
    policy = build_policy(cfg, parallel)
    value = build_value_model(cfg, parallel)
    apply_freeze(value, VALUE_DEFAULT_FREEZE_PATTERNS)
    pf = bench.trainable_fractions(_named(policy))
    vf = bench.trainable_fractions(_named(value))
    assert pf["attn_qkv"] == pf["lm_head"] == pf["expert_fc1"] == 1.0
    assert vf["attn_qkv"] == vf["attn_proj"] == 0.0
    assert vf["router"] == vf["expert_fc2"] == vf["value_head"] == 1.0
    assert vf["_layer0_input_grad"] == 1.0  # layer 0's input norm trains in the critic
    for kind, model, frac in (("policy", policy, pf), ("value", value, vf)):
        fwd = sum(bench.forward_flops(cfg, ROWS, SEQ, kind).values())
        bwd = sum(bench.backward_flops(cfg, ROWS, SEQ, kind, frac).values())
        assert _counted(model, parallel, kind, forward_only=True) == fwd, kind
        assert _counted(model, parallel, kind, forward_only=False) == fwd + bwd, kind
    return pf, vf


def test_flops_match_flop_counter(tiny_moe, parallel_1rank):
    pf, vf = _check_model(tiny_moe, parallel_1rank)
    # the SAO phases: K value updates (the first gives V_old), a no-grad value forward, one
    # policy update; with lam_value != 1 one no-grad forward more before the updates
    fl = bench.step_flops(tiny_moe, ROWS, SEQ, 2, pf, vf)
    fv = sum(bench.forward_flops(tiny_moe, ROWS, SEQ, "value").values())
    bv = sum(bench.backward_flops(tiny_moe, ROWS, SEQ, "value", vf).values())
    assert fl["value_phase"] == 3 * fv + 2 * bv
    with_targets = bench.step_flops(tiny_moe, ROWS, SEQ, 2, pf, vf, targets_forward=True)
    assert with_targets["value_phase"] == 4 * fv + 2 * bv
    assert fl["train_step"] == fl["value_phase"] + fl["policy_update"]
    assert fl["value_step"] == 2 * fv + 2 * bv  # pre-training: no forward after its updates


def test_flops_match_with_shared_expert_and_dense_layer(tiny_moe, parallel_1rank):
    cfg = dataclasses.replace(
        tiny_moe,
        shared_expert_intermediate_size=24,
        shared_expert_gate=True,
        mlp_only_layers=[0],
        intermediate_size=48,
        qk_layernorm=False,
    )
    _check_model(cfg, parallel_1rank)


def test_hand_count():
    """A 1-layer config counted by hand: t = 2 rows x 8 tokens = 16 positions."""
    from sao_megatron.models import MoEModelConfig

    cfg = MoEModelConfig(
        vocab_size=10,
        hidden_size=4,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=3,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=5,
    )
    t = 16
    per_token = 2 * (4 * (2 + 2 * 1) * 3 + 2 * 3 * 4 + 4 * 4 + 2 * (4 * 2 * 5 + 5 * 4) + 4 * 10)
    attn = 2 * 2 * (8 * 8) * 2 * 3 * 2  # QK^T and AV over the full 8x8 square, 2 heads, 2 rows
    fwd = bench.forward_flops(cfg, 2, 8, "policy")
    assert sum(fwd.values()) == t * per_token + attn
    everything = {k: 1.0 for k in bench.COMPONENT_WEIGHTS} | {"_layer0_input_grad": 1.0}
    assert sum(bench.backward_flops(cfg, 2, 8, "policy", everything).values()) == pytest.approx(
        2 * sum(fwd.values()), rel=0, abs=0
    )
    frozen_attn = everything | {"attn_qkv": 0.0, "attn_proj": 0.0, "_layer0_input_grad": 0.0}
    vf = bench.forward_flops(cfg, 2, 8, "value")
    want = 2 * sum(vf.values()) - vf["attn_qkv"] - vf["attn_proj"] - vf["attn_qkv"]
    assert sum(bench.backward_flops(cfg, 2, 8, "value", frozen_attn).values()) == want


def test_aggregate_is_time_weighted():
    gemms = [bench.Gemm("a", 2, 3, 4, uses=3), bench.Gemm("b", 5, 6, 7, uses=1)]
    rates = {"a": 1e9, "b": 4e9}
    secs = 3 * gemms[0].flops / 1e9 + gemms[1].flops / 4e9
    assert bench.aggregate(gemms, rates) == pytest.approx((3 * 48 + 420) / secs)
    assert bench.aggregate(gemms, {"a": 1e9, "b": "n/a (no CUDA)"}) == "n/a"


def test_sao_phases_match_flop_counter(monkeypatch, parallel_1rank):
    """Everything RLStep.train_step / value_step multiplies, minus the advantage scan (not model
    FLOPs), equals `step_flops`: (K + 1) value forwards, K value backwards, 1 policy update
    (lam_value = 1: no forward before the value updates); a value pre-training step K value
    forwards and backwards (no forward after its updates)."""
    from sao_megatron.configs import load_config
    from sao_megatron.trainer.job import JobConfig
    from tests.conftest import tiny_moe_kwargs

    model = {**tiny_moe_kwargs(), "vocab_size": 300}
    overrides = [f"model.{k}={v}" for k, v in model.items()] + [
        "tokenizer.vocab_size=300",
        "rollout.max_tokens_per_action=16",
    ]
    job = load_config(JobConfig, None, overrides)
    policy, value, step, batch = bench.build_trainer(job, parallel_1rank, 4, 16, 2)
    pf = bench.trainable_fractions(_named(policy.unwrapped))
    vf = bench.trainable_fractions(_named(value.unwrapped))
    k = job.algorithm.sao.value_updates_per_policy_update
    assert k == 2
    want = bench.step_flops(job.model, 4, 16, k, pf, vf)

    scan_flops = []

    def counted(original):
        def call(*args, **kwargs):
            with FlopCounterMode(display=False) as inner:  # nested: the outer one sees it too
                out = original(*args, **kwargs)
            scan_flops.append(inner.get_total_flops())
            return out

        return call

    for name in ("advantages", "value_targets"):  # the GAE scans: not model FLOPs
        monkeypatch.setattr(step.algorithm, name, counted(getattr(step.algorithm, name)))
    for phase in ("train_step", "value_step"):
        scan_flops.clear()
        with FlopCounterMode(display=False) as outer:
            if phase == "train_step":
                step.train_step(batch, train_version=0)
            else:
                step.value_step(batch)
        assert scan_flops, "the advantage scan ran outside the counted call"
        assert outer.get_total_flops() - sum(scan_flops) == want[phase], phase


def test_grpo_step_matches_flop_counter(parallel_1rank):
    """A GRPO RLStep.train_step multiplies exactly `grpo_step_flops` (old log-probs forward +
    policy update), on the grouped synthetic batch the benchmark times next to SAO's step."""
    from sao_megatron.configs import load_config
    from sao_megatron.trainer.job import JobConfig
    from tests.conftest import tiny_moe_kwargs

    model = {**tiny_moe_kwargs(), "vocab_size": 300}
    overrides = [f"model.{k}={v}" for k, v in model.items()] + [
        "tokenizer.vocab_size=300",
        "rollout.max_tokens_per_action=16",
    ]
    job = load_config(JobConfig, None, overrides)  # SAO job; GRPO takes its default G = 8
    group = job.algorithm.grpo.group_size
    assert group == 8
    policy, _, _, batch = bench.build_trainer(job, parallel_1rank, 16, 16, 4, group_size=group)
    assert sorted(set(batch.task_ids)) == ["bench0", "bench1"]
    grpo = bench.build_grpo_step(job, parallel_1rank, policy, 4)
    assert grpo.algorithm.name == "grpo"
    pf = bench.trainable_fractions(_named(policy.unwrapped))
    want = bench.grpo_step_flops(job.model, 16, 16, pf)
    with FlopCounterMode(display=False) as counter:
        metrics = grpo.train_step(batch, train_version=0)
    # GRPO's group statistics are a handful of scalar ops the counter does not see (no matmul)
    assert counter.get_total_flops() == want
    assert "time/old_logprobs" in metrics and "time/policy" in metrics
