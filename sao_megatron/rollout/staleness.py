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

How much of an episode the bound keeps depends on its length: an episode of N turns sampled
while the trainer took k steps carries tokens of up to k + 1 versions, and at most the newest
``max_staleness + 1`` of them are within the bound when it is trained. `in_bound_by_length`
reports, per episode-length bucket (`LENGTH_BUCKETS`), the fraction of action tokens within the
bound and the number of episodes (``rollout/staleness/*``), so the bound can be sized for the
long episodes of a task mix.
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


#: Episode-length buckets of `in_bound_by_length`: (name, fewest, most) action nodes (turns) per
#: episode, most None for no upper edge. Fixed powers of 4 (not batch quantiles), so one bucket
#: means the same episodes at every step and in every run.
LENGTH_BUCKETS: tuple[tuple[str, int, int | None], ...] = (
    ("1", 1, 1),
    ("2-4", 2, 4),
    ("5-16", 5, 16),
    ("17-64", 17, 64),
    ("65-256", 65, 256),
    ("257-inf", 257, None),
)
_UPPER_EDGES = torch.tensor([hi for _, _, hi in LENGTH_BUCKETS[:-1]], dtype=torch.long)

IN_BOUND_PREFIX = "rollout/staleness/in_bound_fraction/turns_"
NUM_EPISODES_PREFIX = "rollout/staleness/num_episodes/turns_"


def in_bound_by_length_sums(
    stale: torch.Tensor,
    action_mask: torch.Tensor,
    row_trajectory: torch.Tensor,
    num_nodes: torch.Tensor,
) -> dict[str, float]:
    """Per episode-length bucket: episodes, action tokens, action tokens within the bound.

    The counts add over data-parallel ranks (each trajectory lives on one rank); every bucket
    of `LENGTH_BUCKETS` is present, zeros included, so every rank returns the same keys.
    `in_bound_by_length` turns the (summed) counts into the logged metrics.

    Args:
        stale: [B, T] bool, action tokens beyond the bound (`stale_token_mask(policy_versions,
            train_version, max_staleness)`; all False without a bound).
        action_mask: [B, T] bool, aligned with `stale` (both at token or at prediction
            positions).
        row_trajectory: [B] int64, the trajectory of each row; rows with -1 (padding) count
            nowhere.
        num_nodes: [num_traj] int64, action nodes (turns) per trajectory: its bucket.
    Returns: ``{"<bucket>/num_episodes", "<bucket>/num_action_tokens",
        "<bucket>/num_in_bound_tokens": float}`` for every bucket name of `LENGTH_BUCKETS`.
    Raises ValueError if shapes disagree or a trajectory has no action node.
    """
    if stale.shape != action_mask.shape or stale.shape[:1] != row_trajectory.shape:
        raise ValueError(
            f"stale {tuple(stale.shape)}, action_mask {tuple(action_mask.shape)} and "
            f"row_trajectory {tuple(row_trajectory.shape)} must be [B, T], [B, T] and [B]"
        )
    if bool((num_nodes < 1).any()):
        raise ValueError(f"num_nodes holds {num_nodes.min()}: every episode has >= 1 action node")
    mask = action_mask.to(torch.bool)
    real = row_trajectory >= 0
    traj = row_trajectory[real]
    n_traj = int(num_nodes.numel())
    tokens = torch.zeros(n_traj, dtype=torch.float64)
    tokens.index_add_(0, traj, mask[real].sum(1).double())
    in_bound = torch.zeros(n_traj, dtype=torch.float64)
    in_bound.index_add_(0, traj, (mask & ~stale.to(torch.bool))[real].sum(1).double())
    bucket = torch.bucketize(num_nodes.to(torch.long), _UPPER_EDGES)  # i: edge[i-1] < n <= edge[i]
    out: dict[str, float] = {}
    for i, (name, _, _) in enumerate(LENGTH_BUCKETS):
        sel = bucket == i
        out[f"{name}/num_episodes"] = float(sel.sum())
        out[f"{name}/num_action_tokens"] = float(tokens[sel].sum())
        out[f"{name}/num_in_bound_tokens"] = float(in_bound[sel].sum())
    return out


def in_bound_by_length(sums: dict[str, float]) -> dict[str, float]:
    """The logged metrics of the counts of `in_bound_by_length_sums`, for the buckets that hold
    an episode (bucket names as in `LENGTH_BUCKETS`):

    * ``rollout/staleness/in_bound_fraction/turns_<bucket>``: action tokens of the bucket's
      episodes within the bound / all their action tokens, 0..1 (absent without action tokens);
    * ``rollout/staleness/num_episodes/turns_<bucket>``: the bucket's episodes in the batch.
    """
    out: dict[str, float] = {}
    for name, _, _ in LENGTH_BUCKETS:
        n = sums[f"{name}/num_episodes"]
        if n == 0:
            continue
        out[NUM_EPISODES_PREFIX + name] = n
        tokens = sums[f"{name}/num_action_tokens"]
        if tokens > 0:
            out[IN_BOUND_PREFIX + name] = sums[f"{name}/num_in_bound_tokens"] / tokens
    return out


__all__ = [
    "LENGTH_BUCKETS",
    "in_bound_by_length",
    "in_bound_by_length_sums",
    "stale_token_fraction",
    "stale_token_mask",
]
