"""Losses vs per-token loop references, autograd checks, and micro-batch gradient accumulation."""

from __future__ import annotations

import math

import pytest
import torch

from sao_megatron.algorithm.importance import dis_band_weights, tis_weights
from sao_megatron.algorithm.losses import (
    aggregate,
    dis_policy_loss,
    entropy_from_logits,
    entropy_loss,
    kl_loss,
    kl_per_token,
    ppo_clip_loss,
    value_loss,
)
from tests.algorithm.batches import random_batch, random_logprobs

MODES = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]


def ref_aggregate(x, mask, mode, num_tokens=None, num_sequences=None):
    xs, ms = x.tolist(), mask.tolist()
    rows = [[v for v, m in zip(xr, mr, strict=True) if m] for xr, mr in zip(xs, ms, strict=True)]
    if mode == "token_mean":
        n = num_tokens if num_tokens is not None else sum(len(r) for r in rows)
        return sum(sum(r) for r in rows) / max(n, 1)
    s = num_sequences if num_sequences is not None else sum(1 for r in rows if r)
    if mode == "seq_mean_token_mean":
        return sum(sum(r) / len(r) for r in rows if r) / max(s, 1)
    return sum(sum(r) for r in rows) / max(s, 1)


def make(seed):
    bt = random_batch(seed + 40)
    lp, blp = random_logprobs(bt.action_mask, seed)
    g = torch.Generator().manual_seed(seed + 1)
    adv = torch.randn(bt.action_mask.shape, generator=g, dtype=torch.float64)
    # NaN off the mask must never leak into a loss
    adv = torch.where(bt.action_mask, adv, float("nan"))
    return bt.action_mask, lp, blp, adv


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_matches_reference_and_ignores_nan_off_mask(mode):
    mask, lp, _, adv = make(0)
    torch.testing.assert_close(
        aggregate(adv, mask, mode),
        torch.tensor(ref_aggregate(torch.nan_to_num(adv), mask, mode), dtype=torch.float64),
    )
    empty = torch.zeros_like(mask)
    assert aggregate(adv, empty, mode).item() == 0.0
    with pytest.raises(ValueError, match="token_mean"):
        aggregate(adv, mask, "sum")


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("mode", MODES)
def test_dis_loss_value_and_gradient(seed, mode):
    mask, lp, blp, adv = make(seed)
    lp = lp.clone().requires_grad_(True)
    loss = dis_policy_loss(lp, blp, adv, mask, eps_low=0.3, eps_high=5.0, mode=mode)
    f = dis_band_weights(lp, blp, mask, 0.3, 5.0).weights
    per_tok = torch.where(mask, -f * torch.nan_to_num(adv) * lp.detach(), 0.0)
    torch.testing.assert_close(
        loss.detach(), torch.tensor(ref_aggregate(per_tok, mask, mode), dtype=torch.float64)
    )
    (grad,) = torch.autograd.grad(loss, lp)
    # analytic gradient: -m f(r) A / N (token_mean); per-row denominators for the seq modes
    n_b = mask.sum(1, keepdim=True).double()
    rows = (n_b > 0).sum().double()
    denom = {
        "token_mean": mask.sum().double(),
        "seq_mean_token_mean": n_b * rows,
        "seq_mean_token_sum": rows.expand_as(n_b),
    }[mode]
    expect = torch.where(mask, -f * torch.nan_to_num(adv) / denom, 0.0)
    torch.testing.assert_close(grad, expect, rtol=1e-12, atol=1e-15)
    dropped = mask & (f == 0)
    assert dropped.any() and (grad[dropped] == 0).all()  # far-off ratios: no gradient, no NaN


