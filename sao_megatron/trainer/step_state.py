"""What the phases of one train step hand each other (`StepState`), on one DP rank.

Tensors are on CPU, over the R padded rows of the rank's `RankBatch`
(`sao_megatron.data.micro_batches.layout_micro_batches`), at prediction positions [R, T-1]:
entry p is about token p+1, as every loss input of a `MicroBatch`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sao_megatron.data.micro_batches import RankBatch


@dataclass(kw_only=True)
class PendingTargets:
    """Value targets waiting for the bootstrap values, R = base + coef * V_last (the rank's
    padded rows, prediction positions; see `sao_megatron.algorithm.base.ValueTargets`).

    base, coef: [R, T-1] float64. boot_row: [R] int64, the row holding the last action token
    of row r's trajectory (r itself where coef is 0). boot_pos: [R] int64, that token's
    prediction position.
    """

    base: torch.Tensor
    coef: torch.Tensor
    boot_row: torch.Tensor
    boot_pos: torch.Tensor

    def returns(self, after: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        """float32 returns [R, T-1] of `rows` from the values after each token, after [R, T-1]
        (`values_at_predictions`; or [b, T-1] of those rows, whose boot_row then indexes from
        rows.start)."""
        rows = rows or slice(0, self.base.shape[0])
        src = self.boot_row[rows] - (rows.start or 0)
        v_last = after[src, self.boot_pos[rows]].detach().to(torch.float64)
        return (self.base[rows] + self.coef[rows] * v_last[:, None]).float()


@dataclass(kw_only=True)
class StepState:
    """What the phases of one train step hand each other, on this DP rank.

    batch: this rank's trajectories, laid out in micro-batches of R rows (`RLStep.start`).
    train_version: the policy version trained.
    num_tokens / num_sequences: global action tokens / rows with action tokens (denominators).
    values: (before, after) [R, T-1] float32 V_old of the critic before its updates, before and
        after each token (`values_at_predictions`, `ValuePhases.values`): from VALUE_TARGETS'
        forward or the first VALUE_UPDATE's.
    returns, value_mask: [R, T-1] value targets and where the value loss is taken.
    pending_targets: value-free targets (`PendingTargets`) until a forward gives V_last.
    num_value_tokens: global count of value_mask (the value loss denominator).
    value_updates: VALUE_UPDATE phases done so far.
    old_logprobs: [R, T-1] float32 l_old (OLD_LOGPROBS).
    advantages: [R, T-1] float32 (ADVANTAGES).
    logprobs, entropy: [R, T-1] float32 of the policy update's forward (POLICY_UPDATE).
    stale: [R, T-1] bool, action tokens beyond the per-token staleness bound (all False without
        a bound).
    routing_differs: [R, T-1] bool, the trainer's own top-k differed from the recorded one in
        some layer for the token (POLICY_UPDATE; None without recorded routing).
    metrics: what the phases measured (returned by `RLStep.finish`).
    """

    batch: RankBatch
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

    @property
    def num_real_rows(self) -> int:
        """Rows of `batch` before padding (its first rows)."""
        return self.batch.num_real_rows
