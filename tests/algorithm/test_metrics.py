"""Deviation metrics and explained variance vs plain-loop float64 references."""

from __future__ import annotations

import math

import pytest
import torch

from sao_megatron.algorithm.metrics import explained_variance, off_policy_metrics
from tests.algorithm.batches import random_batch, random_logprobs


def test_off_policy_metrics_match_reference():
    bt = random_batch(60)
    mask = bt.action_mask
    lp, blp = random_logprobs(mask, 6, spread=0.2)
    lp = torch.where(lp - blp > 5, blp + 2.5, lp)  # keep r finite for the chi-square reference
    g = torch.Generator().manual_seed(1)
    versions = torch.randint(3, 9, mask.shape, generator=g)
    versions = torch.where(mask, versions, -1)  # -1 off action: must not enter the lag
    adv = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    adv = torch.where(mask, adv, 99.0)  # off action: must not count
    got = off_policy_metrics(
        lp,
        blp,
        mask,
        eps_low=0.3,
        eps_high=5.0,
        policy_versions=versions,
        train_version=10,
        advantages=adv,
    )
    d = [
        float(lp[b, t] - blp[b, t])
        for b in range(mask.shape[0])
        for t in range(mask.shape[1])
        if mask[b, t]
    ]
    lags = [
        10 - int(versions[b, t])
        for b in range(mask.shape[0])
        for t in range(mask.shape[1])
        if mask[b, t]
    ]
    advs = [
        float(adv[b, t]) for b in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[b, t]
    ]
    n = len(d)
    r = [math.exp(x) for x in d]
    against = sum(
        1 for x, a in zip(r, advs, strict=True) if (a > 0 and x <= 0.7) or (a < 0 and x >= 6.0)
    )
    ref = {
        "num_action_tokens": n,
        "mean_abs_one_minus_ratio": sum(abs(1 - x) for x in r) / n,
        "mean_abs_logprob_diff": sum(abs(x) for x in d) / n,
        "mismatch_kl": sum(-x for x in d) / n,
        "k3": sum(x - 1 - math.log(x) for x in r) / n,
        "chi_square": sum((x - 1) ** 2 for x in r) / n,
        "ess": sum(r) ** 2 / (n * sum(x * x for x in r)),
        "fraction_dropped": sum(1 for x in r if not (0.7 < x < 6.0)) / n,
        "version_lag_mean": sum(lags) / n,
        "version_lag_max": max(lags),
        "fraction_dropped_against_advantage": against / n,
    }
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert math.isclose(got[k], v, rel_tol=1e-10, abs_tol=1e-12), k
    assert 0 < got["fraction_dropped"] < 1 and 0 < got["ess"] <= 1
    assert 0 < got["fraction_dropped_against_advantage"] < got["fraction_dropped"]


def test_on_policy_metrics_are_exact():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    lp = torch.tensor([[-1.0, -2.0, 5.0], [0.0, 0.0, 0.0]])
    got = off_policy_metrics(lp, lp, mask)
    assert got["mean_abs_one_minus_ratio"] == 0 and got["k3"] == 0 and got["ess"] == 1
    assert got["fraction_dropped"] == 0 and got["num_action_tokens"] == 2


def test_empty_batch_reports_nan_and_versions_need_train_version():
    mask = torch.zeros(2, 3, dtype=torch.bool)
    lp = torch.zeros(2, 3)
    got = off_policy_metrics(lp, lp, mask)
    assert got["num_action_tokens"] == 0 and math.isnan(got["ess"])
    with pytest.raises(ValueError, match="train_version"):
        off_policy_metrics(lp, lp, mask, policy_versions=torch.zeros(2, 3, dtype=torch.long))


def test_explained_variance():
    g = torch.Generator().manual_seed(3)
    ret = torch.randn(4, 6, generator=g, dtype=torch.float64)
    v = ret + 0.5 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    mask = torch.rand(4, 6, generator=g) < 0.6
    ys = [float(ret[b, t]) for b in range(4) for t in range(6) if mask[b, t]]
    res = [float(ret[b, t] - v[b, t]) for b in range(4) for t in range(6) if mask[b, t]]

    def var(xs):
        m = sum(xs) / len(xs)
        return sum((x - m) ** 2 for x in xs) / len(xs)

    assert math.isclose(explained_variance(v, ret, mask), 1 - var(res) / var(ys), rel_tol=1e-12)
    assert explained_variance(ret, ret, mask) == 1.0
    assert math.isnan(explained_variance(v, torch.ones_like(ret), mask))
    assert math.isnan(explained_variance(v, ret, torch.zeros_like(mask)))