def test_dropped_tokens_stay_in_denominator():
    mask = torch.ones(1, 4, dtype=torch.bool)
    blp = torch.zeros(1, 4, dtype=torch.float64)
    lp = torch.tensor([[0.0, 0.0, 10.0, -10.0]], dtype=torch.float64, requires_grad=True)
    adv = torch.ones(1, 4, dtype=torch.float64)
    loss = dis_policy_loss(lp, blp, adv, mask)
    loss.backward()
    assert lp.grad.tolist() == [[-0.25, -0.25, 0.0, 0.0]]  # divided by 4, not by 2 kept tokens


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("which", ["dis", "ppo", "value"])
def test_micro_batches_sum_to_full_batch_gradient(mode, which):
    """Rows split into micro-batches with different token counts; global denominators passed."""
    mask, lp0, blp, adv = make(7)
    g = torch.Generator().manual_seed(9)
    old = lp0 + 0.1 * torch.randn(lp0.shape, generator=g, dtype=torch.float64)
    ret = torch.randn(lp0.shape, generator=g, dtype=torch.float64)
    num_tokens, num_seqs = int(mask.sum()), int((mask.sum(1) > 0).sum())

    def loss_fn(lp, sl, n_tok, n_seq):
        kw = dict(mode=mode, num_tokens=n_tok, num_sequences=n_seq)
        if which == "dis":
            return dis_policy_loss(lp[sl], blp[sl], adv[sl], mask[sl], **kw)
        if which == "ppo":
            return ppo_clip_loss(lp[sl], old[sl], adv[sl], mask[sl], dual_clip=3.0, **kw)
        return value_loss(lp[sl], old[sl], ret[sl], mask[sl], clip=0.05, **kw)

    full = lp0.clone().requires_grad_(True)
    loss_full = loss_fn(full, slice(None), None, None)
    loss_full.backward()
    acc = lp0.clone().requires_grad_(True)
    total = 0.0
    bounds = [0, 1, 4, 5, 9, mask.shape[0]]  # micro-batches of 1, 3, 1, 4, 3 rows
    sizes = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        part = loss_fn(acc, slice(lo, hi), num_tokens, num_seqs)
        part.backward()
        total += float(part.detach())
        sizes.append(int(mask[lo:hi].sum()))
    assert len(set(sizes)) > 2  # genuinely different token counts
    torch.testing.assert_close(acc.grad, full.grad, rtol=1e-12, atol=1e-14)
    assert math.isclose(total, float(loss_full.detach()), rel_tol=1e-12, abs_tol=1e-14)


def ref_ppo(lp, old, adv, mask, lo, hi, dual, w):
    out = torch.zeros(lp.shape, dtype=torch.float64)
    lp_l, old_l, adv_l, m_l = lp.tolist(), old.tolist(), adv.tolist(), mask.tolist()
    for b in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if not m_l[b][t]:
                continue
            rho = math.exp(max(min(lp_l[b][t] - old_l[b][t], 20.0), -20.0))
            a = adv_l[b][t]
            val = max(-a * rho, -a * min(max(rho, 1 - lo), 1 + hi))
            if dual is not None and a < 0:
                val = min(val, -dual * a)
            out[b, t] = val * (1.0 if w is None else float(w[b, t]))
    return out


@pytest.mark.parametrize("dual", [None, 3.0])
@pytest.mark.parametrize("use_w", [False, True])
def test_ppo_clip_matches_reference(dual, use_w):
    mask, lp, blp, adv = make(3)
    g = torch.Generator().manual_seed(5)
    old = lp + 0.4 * torch.randn(lp.shape, generator=g, dtype=torch.float64)
    old = torch.where(torch.rand(lp.shape, generator=g) < 0.05, lp - 3.0, old)  # big ratios
    w = tis_weights(old, blp, mask, 2.0).weights if use_w else None
    loss = ppo_clip_loss(
        lp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=dual, weights=w
    )
    ref = ref_ppo(lp, old, torch.nan_to_num(adv), mask, 0.2, 0.28, dual, w)
    torch.testing.assert_close(
        loss, torch.tensor(ref_aggregate(ref, mask, "token_mean"), dtype=torch.float64)
    )


def test_ppo_dual_clip_hand_case():
    mask = torch.ones(1, 3, dtype=torch.bool)
    old = torch.zeros(1, 3, dtype=torch.float64)
    lp = torch.tensor([[math.log(10.0), math.log(10.0), math.log(1.1)]], dtype=torch.float64)
    adv = torch.tensor([[-1.0, 1.0, 1.0]], dtype=torch.float64)
    per = [min(max(10.0, 1.2), 3.0), -1.2, -1.1]  # A<0 capped at 3; A>0 clipped at 1.2; inside
    loss = ppo_clip_loss(lp, old, adv, mask, dual_clip=3.0)
    assert math.isclose(float(loss), sum(per) / 3, rel_tol=1e-12)


@pytest.mark.parametrize("clip", [None, 0.1])
def test_value_loss_matches_reference(clip):
    bt = random_batch(50)
    g = torch.Generator().manual_seed(2)
    v = torch.randn(bt.values.shape, generator=g, dtype=torch.float64)
    v_old = v + 0.3 * torch.randn(v.shape, generator=g, dtype=torch.float64)
    r = torch.randn(v.shape, generator=g, dtype=torch.float64)
    got = value_loss(v, v_old, r, bt.action_mask, clip=clip)
    per = torch.zeros(v.shape, dtype=torch.float64)
    for b in range(v.shape[0]):
        for t in range(v.shape[1]):
            vv, vo, rr = float(v[b, t]), float(v_old[b, t]), float(r[b, t])
            if clip is None:
                per[b, t] = 0.5 * (vv - rr) ** 2
            else:
                vc = vo + min(max(vv - vo, -clip), clip)
                per[b, t] = 0.5 * max((vv - rr) ** 2, (vc - rr) ** 2)
    torch.testing.assert_close(
        got, torch.tensor(ref_aggregate(per, bt.action_mask, "token_mean"), dtype=torch.float64)
    )


