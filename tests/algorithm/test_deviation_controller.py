"""The deviation controller's control law on synthetic plants, and its wiring into admission."""

from __future__ import annotations

import collections
import math

import pytest

from sao_megatron.algorithm.deviation_controller import (
    DeviationController,
    DeviationControllerConfig,
)

TARGET = 0.05


def plant_deviation(eta: int, base: float = 0.005, per_version: float = 0.02) -> float:
    """Synthetic run without delay: mean |1 - r| grows linearly with the staleness bound."""
    return base + per_version * eta


def plant_busy(n_max: int, needed: int = 8) -> float:
    """The engines are saturated with `needed` episodes in flight."""
    return min(1.0, n_max / needed)


class FifoPlant:
    """An asynchronous run with the rollout's delay: per train step the engines start up to
    `rate` batches within AReaL's capacity rule (batches started <= v + eta + 1, v the train
    version), the trainer trains the oldest finished batch; its tokens lag v - (version it was
    sampled at), and mean |1 - r| = base + per_version * lag. Busy: batches started / rate."""

    def __init__(self, base: float = 0.005, per_version: float = 0.02, rate: int = 2) -> None:
        self.base, self.per_version, self.rate = base, per_version, rate
        self.queue: collections.deque[int] = collections.deque()
        self.started = self.version = 0

    def step(self, eta: int) -> tuple[float, float, int]:
        """One train step under admission bound eta: (deviation, busy fraction, lag)."""
        admitted = 0
        while admitted < self.rate and self.started < self.version + eta + 1:
            self.queue.append(self.version)
            self.started += 1
            admitted += 1
        lag = self.version - self.queue.popleft()
        self.version += 1
        return self.base + self.per_version * lag, admitted / self.rate, lag


def _ctl(**kw) -> DeviationController:
    base = dict(target=TARGET, max_staleness=6, max_inflight=16, min_inflight=1, ema=1.0)
    return DeviationController(DeviationControllerConfig(**(base | kw)))


def _run_on_fifo(ctl: DeviationController, steps: int = 40):
    plant, trace = FifoPlant(), []
    for _ in range(steps):
        d, busy, _ = plant.step(ctl.max_staleness)
        trace.append((d, ctl.max_staleness, ctl.max_inflight))
        ctl.update(deviation=d, deviation_lag0=0.005, busy_fraction=busy)
    return trace


def test_fixed_bound_on_the_fifo_plant_lags_by_eta():
    plant = FifoPlant()
    lags = [plant.step(6)[2] for _ in range(30)]
    assert lags[:3] == [0, 1, 1] and lags[-5:] == [6] * 5  # the rollout runs eta batches ahead
    assert plant_deviation(6) > TARGET  # 0.125: the user's fixed bound breaks the target


def test_holds_the_target_where_the_fixed_bound_breaks_it():
    trace = _run_on_fifo(_ctl(ema=0.5))
    ds, etas, ns = zip(*trace, strict=True)
    # the largest bound within the target: 0.005 + 0.02 * 2 = 0.045 <= 0.05 < 0.065
    assert etas[-1] == 2 and set(etas[-10:]) == {2}
    assert all(d <= TARGET for d in ds[20:])  # after the transient
    assert min(etas) >= 1  # never driven to synchronous rollout
    assert min(ns) == 16  # staleness fixed it: the engines keep all their episodes


def test_per_step_law_overshoots_on_a_delayed_plant():
    """Without waiting a round trip (the first version's law) the controller keeps cutting
    while the batches admitted under the old bound drain: eta 0 and fewer episodes."""
    trace = _run_on_fifo(_ctl(ema=0.5, wait_round_trip=False))
    _, etas, ns = zip(*trace, strict=True)
    assert min(etas) == 0 and min(ns) < 16


