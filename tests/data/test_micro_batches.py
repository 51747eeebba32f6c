"""`layout_micro_batches` against a reference built by hand, row by row, in plain Python.

Five rows, four trajectories (trajectory 0 windowed: one row per action node), right-padded to
T = 7. Token counts 9, 7, 4, 3: dealt largest first to the least-loaded of 2 DP ranks, rank 0
gets trajectories 0 and 3 (rows 0, 1, 4), rank 1 trajectories 1 and 2 (rows 2, 3); with 2 rows
per micro-batch both ranks get R = 4 rows (the larger share, 3, rounded up).
"""

import pytest
import torch

from sao_megatron.data.batch import TrainBatch
from sao_megatron.data.micro_batches import layout_micro_batches, values_at_predictions

T = 7
#: (trajectory, node, token ids, {action token position: (behaviour log-prob, policy version)})
ROWS = [
    (0, 0, [11, 12, 13, 14, 15], {3: (-0.5, 3), 4: (-0.25, 3)}),
    (0, 1, [21, 22, 23, 24], {2: (-1.0, 4), 3: (-0.75, 4)}),
    (1, 0, [31, 32, 33, 34, 35, 36, 37], {2: (-0.125, 5), 5: (-2.0, 5)}),
    (2, 0, [41, 42, 43, 44], {1: (-0.5, 5), 2: (-1.5, 5)}),
    (3, 0, [51, 52, 53], {2: (-3.0, 2)}),
]
TASKS = ["a", "b", "g", "g"]
#: DP rank -> (global rows, global trajectories), by the greedy deal worked out above
SHARES = {0: ([0, 1, 4], [0, 3]), 1: ([2, 3], [1, 2])}


def _batch() -> TrainBatch:
    n = len(ROWS)
    token_ids = torch.zeros(n, T, dtype=torch.long)
    position_ids = torch.zeros(n, T, dtype=torch.long)
    loss_mask = torch.zeros(n, T, dtype=torch.bool)
    action_mask = torch.zeros(n, T, dtype=torch.bool)
    node_index = torch.full((n, T), -1, dtype=torch.long)
    behaviour = torch.zeros(n, T, dtype=torch.float32)
    versions = torch.full((n, T), -1, dtype=torch.long)
    for r, (_, node, tokens, actions) in enumerate(ROWS):
        k = len(tokens)
        token_ids[r, :k] = torch.tensor(tokens)
        position_ids[r, :k] = torch.arange(k)
        loss_mask[r, :k] = True
        node_index[r, :k] = node
        for t, (lp, v) in actions.items():
            action_mask[r, t], behaviour[r, t], versions[r, t] = True, lp, v
    return TrainBatch(
        token_ids=token_ids,
        position_ids=position_ids,
        loss_mask=loss_mask,
        action_mask=action_mask,
        node_index=node_index,
        behaviour_logprobs=behaviour,
        policy_versions=versions,
        row_trajectory=torch.tensor([row[0] for row in ROWS]),
        node_rewards=torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.5, 0.0], [0.0, 0.0]]),
        num_nodes=torch.tensor([2, 1, 1, 1]),
        truncated=torch.tensor([True, False, False, True]),
        task_ids=list(TASKS),
        group_index=torch.zeros(4, dtype=torch.long),
    )


