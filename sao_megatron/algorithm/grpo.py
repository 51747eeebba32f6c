"""GRPO: group-relative policy optimisation, the baseline (DeepSeekMath, arXiv 2402.03300).

Choices:

1. G trajectories per task (`algorithm.grpo.group_size`, default 8); no value model.
2. Outcome advantages, the same for every action token of trajectory i:
       A_i = (R_i - mean_G R) / (std_G R + eps)     (std_normalize=false: R_i - mean_G R, Dr.GRPO)
3. Old log-probs l_old recomputed by the trainer before the update (a policy forward, no grad).
4. PPO-clip loss on rho_t = exp(l_theta - l_old), dual clip for A < 0, optionally times a
   behaviour weight w_t on exp(l_old - l_b) for engine/trainer mismatch
   (`algorithm.importance.weighting`: tis, masked_is, seq_geo_mask, decoupled_ppo or none):
       l_t = w_t max(-A rho_t, -A clip(rho_t, 1 - clip_low, 1 + clip_high))
       L   = sum_t m_t l_t / N
Data-parallel sharding keeps a group on one rank, so group statistics stay local.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .advantages import AdvantageOutput, grpo_advantages
from .base import AdvantageInputs, Algorithm, Phase
from .importance import importance_weights
from .losses import ppo_clip_loss
from .registry import register

if TYPE_CHECKING:
    from .config import AlgorithmConfig


def group_advantages(config: AlgorithmConfig, inputs: AdvantageInputs) -> AdvantageOutput:
    """`grpo_advantages` of each trajectory's total reward, broadcast to its action tokens.

    Needs inputs.group_ids [B]; returns advantages [B, T] (no value targets). Raises ValueError
    when group_ids are missing.
    """
    if inputs.group_ids is None:
        raise ValueError(f"algorithm.name={config.name!r} needs group_ids [B] (one id per task)")
    cfg = config.grpo
    mask = inputs.action_mask.to(torch.bool)
    scores = inputs.node_rewards.sum(dim=1)
    adv = grpo_advantages(scores, inputs.group_ids, std_normalize=cfg.std_normalize, eps=cfg.eps)
    return AdvantageOutput(advantages=torch.where(mask, adv[:, None], 0.0))


def proximal_ppo_loss(
    config: AlgorithmConfig,
    *,
    old_logprobs: torch.Tensor | None,
    behaviour_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    **loss_inputs,
) -> torch.Tensor:
    """PPO's clip on rho_t = exp(l_theta - l_old), times the behaviour weight w_t of
    `algorithm.importance.weighting` on exp(l_old - l_b) (choice 4 above):

        l_t = w_t max(-A_t rho_t, -A_t clip(rho_t, 1 - clip_low, 1 + clip_high))

    With weighting=decoupled_ppo, w_t = min(exp(l_old - l_b), decoupled_weight_cap): the
    decoupled objective (Hilton et al. 2022, arXiv 2110.00641; AReaL, arXiv 2505.24298, eq. 5),
    whose clip is anchored at the trainer's own log-probs, not the engine's. GRPO and SAO with
    ``decoupled_ppo`` use it.

    Args:
        old_logprobs, behaviour_logprobs, action_mask: [B, T] l_old (the OLD_LOGPROBS phase's),
            l_b (the engine's), the action tokens.
        loss_inputs: `losses.ppo_clip_loss`'s logprobs and advantages [B, T], num_tokens,
            num_sequences.

    Returns a scalar. Raises ValueError without old_logprobs.
    """
    if old_logprobs is None:
        raise ValueError(
            f"algorithm.name={config.name!r} with algorithm.importance.weighting="
            f"{config.importance.weighting!r} needs old_logprobs [B, T] recomputed by the "
            "trainer (its schedule's OLD_LOGPROBS phase)"
        )
    w = importance_weights(config.importance, old_logprobs, behaviour_logprobs, action_mask)
    ppo = config.ppo
    return ppo_clip_loss(
        old_logprobs=old_logprobs,
        action_mask=action_mask,
        clip_low=ppo.clip_low,
        clip_high=ppo.clip_high,
        dual_clip=ppo.dual_clip,
        weights=w.weights,
        mode=config.loss_aggregation,
        **loss_inputs,
    )


@register
class GRPO(Algorithm):
    """Old log-probs -> group advantages -> PPO-clip policy update."""

    name = "grpo"
    needs_value_model = False
    keeps_groups_together = True
    default_importance = "none"
    importance_weightings = ("tis", "masked_is", "seq_geo_mask", "decoupled_ppo", "none")
    schedule = (Phase.OLD_LOGPROBS, Phase.ADVANTAGES, Phase.POLICY_UPDATE)

    @classmethod
    def config_sections(cls, config: AlgorithmConfig) -> set[str]:
        return {"grpo", "ppo", "importance"}

    @property
    def group_size(self) -> int:
        return self.config.grpo.group_size

    def compute_advantages(self, inputs: AdvantageInputs) -> AdvantageOutput:
        return group_advantages(self.config, inputs)

    def policy_loss(self, *, old_logprobs=None, **kw) -> torch.Tensor:
        """`proximal_ppo_loss`. Raises ValueError without old_logprobs [B, T]."""
        return proximal_ppo_loss(self.config, old_logprobs=old_logprobs, **kw)
