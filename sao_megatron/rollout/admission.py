"""The rollout's admission bounds: episodes in flight and admission staleness, fixed or steered.

Without ``rollout.deviation_target`` the bounds are the config's (``max_concurrent_episodes``
episodes in flight, ``max_staleness`` versions). With it, the `DeviationController`
(`sao_megatron.algorithm.deviation_controller`) moves both after every train step from the
step's measured deviation, and `AdmissionBounds` applies them: the staleness bound to the
`StalenessBuffer` (``rollout.deviation_bound_trained``: to the admitted data too), the limit on
episodes in flight to the manager's scheduling (`max_inflight`).
"""

from __future__ import annotations

from sao_megatron.algorithm.deviation_controller import (
    DeviationController,
    DeviationControllerConfig,
)
from sao_megatron.rollout.buffer import StalenessBuffer
from sao_megatron.rollout.config import RolloutConfig


class AdmissionBounds:
    """The admission bounds of one rollout and, with a deviation target, their controller.

    Args:
        config: the rollout config (``max_concurrent_episodes``, ``max_staleness``,
            ``deviation_target``, ``deviation_bound_trained``).
        group_size: trajectories per task (the controller keeps at least one group in flight).
        buffer: the `StalenessBuffer` whose admission staleness the controller sets.

    Attributes:
        max_inflight: episodes in flight at most (the controller's n_max, with one).
        controller: the `DeviationController`, or None without ``rollout.deviation_target``.
    """

    def __init__(self, config: RolloutConfig, group_size: int, buffer: StalenessBuffer) -> None:
        self.config = config
        self.buffer = buffer
        self.max_inflight = config.max_concurrent_episodes
        self.controller: DeviationController | None = None
        if config.deviation_target is not None:
            self.controller = DeviationController(
                DeviationControllerConfig(
                    target=config.deviation_target,
                    max_staleness=config.max_staleness,
                    max_inflight=max(config.max_concurrent_episodes, group_size),
                    min_inflight=group_size,
                    immediate_cut=config.deviation_bound_trained,
                )
            )

    def observe(self, metrics: dict[str, float], busy_fraction: float) -> dict[str, float]:
        """Feed a train step's metrics and the engines' busy fraction (0..1) to the controller
        and apply its bounds; return its state (``controller/*``; {} without a controller).

        Reads ``deviation/abs_one_minus_ratio_mean`` and
        ``deviation/lag0/abs_one_minus_ratio_mean`` (`sao_megatron.trainer.rl_step`; NaN if
        absent).
        """
        if self.controller is None:
            return {}
        self.controller.update(
            deviation=float(metrics.get("deviation/abs_one_minus_ratio_mean", float("nan"))),
            deviation_lag0=float(
                metrics.get("deviation/lag0/abs_one_minus_ratio_mean", float("nan"))
            ),
            busy_fraction=busy_fraction,
        )
        self._apply()
        return self.controller.metrics()

    def state_dict(self) -> dict | None:
        """The controller's state (None without one)."""
        return self.controller.state_dict() if self.controller is not None else None

    def load_state_dict(self, state: dict | None) -> None:
        """Continue the controller from `state` (if both exist) and apply its bounds now."""
        if self.controller is not None and state is not None:
            self.controller.load_state_dict(state)
            self._apply()

    def _apply(self) -> None:
        self.buffer.set_admission_staleness(
            self.controller.max_staleness, hand_off=self.config.deviation_bound_trained
        )
        self.max_inflight = self.controller.max_inflight
