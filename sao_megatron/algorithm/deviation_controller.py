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

The plant has a delay. A change of eta reaches the trained batches only after the trajectories
already admitted under the old bound have been trained: when the trainer is the bottleneck the
rollout runs eta batches ahead (AReaL's capacity rule), so that takes about eta steps — TCP's
round-trip time. A controller that reacts to every step (``wait_round_trip=False``, the law of
the first version) keeps cutting while the old batches drain and overshoots to eta = 0 and to
few episodes in flight (`tools/sim_deviation_controller.py` shows it on such a plant). With
``wait_round_trip`` (the default) it changes eta at most once per round trip, like TCP's one
window cut per RTT (RFC 6582, NewReno), and cuts by the measured excess instead of one step.

Control law, per step with measured D (mean |1 - r| of the step), smoothed as
D_ema <- (1 - a) D_ema + a D (a = `ema`; the first measurement initialises it), target D*, dead
band h = `hysteresis` < 1, D0 = the lag-0 tokens' mean |1 - r| (0 when unmeasured):

0. Round trip (``wait_round_trip``): for `hold` steps after a change of eta (the larger of the
   old and the new bound, at least 1) the measurements describe episodes admitted under the old
   bound: eta and the decreases wait, only n_max may grow (rule 3 with D for D_ema); when the
   hold ends D_ema restarts from the next measurement. With ``immediate_cut`` (the bound also
   applies to the data already admitted, ``rollout.deviation_bound_trained``) a cut reaches the
   very next batch: no hold, D_ema restarts from the next step's measurement; after an increase
   the hold stays a round trip (the looser bound shows only as new episodes age).
1. D_ema > D*, and the lag-0 tokens alone are under the target (D0 < D*): the excess comes from
   staleness, which admission controls -> decrease. While eta > min_staleness: with
   ``wait_round_trip`` eta <- clip(floor(eta (h D* - D0) / (D_ema - D0)), min_staleness,
   eta - 1) — the bound whose deviation would sit at h D* if deviation grows linearly with lag
   (a policy drifting at a steady rate; if it grows slower, the next round trip cuts again);
   when the bound that broke the target was a probe (rule 3 had just raised it from eta - 1),
   the cut goes back to at least eta - 1, which held a round trip before (the linear law
   over-cuts when the deviation grows faster than linearly with lag, and a failed probe says
   nothing about the bound below it) — else eta <- eta - 1. At eta = min_staleness:
   n_max <- max(floor(beta n_max), min_inflight) (beta = `decrease_factor`; fewer episodes in
   flight shorten the lag of long episodes).
2. D_ema > D* but D0 >= D*: tokens sampled by the trained version already deviate (numerics,
   MoE routing): tightening admission cannot help and would only idle the engines -> hold, and
   report it (``controller/limited_by_lag0`` = 1; routing replay or a higher precision are the
   remedies).
3. D_ema <= D* and the engines were busy less than `busy_threshold` of the step's wall time ->
   increase: n_max <- min(n_max + `increase_step`, max); and if also D_ema < h D* (a dead band
   against oscillation) eta <- min(eta + 1, max), unless that bound broke the target less than
   B steps ago (probe back-off, with ``wait_round_trip``: B = `probe_backoff` after the first
   cut from a bound, doubled each time the same bound breaks the target again, up to
   `probe_backoff_max`; forgotten once that bound holds a round trip). Without it additive
   increase re-probes the failed bound every few steps and spends a round trip over the target
   each time; with it the probes thin out exponentially (TCP's retransmission-timer back-off,
   Karn & Partridge 1987) while a policy that slows down is still found.
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
    wait_round_trip: bool = True
    probe_backoff: int = 8
    probe_backoff_max: int = 64
    immediate_cut: bool = False

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
        if not 0 <= self.probe_backoff <= self.probe_backoff_max:
            raise ValueError(
                f"probe_backoff={self.probe_backoff}: must be in [0, probe_backoff_max="
                f"{self.probe_backoff_max}] steps (0: no back-off)"
            )


class DeviationController:
    """The AIMD admission controller (module docstring). Starts at the ceilings (the user's
    bounds), so it only tightens when the deviation asks for it.

    Attributes: config, max_staleness (eta), max_inflight (n_max), deviation_ema (NaN until
    the first measurement and after a round trip), hold (steps left in the round trip),
    last_action (-1 decrease, 0 hold, +1 increase), limited_by_lag0; the memory of rules 1 and
    3: probed_from (the bound a probe raised eta from, None once the probe held or failed),
    failed_eta (the bound last cut from, None once it holds), backoff (its current back-off,
    steps), probe_block (steps left before failed_eta may be tried again).
    """

    def __init__(self, config: DeviationControllerConfig) -> None:
        self.config = config
        self.max_staleness = config.max_staleness
        self.max_inflight = config.max_inflight
        self.deviation_ema = math.nan
        self.hold = 0
        self.last_action = 0
        self.limited_by_lag0 = False
        self.probed_from: int | None = None
        self.failed_eta: int | None = None
        self.backoff = 0
        self.probe_block = 0

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
        before = (self.max_staleness, self.max_inflight)
        self.probe_block = max(self.probe_block - 1, 0)
        if self.hold > 0:  # rule 0: the batches still come from the old bound
            self.hold -= 1
            if self.hold == 0:
                self.deviation_ema = math.nan
            if deviation <= c.target and busy_fraction < c.busy_threshold:
                self.max_inflight = min(self.max_inflight + c.increase_step, c.max_inflight)
            return self._action(before)
        if math.isnan(self.deviation_ema):
            self.deviation_ema = deviation
        else:
            self.deviation_ema = (1 - c.ema) * self.deviation_ema + c.ema * deviation
        d, low = self.deviation_ema, c.hysteresis * c.target
        d0 = deviation_lag0 if math.isfinite(deviation_lag0) else 0.0
        eta = self.max_staleness
        probe = self.probed_from is not None and eta == self.probed_from + 1
        if d <= c.target:  # this bound holds: a probe of it succeeded, a failure is forgotten
            self.probed_from = None
            if eta == self.failed_eta:
                self.failed_eta, self.backoff, self.probe_block = None, 0, 0
        if d > c.target:
            if d0 >= c.target:
                self.limited_by_lag0 = True
            elif eta > c.min_staleness:
                if c.wait_round_trip:
                    cut = max(
                        c.min_staleness, min(eta - 1, math.floor(eta * (low - d0) / (d - d0)))
                    )
                    self._back_off(eta)
                    self._set_eta(max(cut, eta - 1) if probe else cut)
                    self.probed_from = None
                else:
                    self.max_staleness = eta - 1
            else:
                n = math.floor(c.decrease_factor * self.max_inflight)
                self.max_inflight = max(n, c.min_inflight)
                if c.wait_round_trip:
                    self.hold = 1
        elif busy_fraction < c.busy_threshold:
            self.max_inflight = min(self.max_inflight + c.increase_step, c.max_inflight)
            if d < low and eta < c.max_staleness:
                if c.wait_round_trip:
                    blocked = self.probe_block > 0 and self.failed_eta is not None
                    if not (blocked and eta + 1 >= self.failed_eta):
                        self._set_eta(eta + 1)
                        self.probed_from = eta
                else:
                    self.max_staleness = eta + 1
        return self._action(before)

    def _back_off(self, eta: int) -> None:
        """Bound `eta` broke the target: block probes of it for B steps (rule 3), B doubling
        when the same bound fails again."""
        c = self.config
        if eta == self.failed_eta:
            self.backoff = min(2 * self.backoff, c.probe_backoff_max)
        else:
            self.backoff = c.probe_backoff
        self.failed_eta, self.probe_block = eta, self.backoff

    def _set_eta(self, eta: int) -> None:
        """Change eta and wait one round trip (rule 0) for it to reach the trained batches; after
        a cut with ``immediate_cut`` (the bound holds the admitted data too) the next batch
        already obeys it: no hold, the average restarts from the next measurement."""
        if eta < self.max_staleness and self.config.immediate_cut:
            self.hold, self.deviation_ema = 0, math.nan
        else:
            self.hold = max(self.max_staleness, eta, 1)
        self.max_staleness = eta

    def _action(self, before: tuple[int, int]) -> int:
        after = (self.max_staleness, self.max_inflight)
        self.last_action = 0 if after == before else (1 if after > before else -1)
        return self.last_action

    def metrics(self) -> dict[str, float]:
        """The controller's state, logged each step (``controller/*``)."""
        return {
            "controller/max_staleness": float(self.max_staleness),
            "controller/max_inflight": float(self.max_inflight),
            "controller/deviation_ema": self.deviation_ema,
            "controller/target": self.config.target,
            "controller/action": float(self.last_action),
            "controller/limited_by_lag0": float(self.limited_by_lag0),
            "controller/hold": float(self.hold),
            "controller/probe_block": float(self.probe_block),
        }

    def state_dict(self) -> dict:
        return {
            "max_staleness": self.max_staleness,
            "max_inflight": self.max_inflight,
            "deviation_ema": self.deviation_ema,
            "hold": self.hold,
            "probed_from": self.probed_from,
            "failed_eta": self.failed_eta,
            "backoff": self.backoff,
            "probe_block": self.probe_block,
        }

    def load_state_dict(self, sd: dict) -> None:
        self.max_staleness = int(sd["max_staleness"])
        self.max_inflight = int(sd["max_inflight"])
        self.deviation_ema = float(sd["deviation_ema"])
        self.hold = int(sd.get("hold", 0))
        probed, failed = sd.get("probed_from"), sd.get("failed_eta")
        self.probed_from = None if probed is None else int(probed)
        self.failed_eta = None if failed is None else int(failed)
        self.backoff = int(sd.get("backoff", 0))
        self.probe_block = int(sd.get("probe_block", 0))


__all__ = ["DeviationController", "DeviationControllerConfig"]
