"""Importance weights vs per-token loop references, including ratios far outside every band."""

from __future__ import annotations

import math

import pytest
import torch

from sao_megatron.algorithm.config import ImportanceConfig
from sao_megatron.algorithm.importance import (
    decoupled_ppo_weights,
    dis_band_weights,
    importance_weights,
    masked_is_weights,
    seq_geo_mask_weights,
    tis_weights,
)
from tests.algorithm.batches import random_batch, random_logprobs


def per_token_ref(lp, blp, mask, fn):
    """Apply fn(r) -> (weight, keep) to each action token in a python loop."""
    w = [[0.0] * lp.shape[1] for _ in range(lp.shape[0])]
    keep = [[False] * lp.shape[1] for _ in range(lp.shape[0])]
    lp_l, blp_l, m_l = lp.tolist(), blp.tolist(), mask.tolist()
    for b in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if m_l[b][t]:
                d = lp_l[b][t] - blp_l[b][t]
                r = math.exp(d) if d < 700 else math.inf
                w[b][t], keep[b][t] = fn(r, d)
    return torch.tensor(w, dtype=torch.float64), torch.tensor(keep, dtype=torch.bool)


@pytest.fixture(params=[0, 1, 2])
def inputs(request):
    bt = random_batch(request.param + 20)
    lp, blp = random_logprobs(bt.action_mask, request.param)
    return lp, blp, bt.action_mask


@pytest.mark.parametrize("eps_low,eps_high", [(0.3, 5.0), (0.8, 3.0), (0.1, 0.1)])
def test_dis_band(inputs, eps_low, eps_high):
    lp, blp, mask = inputs
    out = dis_band_weights(lp, blp, mask, eps_low, eps_high)

    def f(r, _d):
        inside = 1 - eps_low < r < 1 + eps_high
        return (r if inside else 0.0), inside

    w, keep = per_token_ref(lp, blp, mask, f)
    torch.testing.assert_close(out.weights, w)
    assert torch.equal(out.keep, keep)
    assert (~keep & mask).any() and keep.any()  # some dropped (r far out), some kept
    assert torch.isfinite(out.weights).all()


def test_dis_band_is_open_interval_and_stop_gradient():
    blp = torch.zeros(1, 4, dtype=torch.float64)
    r = torch.tensor([[0.7, 0.7000001, 5.9999, 6.0]], dtype=torch.float64)
    lp = r.log().requires_grad_(True)
    out = dis_band_weights(lp, blp, torch.ones(1, 4, dtype=torch.bool), 0.3, 5.0)
    assert out.keep.tolist() == [[False, True, True, False]]
    assert not out.weights.requires_grad


def test_tis(inputs):
    lp, blp, mask = inputs
    out = tis_weights(lp, blp, mask, cap=2.0)
    w, keep = per_token_ref(lp, blp, mask, lambda r, d: (min(math.exp(min(d, 20.0)), 2.0), True))
    torch.testing.assert_close(out.weights, w)
    assert torch.equal(out.keep, keep)


def test_masked_is(inputs):
    lp, blp, mask = inputs
    out = masked_is_weights(lp, blp, mask, beta=1.5)
    w, keep = per_token_ref(
        lp, blp, mask, lambda r, d: (r, True) if 1 / 1.5 <= r <= 1.5 else (0.0, False)
    )
    torch.testing.assert_close(out.weights, w)
    assert torch.equal(out.keep, keep)


@pytest.mark.parametrize("cap", [None, 3.0])
def test_decoupled_ppo(inputs, cap):
    lp, blp, mask = inputs
    out = decoupled_ppo_weights(lp, blp, mask, cap)

    def f(_r, d):
        w = math.exp(min(d, 20.0))
        return (w if cap is None else min(w, cap)), True

    w, _ = per_token_ref(lp, blp, mask, f)
    torch.testing.assert_close(out.weights, w)
    assert torch.isfinite(out.weights).all()


def test_seq_geo_mask():
    bt = random_batch(33)
    mask = bt.action_mask
    lp, blp = random_logprobs(mask, 4, spread=0.02)
    lp = torch.where(torch.rand(mask.shape) < 0.02, lp + 5.0, lp)  # push a few rows out
    low, high = 0.98, 1.02
    out = seq_geo_mask_weights(lp, blp, mask, low, high)
    ref = torch.zeros(mask.shape, dtype=torch.bool)
    kept_rows = dropped_rows = 0
    for b in range(mask.shape[0]):
        ts = [t for t in range(mask.shape[1]) if mask[b, t]]
        if not ts:
            continue
        geo = math.exp(sum(float(lp[b, t] - blp[b, t]) for t in ts) / len(ts))
        if low <= geo <= high:
            kept_rows += 1
            for t in ts:
                ref[b, t] = True
        else:
            dropped_rows += 1
    assert torch.equal(out.keep, ref)
    torch.testing.assert_close(out.weights, ref.double())
    assert kept_rows and dropped_rows


@pytest.mark.parametrize(
    "kind", ["dis_band", "tis", "masked_is", "seq_geo_mask", "decoupled_ppo", "none"]
)
def test_dispatch_selects_each_variant(inputs, kind):
    lp, blp, mask = inputs
    cfg = ImportanceConfig(weighting=kind, decoupled_weight_cap=4.0)
    got = importance_weights(cfg, lp, blp, mask)
    expect = {
        "dis_band": lambda: dis_band_weights(lp, blp, mask, cfg.eps_low, cfg.eps_high),
        "tis": lambda: tis_weights(lp, blp, mask, cfg.tis_cap),
        "masked_is": lambda: masked_is_weights(lp, blp, mask, cfg.mis_beta),
        "seq_geo_mask": lambda: seq_geo_mask_weights(
            lp, blp, mask, cfg.seq_geo_low, cfg.seq_geo_high
        ),
        "decoupled_ppo": lambda: decoupled_ppo_weights(lp, blp, mask, 4.0),
        "none": None,
    }[kind]
    if expect is None:
        torch.testing.assert_close(got.weights, mask.double())
    else:
        torch.testing.assert_close(got.weights, expect().weights)
