"""Importance weights that correct for the behaviour policy: DIS band, TIS, masked IS, sequence
geometric-mean masking, decoupled PPO.

Every function takes per-token log-probs [B, T] (nats) and the action mask [B, T] bool and returns
*stop-gradient* weights [B, T] (dtype of the log-probs, 0 off the mask) plus, where tokens can be
dropped, the kept mask. A dropped token has weight 0 but stays in the loss denominator (the
aggregation in losses.py counts the action mask, not the kept mask).

Ratios: r_t = exp(l_target - l_behaviour), where l_target is the trainer's current log-prob for
SAO (l_theta) and the recomputed old log-prob for GRPO (l_old). r far outside any band is safe:
a ratio of inf (log-ratio > ~88 in float32) is dropped, not propagated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .config import ImportanceConfig

_MAX_LOG_RATIO = 20.0  # exp(20) ~ 4.9e8: keeps uncapped weights finite; bands sit far inside.


@dataclass(kw_only=True)
class ImportanceWeights:
    """weights: [B, T] stop-gradient, 0 off mask and on dropped tokens; keep: [B, T] bool."""

    weights: torch.Tensor
    keep: torch.Tensor


def log_ratio(
    target_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, action_mask: torch.Tensor
) -> torch.Tensor:
    """l_target - l_behaviour on action tokens, 0 elsewhere; detached. [B, T] float."""
    diff = target_logprobs.detach() - behaviour_logprobs.to(target_logprobs.dtype)
    return torch.where(action_mask.to(torch.bool), diff, 0.0)


def dis_band_weights(
    target_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> ImportanceWeights:
    """SAO direct importance sampling band: f(r) = r if 1 - eps_low < r < 1 + eps_high, else 0.

    Tokens outside the open band are dropped (weight 0), not clipped. Source: SAO (arXiv
    2607.07508), DIS objective; docs/ARCHITECTURE.md. Defaults eps_low = 0.3, eps_high = 5.0.
    """
    mask = action_mask.to(torch.bool)
    lr = log_ratio(target_logprobs, behaviour_logprobs, mask)
    r = torch.exp(lr)
    keep = mask & (r > 1.0 - eps_low) & (r < 1.0 + eps_high)
    return ImportanceWeights(weights=torch.where(keep, r, 0.0), keep=keep)


def tis_weights(
    target_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    cap: float,
) -> ImportanceWeights:
    """Truncated importance sampling: w = min(r, cap), nothing dropped.

    Source: Ionides 2008 (truncated IS); applied to engine/trainer mismatch by Yao et al. 2025,
    "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training" (TIS, C = 2).
    """
    mask = action_mask.to(torch.bool)
    lr = log_ratio(target_logprobs, behaviour_logprobs, mask).clamp(max=_MAX_LOG_RATIO)
    w = torch.exp(lr).clamp(max=cap)
    return ImportanceWeights(weights=torch.where(mask, w, 0.0), keep=mask)


def masked_is_weights(
    target_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    beta: float,
) -> ImportanceWeights:
    """Token-level masked importance sampling: w = r if 1/beta <= r <= beta, else 0 (dropped).

    Source: Liu, Li et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the
    Training-Inference Mismatch" (token-level MIS).
    """
    mask = action_mask.to(torch.bool)
    r = torch.exp(log_ratio(target_logprobs, behaviour_logprobs, mask))
    keep = mask & (r >= 1.0 / beta) & (r <= beta)
    return ImportanceWeights(weights=torch.where(keep, r, 0.0), keep=keep)


def seq_geo_mask_weights(
    target_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    low: float,
    high: float,
) -> ImportanceWeights:
    """Sequence geometric-mean masking: keep a whole row iff low <= exp(mean_t log r_t) <= high.

    The mean is over the row's action tokens; kept tokens get weight 1 (no reweighting), rows
    outside the bounds weight 0. Rows with no action token count as kept (they have no tokens).
    Source: Liu, Li et al. 2025, "When Speed Kills Stability" (sequence-level geometric masking).
    """
    mask = action_mask.to(torch.bool)
    lr = log_ratio(target_logprobs, behaviour_logprobs, mask).to(torch.float64)
    n = mask.sum(dim=1).clamp(min=1)
    geo = torch.exp(lr.sum(dim=1) / n)
    keep = mask & ((geo >= low) & (geo <= high))[:, None]
    return ImportanceWeights(weights=keep.to(target_logprobs.dtype), keep=keep)


def decoupled_ppo_weights(
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    cap: float | None = None,
) -> ImportanceWeights:
    """Decoupled PPO behaviour weight w = pi_prox / pi_behaviour (optionally capped).

    The PPO-clip ratio is then taken against the proximal policy (old_logprobs = proximal).
    Source: Hilton et al. 2022 (decoupled objective, arXiv 2110.00641); Fu et al. 2025, AReaL
    (arXiv 2505.24298), eq. 5.
    """
    mask = action_mask.to(torch.bool)
    w = torch.exp(log_ratio(proximal_logprobs, behaviour_logprobs, mask).clamp(max=_MAX_LOG_RATIO))
    if cap is not None:
        w = w.clamp(max=cap)
    return ImportanceWeights(weights=torch.where(mask, w, 0.0), keep=mask)


def importance_weights(
    config: ImportanceConfig,
    target_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
) -> ImportanceWeights:
    """The weights selected by `algorithm.importance.weighting` (config: that section).

    target_logprobs: [B, T] l_theta (SAO) or recomputed l_old / proximal (GRPO); behaviour
    [B, T]; action_mask [B, T]. "none" gives weight 1 on every action token.
    """
    kind = config.weighting
    args = (target_logprobs, behaviour_logprobs, action_mask)
    if kind == "dis_band":
        return dis_band_weights(*args, config.eps_low, config.eps_high)
    if kind == "tis":
        return tis_weights(*args, config.tis_cap)
    if kind == "masked_is":
        return masked_is_weights(*args, config.mis_beta)
    if kind == "seq_geo_mask":
        return seq_geo_mask_weights(*args, config.seq_geo_low, config.seq_geo_high)
    if kind == "decoupled_ppo":
        return decoupled_ppo_weights(*args, config.decoupled_weight_cap)
    if kind == "none":
        mask = action_mask.to(torch.bool)
        return ImportanceWeights(weights=mask.to(target_logprobs.dtype), keep=mask)
    raise ValueError(f"algorithm.importance.weighting={kind!r}: unknown")
