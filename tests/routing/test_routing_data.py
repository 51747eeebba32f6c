"""Routed experts through the rollout's recorder, the trajectory, packing, DP sharding, padding
and pickling (what the rank-0 broadcast of a batch does)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from sao_megatron.data.batch import pack_trajectories
from sao_megatron.data.micro_batches import (
    layout_micro_batches,
    local_batch,
    pad_rows,
    shard_for_data_parallel,
)
from sao_megatron.data.trajectory import ActionNode, Trajectory
from sao_megatron.rollout.routing import (
    RoutingRecorder,
    bytes_per_token,
    decode_routing,
    encode_routing,
    routing_dtype,
)

L, K = 3, 2  # layers, top-k


def rows_for(positions: range, seed: int = 0) -> torch.Tensor:
    """A recognisable row per absolute position: expert ids (p + l + j) % 8."""
    p = torch.tensor(list(positions))[:, None, None]
    lay = torch.arange(L)[None, :, None]
    j = torch.arange(K)[None, None, :]
    return ((p + lay + j + seed) % 8).to(torch.uint8)


def test_dtype_and_bytes_per_token():
    assert routing_dtype(8) == torch.uint8 and routing_dtype(256) == torch.uint8
    assert routing_dtype(257) == torch.int16
    assert bytes_per_token(2, 2, 8) == 4  # the tiny vLLM test model
    assert bytes_per_token(48, 8, 128) == 384  # Qwen3-30B-A3B
    assert bytes_per_token(10, 4, 512) == 80
    with pytest.raises(ValueError, match="num_experts"):
        routing_dtype(0)


def test_wire_format_round_trip_like_vllm():
    """vLLM's numpy2base64 is base64 of np.save bytes; uint16 (over 256 experts) -> int16."""
    r = rows_for(range(5))
    assert torch.equal(decode_routing(encode_routing(r)), r)
    wide = np.arange(5 * L * K, dtype=np.uint16).reshape(5, L, K) + 300
    got = decode_routing(encode_routing(wide))
    assert got.dtype == torch.int16 and torch.equal(got.long(), torch.from_numpy(wide).long())
    with pytest.raises(ValueError, match="3-d integer"):
        decode_routing(encode_routing(np.zeros((2, 3), dtype=np.uint8)))


def _full_history_episode():
    """obs0 (3) act0 (2) obs1 (2) act1 (3): T = 10; the engine forwards positions 0..8."""
    return [
        ([1, 5, 6], [7, 8]),
        ([9, 10], [11, 12, 2]),
    ]


def test_recorder_full_history_asks_only_for_new_positions():
    rec = RoutingRecorder(full_history=True)
    prompt, seq = [], []
    for obs, act in _full_history_episode():
        prompt = seq + obs
        start = rec.start(prompt)
        assert start == (len(seq) - 1 if seq else 0)
        end = len(prompt) + len(act) - 1  # what the engine returns: positions start..end-1
        rec.add(prompt, act, rows_for(range(start, end)))
        seq = prompt + act
    assert rec.num_recorded == len(seq) - 1 == 9
    nodes = [
        ActionNode(
            observation_token_ids=o,
            action_token_ids=a,
            behaviour_logprobs=[-0.5] * len(a),
            policy_versions=[0] * len(a),
        )
        for o, a in _full_history_episode()
    ]
    traj = Trajectory(task_id="t", nodes=nodes)
    rec.assign(traj)
    assert traj.has_routing
    assert traj.nodes[0].routed_experts.shape == (5, L, K)  # all its tokens were forwarded
    assert traj.nodes[1].routed_experts.shape == (4, L, K)  # the last sampled token was not
    traj.validate()
    seq_ = traj.to_token_sequence()
    assert torch.equal(seq_.routed_experts[:9], rows_for(range(9)))
    assert seq_.routing_mask.tolist() == [True] * 9 + [False]


def test_recorder_rejects_misaligned_rows():
    rec = RoutingRecorder(full_history=True)
    with pytest.raises(ValueError, match="expected 4 rows"):
        rec.add([1, 2, 3], [4, 5], rows_for(range(3)))
    with pytest.raises(ValueError, match="expected 4 rows"):
        rec.add([1, 2, 3], [4, 5], None)
    rec.add([1, 2, 3], [4, 5], rows_for(range(4)))
    with pytest.raises(ValueError, match="extend the previous"):
        rec.start([1, 2])


def _traj(task_id, obs_act, seed, window=False):
    nodes = []
    pos = 0
    for i, (o, a) in enumerate(obs_act):
        ctx = o if not window else [1] + o
        n = len(ctx) + len(a)
        last = i == len(obs_act) - 1 or window
        nodes.append(
            ActionNode(
                observation_token_ids=o,
                action_token_ids=a,
                behaviour_logprobs=[-0.1] * len(a),
                policy_versions=[3] * len(a),
                context_token_ids=ctx if window else None,
                routed_experts=rows_for(range(pos, pos + n - int(last)), seed),
            )
        )
        pos = 0 if window else pos + n
    return Trajectory(
        task_id=task_id, nodes=nodes, context_mode="window" if window else "full_history"
    )


