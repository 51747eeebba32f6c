"""Per-token staleness: which action tokens are too old to enter the policy loss.

Bounded staleness (docs/ROLLOUT.md, "Bounded staleness") is enforced in three places:

1. admission: an episode starts only while the engines' weight version v satisfies
   ``train_version - v <= max_staleness`` (and AReaL's capacity rule holds, `buffer.py`);
2. hand-off: a trajectory group whose *newest* token is already older than the bound carries no
   trainable token and is dropped (counted, its task requeued; `StalenessBuffer`);
3. training (here): episodes are never aborted for staleness, so a long episode that lived
   through several weight updates reaches the trainer with its early tokens older than the
   bound. Those tokens are excluded from the policy loss; they stay in its denominator (as DIS
   band drops do) and are reported as ``deviation/stale_token_fraction``. Tokens within the
   bound are corrected per token by direct importance sampling on their recorded behaviour
   log-probs as before.

The lag of one token is ``train_version - policy_version``: the number of weight updates
between the policy that sampled it and the policy being trained (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import torch


def stale_token_mask(
    policy_versions: torch.Tensor, train_version: int, max_staleness: int
) -> torch.Tensor:
    """True on sampled tokens whose version lag exceeds the bound.

    ``stale[b, t] = policy_versions[b, t] >= 0 and train_version - policy_versions[b, t] >
    max_staleness``. Positions that are not action tokens carry version -1 (`TrainBatch`) and are
    never stale, so the result can be combined with any action mask.

    Args:
        policy_versions: [B, T] (any shape) int64, the engine weight version that sampled each
            token; -1 off action tokens.
        train_version: the version of the policy being trained (before this update).
        max_staleness: eta >= 0, `rollout.max_staleness`.
    Returns: bool tensor of the shape of `policy_versions`.
    Raises ValueError if max_staleness < 0 or the versions are not integers.
    """
    if max_staleness < 0:
        raise ValueError(f"rollout.max_staleness={max_staleness}: must be >= 0")
    if policy_versions.dtype.is_floating_point or policy_versions.dtype == torch.bool:
        raise ValueError(f"policy_versions must be an integer tensor, got {policy_versions.dtype}")
    return (policy_versions >= 0) & (train_version - policy_versions > max_staleness)


def stale_token_fraction(
    policy_versions: torch.Tensor,
    action_mask: torch.Tensor,
    train_version: int,
    max_staleness: int,
) -> float:
    """Fraction of action tokens that `stale_token_mask` drops (NaN when there are none).

    policy_versions, action_mask: [B, T] int64 / bool, aligned (both at token positions or both
    at prediction positions).
    """
    mask = action_mask.to(torch.bool)
    n = int(mask.sum())
    if n == 0:
        return float("nan")
    stale = stale_token_mask(policy_versions, train_version, max_staleness) & mask
    return int(stale.sum()) / n


__all__ = ["stale_token_fraction", "stale_token_mask"]
