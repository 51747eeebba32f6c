"""The algorithm's advantage math on a step's local batch: action streams in, predictions out.

The algorithm (`sao_megatron.algorithm.base.Algorithm`) computes on one action stream per
trajectory (`AdvantageInputs`), so its result does not depend on how the trajectories were packed
into rows; `StepAdvantages` builds those inputs from the rank's trajectories and puts the outputs
back on its padded rows at prediction positions (`RankBatch.from_streams`: [R, T-1], 0 on padding
rows and off the action tokens). Batch statistics (whitening) reduce over the other DP ranks'
shares with the `BatchReducer` given.
"""

from __future__ import annotations

import torch

from sao_megatron.algorithm.advantages import LOCAL_BATCH, BatchReducer
from sao_megatron.algorithm.base import AdvantageInputs, Algorithm
from sao_megatron.data.batch import gather_to_streams
from sao_megatron.data.micro_batches import RankBatch
from sao_megatron.trainer.step_state import StepState


class StepAdvantages:
    """Advantages, returns and value targets of `algorithm` on a `StepState`'s local batch.

    Args:
        algorithm: the algorithm object.
        reducer: sums over the ranks holding the rest of the batch (`StepContext.batch_reducer`);
            `LOCAL_BATCH` when the local batch is the whole batch. Every DP rank must then call
            `compute` in step with the others (the phases do).
    """

    def __init__(self, algorithm: Algorithm, reducer: BatchReducer = LOCAL_BATCH) -> None:
        self.algorithm, self.reducer = algorithm, reducer

    def inputs(self, rank: RankBatch) -> AdvantageInputs:
        """`AdvantageInputs` of the rank's trajectories (one action stream each), no values."""
        real = rank.trajectories
        node_idx, valid = gather_to_streams(real, real.node_index)
        groups = {tid: i for i, tid in enumerate(dict.fromkeys(real.task_ids))}
        return AdvantageInputs(
            node_rewards=real.node_rewards,
            node_index=node_idx,
            action_mask=valid,
            truncated=real.truncated,
            group_ids=torch.tensor([groups[t] for t in real.task_ids], dtype=torch.long),
            reducer=self.reducer,
        )

    def compute(
        self, state: StepState, values: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """`Algorithm.advantages` on the local batch: (advantages [R, T-1] float32, returns
        [R, T-1] float32 or None, value mask [R, T-1] bool or None) at prediction positions.

        values: (before, after) [R, T-1] of the critic (`ValuePhases.values`), or None; they
        give V(s_t) on the action tokens and the bootstrap V_last of truncated trajectories.
        """
        rank = state.batch
        inputs = self.inputs(rank)
        if values is not None:
            before, after = values
            inputs.values, _ = rank.to_streams(before)
            last, found = rank.last_actions()
            inputs.bootstrap_values = torch.where(
                found, after[last[:, 0], last[:, 1]].to(torch.float32), 0.0
            )
        out = self.algorithm.advantages(inputs)
        adv = rank.from_streams(out.advantages.float())
        ret = rank.from_streams(out.returns.float()) if out.returns is not None else None
        vmask = None
        if out.value_mask is not None:
            vmask = rank.from_streams(out.value_mask.float()).bool()
        return adv, ret, vmask

    def value_targets(
        self, state: StepState
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """`Algorithm.value_targets` on the local batch, R = base + coef * V_last: (base
        [R, T-1] float64, coef [R, T-1] float64, value mask [R, T-1] bool) at prediction
        positions, or None when the targets need the critic's values (then `compute` with
        values gives them)."""
        rank = state.batch
        targets = self.algorithm.value_targets(self.inputs(rank))
        if targets is None:
            return None
        base = rank.from_streams(targets.base)
        coef = rank.from_streams(targets.bootstrap_coef)
        vmask = rank.from_streams(targets.value_mask.to(torch.float64)).bool()
        return base, coef, vmask
