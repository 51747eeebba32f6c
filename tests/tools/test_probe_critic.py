"""tools/probe_critic.py: the ridge probe's held-out explained variance against a float64
least-squares reference, and its limits (a target the features carry, one they do not)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
_spec = importlib.util.spec_from_file_location("probe_critic", ROOT / "tools" / "probe_critic.py")
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)


def test_ridge_ev_matches_least_squares_and_bounds():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 5, generator=g, dtype=torch.float64)
    w = torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0], dtype=torch.float64)
    noise = 0.5 * torch.randn(400, generator=g, dtype=torch.float64)
    y = x @ w + 2.0 + noise
    xtr, ytr, xte, yte = x[:300], y[:300], x[300:], y[300:]
    # reference: ordinary least squares with an intercept column, scored on the held-out part
    a = torch.cat([xtr, torch.ones(300, 1, dtype=torch.float64)], 1)
    coef = torch.linalg.lstsq(a, ytr[:, None]).solution[:, 0]
    pred = torch.cat([xte, torch.ones(100, 1, dtype=torch.float64)], 1) @ coef
    ref = 1 - float((yte - pred).var(unbiased=False) / yte.var(unbiased=False))
    assert probe.ridge_ev(xtr, ytr, xte, yte, 1e-9) == pytest.approx(ref, abs=1e-9)
    # the noise share bounds it: Var[w.x] / (Var[w.x] + 0.25) = 14.25 / 14.5
    assert ref == pytest.approx(14.25 / 14.5, abs=0.03)
    # features unrelated to the target explain nothing on held-out rows
    z = torch.randn(400, 5, generator=g, dtype=torch.float64)
    assert probe.ridge_ev(z[:300], ytr, z[300:], yte, 1e-3) < 0.05
