"""AlgorithmConfig: every switch of the SAO / GRPO math, validated at construction.

Filled from YAML (`algorithm:` block) through OmegaConf structured configs, so fields use plain
types; string choices are checked in `__post_init__` with a ValueError naming the field and the
fix. docs/ALGORITHM.md maps each field to the formula it selects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

ALGORITHM_NAMES = ("sao", "grpo")
ADVANTAGE_GRANULARITIES = ("action_token", "node_last_token", "node_mean")
IMPORTANCE_WEIGHTINGS = (
    "dis_band",
    "ppo_clip",
    "tis",
    "masked_is",
    "seq_geo_mask",
    "decoupled_ppo",
    "none",
)
# Which behaviour-correction schemes each algorithm's policy loss can use (see docs/ALGORITHM.md).
_IMPORTANCE_BY_ALGORITHM = {
    "sao": ("dis_band", "ppo_clip", "tis", "masked_is", "seq_geo_mask", "none"),
    "grpo": ("tis", "masked_is", "seq_geo_mask", "decoupled_ppo", "none"),
}
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
KL_ESTIMATORS = ("k1", "k2", "k3", "k3_is")


def _choice(field: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"algorithm.{field}={value!r}: must be one of {', '.join(choices)}")


def _interval(field: str, value: float, lo: float, hi: float, *, lo_open: bool, hi_open: bool):
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > lo if lo_open else value >= lo)
    ok = ok and (value < hi if hi_open else value <= hi)
    if not ok:
        lb, rb = ("(" if lo_open else "["), (")" if hi_open else "]")
        raise ValueError(f"algorithm.{field}={value!r}: must be in {lb}{lo}, {hi}{rb}")


@dataclass(kw_only=True)
class AlgorithmConfig:
    """Switches of the RL math (advantages, importance weights, losses). Defaults are SAO's.

    Raises ValueError (naming the field and the allowed values) on any invalid setting.
    """

    #: fields __post_init__ fills from others when left None (see sao_megatron.configs)
    DERIVED_FIELDS: ClassVar[tuple[str, ...]] = ("importance_weighting",)

    # --- which algorithm -------------------------------------------------------------------
    name: str = "sao"
    """"sao" (single trajectory, value model, direct importance sampling) or "grpo" (groups of
    `grpo_group_size` samples per task, PPO-clip on recomputed old log-probs)."""

    # --- advantages ------------------------------------------------------------------------
    advantage_granularity: str = "action_token"
    """SAO only. "action_token": GAE over action tokens; "node_last_token": GAE over action nodes
    with the value at each node's last action token; "node_mean": node value = mean over the
    node's action tokens."""
    gamma: float = 1.0
    """Discount per GAE step (per action token or per node), in [0, 1]."""
    lam_policy: float = 0.95
    """GAE lambda for the policy advantages, in [0, 1]; replaced per trajectory by the
    length-adaptive value when `length_adaptive_alpha` is set."""
    lam_value: float = 1.0
    """GAE lambda for the value targets (returns = A(lam_value) + V), in [0, 1]. VAPO uses 1."""
    length_adaptive_alpha: float | None = None
    """VAPO length-adaptive lambda: lam_policy = clamp(1 - 1/(alpha * l), 0, 1) with l the number
    of GAE steps of the trajectory. None turns it off. VAPO uses 0.05."""
    bootstrap_truncated: bool = True
    """Truncated trajectories bootstrap with V(last state) instead of 0 (treating truncation as
    termination when False)."""
    whiten_advantages: bool = False
    """Normalise policy advantages to zero mean / unit std over the batch's action tokens."""

    # --- importance weighting (behaviour-policy correction) ---------------------------------
    importance_weighting: str | None = None
    """One of dis_band (SAO default), ppo_clip, tis, masked_is, seq_geo_mask, decoupled_ppo, none
    (GRPO default). None picks the algorithm's default. dis_band and ppo_clip are SAO-only
    (ppo_clip: PPO's clipped surrogate on r = pi_theta / pi_behaviour with clip_low/clip_high, the
    behaviour log-probs standing in for the old policy; the DIS-vs-PPO ablation), decoupled_ppo is
    GRPO-only."""
    eps_low: float = 0.3
    """DIS band: tokens with r <= 1 - eps_low are dropped. In (0, 1); 0.3 reasoning, 0.8 coding."""
    eps_high: float = 5.0
    """DIS band: tokens with r >= 1 + eps_high are dropped. > 0; 5.0 reasoning, 3.0 coding."""
    tis_cap: float = 2.0
    """TIS: weight = min(r, tis_cap); > 0."""
    mis_beta: float = 2.0
    """Masked IS: keep r in [1/mis_beta, mis_beta], weight 0 outside; > 1."""
    seq_geo_low: float = 0.99
    """Sequence geometric-mean masking: drop a sequence if exp(mean log r) < seq_geo_low."""
    seq_geo_high: float = 1.01
    """Sequence geometric-mean masking: drop a sequence if exp(mean log r) > seq_geo_high."""
    decoupled_weight_cap: float | None = None
    """Decoupled PPO: cap on the behaviour weight pi_prox / pi_behaviour (None = uncapped)."""

    # --- PPO-clip (GRPO) ------------------------------------------------------------------
    clip_low: float = 0.2
    """PPO ratio clip below: clip(r, 1 - clip_low, ...), in (0, 1)."""
    clip_high: float = 0.2
    """PPO ratio clip above: clip(r, ..., 1 + clip_high), > 0 (DAPO clip-higher uses 0.28)."""
    dual_clip: float | None = 3.0
    """Dual-clip constant c > 1: for A < 0 the per-token loss is capped at -c * A. None = off."""

    # --- value loss -------------------------------------------------------------------------
    value_clip: float | None = 0.2
    """Clip V - V_old to [-value_clip, value_clip] in the pessimistic value loss; None = off."""
    value_updates_per_policy_update: int = 2
    """Value-model updates on the same trajectories before each policy update (>= 0)."""

    # --- loss assembly ----------------------------------------------------------------------
    loss_aggregation: str = "token_mean"
    """token_mean (divide by the global action-token count), seq_mean_token_mean,
    seq_mean_token_sum."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (loss -= entropy_coef * H); >= 0."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference policy (loss += kl_coef * KL); >= 0."""
    kl_estimator: str = "k3"
    """k1, k2, k3 (Schulman 2020) or k3_is (k3 weighted by pi_theta / pi_behaviour, unbiased
    off-policy, DeepSeek-V3.2)."""

    # --- GRPO -------------------------------------------------------------------------------
    grpo_group_size: int = 8
    """Samples per task in GRPO (>= 1)."""
    grpo_std_normalize: bool = True
    """Divide group-centred rewards by the group std (GRPO); False gives Dr.GRPO."""
    grpo_eps: float = 1e-6
    """Added to the group std in GRPO's denominator (> 0)."""

    # --- off-policy control -----------------------------------------------------------------
    max_staleness: int = 4
    """Admit a trajectory only if train_version - min(policy_version) <= max_staleness (>= 0)."""

    def __post_init__(self) -> None:
        _choice("name", self.name, ALGORITHM_NAMES)
        _choice("advantage_granularity", self.advantage_granularity, ADVANTAGE_GRANULARITIES)
        if self.importance_weighting is None:
            self.importance_weighting = "dis_band" if self.name == "sao" else "none"
        _choice("importance_weighting", self.importance_weighting, IMPORTANCE_WEIGHTINGS)
        allowed = _IMPORTANCE_BY_ALGORITHM[self.name]
        if self.importance_weighting not in allowed:
            raise ValueError(
                f"algorithm.importance_weighting={self.importance_weighting!r} does not apply to "
                f"algorithm.name={self.name!r}: use one of {', '.join(allowed)}"
            )
        _choice("loss_aggregation", self.loss_aggregation, LOSS_AGGREGATIONS)
        _choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        for f in ("gamma", "lam_policy", "lam_value"):
            _interval(f, getattr(self, f), 0.0, 1.0, lo_open=False, hi_open=False)
        if self.length_adaptive_alpha is not None:
            _interval(
                "length_adaptive_alpha",
                self.length_adaptive_alpha,
                0.0,
                math.inf,
                lo_open=True,
                hi_open=True,
            )
        _interval("eps_low", self.eps_low, 0.0, 1.0, lo_open=True, hi_open=True)
        _interval("eps_high", self.eps_high, 0.0, math.inf, lo_open=True, hi_open=True)
        _interval("tis_cap", self.tis_cap, 0.0, math.inf, lo_open=True, hi_open=True)
        _interval("mis_beta", self.mis_beta, 1.0, math.inf, lo_open=True, hi_open=True)
        _interval("seq_geo_low", self.seq_geo_low, 0.0, 1.0, lo_open=True, hi_open=False)
        _interval("seq_geo_high", self.seq_geo_high, 1.0, math.inf, lo_open=False, hi_open=True)
        if self.decoupled_weight_cap is not None:
            _interval(
                "decoupled_weight_cap",
                self.decoupled_weight_cap,
                0.0,
                math.inf,
                lo_open=True,
                hi_open=True,
            )
        _interval("clip_low", self.clip_low, 0.0, 1.0, lo_open=True, hi_open=True)
        _interval("clip_high", self.clip_high, 0.0, math.inf, lo_open=True, hi_open=True)
        if self.dual_clip is not None:
            _interval("dual_clip", self.dual_clip, 1.0, math.inf, lo_open=True, hi_open=True)
        if self.value_clip is not None:
            _interval("value_clip", self.value_clip, 0.0, math.inf, lo_open=True, hi_open=True)
        for f in ("entropy_coef", "kl_coef"):
            _interval(f, getattr(self, f), 0.0, math.inf, lo_open=False, hi_open=True)
        _interval("grpo_eps", self.grpo_eps, 0.0, math.inf, lo_open=True, hi_open=True)
        for f, lo in (
            ("value_updates_per_policy_update", 0),
            ("grpo_group_size", 1),
            ("max_staleness", 0),
        ):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"algorithm.{f}={v!r}: must be an integer >= {lo}")
        for f in ("bootstrap_truncated", "whiten_advantages", "grpo_std_normalize"):
            if not isinstance(getattr(self, f), bool):
                raise TypeError(f"algorithm.{f}={getattr(self, f)!r}: must be true or false")
