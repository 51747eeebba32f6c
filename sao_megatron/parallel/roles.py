"""Critic placement: the trainer world split into policy ranks and value (critic) ranks.

With ``value.placement: separate`` the first half of the world trains the policy and the second
half the value model, concurrently (`sao_megatron.trainer.critic_placement`). Megatron is
initialised once over the whole world (`initialize_parallel`) with tp = pp = ep = 1, so every
model-parallel group (tp, pp, ep, mp, expt_tp, ...) holds one rank and is already right for
either role; only the data-parallel groups span ranks, and those are replaced here by groups
over the role's own ranks (`dist.new_group`), in a copy of Megatron's ``ProcessGroupCollection``.

Who reads those groups (Megatron-Core 0.16, checked in its sources): DDP's gradient reduction
and scaling (``dp``, ``dp_cp``, ``intra_dp_cp``, ``expt_dp``, ``intra_expt_dp`` through
``ProcessGroupCollection.setup_process_groups_for_ddp``), the optimiser and distributed optimiser
(``dp_cp``, ``intra_dp_cp``, ``intra_expt_dp``, ``intra_dist_opt`` through
``setup_process_groups_for_optimizer``; gradient clipping reduces over ``mp`` /
``expt_tp_pp``, one rank here), and our own code (`StepContext.dp_sum`: ``dp``;
`StepContext.world_sum`, the routing-replay counts: ``ParallelState.model_group``, set to the
role's ranks).
Megatron's global ``parallel_state`` data-parallel group (the whole world) is read only where
the schedule's ``finalize_model_grads`` all-reduces a token count, which it does only with
``calculate_per_token_loss`` (never set by this project).

Layout: ranks [0, P) are the policy, [P, 2P) the value model, P = world_size / 2; policy DP
rank i pairs with value DP rank i (global rank P + i), which trains on the same trajectories
(`layout_micro_batches` deals them by DP rank and size, equal in both roles) and sends it their
advantages. Rejected with a ValueError: an odd world, tp/pp/ep/expert_tp/virtual_pp other than
1 (their groups would have to be split by role too; not built or tested).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch.distributed as dist

from sao_megatron.parallel.state import ParallelState

POLICY, VALUE = "policy", "value"
PLACEMENTS = ("colocated", "separate")

#: the ProcessGroupCollection fields that span data-parallel ranks (tp = cp = 1: tp_dp_cp = dp)
_DP_GROUPS = (
    "dp",
    "dp_cp",
    "tp_dp_cp",
    "expt_dp",
    "intra_dp_cp",
    "intra_expt_dp",
    "intra_dist_opt",
)


@dataclass
class RoleLayout:
    """This rank's role under ``value.placement: separate``.

    Attributes:
        role: "policy" or "value".
        policy_ranks, value_ranks: global ranks of each role (P each).
        peer: global rank of the paired rank of the other role (same DP rank).
        parallel: this rank's `ParallelState` within its role: ``dp`` = P, ``dp_rank`` the
            index among the role's ranks, ``pg_collection`` with the role's DP groups. Pass it
            to the role's model builders, `build_optimizer` and the step.
    """

    role: str
    policy_ranks: list[int]
    value_ranks: list[int]
    peer: int
    parallel: ParallelState

    @property
    def is_policy(self) -> bool:
        return self.role == POLICY


def check_separate_layout(world_size: int, parallel_cfg) -> None:
    """Raise ValueError unless `world_size` ranks with `parallel_cfg` can be split by role."""
    c = parallel_cfg
    others = {"tp": c.tp, "pp": c.pp, "ep": c.ep, "expert_tp": c.expert_tp}
    bad = {k: v for k, v in others.items() if v != 1}
    if bad or c.virtual_pp not in (None, 1):
        got = ", ".join(f"parallel.{k}={v}" for k, v in bad.items()) or (
            f"parallel.virtual_pp={c.virtual_pp}"
        )
        raise ValueError(
            f"value.placement=separate supports data parallelism only (got {got}): set "
            "parallel.tp=parallel.pp=parallel.ep=1, or use value.placement=colocated"
        )
    if world_size < 2 or world_size % 2:
        raise ValueError(
            f"value.placement=separate splits the world into equal policy and value halves: "
            f"world size {world_size} must be even and >= 2 (launch 2*D ranks for D-way data "
            "parallelism in each role), or use value.placement=colocated"
        )


def split_roles(parallel: ParallelState) -> RoleLayout:
    """Split the world of `parallel` (from `initialize_parallel`) into policy and value ranks.

    Collective: every rank must call it (it creates the role groups, in the same order on every
    rank). Raises ValueError for the layouts listed in the module docstring.
    """
    world = parallel.world_size
    check_separate_layout(world, parallel.cfg)
    half = world // 2
    ranks = {POLICY: list(range(half)), VALUE: list(range(half, world))}
    groups = {name: dist.new_group(ranks=r) for name, r in ranks.items()}  # collective, in order
    role = POLICY if parallel.rank < half else VALUE
    index = ranks[role].index(parallel.rank)
    pgc = copy.copy(parallel.pg_collection)
    for name in _DP_GROUPS:
        if hasattr(pgc, name):
            setattr(pgc, name, groups[role])
    if hasattr(pgc, "inter_dist_opt"):  # one distributed-optimiser instance per role
        delattr(pgc, "inter_dist_opt")
    mine = dataclasses.replace(
        parallel, dp=half, dp_rank=index, pg_collection=pgc, model_group=groups[role]
    )
    other = VALUE if role == POLICY else POLICY
    return RoleLayout(
        role=role,
        policy_ranks=ranks[POLICY],
        value_ranks=ranks[VALUE],
        peer=ranks[other][index],
        parallel=mine,
    )