def test_packing_sharding_padding_and_pickle_keep_rows_aligned():
    trajs = [
        _traj("a", [([1, 4], [5, 2])], seed=0),
        _traj("b", [([1, 4, 4, 4], [5, 6, 2]), ([7], [8, 2])], seed=1),
        _traj("c", [([4, 4], [5, 2]), ([7, 7], [9, 2])], seed=2, window=True),
    ]
    for t in trajs:
        t.validate()
    batch = pack_trajectories(trajs, pad_token_id=0, max_seq_len=64, pad_to_multiple_of=4)
    assert batch.routed_experts.shape == (4, 12, L, K) and batch.routed_experts.dtype == torch.uint8
    assert batch.routing_mask.dtype == torch.bool
    # row 1 = trajectory b (full history, 10 tokens): positions 0..8 recorded, 9 not, pad not
    assert batch.routing_mask[1].tolist() == [True] * 9 + [False] * 3
    assert torch.equal(batch.routed_experts[1, :9], rows_for(range(9), 1))
    # rows 2, 3 = trajectory c's nodes (window: [1] + obs + action, each its own request)
    assert batch.routing_mask[2].tolist() == [True] * 4 + [False] * 8
    assert torch.equal(batch.routed_experts[3, :4], rows_for(range(4), 2))
    # mask never True past the real tokens
    assert not bool((batch.routing_mask & ~batch.loss_mask).any())

    # DP sharding (2 ranks) keeps each row's routing with the row
    seen = {}
    for rank in range(2):
        rows, ts = shard_for_data_parallel(batch, rank, 2, by_group=False)
        local = local_batch(batch, rows, ts)
        assert torch.equal(local.routed_experts, batch.routed_experts[rows])
        assert torch.equal(local.routing_mask, batch.routing_mask[rows])
        for r, g in enumerate(rows.tolist()):
            seen[g] = local.routed_experts[r]
        # micro-batches carry them, at token positions
        rank_batch = layout_micro_batches(
            batch, dp_rank=rank, dp_size=2, micro_batch_size=1, by_group=False
        )
        for mb in rank_batch.micro_batches[: len(rows)]:
            assert torch.equal(mb.routed_experts, local.routed_experts[mb.rows])
            assert torch.equal(mb.routing_mask, local.routing_mask[mb.rows])
    assert sorted(seen) == [0, 1, 2, 3]

    # padding rows (the trainer's equal-row-count padding) carry no routing
    padded = pad_rows(batch, 6)
    assert padded.routed_experts.shape[0] == 6 and not bool(padded.routing_mask[4:].any())

    # pickling (broadcast_from_rank0 of trajectories; any checkpointed copy) is lossless
    again = pickle.loads(pickle.dumps(trajs))
    b2 = pack_trajectories(again, pad_token_id=0, max_seq_len=64, pad_to_multiple_of=4)
    assert torch.equal(b2.routed_experts, batch.routed_experts)
    assert torch.equal(b2.routing_mask, batch.routing_mask)


def test_batch_without_routing_has_none_and_mixed_batches_mask_the_missing_rows():
    plain = _traj("p", [([1, 4], [5, 2])], seed=0)
    plain.nodes[0].routed_experts = None
    b = pack_trajectories([plain], pad_token_id=0, max_seq_len=16)
    assert (
        b.routed_experts is None
        and b.routing_mask is None
        and "routed_experts" not in b.rows(slice(0, 1))
    )
    mixed = pack_trajectories(
        [plain, _traj("r", [([1, 4], [5, 2])], seed=0)], pad_token_id=0, max_seq_len=16
    )
    assert mixed.routing_mask[0].sum() == 0 and mixed.routing_mask[1].sum() == 3


def test_validation_names_the_field():
    t = _traj("a", [([1, 4], [5, 2]), ([6], [7, 2])], seed=0)
    t.nodes[0].routed_experts = torch.zeros(9, L, K, dtype=torch.uint8)  # > segment length
    with pytest.raises(ValueError, match=r"nodes\[0\]\.routed_experts"):
        t.validate()
    t = _traj("a", [([1, 4], [5, 2]), ([6], [7, 2])], seed=0)
    t.nodes[1].routed_experts = torch.zeros(2, L + 1, K, dtype=torch.uint8)
    with pytest.raises(ValueError, match="disagree on routed_experts"):
        t.validate()
    t.nodes[1].routed_experts = torch.zeros(2, L, K, dtype=torch.int64)
    with pytest.raises(ValueError, match="uint8/int16"):
        t.validate()
