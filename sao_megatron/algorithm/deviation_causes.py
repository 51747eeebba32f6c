"""Train/inference deviation split by its cause: version lag, routing, numerics (pure math).

With l_theta the trainer's log-prob of a sampled token, l_b the engine's (behaviour) one and
r = exp(l_theta - l_b), every action token falls in one of three groups:

* ``lag1plus``: sampled by an older policy version (train_version - policy_version > 0): the
  deviation is staleness (plus whatever the two groups below add).
* ``lag0_routing_differs``: sampled by the trained version, and the trainer's own top-k differs
  from the engine's recorded one in at least one MoE layer at the token's prediction position
  (the position whose output scores the token): routing (plus numerics).
* ``lag0_routing_same``: sampled by the trained version with the same experts at the prediction
  position in every layer: numerics alone (kernels, precision, reduction order) — earlier
  positions' routing can still reach it through attention, so this group is an upper bound on
  the pure-numerics deviation.

Per group: the token share and the means of |1 - r| and |l_theta - l_b| (the statistics of
`sao_megatron.algorithm.metrics.off_policy_metrics`, SAO's target mean |1 - r| < 0.05).
Without recorded routing the lag-0 tokens form one group ``lag0``.
The function returns *sums and counts* so that data-parallel ranks can add theirs before the
means are taken (`finish_deviation_causes`).
"""

from __future__ import annotations

import math

import torch

GROUPS = ("lag0", "lag0_routing_same", "lag0_routing_differs", "lag1plus")


def deviation_cause_sums(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    version_lag: torch.Tensor,
    routing_differs: torch.Tensor | None = None,
) -> dict[str, float]:
    """Sums per cause group over the masked tokens (float64).

    Args:
        logprobs, behaviour_logprobs: [B, T] float, nats (prediction positions, aligned).
        mask: [B, T] bool, the tokens to measure (action tokens within the staleness bound).
        version_lag: [B, T] int, train_version - policy_version of each token.
        routing_differs: [B, T] bool or None, the trainer's top-k differs from the recorded one
            in some layer at the token's prediction position (False where nothing recorded).
    Returns: {"<group>/count", "<group>/abs_one_minus_ratio_sum", "<group>/abs_logprob_diff_sum"}
        for each group of `GROUPS` (the routing groups only with `routing_differs`).
    """
    m = mask.to(torch.bool)
    lr = torch.where(m, logprobs.double() - behaviour_logprobs.double(), 0.0).clamp(-20, 20)
    one_minus = (1.0 - lr.exp()).abs()
    groups = {"lag0": m & (version_lag == 0), "lag1plus": m & (version_lag > 0)}
    if routing_differs is not None:
        rd = routing_differs.to(torch.bool)
        groups["lag0_routing_same"] = groups["lag0"] & ~rd
        groups["lag0_routing_differs"] = groups["lag0"] & rd
    out: dict[str, float] = {}
    for name, g in groups.items():
        out[f"{name}/count"] = float(g.sum())
        out[f"{name}/abs_one_minus_ratio_sum"] = float(one_minus[g].sum())
        out[f"{name}/abs_logprob_diff_sum"] = float(lr.abs()[g].sum())
    return out


def finish_deviation_causes(sums: dict[str, float]) -> dict[str, float]:
    """Sums (possibly added over ranks) -> metrics: ``<group>/token_fraction`` (of all measured
    tokens), ``<group>/abs_one_minus_ratio_mean`` and ``<group>/abs_logprob_diff_mean``. An empty
    group reports its token fraction (0) and no means: nothing to report, never a fake 0 (and no
    NaN for the metrics logger to warn about on every step that has no stale tokens)."""
    total = sums.get("lag0/count", 0.0) + sums.get("lag1plus/count", 0.0)
    out = {}
    for name in GROUPS:
        if f"{name}/count" not in sums:
            continue
        n = sums[f"{name}/count"]
        out[f"{name}/token_fraction"] = n / total if total else math.nan
        if n:
            out[f"{name}/abs_one_minus_ratio_mean"] = sums[f"{name}/abs_one_minus_ratio_sum"] / n
            out[f"{name}/abs_logprob_diff_mean"] = sums[f"{name}/abs_logprob_diff_sum"] / n
    return out


__all__ = ["GROUPS", "deviation_cause_sums", "finish_deviation_causes"]
