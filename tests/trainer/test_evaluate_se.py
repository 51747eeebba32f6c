"""The held-out success rate comes with its binomial standard error sqrt(p (1 - p) / n)."""

import math

import pytest

from sao_megatron.trainer.evaluate import _summarise
from tests.trainer.test_evaluate_summary import _traj


def test_success_se_is_the_binomial_standard_error_over_all_tasks():
    results = [("chain_sum", _traj([1.0], {"success": True})) for _ in range(3)]
    results += [("chain_sum", _traj([0.0], {"success": False})) for _ in range(4)]
    results += [("chain_sum", None)]  # an episode error: unsolved, counted in n
    out = _summarise(results, ["chain_sum"], threshold=1.0)
    p = 3 / 8
    assert out["eval/chain_sum/success_rate"] == pytest.approx(p)
    assert out["eval/chain_sum/success_se"] == pytest.approx(math.sqrt(p * (1 - p) / 8))
    assert out["eval/chain_sum/success_se"] == pytest.approx(0.171163, abs=1e-6)
    all_solved = _summarise(results[:3], ["chain_sum"], threshold=1.0)
    assert all_solved["eval/chain_sum/success_se"] == 0.0
