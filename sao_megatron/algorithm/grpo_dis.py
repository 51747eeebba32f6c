"""GRPO+DIS: GRPO's group advantages with SAO's policy loss -- the paper's middle baseline.

It isolates what SAO's critic buys over group statistics (arXiv 2607.07508 compares SAO, this,
and GRPO). Choices:

1. G trajectories per task (`algorithm.grpo.group_size`); no value model.
2. A_i = (R_i - mean_G R) / (std_G R + eps) on every action token (as grpo.py).
3. No old log-probs: the policy loss is SAO's direct importance sampling on the behaviour
   log-probs the engine recorded (as sao.py):
       r_t = exp(l_theta - l_b);  f(r) = r if 1 - eps_low < r < 1 + eps_high else 0
       L   = -sum_t m_t sg(f(r_t)) A_t l_theta_t / N
Data-parallel sharding keeps a group on one rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .advantages import AdvantageOutput
from .base import AdvantageInputs, Algorithm, Phase
from .grpo import group_advantages
from .registry import register
from .sao import BEHAVIOUR_WEIGHTINGS, behaviour_policy_loss

if TYPE_CHECKING:
    from .config import AlgorithmConfig


@register
class GRPODIS(Algorithm):
    """Group advantages -> DIS policy update on the behaviour log-probs."""

    name = "grpo_dis"
    needs_value_model = False
    keeps_groups_together = True
    default_importance = "dis_band"
    importance_weightings = BEHAVIOUR_WEIGHTINGS
    ppo_weightings = ("ppo_clip",)
    schedule = (Phase.ADVANTAGES, Phase.POLICY_UPDATE)

    @classmethod
    def config_sections(cls, config: AlgorithmConfig) -> set[str]:
        extra = {"ppo"} if config.importance.weighting in cls.ppo_weightings else set()
        return {"grpo", "importance"} | extra

    @property
    def group_size(self) -> int:
        return self.config.grpo.group_size

    def compute_advantages(self, inputs: AdvantageInputs) -> AdvantageOutput:
        return group_advantages(self.config, inputs)

    def policy_loss(self, *, old_logprobs=None, **kw) -> torch.Tensor:
        """`sao.behaviour_policy_loss` (no OLD_LOGPROBS phase, so old_logprobs is unused)."""
        return behaviour_policy_loss(self.config, **kw)