def _reference(dp_rank: int, num_rows: int) -> dict[str, list]:
    """The rank's rows as nested lists: model inputs at token positions t, loss inputs at
    prediction positions p (token p+1), padding rows after the real ones."""
    rows, trajs = SHARES[dp_rank]
    local = {g: i for i, g in enumerate(trajs)}
    ref = {k: [] for k in ("pos", "attn", "act", "blp", "ver", "traj", "stream")}
    seen = {i: 0 for i in local.values()}  # action tokens so far, per local trajectory
    for r in range(num_rows):
        if r < len(rows):
            traj, _, tokens, actions = ROWS[rows[r]]
            k, tr = len(tokens), local[traj]
        else:  # padding row: its first token visible, nothing else
            k, tr, actions = 1, -1, {}
        ref["pos"].append([t if t < k else 0 for t in range(T)])
        ref["attn"].append([t < k for t in range(T)])
        ref["act"].append([p + 1 in actions for p in range(T - 1)])
        ref["blp"].append(
            [float(actions[p + 1][0]) if p + 1 in actions else 0.0 for p in range(T - 1)]
        )
        ref["ver"].append([actions[p + 1][1] if p + 1 in actions else -1 for p in range(T - 1)])
        ref["traj"].append(tr)
        stream = []
        for p in range(T - 1):
            if p + 1 in actions:
                stream.append(seen[tr])
                seen[tr] += 1
            else:
                stream.append(-1)
        ref["stream"].append(stream)
    ref["stream_length"] = [seen[i] for i in range(len(trajs))]
    return ref


@pytest.mark.parametrize("dp_rank", [0, 1])
def test_layout_matches_the_hand_built_reference(dp_rank):
    batch = _batch()
    rank = layout_micro_batches(
        batch, dp_rank=dp_rank, dp_size=2, micro_batch_size=2, by_group=False
    )
    rows, trajs = SHARES[dp_rank]
    assert rank.num_rows == 4 and rank.num_real_rows == len(rows)
    assert rank.token_shape == (4, T) and rank.prediction_shape == (4, T - 1)
    ref = _reference(dp_rank, 4)
    got = rank.rows
    # dtypes as documented
    assert got.token_ids.dtype == got.position_ids.dtype == got.policy_versions.dtype == torch.long
    assert got.attention_mask.dtype == got.action_mask.dtype == torch.bool
    assert got.behaviour_logprobs.dtype == torch.float32
    # token positions: the rank's rows of the global batch, then the padding rows
    assert torch.equal(got.token_ids[: len(rows)], batch.token_ids[rows])
    assert got.position_ids.tolist() == ref["pos"]
    assert got.attention_mask.tolist() == ref["attn"]
    # prediction positions: entry p is token p+1's
    assert got.action_mask.tolist() == ref["act"]
    assert torch.equal(
        got.behaviour_logprobs.double(), torch.tensor(ref["blp"], dtype=torch.float64)
    )
    assert got.policy_versions.tolist() == ref["ver"]
    assert got.row_trajectory.tolist() == ref["traj"]
    assert rank.stream_position.tolist() == ref["stream"]
    assert rank.stream_length.tolist() == ref["stream_length"]
    assert got.routed_experts is None and got.routing_mask is None
    # the rank's trajectories: real rows only, renumbered from 0
    real = rank.trajectories
    assert real.task_ids == [TASKS[t] for t in trajs] and real.num_rows == len(rows)
    assert torch.equal(real.node_rewards, batch.node_rewards[trajs])
    assert torch.equal(real.token_ids, batch.token_ids[rows])


@pytest.mark.parametrize("dp_rank", [0, 1])
def test_micro_batches_are_consecutive_row_slices(dp_rank):
    rank = layout_micro_batches(
        _batch(), dp_rank=dp_rank, dp_size=2, micro_batch_size=2, by_group=False
    )
    assert rank.micro_batch_size == 2
    assert [(mb.rows.start, mb.rows.stop) for mb in rank.micro_batches] == [(0, 2), (2, 4)]
    names = ("token_ids", "position_ids", "attention_mask", "action_mask", "behaviour_logprobs")
    names += ("policy_versions", "row_trajectory")
    extra = torch.arange(4 * (T - 1), dtype=torch.float64).reshape(4, T - 1)
    for mb in rank.micro_batches:
        for name in names:
            assert torch.equal(getattr(mb, name), getattr(rank.rows, name)[mb.rows]), name
        inputs = mb.model_inputs({"advantages": extra})
        assert torch.equal(inputs.input_ids, mb.token_ids)
        assert torch.equal(inputs.attention_mask, mb.attention_mask)
        assert torch.equal(inputs.position_ids, mb.position_ids)
        assert torch.equal(inputs.extras["advantages"], extra[mb.rows])
        assert torch.equal(inputs.extras["behaviour_logprobs"], mb.behaviour_logprobs)
        assert torch.equal(inputs.extras["action_mask"], mb.action_mask)
    assert len(rank.model_inputs()) == 2


