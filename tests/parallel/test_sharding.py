"""The shard map's slicing on one process: SwiGLU halves, split/join inverses, errors."""

from __future__ import annotations

import pytest
import torch

from sao_megatron.parallel.sharding import (
    ParamShard,
    join_tensor,
    shard_map,
    shard_state_dict,
    split_tensor,
)


def _shard(tp_dim, glu=False, shape=(8, 4)):
    return ParamShard(
        "w",
        "decoder.layers.0.mlp.linear_fc1.weight",
        torch.zeros(shape),
        True,
        tp_dim=tp_dim,
        glu=glu,
    )


def test_swiglu_split_keeps_gate_and_up_halves_per_rank():
    full = torch.arange(8.0)[:, None].expand(8, 3)  # rows 0-3 gate, 4-7 up
    s = _shard(0, glu=True)
    parts = [split_tensor(full, s, r, 2) for r in range(2)]
    assert parts[0][:, 0].tolist() == [0, 1, 4, 5] and parts[1][:, 0].tolist() == [2, 3, 6, 7]
    assert torch.equal(join_tensor(parts, s), full)


@pytest.mark.parametrize("dim", [0, 1])
def test_split_then_join_is_identity(dim):
    full = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    s = _shard(dim)
    parts = [split_tensor(full, s, r, 2) for r in range(2)]
    assert parts[0].shape[dim] == full.shape[dim] // 2
    assert torch.equal(join_tensor(parts, s), full)
    assert split_tensor(full, _shard(None), 1, 2) is full  # replicated


def test_indivisible_split_names_the_parameter():
    with pytest.raises(ValueError, match="linear_fc1.weight: dim 0 of size 6"):
        split_tensor(torch.zeros(6, 2), _shard(0, glu=True), 0, 2)


def test_shard_state_dict_errors_name_the_parameter(parallel_1rank, tiny_moe):
    """At 1 rank the map is the identity; coordinates that do not fit the chunk (TP rank 1 of 2,
    EP rank 1) and a missing key are errors naming the parameter. Real TP/EP/PP slices are
    checked by test_layouts.py (init) and tests/weight_sync (gather)."""
    from sao_megatron.models import build_policy

    (policy,) = build_policy(tiny_moe, parallel_1rank)
    full = policy.state_dict()
    shards = shard_map(policy)
    assert [s.local_name for s in shards] == list(full)
    assert all(s.global_name == s.local_name for s in shards)  # 1 rank: local == global
    with pytest.raises(ValueError, match="embedding.word_embeddings.weight: sliced shape"):
        shard_state_dict(full, policy, tp_rank=1, tp_size=2, ep_rank=0)
    with pytest.raises(ValueError, match="not on EP rank 1"):
        shard_state_dict(full, policy, tp_rank=0, tp_size=1, ep_rank=1)
    with pytest.raises(KeyError, match="output_layer.weight"):
        shard_state_dict(
            {k: v for k, v in full.items() if k != "output_layer.weight"},
            policy,
            tp_rank=0,
            tp_size=1,
            ep_rank=0,
        )
