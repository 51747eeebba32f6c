"""Checkpoint parts of a world split by role (``value.placement: separate``).

With the critic on ranks of its own, the policy ranks hold the parts ``policy`` and
``policy_optimizer`` and the value ranks ``value`` and ``value_optimizer``; one checkpoint holds
all four, written and read by every rank together (`CheckpointManager` is collective over the
world). Two things of Megatron's dist_checkpointing need adjusting for that (Megatron-Core 0.16,
checked in ``dist_checkpointing/validation.py`` and ``strategies/common.py``):

* Replica ids. A tensor is written by its main replica (``replica_id`` 0 in every component).
  The models' sharded state dicts take the data-parallel component from Megatron's global
  data-parallel rank, which spans both roles: the value model's tensors on value rank P (global
  DP rank P) would have no main replica and the save fails its integrity check. With
  tp = pp = ep = 1 (the only layout `split_roles` accepts) every tensor of a role is replicated
  over the role's DP ranks, so `set_replica_ids` rewrites the DP component to the role's DP rank.
* The common (non-tensor) state of a part (an optimiser's ``param_groups``, step counts) is
  written by global rank 0 only, a policy rank. `with_other_roles_parts` gives rank 0 the common
  state of each value part (sent from the first value rank) so it is written too.

A rank passes ``{}`` for each part of the other role; dist_checkpointing saves and loads such
ranks' empty shares without complaint. `role_split_parts` assembles a rank's parts for a save
or a load; `merge_from_value_ranks` brings the value ranks' small state (LR schedulers) to the
common state rank 0 saves. Tested in tests/trainer/test_separate_job.py (save, resume, and the
four parts equal to a colocated run's, tensor for tensor).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

if TYPE_CHECKING:
    from sao_megatron.parallel.roles import RoleLayout

#: the parts of a role-split RL checkpoint and the role holding each
ROLE_OF_PART = {
    "policy": "policy",
    "policy_optimizer": "policy",
    "value": "value",
    "value_optimizer": "value",
}


def set_replica_ids(sharded: dict, dp_rank: int) -> dict:
    """Set the data-parallel component of every replica id in `sharded` to `dp_rank`, in place.

    Only valid for models replicated over their role's DP ranks (tp = pp = ep = 1). A tuple id
    ``(..., dp)`` keeps its other components; an int id becomes `dp_rank`. Returns `sharded`.
    """
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    def fix(x):
        if isinstance(x, ShardedBase):
            r = x.replica_id
            x.replica_id = (*r[:-1], dp_rank) if isinstance(r, tuple) else dp_rank
        return x

    dict_list_map_inplace(fix, sharded)
    return sharded


def with_other_roles_parts(
    mine: Mapping[str, dict],
    owners: Mapping[str, int],
    *,
    rank: int,
) -> dict[str, Any]:
    """Every part of the checkpoint for this rank: its own (`mine`) and ``{}`` for the others,
    except on global rank 0, which gets the common (non-tensor) state of each part it does not
    hold from that part's first owner rank, `owners[name]` (a collective: every rank calls it,
    one object broadcast per such part).

    Args:
        mine: part name -> this rank's sharded state dict (replica ids already set).
        owners: every part name -> the global rank whose common state is saved (the role's
            first rank).
        rank: this rank's global rank.
    """
    from megatron.core.dist_checkpointing.utils import extract_sharded_base

    out: dict[str, Any] = {}
    for name in sorted(owners):
        src = owners[name]
        if src == 0:  # rank 0 holds it: its own common state is saved
            out[name] = mine.get(name, {})
            continue
        common = None
        if rank == src:
            _, common = extract_sharded_base(mine[name])
        box = [common]
        dist.broadcast_object_list(box, src=src)
        if name in mine:
            out[name] = mine[name]
        elif rank == 0:
            out[name] = box[0]
        else:
            out[name] = {}
    return out


def role_split_parts(
    parts: Mapping[str, dict], roles: RoleLayout, rank: int, *, loading: bool = False
) -> dict[str, Any]:
    """Every part of a role-split checkpoint for this rank (`ROLE_OF_PART`): its own `parts`
    (fresh sharded state dicts, replica ids set to its role's DP rank) and the other role's as
    ``{}``, or, saving on global rank 0, as their common state (`with_other_roles_parts`, a
    collective when saving)."""
    mine = {n: set_replica_ids(sd, roles.parallel.dp_rank) for n, sd in parts.items()}
    first = {"policy": roles.policy_ranks[0], "value": roles.value_ranks[0]}
    owners = {name: first[role] for name, role in ROLE_OF_PART.items()}
    if loading:
        return {n: mine.get(n, {}) for n in owners}
    return with_other_roles_parts(mine, owners, rank=rank)


def merge_from_value_ranks(obj: dict, roles: RoleLayout, rank: int) -> dict:
    """Rank 0's `obj` updated with the first value rank's (e.g. the LR schedulers' states for
    the common state rank 0 saves); `obj` unchanged on the other ranks. A collective."""
    box = [obj]
    dist.broadcast_object_list(box, src=roles.value_ranks[0])
    return obj | box[0] if rank == 0 else obj