def test_cut_is_proportional_to_the_excess():
    ctl = _ctl()
    ctl.update(deviation=0.125, deviation_lag0=0.005, busy_fraction=1.0)
    # floor(6 * (0.035 - 0.005) / (0.125 - 0.005)) = floor(1.5) = 1; then a 6-step round trip
    assert (ctl.max_staleness, ctl.hold, ctl.last_action) == (1, 6, -1)
    for left in range(5, -1, -1):
        assert ctl.update(deviation=0.3, busy_fraction=1.0) == 0 and ctl.hold == left
    assert math.isnan(ctl.deviation_ema)  # the next measurement starts a fresh average
    ctl.update(deviation=0.02, busy_fraction=1.0)
    assert ctl.deviation_ema == 0.02 and ctl.max_staleness == 1


def test_an_immediate_cut_does_not_wait_a_round_trip():
    """With the bound applied to admitted data (rollout.deviation_bound_trained) the next batch
    already obeys a cut, so the controller measures it at once and may cut again."""
    ctl = _ctl(immediate_cut=True)
    ctl.update(deviation=0.125, deviation_lag0=0.005, busy_fraction=1.0)
    # floor(1.5) = 1, as without; no hold (6 steps without) and a fresh average
    assert (ctl.max_staleness, ctl.hold) == (1, 0) and math.isnan(ctl.deviation_ema)
    ctl.update(deviation=0.08, deviation_lag0=0.005, busy_fraction=1.0)  # the next batch, eta 1
    assert (ctl.max_staleness, ctl.last_action) == (0, -1)
    ctl.max_staleness, ctl.hold = 1, 0
    ctl.update(deviation=0.001, busy_fraction=0.2)  # an increase still waits a round trip
    assert (ctl.max_staleness, ctl.hold) == (2, 2)
    assert ctl.metrics()["controller/max_staleness"] == 2.0


def test_cuts_episodes_in_flight_only_at_the_staleness_floor():
    ctl = _ctl(max_staleness=1)
    expected = [(0, 16), (0, 16), (0, 8), (0, 8), (0, 4), (0, 4), (0, 2), (0, 2), (0, 1)]
    for eta_n in expected + [(0, 1)] * 3:  # each cut waits one step (round trip at eta = 0)
        ctl.update(deviation=0.2, deviation_lag0=0.01, busy_fraction=1.0)
        assert (ctl.max_staleness, ctl.max_inflight) == eta_n
    assert ctl.last_action == 0  # at both floors


def test_recovers_when_the_deviation_falls_and_engines_idle():
    ctl = _ctl(max_staleness=3, increase_step=2)
    for _ in range(16):  # a perturbation (e.g. an LR spike) drives both knobs down
        ctl.update(deviation=0.3, deviation_lag0=0.01, busy_fraction=1.0)
    assert (ctl.max_staleness, ctl.max_inflight) == (0, 1)
    actions = []
    for _ in range(20):
        actions.append(ctl.update(deviation=0.01, busy_fraction=plant_busy(ctl.max_inflight)))
    assert set(actions) <= {0, 1} and actions[0] == 1 and actions[-1] == 0
    # episodes grown until the engines are saturated (8); staleness grows (one step per round
    # trip) only while they idle: 0 -> 1 -> 2, and then the engines are busy
    assert ctl.max_staleness == 2
    assert plant_busy(ctl.max_inflight) >= 0.9 and ctl.max_inflight <= 9


def test_busy_engines_are_not_given_more_work():
    ctl = _ctl()
    ctl.max_inflight = 8
    ctl.update(deviation=0.001, busy_fraction=0.95)
    assert ctl.max_inflight == 8 and ctl.last_action == 0


def test_dead_band_grows_episodes_but_not_staleness():
    ctl = _ctl()
    ctl.max_staleness, ctl.max_inflight = 2, 4
    ctl.update(deviation=0.04, busy_fraction=0.5)  # 0.035 <= 0.04 <= 0.05
    assert (ctl.max_staleness, ctl.max_inflight) == (2, 5)


def test_lag0_deviation_is_not_fought_with_admission():
    ctl = _ctl()
    ctl.update(deviation=0.08, deviation_lag0=0.07, busy_fraction=1.0)
    assert (ctl.max_staleness, ctl.max_inflight) == (6, 16)
    assert ctl.limited_by_lag0 and ctl.metrics()["controller/limited_by_lag0"] == 1.0


