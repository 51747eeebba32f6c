"""SAO: single-trajectory asynchronous optimisation (arXiv 2607.07508; docs/ARCHITECTURE.md).

Choices, in the order a train step runs them:

1. One trajectory per task, streamed to the trainer as it ends (group size 1).
2. Value model: V_old and the targets R = A(lam_value) + V from GAE over action tokens (or
   action nodes, `algorithm.sao.advantage_granularity`), then K value updates on the same batch
   (K = `algorithm.sao.value_updates_per_policy_update`, default 2) with the clipped loss
   0.5 max((V - R)^2, (V_old + clip(V - V_old, +-eps_v) - R)^2).
   With lam_value = 1 the targets need no values: GAE(1) telescopes,
       A_t(1) + V_t = sum_k gamma^k r_{t+k} + gamma^(L-t) V_last      (the V_t cancel)
   so R is the discounted reward-to-go plus the discounted bootstrap V_last of a truncated row
   (`value_targets`), and V_old is the first update's own forward (detached): its clip term is
   then inactive by construction (V - V_old = 0, both branches of the max equal), so the first
   update is the unclipped one and the value forward before it is saved.
3. Advantages with the critic *after* its updates: GAE(lam_policy), observation tokens skipped.
4. Policy update on the behaviour log-probs l_b the rollout engine recorded -- no recomputed
   "old" log-probs (SAO saves that forward pass). By default PPO's clipped surrogate on
   r = exp(l_theta - l_b) (Schulman et al. 2017, eq. 7, with pi_b standing in for pi_old; clip
   `algorithm.ppo.clip_low/high` = 0.2, dual clip 3):

       L_pi = sum_t m_t max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high)) / N

   This departs from the paper, measured: its direct importance sampling (DIS) band
   (`algorithm.importance.weighting: dis_band`)

       f(r) = r if 1 - eps_low < r < 1 + eps_high else 0        (dropped, not clipped)
       L_pi = -sum_t m_t sg(f(r_t)) A_t l_theta_t / N          (N: global action tokens)

   gives no gradient to a token that left the band against its advantage, so nothing pulls it
   back; under staleness bound 4 it collapsed the quickstart in 2 of 4 seeds, PPO's clip in
   none (docs/ALGORITHM.md, "Importance weights"). `algorithm.importance.weighting` also swaps
   in TIS / masked IS / sequence masking / none.

   `decoupled_ppo` gives up the saved forward: the schedule gains an OLD_LOGPROBS phase (after
   the value updates) and the loss is GRPO's `grpo.proximal_ppo_loss`, PPO's clip on
   exp(l_theta - l_old) times w = exp(l_old - l_b) (Hilton et al. 2022). For an engine whose
   log-probs differ from the trainer's even at lag 0 (a bf16 engine beside an fp32 trainer):
   the clip then anchors at the trainer's own policy (docs/ALGORITHM.md, "An engine whose
   log-probs differ from the trainer's").
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from .advantages import AdvantageOutput, action_token_gae, final_next_values, node_gae
from .base import AdvantageInputs, Algorithm, Phase, ValueTargets
from .grpo import proximal_ppo_loss
from .importance import importance_weights
from .losses import dis_policy_loss, policy_gradient_loss, ppo_clip_loss
from .registry import register

if TYPE_CHECKING:
    from .config import AlgorithmConfig

#: behaviour corrections of a policy loss on r = exp(l_theta - l_b) (SAO, GRPO+DIS)
BEHAVIOUR_WEIGHTINGS = ("dis_band", "ppo_clip", "tis", "masked_is", "seq_geo_mask", "none")


def behaviour_policy_loss(
    config: AlgorithmConfig,
    *,
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    num_tokens: int | torch.Tensor | None = None,
    num_sequences: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Policy loss on r = exp(l_theta - l_b), weighted per `algorithm.importance.weighting`.

    dis_band: `dis_policy_loss` (the formula above); ppo_clip: `ppo_clip_loss` with l_b as
    pi_old (Schulman et al. 2017, eq. 7); otherwise `policy_gradient_loss` with the weights of
    `importance_weights`. Shapes: all [B, T]; returns a scalar.
    """
    imp = config.importance
    agg = dict(mode=config.loss_aggregation, num_tokens=num_tokens, num_sequences=num_sequences)
    if imp.weighting == "dis_band":
        return dis_policy_loss(
            logprobs,
            behaviour_logprobs,
            advantages,
            action_mask,
            eps_low=imp.eps_low,
            eps_high=imp.eps_high,
            **agg,
        )
    if imp.weighting == "ppo_clip":
        ppo = config.ppo
        return ppo_clip_loss(
            logprobs,
            behaviour_logprobs,
            advantages,
            action_mask,
            clip_low=ppo.clip_low,
            clip_high=ppo.clip_high,
            dual_clip=ppo.dual_clip,
            **agg,
        )
    w = importance_weights(imp, logprobs, behaviour_logprobs, action_mask).weights
    return policy_gradient_loss(logprobs, advantages, w, action_mask, **agg)