@pytest.mark.parametrize("dp_rank", [0, 1])
def test_streams_and_last_actions(dp_rank):
    rank = layout_micro_batches(
        _batch(), dp_rank=dp_rank, dp_size=2, micro_batch_size=2, by_group=False
    )
    rows, trajs = SHARES[dp_rank]
    x = torch.tensor(
        [[100.0 * r + p + 0.5 for p in range(T - 1)] for r in range(4)], dtype=torch.float64
    )
    # reference: each trajectory's action predictions in row order, then position order
    want: list[list[float]] = [[] for _ in trajs]
    last = [(0, 0)] * len(trajs)
    for r, g in enumerate(rows):
        traj, _, _, actions = ROWS[g]
        for t in sorted(actions):
            want[trajs.index(traj)].append(100.0 * r + (t - 1) + 0.5)
            last[trajs.index(traj)] = (r, t - 1)
    streams, valid = rank.to_streams(x)
    assert streams.dtype == torch.float64 and streams.shape == (len(trajs), max(map(len, want)))
    for i, w in enumerate(want):
        assert streams[i, : len(w)].tolist() == w and valid[i].sum() == len(w)
        assert not bool(streams[i, len(w) :].any())
    back = rank.from_streams(streams)
    action = torch.tensor(_reference(dp_rank, 4)["act"])
    assert back.shape == (4, T - 1) and torch.equal(back, torch.where(action, x, 0.0))
    got_last, found = rank.last_actions()
    assert got_last.tolist() == [list(rc) for rc in last] and bool(found.all())


def test_values_at_predictions_before_and_after_each_token():
    raw = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]], dtype=torch.float64)
    before, after = values_at_predictions(raw)  # p scores token p+1
    assert before.tolist() == [[1.0, 2.0, 3.0], [5.0, 6.0, 7.0]]  # V(state before token p+1)
    assert after.tolist() == [[2.0, 3.0, 4.0], [6.0, 7.0, 8.0]]  # V(state after token p+1)


def test_groups_stay_on_one_rank_and_the_row_count_is_common():
    """With by_group, trajectories 2 and 3 (task "g", 7 tokens) go together: after trajectory
    0 (9) to rank 0 and trajectory 1 (7, key "1" < "g") to rank 1, the group joins rank 1."""
    batch = _batch()
    got = [
        layout_micro_batches(batch, dp_rank=r, dp_size=2, micro_batch_size=2, by_group=True)
        for r in range(2)
    ]
    assert [g.trajectories.task_ids for g in got] == [["a"], ["b", "g", "g"]]
    assert [g.num_real_rows for g in got] == [2, 3] and [g.num_rows for g in got] == [4, 4]
    one = layout_micro_batches(batch, dp_rank=0, dp_size=1, micro_batch_size=3, by_group=False)
    assert one.num_rows == 6 and one.num_real_rows == 5 and len(one.micro_batches) == 2


def test_errors_name_the_fix():
    batch = _batch()
    with pytest.raises(ValueError, match="rank 4 got no trajectory.*trajectories_per_batch"):
        layout_micro_batches(batch, dp_rank=0, dp_size=5, micro_batch_size=1, by_group=False)
    with pytest.raises(ValueError, match="micro_batch_size"):
        layout_micro_batches(batch, dp_rank=0, dp_size=1, micro_batch_size=0, by_group=False)