def test_ema_and_missing_measurements():
    ctl = _ctl(ema=0.5)
    ctl.update(deviation=0.04)
    ctl.update(deviation=0.08)
    assert ctl.deviation_ema == pytest.approx(0.06)  # 0.5 * 0.04 + 0.5 * 0.08
    before = ctl.state_dict()
    assert ctl.update(deviation=math.nan) == 0 and ctl.state_dict() == before
    other = _ctl()
    other.load_state_dict(before)
    assert other.state_dict() == before
    m = ctl.metrics()
    assert set(m) == {
        "controller/max_staleness",
        "controller/max_inflight",
        "controller/deviation_ema",
        "controller/target",
        "controller/action",
        "controller/limited_by_lag0",
        "controller/hold",
        "controller/probe_block",
    }


class TablePlant:
    """No delay, deviation by bound: mean |1 - r| at eta is ``table[eta]`` (a policy whose
    deviation jumps past the target between two bounds, as in the real lr-3e-4 run)."""

    def __init__(self, table: dict[int, float]) -> None:
        self.table = table

    def drive(self, ctl: DeviationController, steps: int) -> list[int]:
        etas = []
        for _ in range(steps):
            etas.append(ctl.max_staleness)
            ctl.update(deviation=self.table[ctl.max_staleness], busy_fraction=0.2)
        return etas


def test_a_failed_probe_goes_back_to_the_bound_that_held_not_the_linear_law():
    ctl = _ctl(max_staleness=2)
    ctl.max_staleness = 1
    ctl.update(deviation=0.02, busy_fraction=0.2)  # 0.02 < 0.035: probe eta 2
    assert (ctl.max_staleness, ctl.hold, ctl.probed_from) == (2, 2, 1)
    ctl.update(deviation=0.12, busy_fraction=0.2)  # the round trip: old batches
    ctl.update(deviation=0.12, busy_fraction=0.2)
    ctl.update(deviation=0.12, busy_fraction=0.2)  # measured at eta 2: cut
    # the linear law: floor(2 * 0.035 / 0.12) = 0; eta 1 held at 0.02 <= 0.05: back to 1
    assert (ctl.max_staleness, ctl.last_action) == (1, -1)
    assert (ctl.failed_eta, ctl.backoff, ctl.probe_block) == (2, 8, 8)
    assert ctl.probed_from is None
    # a failure that is not a probe (the policy speeds up at a bound that held) follows the law
    for _ in range(3):
        ctl.update(deviation=0.02, busy_fraction=1.0)  # busy engines: no probe, eta stays 1
    assert ctl.max_staleness == 1 and ctl.probed_from is None
    ctl.update(deviation=0.2, busy_fraction=1.0)
    assert ctl.max_staleness == 0  # floor(1 * 0.035 / 0.2) = 0


def test_probes_of_a_failed_bound_back_off_exponentially():
    plant = TablePlant({0: 0.005, 1: 0.02, 2: 0.12})
    etas = plant.drive(_ctl(max_staleness=2), 120)
    starts = [i for i in range(1, len(etas)) if etas[i] == 2 and etas[i - 1] == 1]
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    # each failure of eta 2 doubles the wait before the next probe: 8, 16, 32, 64 steps (+ the
    # round trips); without the back-off the probe recurs every few steps
    assert len(starts) >= 3 and all(b > a for a, b in zip(gaps, gaps[1:], strict=False))
    # the first cut (from the start at eta 2: not a probe) follows the linear law to 0; every
    # later one is a failed probe of eta 2 and goes back to eta 1
    assert etas[:4] == [2, 0, 0, 0] and min(etas[4:]) == 1
    plain = TablePlant({0: 0.005, 1: 0.02, 2: 0.12}).drive(
        _ctl(max_staleness=2, probe_backoff=0), 120
    )
    over = lambda xs: sum(x == 2 for x in xs)  # noqa: E731 - steps spent at the bad bound
    assert over(etas) * 3 < over(plain)


