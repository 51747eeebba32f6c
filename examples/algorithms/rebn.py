"""ReBN: REINFORCE with return batch normalisation, GEM's baseline (arXiv 2510.01051) -- a plug-in.

An algorithm in one file outside the package: ``@register`` adds it to the registry when the
module is imported, which ``sao-train --import examples/algorithms/rebn.py`` (or the config's
``plugins: [examples/algorithms/rebn.py]``) does before the config is read, in every rank:

    sao-train examples/configs/quickstart.yaml --import examples/algorithms/rebn.py \\
        algorithm.name=rebn 'stages=[sft,rl]' algorithm.options.eps=1e-4

Choices and simplifications:

1. One trajectory per task (group size 1), no value model, no reference model.
2. One return per trajectory, undiscounted: R_i = sum_n r_{i,n} over its action nodes.
   (GEM normalises per-turn discounted returns G_{i,n}; with one reward at the end and
   gamma = 1 they are this R_i on every turn.)
3. Return batch normalisation over the B trajectories of the global batch, with the
   population std, as batch normalisation does:
       A_i = (R_i - mean_B R) / (std_B R + eps)       (std_normalize=false: A_i = R_i - mean_B R)
   the same A_i on every action token of trajectory i; a batch of equal returns gives A = 0.
   Each data-parallel rank holds a share of the batch; the sums behind mean and std go through
   ``inputs.reducer`` (a sum over the DP ranks, two passes: B and sum R, then sum (R - mean)^2),
   so A is the same at any DP size.
4. Loss: importance-weighted REINFORCE on the trainer's log-probs l_theta, with the behaviour
   weight w_t of `algorithm.importance.weighting` on r_t = exp(l_theta - l_b) (default tis:
   w_t = min(r_t, tis_cap), the truncated IS that corrects for the engine's stale/mismatched
   policy; ``none`` gives w_t = 1):
       L = -sum_t m_t sg(w_t) A_t l_theta_t / N       (N: global action tokens, token_mean)
   No old log-probs are recomputed (no OLD_LOGPROBS phase) and no ratio is clipped.

Options (``algorithm.options``, validated by `ReBNOptions`): eps, std_normalize.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sao_megatron.algorithm.advantages import LOCAL_BATCH, AdvantageOutput, BatchReducer
from sao_megatron.algorithm.base import AdvantageInputs, Algorithm, Phase
from sao_megatron.algorithm.importance import importance_weights
from sao_megatron.algorithm.losses import policy_gradient_loss
from sao_megatron.algorithm.registry import register


@dataclass(kw_only=True)
class ReBNOptions:
    """``algorithm.options`` of rebn."""

    eps: float = 1e-6
    """Added to the batch std of the returns (> 0)."""
    std_normalize: bool = True
    """Divide the centred returns by the batch std; false: centring only."""

    def __post_init__(self) -> None:
        if isinstance(self.eps, bool) or not isinstance(self.eps, int | float) or self.eps <= 0:
            raise ValueError(f"algorithm.options.eps={self.eps!r}: must be a number > 0")
        if not isinstance(self.std_normalize, bool):
            raise TypeError(f"algorithm.options.std_normalize={self.std_normalize!r}: true/false")


def rebn_advantages(
    node_rewards: torch.Tensor,
    action_mask: torch.Tensor,
    eps: float,
    std_normalize: bool = True,
    reducer: BatchReducer = LOCAL_BATCH,
) -> torch.Tensor:
    """A [B, T] (dtype of node_rewards): the batch-normalised return of each trajectory on its
    action tokens (choice 3), 0 elsewhere; the batch is every rank's rows under `reducer` (each
    rank calls this once per step, in step). node_rewards [B, N] float, action_mask [B, T]."""
    returns = node_rewards.to(torch.float64).sum(dim=1)  # R_i: [B]
    num, total = reducer.sum(torch.stack([returns.new_tensor(returns.numel()), returns.sum()]))
    centred = returns - (total / num if num > 0 else 0.0)
    if std_normalize:
        var = reducer.sum(centred.pow(2).sum().reshape(1))[0] / num.clamp(min=1)
        centred = centred / (var.sqrt() + eps)  # population std
    adv = torch.where(action_mask.to(torch.bool), centred[:, None], 0.0)
    return adv.to(node_rewards.dtype)


@register
class ReBN(Algorithm):
    """Batch-normalised returns -> importance-weighted REINFORCE update."""

    name = "rebn"
    needs_value_model = False
    keeps_groups_together = False
    default_importance = "tis"
    importance_weightings = ("tis", "masked_is", "seq_geo_mask", "dis_band", "none")
    options_class = ReBNOptions  # validates algorithm.options (sao_megatron.algorithm.config)
    schedule = (Phase.ADVANTAGES, Phase.POLICY_UPDATE)

    def __init__(self, config) -> None:
        super().__init__(config)
        self.options: ReBNOptions = config.typed_options()

    @classmethod
    def config_sections(cls, config) -> set[str]:
        return {"importance"}  # the sao/grpo/ppo sections must stay at their defaults

    def compute_advantages(self, inputs: AdvantageInputs) -> AdvantageOutput:
        opt = self.options
        adv = rebn_advantages(
            inputs.node_rewards, inputs.action_mask, opt.eps, opt.std_normalize, inputs.reducer
        )
        return AdvantageOutput(advantages=adv)

    def policy_loss(
        self,
        *,
        logprobs,
        behaviour_logprobs,
        advantages,
        action_mask,
        old_logprobs=None,
        num_tokens=None,
        num_sequences=None,
    ) -> torch.Tensor:
        """Choice 4; old_logprobs is unused (no OLD_LOGPROBS phase). Shapes [B, T]."""
        cfg = self.config
        w = importance_weights(cfg.importance, logprobs, behaviour_logprobs, action_mask).weights
        return policy_gradient_loss(
            logprobs,
            advantages,
            w,
            action_mask,
            cfg.loss_aggregation,
            num_tokens=num_tokens,
            num_sequences=num_sequences,
        )
