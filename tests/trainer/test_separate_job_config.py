"""``value.placement: separate`` in the job without launching it: what the controller rejects
(ValueError naming the field and the fix) and the checkpoint replica-id rewrite of a role."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sao_megatron.configs import load_config
from sao_megatron.trainer.controller import Controller
from sao_megatron.trainer.job import JobConfig


def _separate(*overrides: str) -> JobConfig:
    return load_config(JobConfig, None, ["value.placement=separate", *overrides])


@pytest.mark.parametrize("field", ["policy_optim", "value_optim"])
def test_distributed_optimizer_is_rejected(parallel_1rank, field):
    job = _separate(f"{field}.distributed_optimizer=true")
    two_ranks = dataclasses.replace(parallel_1rank, world_size=2)  # checked before any group
    with pytest.raises(ValueError, match=f"{field}.distributed_optimizer=false") as err:
        Controller(job, two_ranks)
    assert "value.placement=separate" in str(err.value)


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        ((), 1, "world size 1 must be even"),
        ((), 3, "world size 3 must be even"),
        (("parallel.tp=2",), 4, "parallel.tp=2"),
        (("parallel.ep=2",), 4, "parallel.ep=2"),
    ],
)
def test_layouts_a_role_split_cannot_take_are_rejected(parallel_1rank, overrides, world, message):
    job = _separate(*overrides)
    cfg = job.parallel
    p = dataclasses.replace(parallel_1rank, world_size=world, cfg=cfg)
    with pytest.raises(ValueError, match="value.placement") as err:
        Controller(job, p)
    assert message in str(err.value)


def test_set_replica_ids_moves_the_dp_component_only():
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    from sao_megatron.trainer.checkpoint.role_parts import set_replica_ids

    t = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), replica_id=(0, 0, 3))
    o = ShardedObject("o", {"a": 1}, (1,), (0,), replica_id=5)
    sd = {"w": t, "nested": {"o": o, "plain": 7}, "list": [t]}
    assert set_replica_ids(sd, 0) is sd
    assert t.replica_id == (0, 0, 0) and o.replica_id == 0 and sd["nested"]["plain"] == 7
    set_replica_ids(sd, 1)
    assert t.replica_id == (0, 0, 1) and o.replica_id == 1
