"""What the phases of one train step hand each other (`StepState`), on one DP rank.

Tensors are on CPU, over the padded local batch of `step_batch.shard_batch`: [R, T] at token
positions, [R, T-1] at prediction positions (`step_batch.pred`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sao_megatron.data.batch import TrainBatch


@dataclass(kw_only=True)
class PendingTargets:
    """Value targets waiting for the bootstrap values, R = base + coef * V_last (padded local
    batch, token positions; see `sao_megatron.algorithm.base.ValueTargets`).

    base, coef: [R, T] float64. boot_row: [R] int64, the row holding the last action token of
    row r's trajectory (r itself where coef is 0). boot_pos: [R] int64, that token's position.
    """

    base: torch.Tensor
    coef: torch.Tensor
    boot_row: torch.Tensor
    boot_pos: torch.Tensor

    def returns(self, raw: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        """float32 returns of `rows` from raw values [R, T] (or [b, T] of those rows, whose
        boot_row then indexes from rows.start)."""
        rows = rows or slice(0, self.base.shape[0])
        src = self.boot_row[rows] - (rows.start or 0)
        v_last = raw[src, self.boot_pos[rows]].detach().to(torch.float64)
        return (self.base[rows] + self.coef[rows] * v_last[:, None]).float()


@dataclass(kw_only=True)
class StepState:
    """What the phases of one train step hand each other, on this DP rank.

    batch: this rank's trajectories, padded to a common row count [R, T] (`RLStep.start`).
    num_real_rows: rows of `batch` before padding. train_version: the policy version trained.
    num_tokens / num_sequences: global action tokens / rows with action tokens (denominators).
    values: (at_tokens, raw) [R, T] float32 V_old of the critic before its updates (see
        `ValuePhases.values`): from VALUE_TARGETS' forward or the first VALUE_UPDATE's.
    returns, value_mask: [R, T] value targets and where the value loss is taken.
    pending_targets: value-free targets (`PendingTargets`) until a forward gives V_last.
    num_value_tokens: global count of value_mask (the value loss denominator).
    value_updates: VALUE_UPDATE phases done so far.
    old_logprobs: [R, T-1] float32 l_old at prediction positions (OLD_LOGPROBS).
    advantages: [R, T] float32 at token positions (ADVANTAGES).
    logprobs, entropy: [R, T-1] float32 of the policy update's forward (POLICY_UPDATE).
    stale: [R, T-1] bool, action tokens beyond the per-token staleness bound (prediction
        positions; all False without a bound).
    routing_differs: [R, T-1] bool, the trainer's own top-k differed from the recorded one in
        some layer at the prediction position (POLICY_UPDATE; None without recorded routing).
    metrics: what the phases measured (returned by `RLStep.finish`).
    """

    batch: TrainBatch
    num_real_rows: int
    train_version: int
    num_tokens: float
    num_sequences: float
    values: tuple[torch.Tensor, torch.Tensor] | None = None
    returns: torch.Tensor | None = None
    value_mask: torch.Tensor | None = None
    pending_targets: PendingTargets | None = None
    num_value_tokens: float = 0.0
    value_updates: int = 0
    old_logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    stale: torch.Tensor | None = None
    routing_differs: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)
