"""Routing replay on 2 gloo ranks (TP=2 with sequence parallelism, EP=2, PP=2, DP=2) equals the
float64 reference exactly as at 1 rank (fp32 tolerance 1e-5); without replay it does not, and
the global mismatch count equals the 1-rank one."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import launch, tiny_moe_kwargs
from tests.routing import replay_worker
from tests.routing.replay_case import B, T

pytestmark = pytest.mark.distributed

TOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replay")
    launch(replay_worker.worker, 2, str(tmp))
    return [torch.load(tmp / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("layout", list(replay_worker.LAYOUTS))
def test_layout_replays_exactly(results, layout):
    layers = tiny_moe_kwargs()["num_hidden_layers"]
    for rank, res in enumerate(results):
        case, out = res["case"], res[layout]
        assert "error" not in out, f"rank {rank}: {out.get('error')}"
        assert case["num_flips"] > 0
        assert out["replay"] < TOL, (rank, out)
        assert out["plain"] > 100 * TOL, (rank, out)
        compared = B * (T - 1) * layers
        # summed over both ranks, no (token, layer) counted twice or missed
        assert out["plain_counts"] == [case["num_flips"], compared], (rank, out)
        assert out["plain_differs_ok"], (rank, out)  # per-token map, ORed over TP and PP
        assert out["replay_counts"] == [case["num_flips_replayed"], compared], (rank, out)
        if layout == "pp2":
            assert out["local_layers"] == layers // 2
