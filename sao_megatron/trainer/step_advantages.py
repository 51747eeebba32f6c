"""The algorithm's advantage math on a step's local batch: action streams in, token positions out.

The algorithm (`sao_megatron.algorithm.base.Algorithm`) computes on one action stream per
trajectory (`AdvantageInputs`), so its result does not depend on how the trajectories were packed
into rows; `StepAdvantages` builds those inputs from the real rows of the padded local batch and
puts the outputs back on its rows ([R, T], 0 on padding rows and off the action tokens). Batch
statistics (whitening) reduce over the other DP ranks' shares with the `BatchReducer` given.
"""

from __future__ import annotations

import torch

from sao_megatron.algorithm.advantages import LOCAL_BATCH, BatchReducer
from sao_megatron.algorithm.base import AdvantageInputs, Algorithm
from sao_megatron.data.batch import TrainBatch, gather_to_streams
from sao_megatron.trainer.step_batch import last_state_values, real_rows, to_padded
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

    def inputs(self, real: TrainBatch) -> AdvantageInputs:
        """`AdvantageInputs` of the real rows (one action stream per trajectory), no values."""
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
        """`Algorithm.advantages` on the local batch: (advantages [R, T] float32, returns [R, T]
        float32 or None, value mask [R, T] bool or None) at token positions.

        values: (at_tokens, raw) [R, T] of the critic (`ValuePhases.values`), or None; they give
        V(s_t) on the action tokens and the bootstrap V_last of truncated trajectories.
        """
        b, num_real_rows = state.batch, state.num_real_rows
        real = real_rows(b, num_real_rows)
        inputs = self.inputs(real)
        if values is not None:
            at_tokens, raw = values
            inputs.values, _ = gather_to_streams(real, at_tokens[:num_real_rows])
            inputs.bootstrap_values = last_state_values(real, raw)
        out = self.algorithm.advantages(inputs)
        adv = to_padded(b, real, out.advantages.float())
        ret = to_padded(b, real, out.returns.float()) if out.returns is not None else None
        vmask = None
        if out.value_mask is not None:
            vmask = to_padded(b, real, out.value_mask.float()).bool()
        return adv, ret, vmask

    def value_targets(
        self, state: StepState
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """`Algorithm.value_targets` on the local batch, R = base + coef * V_last: (base [R, T]
        float64, coef [R, T] float64, value mask [R, T] bool) at token positions, or None when the
        targets need the critic's values (then `compute` with values gives them)."""
        b = state.batch
        real = real_rows(b, state.num_real_rows)
        targets = self.algorithm.value_targets(self.inputs(real))
        if targets is None:
            return None
        base = to_padded(b, real, targets.base)
        coef = to_padded(b, real, targets.bootstrap_coef)
        vmask = to_padded(b, real, targets.value_mask.to(torch.float64)).bool()
        return base, coef, vmask
