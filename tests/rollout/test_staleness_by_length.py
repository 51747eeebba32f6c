"""Per-episode-length staleness metrics (issue 31.8): for each turns bucket, the fraction of
action tokens within the bound and the episode count, checked against a hand-computed batch."""

from __future__ import annotations

import pytest
import torch

from sao_megatron.rollout.staleness import (
    LENGTH_BUCKETS,
    in_bound_by_length,
    in_bound_by_length_sums,
    stale_token_mask,
)

F = "rollout/staleness/in_bound_fraction/turns_"
N = "rollout/staleness/num_episodes/turns_"

# train version 5, max_staleness 1: versions 4 and 5 are within the bound, 3 and older are not.
# Rows (-1: not an action token); trajectory 1 is windowed (one row per node), row 5 is padding.
VERSIONS = torch.tensor(
    [
        [-1, 5, 5, -1, -1, -1],  # traj 0, 1 turn: 2 tokens, 2 in bound
        [-1, 3, 3, -1, 4, -1],  # traj 1, 3 turns (rows 1-2): 3 tokens, 1 in bound
        [-1, -1, 5, 5, -1, -1],  # traj 1: 2 tokens, 2 in bound
        [-1, 3, -1, -1, -1, -1],  # traj 2, 1 turn: 1 token, 0 in bound
        [-1, 2, 2, 3, 4, 5],  # traj 3, 300 turns: 5 tokens, 2 in bound
        [-1, -1, -1, -1, -1, -1],  # padding
    ]
)
ROW_TRAJECTORY = torch.tensor([0, 1, 1, 2, 3, -1])
NUM_NODES = torch.tensor([1, 3, 1, 300])


def _sums(versions, row_trajectory, num_nodes, max_staleness=1):
    stale = stale_token_mask(versions, 5, max_staleness)
    return in_bound_by_length_sums(stale, versions >= 0, row_trajectory, num_nodes)


def test_hand_computed_batch():
    m = in_bound_by_length(_sums(VERSIONS, ROW_TRAJECTORY, NUM_NODES))
    assert m == {
        N + "1": 2.0,  # trajectories 0 and 2
        F + "1": 2 / 3,  # (2 + 0) / (2 + 1)
        N + "2-4": 1.0,
        F + "2-4": 3 / 5,  # (1 + 2) / (3 + 2), over both rows of trajectory 1
        N + "257-inf": 1.0,
        F + "257-inf": 2 / 5,
    }  # buckets 5-16, 17-64, 65-256 hold no episode: not logged


def test_bucket_edges():
    """Each bucket holds exactly the turns counts of its name."""
    edges = [1, 2, 4, 5, 16, 17, 64, 65, 256, 257, 10_000]
    versions = torch.full((len(edges), 2), 5)
    m = in_bound_by_length(_sums(versions, torch.arange(len(edges)), torch.tensor(edges)))
    counts = {k.removeprefix(N): v for k, v in m.items() if k.startswith(N)}
    assert counts == {"1": 1, "2-4": 2, "5-16": 2, "17-64": 2, "65-256": 2, "257-inf": 2}
    assert [name for name, _, _ in LENGTH_BUCKETS] == list(counts)
    for name, lo, hi in LENGTH_BUCKETS:
        assert name == (f"{lo}" if lo == hi else f"{lo}-{hi if hi else 'inf'}")


def test_sums_add_over_data_parallel_ranks():
    """Two ranks' counts summed give the whole batch's metrics (every bucket on every rank)."""
    whole = _sums(VERSIONS, ROW_TRAJECTORY, NUM_NODES)
    rank0 = _sums(VERSIONS[:3], torch.tensor([0, 1, 1]), NUM_NODES[:2])
    rank1 = _sums(VERSIONS[3:], torch.tensor([0, 1, -1]), NUM_NODES[2:])
    assert set(rank0) == set(rank1) == set(whole)
    assert {k: rank0[k] + rank1[k] for k in whole} == whole


def test_without_stale_tokens_everything_is_in_bound():
    m = in_bound_by_length(_sums(VERSIONS, ROW_TRAJECTORY, NUM_NODES, max_staleness=3))
    assert [v for k, v in m.items() if k.startswith(F)] == [1.0, 1.0, 1.0]


def test_bad_input_names_the_problem():
    stale = torch.zeros(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"row_trajectory \(3,\)"):
        in_bound_by_length_sums(stale, stale, torch.tensor([0, 1, 2]), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="num_nodes holds 0"):
        in_bound_by_length_sums(stale, stale, torch.tensor([0, 1]), torch.tensor([1, 0]))