def test_a_failed_bound_that_holds_later_is_forgotten():
    ctl = _ctl(max_staleness=2)
    table = {0: 0.005, 1: 0.02, 2: 0.12}
    TablePlant(table).drive(ctl, 6)  # fails at eta 2 once
    assert ctl.failed_eta == 2
    table[2] = 0.03  # the policy slowed down: eta 2 is within the target now
    TablePlant(table).drive(ctl, 30)
    assert ctl.max_staleness == 2 and ctl.failed_eta is None and ctl.backoff == 0
    other = _ctl(max_staleness=2)
    other.load_state_dict(ctl.state_dict())
    assert other.state_dict() == ctl.state_dict()


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"target": 0.0}, "deviation_target"),
        ({"min_staleness": 7}, "min_staleness"),
        ({"min_inflight": 20}, "min_inflight"),
        ({"ema": 0.0}, "ema"),
        ({"increase_step": 0}, "increase_step"),
        ({"probe_backoff": 100}, "probe_backoff"),
    ],
)
def test_config_errors_name_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        DeviationControllerConfig(**({"max_staleness": 6, "max_inflight": 16} | kw))


def test_manager_applies_the_bounds_to_admission(tmp_path):
    from sao_megatron.rollout.config import RolloutConfig
    from sao_megatron.rollout.manager import RolloutManager
    from tests.rollout.fakes import make_formatter

    off = RolloutManager(RolloutConfig(), make_formatter(), [], run_dir=tmp_path)
    assert off.controller is None and off.observe_step({}) == {}
    with pytest.raises(ValueError, match="rollout.deviation_target"):
        RolloutConfig(deviation_target=1.5)
    cfg = RolloutConfig(deviation_target=0.05, max_staleness=3, max_concurrent_episodes=8)
    m = RolloutManager(cfg, make_formatter(), [], run_dir=tmp_path, group_size=2)
    assert m.buffer.admission_staleness == 3 and m.max_inflight == 8
    out = m.observe_step({"deviation/abs_one_minus_ratio_mean": 0.06})
    # floor(3 * (0.035 - 0) / (0.06 - 0)) = 1 (no lag-0 tokens measured: D0 = 0)
    assert out["controller/max_staleness"] == 1.0 and out["controller/action"] == -1.0
    assert m.buffer.admission_staleness == 1 and m.buffer.max_staleness == 3
    # rollout.deviation_bound_trained (default): the admitted data is held to the bound too
    assert m.buffer.hand_off_staleness == 1 and m.controller.config.immediate_cut
    m.buffer.set_train_version(2)  # engines 2 versions behind: admitted at 3, not at 1
    assert not m.buffer.can_start(engine_version=0)
    assert "rollout/busy_fraction" not in out  # not started: no engines to measure

    cfg = RolloutConfig(
        deviation_target=0.05, max_staleness=3, max_concurrent_episodes=8,
        deviation_bound_trained=False,
    )  # fmt: skip
    m = RolloutManager(cfg, make_formatter(), [], run_dir=tmp_path, group_size=2)
    assert not m.controller.config.immediate_cut
    m.observe_step({"deviation/abs_one_minus_ratio_mean": 0.06})
    assert m.buffer.admission_staleness == 1 and m.buffer.hand_off_staleness == 3


def test_hand_off_bound_drops_what_it_leaves_behind():
    from sao_megatron.rollout.buffer import StalenessBuffer
    from tests.rollout.test_units import traj

    def buffer_with(eta_hand_off):
        buf = StalenessBuffer(trajectories_per_batch=2, max_staleness=3)
        for i, v in enumerate([0, 2]):  # newest tokens at versions 0 and 2
            buf.mark_started()
            buf.put_group([traj(f"t{i}", [v])])
        buf.set_admission_staleness(1, hand_off=eta_hand_off)
        return buf

    kept = buffer_with(False)
    kept.set_train_version(3)  # lags 3 and 1: both within max_staleness 3
    assert kept.num_ready() == 2 and kept.stats["num_stale_dropped"] == 0
    held = buffer_with(True)
    held.set_train_version(3)  # lag 3 > 1: dropped (its capacity freed), lag 1 kept
    assert held.num_ready() == 1 and held.stats["num_stale_dropped"] == 1
    assert held.num_started() == 1
