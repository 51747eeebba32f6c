"""The train step's local-batch layout (`sao_megatron.trainer.step_batch`) on a hand-built batch:
padding rows and their removal, streams back to rows, the bootstrap positions and values."""

import torch

from sao_megatron.data.batch import TrainBatch, gather_to_streams
from sao_megatron.trainer.step_batch import (
    last_action_tokens,
    last_state_values,
    pad_rows,
    real_rows,
    stale_tokens,
    to_padded,
    values_at_tokens,
)


def _batch() -> TrainBatch:
    """4 rows of 6 tokens, 3 trajectories: trajectory 0 on rows 0 and 1 (a windowed context per
    node), trajectory 1 on row 2 with no action token, trajectory 2 on row 3."""
    action = torch.tensor(
        [
            [0, 0, 1, 1, 0, 0],  # traj 0, node 0: actions at 2, 3
            [0, 0, 0, 1, 1, 1],  # traj 0, node 1: actions at 3..5 (the last one: row 1, pos 5)
            [0, 0, 0, 0, 0, 0],  # traj 1: prompt only
            [0, 1, 0, 1, 0, 0],  # traj 2: actions at 1 and 3 (the last one: row 3, pos 3)
        ],
        dtype=torch.bool,
    )
    node = torch.where(action, torch.tensor([[0], [1], [0], [0]]), -1)
    versions = torch.where(action, torch.tensor([[3], [5], [0], [1]]), -1)
    return TrainBatch(
        token_ids=torch.arange(1, 25).reshape(4, 6),
        position_ids=torch.arange(6).repeat(4, 1),
        loss_mask=torch.ones(4, 6, dtype=torch.bool),
        action_mask=action,
        node_index=node,
        behaviour_logprobs=torch.where(action, -0.5, 0.0),
        policy_versions=versions,
        row_trajectory=torch.tensor([0, 0, 1, 2]),
        node_rewards=torch.tensor([[0.0, 1.0], [0.0, 0.0], [1.0, 0.0]]),
        num_nodes=torch.tensor([2, 1, 1]),
        truncated=torch.tensor([True, False, True]),
        task_ids=["a", "b", "c"],
        group_index=torch.zeros(3, dtype=torch.long),
    )


def test_padding_rows_are_inert_and_real_rows_drops_them():
    b = _batch()
    padded = pad_rows(b, 6)
    assert padded.num_rows == 6 and pad_rows(b, 4) is b
    # one visible token per padding row, nothing to train on, no trajectory
    assert padded.loss_mask[4:].sum(1).tolist() == [1, 1] and bool(padded.loss_mask[4:, 0].all())
    assert not bool(padded.action_mask[4:].any())
    assert padded.row_trajectory[4:].tolist() == [-1, -1]
    assert padded.policy_versions[4:].eq(-1).all() and padded.node_index[4:].eq(-1).all()
    back = real_rows(padded, 4)
    got = back.rows(slice(None))
    for name, want in b.rows(slice(None)).items():  # every per-row tensor
        assert torch.equal(got[name], want), name
    assert torch.equal(back.node_rewards, b.node_rewards) and back.task_ids == b.task_ids


def test_to_padded_puts_action_streams_back_on_their_rows():
    b = _batch()
    padded = pad_rows(b, 6)
    per_token = torch.arange(24, dtype=torch.float64).reshape(4, 6) + 0.5
    streams, valid = gather_to_streams(b, per_token)
    # trajectory 0's stream runs over both of its rows in order; trajectory 1's is empty
    assert streams[0, :5].tolist() == [2.5, 3.5, 9.5, 10.5, 11.5]
    assert valid.sum(1).tolist() == [5, 0, 2]
    full = to_padded(padded, b, streams)
    assert full.shape == (6, 6) and full.dtype == torch.float64
    want = torch.zeros(6, 6, dtype=torch.float64)
    want[:4] = torch.where(b.action_mask, per_token, 0.0)
    assert torch.equal(full, want)


def test_last_action_tokens_and_bootstrap_values():
    b = _batch()
    last, found = last_action_tokens(b)
    assert last.tolist() == [[1, 5], [0, 0], [3, 3]] and found.tolist() == [True, False, True]
    raw = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    raw[0, 0] = float("nan")  # (0, 0) is only a placeholder: a trajectory without action gets 0
    v = last_state_values(b, raw)
    assert v.dtype == torch.float32
    assert v.tolist() == [float(raw[1, 5]), 0.0, float(raw[3, 3])]


def test_values_at_tokens_is_the_state_before_each_token():
    raw = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    assert values_at_tokens(raw).tolist() == [[0.0, 1.0, 2.0], [0.0, 4.0, 5.0]]


def test_stale_tokens_at_prediction_positions():
    b = _batch()
    assert stale_tokens(b, train_version=5, max_staleness=None).shape == (4, 5)
    assert not bool(stale_tokens(b, train_version=5, max_staleness=None).any())
    stale = stale_tokens(b, train_version=5, max_staleness=2)
    # versions 3 (lag 2) and 5 (lag 0) are within the bound; version 1 (lag 4) is not
    want = torch.zeros(4, 5, dtype=torch.bool)
    want[3, [0, 2]] = True  # row 3's action tokens 1 and 3 at prediction positions 0 and 2
    assert torch.equal(stale, want)