def test_entropy_from_logits_and_bonus():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 7, generator=g, dtype=torch.float64)
    h = entropy_from_logits(logits)
    for b in range(2):
        for t in range(3):
            z = logits[b, t].tolist()
            s = sum(math.exp(v) for v in z)
            ref = -sum(math.exp(v) / s * math.log(math.exp(v) / s) for v in z)
            assert math.isclose(float(h[b, t]), ref, rel_tol=1e-12)
    assert entropy_from_logits(logits.to(torch.bfloat16)).dtype == torch.float32
    mask = torch.tensor([[1, 0, 1], [0, 0, 0]], dtype=torch.bool)
    bonus = entropy_loss(h, mask, 0.01)
    assert math.isclose(float(bonus), -0.01 * (float(h[0, 0]) + float(h[0, 2])) / 2)


def test_kl_estimators_per_token():
    lp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0, -0.5], dtype=torch.float64)
    blp = torch.tensor([-1.2, -2.5, -0.4], dtype=torch.float64)
    for est in ("k1", "k2", "k3", "k3_is"):
        got = kl_per_token(lp, ref, est, blp)
        for i in range(3):
            x = float(ref[i] - lp[i])
            expect = {
                "k1": -x,
                "k2": 0.5 * x * x,
                "k3": math.exp(x) - 1 - x,
                "k3_is": math.exp(float(lp[i] - blp[i])) * (math.exp(x) - 1 - x),
            }[est]
            assert math.isclose(float(got[i]), expect, rel_tol=1e-12, abs_tol=1e-15)
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        kl_per_token(lp, ref, "k3_is")
    with pytest.raises(ValueError, match="KL estimator .k4."):
        kl_per_token(lp, ref, "k4")


def test_k3_is_is_unbiased_in_value_and_gradient_off_policy():
    """Exact expectation over a categorical: E_{pi_b}[k3_is] = KL(pi_theta || pi_ref), same grad."""
    g = torch.Generator().manual_seed(11)
    theta = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    ref_lp = torch.log_softmax(torch.randn(6, generator=g, dtype=torch.float64), 0)
    b_lp = torch.log_softmax(torch.randn(6, generator=g, dtype=torch.float64), 0)
    lp = torch.log_softmax(theta, 0)
    expectation = (b_lp.exp() * kl_per_token(lp, ref_lp, "k3_is", b_lp)).sum()
    exact = (lp.exp() * (lp - ref_lp)).sum()
    torch.testing.assert_close(expectation, exact)
    g1 = torch.autograd.grad(expectation, theta, retain_graph=True)[0]
    g2 = torch.autograd.grad(exact, theta)[0]
    torch.testing.assert_close(g1, g2)
    # the plain k3 under pi_b is biased off-policy (sanity: the test above can fail)
    plain = (b_lp.exp() * kl_per_token(lp, ref_lp, "k3")).sum()
    assert abs(float(plain.detach()) - float(exact.detach())) > 1e-3


def test_kl_loss_aggregates_action_tokens_only():
    mask, lp, blp, _ = make(6)
    g = torch.Generator().manual_seed(8)
    ref = lp + 0.2 * torch.randn(lp.shape, generator=g, dtype=torch.float64)
    ref = torch.where(mask, ref, float("nan"))  # padding garbage must not leak
    lp = lp.clone().requires_grad_(True)
    got = kl_loss(lp, ref, mask, 0.1, "k3_is", blp)
    per = torch.zeros(lp.shape, dtype=torch.float64)
    for b in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if mask[b, t]:
                x = max(min(float(ref[b, t] - lp.detach()[b, t]), 20.0), -20.0)
                w = math.exp(max(min(float(lp.detach()[b, t] - blp[b, t]), 20.0), -20.0))
                per[b, t] = w * (math.exp(x) - 1 - x)
    expect = 0.1 * ref_aggregate(per, mask, "token_mean")
    assert math.isclose(float(got.detach()), expect, rel_tol=1e-10)
    got.backward()
    assert torch.isfinite(lp.grad).all() and (lp.grad[~mask] == 0).all()
