"""Routing replay at 1 rank: where routing is the only train/inference difference, replaying the
recorded experts makes the trainer's log-probs equal the float64 reference (fp32 tolerance
1e-5), without replay they differ; gradients reach the router through the gate weights."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_moe_kwargs
from tests.routing.reference import forward64, logprobs64
from tests.routing.replay_case import B, T, hf_weights, make_case

TOL = 1e-5  # fp32 trainer vs float64 reference, nats


@pytest.fixture
def setup(parallel_1rank):
    from sao_megatron.models import MoEModelConfig, build_policy

    cfg = MoEModelConfig(**tiny_moe_kwargs())
    (chunk,) = build_policy(cfg, parallel_1rank)
    hf = hf_weights(chunk, cfg)
    return cfg, chunk, hf, make_case(hf, cfg), parallel_1rank


def _logprobs(chunk, st, case, replay_obj=None, replay=False, mbs=2):
    from sao_megatron.models import ModelInputs, compute_policy_logprobs

    inputs = ModelInputs(case["ids"], torch.ones(B, T, dtype=torch.long))
    if replay_obj is None:
        lp, _ = compute_policy_logprobs([chunk], st, inputs, micro_batch_size=mbs)
        return lp
    with replay_obj.session(
        case["ids"], case["recorded"], case["mask"], micro_batch_size=mbs, replay=replay
    ):
        lp, _ = compute_policy_logprobs([chunk], st, inputs, micro_batch_size=mbs)
    return lp


def test_replay_matches_reference_and_no_replay_does_not(setup):
    from sao_megatron.models.routing_replay import RoutingReplay

    cfg, chunk, hf, case, st = setup
    assert 0.05 < case["flip_frac"] < 0.6, case["flip_frac"]  # routing really differs
    plain = _logprobs(chunk, st, case)
    # the trainer computes the float64 model's own routing (no near-tie flips at fp32 here)
    assert (plain.double() - case["natural_lp"]).abs().max() < TOL
    rr = RoutingReplay([chunk])
    assert rr.num_local_layers == cfg.num_hidden_layers
    observed = _logprobs(chunk, st, case, rr, replay=False)
    assert torch.equal(observed, plain)  # observing changes nothing, bit for bit
    mism, comp = rr.take_counts()
    assert torch.equal(rr.last_differs, case["differs_any"])
    assert comp == B * (T - 1) * cfg.num_hidden_layers
    assert mism == case["num_flips"] and mism / comp == pytest.approx(case["flip_frac"])
    replayed = _logprobs(chunk, st, case, rr, replay=True)
    err_replay = float((replayed.double() - case["ref_lp"]).abs().max())
    err_plain = float((plain.double() - case["ref_lp"]).abs().max())
    print(f"max |lp - ref|: replay {err_replay:.2e}, without replay {err_plain:.2e}")
    assert err_replay < TOL
    assert err_plain > 100 * TOL  # routing alone moves log-probs far beyond fp32 noise
    # the trainer's own routing is still measured while replaying (on the replayed inputs)
    assert rr.take_counts() == (case["num_flips_replayed"], comp)
    # micro-batching does not matter (one micro-batch, or one row each)
    for mbs in (1, 4):
        again = _logprobs(chunk, st, case, rr, replay=True, mbs=mbs)
        assert float((again.double() - case["ref_lp"]).abs().max()) < TOL
    rr.remove()
    assert torch.equal(_logprobs(chunk, st, case), plain)


def test_replay_gradient_reaches_the_router(setup):
    """d(sum of log-probs)/d(router weight) under replay = the float64 reference's gradient
    with the same forced routing (gate weights softmax(logits[recorded]))."""
    from sao_megatron.models import causal_padding_mask, token_logprobs_and_entropy
    from sao_megatron.models.routing_replay import RoutingReplay

    cfg, chunk, hf, case, st = setup
    ids = case["ids"]
    rr = RoutingReplay([chunk])
    pos = torch.arange(T).expand(B, T)
    mask = causal_padding_mask(torch.ones(B, T))
    with rr.session(ids, case["recorded"], case["mask"], micro_batch_size=B, replay=True):
        logits = chunk(ids, pos, mask)
    lp, _ = token_logprobs_and_entropy(logits[:, :-1], ids[:, 1:], 1.0)
    lp.sum().backward()
    name = "decoder.layers.0.mlp.router.weight"
    got = dict(chunk.named_parameters())[name].grad.double()

    ref = {k: v.double() for k, v in hf.items()}
    gate = ref["model.layers.0.mlp.gate.weight"].requires_grad_(True)
    logits64, _, _ = forward64(ref, cfg, ids, routing=(case["recorded"], case["mask"]))
    logprobs64(logits64, ids).sum().backward()
    assert gate.grad.abs().max() > 1e-3
    assert (got - gate.grad).abs().max() < 1e-4 * max(1.0, float(gate.grad.abs().max()))


def test_mismatched_rows_are_refused(setup):
    from sao_megatron.models.routing_replay import RoutingReplay

    _, chunk, _, case, st = setup
    rr = RoutingReplay([chunk])
    with pytest.raises(ValueError, match="do not match the batch"):
        with rr.session(
            case["ids"], case["recorded"][:, :-1], case["mask"], micro_batch_size=2, replay=True
        ):
            pass
