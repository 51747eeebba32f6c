"""Deviation controller: adapts rollout admission online to hold mean |1 - r| under a target.

SAO's first design objective is an off-policy deviation under 5% (mean |1 - r| < 0.05, r =
pi_theta / pi_behaviour on the trained tokens). A fixed staleness bound is a guess: too loose
and long episodes or a fast-moving policy push the deviation past the target, too tight and the
engines idle while they wait for admission. This controller closes the loop each train step
with additive-increase / multiplicative-decrease (AIMD; Chiu & Jain 1989, "Analysis of the
increase and decrease algorithms for congestion avoidance in computer networks"), the rule that
lets TCP fill a link without overflowing it. Its two actuators are the admission knobs of the
rollout (`sao_megatron.rollout.buffer.StalenessBuffer`, `RolloutManager`):

    eta   : the admission staleness bound, an integer in [min_staleness, rollout.max_staleness]
    n_max : episodes in flight, in [min_inflight, rollout.max_concurrent_episodes]

Control law, per step with measured D (mean |1 - r| of the step), smoothed as
D_ema <- (1 - a) D_ema + a D (a = `ema`; the first measurement initialises it), target D*:

1. D_ema > D*, and the lag-0 tokens alone are under the target (D_lag0 < D*): the excess comes
   from staleness, which admission controls -> decrease: eta <- eta - 1 while eta >
   min_staleness, else n_max <- max(floor(beta n_max), min_inflight) (beta =
   `decrease_factor`; fewer episodes in flight shorten the lag of long episodes).
2. D_ema > D* but D_lag0 >= D*: tokens sampled by the trained version already deviate
   (numerics, MoE routing): tightening admission cannot help and would only idle the engines ->
   hold, and report it (``controller/limited_by_lag0`` = 1; routing replay or a higher
   precision are the remedies).
3. D_ema <= D* and the engines were busy less than `busy_threshold` of the step's wall time ->
   increase: n_max <- min(n_max + `increase_step`, max); and if also D_ema < h D* (h =
   `hysteresis` < 1, a dead band against oscillation) eta <- min(eta + 1, max).
4. Otherwise hold.

A step without a measurement (NaN: no trainable token) changes nothing. Pure: no threads, no
rollout imports; `RolloutManager.observe_step` applies the decisions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(kw_only=True)
class DeviationControllerConfig:
    """Settings of the control law (module docstring). Built from `RolloutConfig` by
    `RolloutManager`: target = rollout.deviation_target, the ceilings = rollout.max_staleness
    and rollout.max_concurrent_episodes, min_inflight = the group size."""

    target: float = 0.05
    max_staleness: int = 4
    max_inflight: int = 16
    min_staleness: int = 0
    min_inflight: int = 1
    ema: float = 0.5
    hysteresis: float = 0.7
    busy_threshold: float = 0.9
    decrease_factor: float = 0.5
    increase_step: int = 1

    def __post_init__(self) -> None:
        if not 0 < self.target < 1:
            raise ValueError(f"rollout.deviation_target={self.target}: must be in (0, 1)")
        if not 0 <= self.min_staleness <= self.max_staleness:
            raise ValueError(
                f"min_staleness={self.min_staleness} must be in [0, rollout.max_staleness="
                f"{self.max_staleness}]"
            )
        if not 1 <= self.min_inflight <= self.max_inflight:
            raise ValueError(
                f"min_inflight={self.min_inflight} must be in [1, "
                f"rollout.max_concurrent_episodes={self.max_inflight}]"
            )
        for name in ("ema", "hysteresis", "busy_threshold", "decrease_factor"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be in (0, 1]")
        if self.increase_step < 1:
            raise ValueError(f"increase_step={self.increase_step}: must be >= 1")


class DeviationController:
    """The AIMD admission controller (module docstring). Starts at the ceilings (the user's
    bounds), so it only tightens when the deviation asks for it.

    Attributes: config, max_staleness (eta), max_inflight (n_max), deviation_ema (NaN until
    the first measurement), last_action (-1 decrease, 0 hold, +1 increase), limited_by_lag0.
    """

    def __init__(self, config: DeviationControllerConfig) -> None:
        self.config = config
        self.max_staleness = config.max_staleness
        self.max_inflight = config.max_inflight
        self.deviation_ema = math.nan
        self.last_action = 0
        self.limited_by_lag0 = False

    def update(
        self, *, deviation: float, deviation_lag0: float = math.nan, busy_fraction: float = 1.0
    ) -> int:
        """One step: measured mean |1 - r| (all trained tokens), that of the lag-0 tokens (NaN
        if none), and the engines' busy fraction of the step's wall time in [0, 1].

        Returns the action taken (-1, 0, +1); the new bounds are the attributes.
        """
        c = self.config
        self.limited_by_lag0 = False
        if not math.isfinite(deviation):
            self.last_action = 0
            return 0
        if math.isnan(self.deviation_ema):
            self.deviation_ema = deviation
        else:
            self.deviation_ema = (1 - c.ema) * self.deviation_ema + c.ema * deviation
        before = (self.max_staleness, self.max_inflight)
        if self.deviation_ema > c.target:
            if math.isfinite(deviation_lag0) and deviation_lag0 >= c.target:
                self.limited_by_lag0 = True
            elif self.max_staleness > c.min_staleness:
                self.max_staleness -= 1
            else:
                n = math.floor(c.decrease_factor * self.max_inflight)
                self.max_inflight = max(n, c.min_inflight)
        elif busy_fraction < c.busy_threshold:
            self.max_inflight = min(self.max_inflight + c.increase_step, c.max_inflight)
            if self.deviation_ema < c.hysteresis * c.target:
                self.max_staleness = min(self.max_staleness + 1, c.max_staleness)
        after = (self.max_staleness, self.max_inflight)
        action = 0 if after == before else (1 if after > before else -1)
        self.last_action = action
        return action

    def metrics(self) -> dict[str, float]:
        """The controller's state, logged each step (``controller/*``)."""
        return {
            "controller/max_staleness": float(self.max_staleness),
            "controller/max_inflight": float(self.max_inflight),
            "controller/deviation_ema": self.deviation_ema,
            "controller/target": self.config.target,
            "controller/action": float(self.last_action),
            "controller/limited_by_lag0": float(self.limited_by_lag0),
        }

    def state_dict(self) -> dict:
        return {
            "max_staleness": self.max_staleness,
            "max_inflight": self.max_inflight,
            "deviation_ema": self.deviation_ema,
        }

    def load_state_dict(self, sd: dict) -> None:
        self.max_staleness = int(sd["max_staleness"])
        self.max_inflight = int(sd["max_inflight"])
        self.deviation_ema = float(sd["deviation_ema"])


__all__ = ["DeviationController", "DeviationControllerConfig"]
