"""MetricsLogger: values round-trip through metrics.jsonl and the TensorBoard event file;
non-finite values become null with a warning; only the logging rank writes; Timer; memory."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from sao_megatron.trainer import metrics as metrics_mod
from sao_megatron.trainer.metrics import (
    LoggingConfig,
    MetricsLogger,
    Timer,
    peak_memory_gib,
    read_metrics,
    reset_peak_memory,
)


def _values(step: int) -> dict:
    return {
        "reward/mean": 0.1 * step + 0.25,
        "reward/success_rate": torch.tensor(step / 10.0, dtype=torch.float64),
        "loss/policy": np.float32(-0.5 + step / 7.0),
        "episode/length_mean": step * 3,
        "stage": "rl",
    }


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="logging.log_interval=0"):
        LoggingConfig(log_interval=0)


def test_jsonl_and_tensorboard_round_trip(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = LoggingConfig(console=False)
    with MetricsLogger(cfg, tmp_path / "run", is_logging_rank=True) as logger:
        for step in range(1, 6):
            logger.log(step, _values(step))
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    for r in records:
        s = r["step"]
        assert r["reward/mean"] == 0.1 * s + 0.25  # float64 exactly through JSON
        assert r["reward/success_rate"] == s / 10.0
        assert r["loss/policy"] == float(np.float32(-0.5 + s / 7.0))
        assert r["episode/length_mean"] == s * 3 and r["stage"] == "rl"
    assert "throughput/steps_per_s" not in records[0]
    assert all(r["throughput/steps_per_s"] > 0 for r in records[1:])

    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    assert "stage" not in acc.Tags()["scalars"]
    for key in ("reward/mean", "reward/success_rate", "loss/policy", "episode/length_mean"):
        events = acc.Scalars(key)
        assert [e.step for e in events] == [1, 2, 3, 4, 5]
        for e in events:
            expected = float(_values(e.step)[key])
            assert e.value == pytest.approx(expected, rel=1e-6, abs=1e-7)  # TB stores float32


def test_non_finite_written_as_null_with_warning(tmp_path):
    cfg = LoggingConfig(console=False, tensorboard=False)
    with MetricsLogger(cfg, tmp_path, is_logging_rank=True) as logger:
        logger.log(1, {"loss/value": 1.5})
        with pytest.warns(UserWarning, match="metric 'loss/value' is nan at step 2"):
            logger.log(2, {"loss/value": float("nan"), "grad_norm/policy": 2.0})
        with pytest.warns(UserWarning, match="'grad_norm/policy' is inf"):
            logger.log(3, {"loss/value": torch.tensor(0.5), "grad_norm/policy": math.inf})
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["loss/value"] for r in records] == [1.5, None, 0.5]
    assert [r.get("grad_norm/policy", "absent") for r in records] == ["absent", 2.0, None]
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text


def test_log_interval_force_and_non_logging_rank(tmp_path):
    cfg = LoggingConfig(console=False, log_interval=3)
    with MetricsLogger(cfg, tmp_path / "a", is_logging_rank=True) as logger:
        for step in range(1, 8):
            logger.log(step, {"reward/mean": float(step)}, force=step == 7)
    assert [r["step"] for r in read_metrics(tmp_path / "a")] == [3, 6, 7]
    silent = LoggingConfig(console=True)
    with MetricsLogger(silent, tmp_path / "b", is_logging_rank=False) as logger:
        logger.log(1, {"reward/mean": 1.0})
    assert not (tmp_path / "b").exists()


def test_bad_values_name_the_key(tmp_path):
    cfg = LoggingConfig(console=False, tensorboard=False)
    with MetricsLogger(cfg, tmp_path, is_logging_rank=True) as logger:
        with pytest.raises(TypeError, match="metric 'loss/policy': expected a scalar"):
            logger.log(1, {"loss/policy": torch.zeros(3)})
        with pytest.raises(TypeError, match="metric 'x'"):
            logger.log(1, {"x": [1, 2]})


def test_progress_bar_shows_reward_success_deviation_rate(tmp_path, capsys):
    cfg = LoggingConfig(tensorboard=False, console=True)
    with MetricsLogger(cfg, tmp_path, is_logging_rank=True, total_steps=4) as logger:
        for step in range(1, 4):
            logger.log(
                step,
                {
                    "reward/mean": 0.5,
                    "reward/success_rate": 0.25,
                    "deviation/abs_one_minus_ratio_mean": 0.0125,
                },
            )
    err = capsys.readouterr().err
    assert "3/4" in err and "reward=0.5" in err and "success=0.25" in err
    assert "dev=0.0125" in err and "step/s=" in err
    assert "eta=" not in err and "route=" not in err  # absent metrics are not shown


def test_progress_shows_routing_mismatch_and_controller_bound(tmp_path, capsys):
    cfg = LoggingConfig(tensorboard=False, console=True)
    with MetricsLogger(cfg, tmp_path, is_logging_rank=True, total_steps=1) as logger:
        logger.log(1, {"deviation/routing_mismatch_frac": 0.0184, "controller/max_staleness": 2})
    err = capsys.readouterr().err
    assert "route=0.0184" in err and "eta=2" in err


def test_wandb_missing_warns(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    cfg = LoggingConfig(console=False, tensorboard=False, wandb=True)
    with pytest.warns(UserWarning, match="logging.wandb=True but wandb is not installed"):
        MetricsLogger(cfg, tmp_path, is_logging_rank=True).close()


def test_timer_accumulates_per_phase(monkeypatch):
    clock = iter([10.0, 10.5, 20.0, 21.25, 30.0, 30.125])
    monkeypatch.setattr(metrics_mod.time, "perf_counter", lambda: next(clock))
    timer = Timer()
    with timer.phase("rollout"):
        pass
    with timer.phase("policy"):
        pass
    with pytest.raises(RuntimeError), timer.phase("rollout"):  # errors are still timed
        raise RuntimeError
    assert timer.summary() == {"time/rollout": 0.625, "time/policy": 1.25}
    assert timer.summary() == {}


def test_peak_memory_is_at_least_current_rss():
    block = np.ones(64 * 2**20 // 8)  # 64 MiB touched
    peak = peak_memory_gib()["memory/peak_rss_gib"]
    assert peak >= psutil.Process().memory_info().rss / 2**30 * 0.999
    assert peak >= block.nbytes / 2**30


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux /proc only")
def test_reset_peak_memory_starts_a_new_window():
    block = np.ones(256 * 2**20 // 8)  # 256 MiB touched, then freed
    high = peak_memory_gib()["memory/peak_rss_gib"]
    del block
    assert reset_peak_memory()
    low = peak_memory_gib()["memory/peak_rss_gib"]
    assert high - low > 0.2  # the freed 256 MiB no longer counts
    assert low >= psutil.Process().memory_info().rss / 2**30 * 0.999
