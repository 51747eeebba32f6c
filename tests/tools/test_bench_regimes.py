"""tools/bench_regimes.py on tiny cells (seconds each): GRPO groups and distinct tasks, token
accounting against the manager's counters, and latency-wrapped episodes waiting concurrently."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
_spec = importlib.util.spec_from_file_location("bench_regimes", ROOT / "tools" / "bench_regimes.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_regimes"] = bench
_spec.loader.exec_module(bench)


@pytest.fixture(scope="module")
def formatter():
    from tests.rollout.fakes import make_formatter

    return make_formatter()


def _args(*extra: str):
    return bench.build_parser().parse_args(
        [
            "--budget-s",
            "1",
            "--warmup-steps",
            "1",
            "--sao-step-s",
            "0.05",
            "--grpo-step-s",
            "0.05",
            "--json",
            "",
            *extra,
        ]  # fmt: skip
    )


def test_trainer_bound_grpo_trains_whole_groups_and_sao_one_episode_per_task(formatter):
    args = _args()
    regime = bench.regimes(args)["trainer_bound"]
    grpo = bench.run_cell(regime, "grpo", 0, args, formatter)
    assert grpo["steps_measured"] >= 1 and grpo["trained"] == 16 * grpo["steps_measured"]
    assert grpo["distinct_tasks"] * 8 == grpo["trained"]  # exactly trained / G
    assert grpo["length_mean"] == 2.0 and grpo["dropped_tokens"] == 0
    assert grpo["trained_tokens"] == grpo["trained_tokens_counter"] > 0
    assert 0.0 <= grpo["trainer_idle_fraction"] < 1.0
    sao = bench.run_cell(regime, "sao", 0, args, formatter)
    assert sao["distinct_tasks"] == sao["trained"] == 16 * sao["steps_measured"]
    assert sao["group_size"] == 1 and sao["slot_hold_s_mean"] == sao["episode_wall_s_mean"]
    machine = dict(command="c", nproc=2, cpu="x", load_before="0", load_after="0", date="d")
    text = bench.report([sao, grpo], args, {**machine, "minutes": 0.1, "commit": "abc"})
    assert "| trainer_bound | SAO | 0.05 |" in text and "| trainer_bound | GRPO (G=8) |" in text
    assert text.rstrip().endswith("<!-- reading -->")


def test_dropped_groups_account_for_generated_minus_trained(formatter):
    """With step timeouts some GRPO groups fail: every token generated in the window is trained,
    dropped with a failed group, or still pending (in flight or buffered) at its end."""
    args = _args("--group-size", "2", "--batch", "4", "--concurrency", "8")
    regime = bench.Regime(
        "timeouts",
        latency="lognormal",
        latency_median_s=0.02,
        latency_shape=0.72,  # P(delay > 0.05 s) ~ 10% per step
        latency_max_s=1.0,
        length="constant",
        length_median=2,
        length_max=2,
        step_timeout_s=0.05,
    )
    r = bench.run_cell(regime, "grpo", 0, args, formatter)
    assert r["failed_groups"] >= 1 and r["dropped_tokens"] == r["discarded_tokens"] > 0
    assert r["trained_tokens"] == r["trained_tokens_counter"]  # batches vs the manager's counter
    assert r["generated_tokens"] - r["trained_tokens"] - r["dropped_tokens"] == (
        r["pending_tokens_end"] - r["pending_tokens_start"]
    )
    assert r["distinct_tasks"] * 2 == r["trained"]


def test_latency_wrapped_episodes_wait_concurrently(formatter):
    """16 episodes of 2 steps x 0.3 s in flight: a batch of 16 every ~0.6 s (~26 traj/s), not
    one episode after another (16 x 0.6 s per batch, 1.7 traj/s). Generous bounds: loaded CPU."""
    args = _args("--budget-s", "2")
    regime = bench.Regime(
        "latency",
        latency="constant",
        latency_median_s=0.3,
        latency_max_s=0.3,
        length="constant",
        length_median=2,
        length_max=2,
    )
    r = bench.run_cell(regime, "sao", 0, args, formatter)
    assert 0.6 <= r["episode_wall_s_mean"] < 2.0, r
    assert r["trained_per_s"] > 8.0, r