@register
class SAO(Algorithm):
    """Value x K -> advantages with the updated critic -> policy update on the behaviour
    log-probs."""

    name = "sao"
    needs_value_model = True
    keeps_groups_together = False
    default_importance = "ppo_clip"  # the paper's is dis_band: module docstring, step 4
    importance_weightings = (*BEHAVIOUR_WEIGHTINGS, "decoupled_ppo")
    ppo_weightings = ("ppo_clip", "decoupled_ppo")  # PPO's clip on l_b, on the recomputed l_old

    @classmethod
    def config_sections(cls, config: AlgorithmConfig) -> set[str]:
        extra = {"ppo"} if config.importance.weighting in cls.ppo_weightings else set()
        return {"sao", "importance"} | extra

    @property
    def schedule(self) -> tuple[Phase, ...]:
        """VALUE_TARGETS, VALUE_UPDATE x K, [OLD_LOGPROBS with decoupled_ppo], ADVANTAGES,
        POLICY_UPDATE."""
        k = self.config.sao.value_updates_per_policy_update
        value = (Phase.VALUE_TARGETS, *[Phase.VALUE_UPDATE] * k)
        old = (Phase.OLD_LOGPROBS,) if self._decoupled else ()
        return (*value, *old, Phase.ADVANTAGES, Phase.POLICY_UPDATE)

    @property
    def _decoupled(self) -> bool:
        return self.config.importance.weighting == "decoupled_ppo"

    def compute_advantages(self, inputs: AdvantageInputs) -> AdvantageOutput:
        """GAE per `algorithm.sao` (action_token_gae or node_gae), with value targets.

        Needs inputs.values [B, T]; truncated rows bootstrap with inputs.bootstrap_values [B]
        when `algorithm.sao.bootstrap_truncated`. Raises ValueError when values are missing.
        """
        cfg = self.config.sao
        mask = inputs.action_mask.to(torch.bool)
        if inputs.values is None:
            raise ValueError("algorithm.name='sao' needs values [B, T] from the value model")
        truncated = inputs.truncated
        if truncated is None:
            truncated = torch.zeros(mask.shape[0], dtype=torch.bool, device=mask.device)
        nxt = final_next_values(truncated, inputs.bootstrap_values, cfg.bootstrap_truncated)
        common = dict(
            values=inputs.values,
            node_rewards=inputs.node_rewards,
            node_index=inputs.node_index,
            action_mask=mask,
            next_values=nxt,
            gamma=cfg.gamma,
            lam_policy=1.0 if cfg.lam_policy is None else cfg.lam_policy,  # unused when adaptive
            lam_value=cfg.lam_value,
            length_adaptive_alpha=cfg.policy_lambda_alpha,
        )
        if cfg.advantage_granularity == "action_token":
            return action_token_gae(**common)
        mode = "last_token" if cfg.advantage_granularity == "node_last_token" else "mean"
        return node_gae(**common, node_value=mode)

    def value_targets(self, inputs: AdvantageInputs) -> ValueTargets | None:
        """With `algorithm.sao.lam_value` = 1, the targets without values (module docstring,
        choice 2): base = returns of `compute_advantages` with V = 0 and V_last = 0 (the
        reward-to-go); bootstrap_coef = its returns with rewards = 0, V = 0 and V_last = 1 on
        the rows that bootstrap (truncated, `bootstrap_truncated`), which is gamma^(L-t) by
        linearity. None for lam_value != 1 (the targets then depend on V). Shapes [B, T]."""
        if self.config.sao.lam_value != 1.0:
            return None
        mask = inputs.action_mask.to(torch.bool)
        zeros = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
        num_rows = mask.shape[0]
        base = self.compute_advantages(
            dataclasses.replace(inputs, values=zeros, bootstrap_values=zeros.new_zeros(num_rows))
        )
        coef = self.compute_advantages(
            dataclasses.replace(
                inputs,
                node_rewards=torch.zeros_like(inputs.node_rewards, dtype=torch.float64),
                values=zeros,
                bootstrap_values=zeros.new_ones(num_rows),
            )
        )
        return ValueTargets(
            base=base.returns, bootstrap_coef=coef.returns, value_mask=base.value_mask
        )

    def policy_loss(self, *, old_logprobs=None, **kw) -> torch.Tensor:
        """`behaviour_policy_loss`; with decoupled_ppo `grpo.proximal_ppo_loss` on the
        OLD_LOGPROBS phase's l_old [B, T] (ValueError without it). Without decoupled_ppo
        old_logprobs is unused (no OLD_LOGPROBS phase)."""
        if self._decoupled:
            return proximal_ppo_loss(self.config, old_logprobs=old_logprobs, **kw)
        return behaviour_policy_loss(self.config, **kw)
