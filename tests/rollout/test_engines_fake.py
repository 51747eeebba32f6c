"""EngineFleet on fake engines: the start weights go through `load` (the one hand-off, a
publisher slot), a strict load names the failed engine, a restarted engine resyncs to them, and
`stop` stops only the engines the fleet started."""

from __future__ import annotations

import time

import pytest
import torch

from sao_megatron.rollout.config import RolloutConfig
from sao_megatron.rollout.engine_client import EngineError
from sao_megatron.rollout.engines import EngineFleet
from sao_megatron.rollout.manager import RolloutManager
from tests.rollout.fakes import FakeEngineClient, FakeProcess, make_formatter
from tests.rollout.test_manager_fake import finite_tasks


def _cfg(**kw) -> RolloutConfig:
    base = dict(
        engine_urls=["http://fake0", "http://fake1"],
        max_model_len=1024,
        max_tokens_per_action=16,
        trajectories_per_batch=4,
        max_concurrent_episodes=4,
        max_staleness=100,
        max_engine_restarts=1,
        request_timeout_s=60.0,
        startup_timeout_s=0.5,
        seed=0,
    )
    return RolloutConfig(**(base | kw))


def test_start_weights_are_a_publisher_slot_and_a_restart_resyncs_to_them(fakes, tmp_path):
    procs = [FakeProcess(f"http://fake{i}", e) for i, e in enumerate(fakes)]
    fleet = EngineFleet(_cfg(), run_dir=tmp_path, client_factory=FakeEngineClient, processes=procs)
    res = fleet.load({"w": torch.ones(2)}, version=5, strict=True)  # starts the fleet
    assert res.path == str(tmp_path / "weights" / "slot1" / "model.safetensors")
    assert all(e.version == "5" and e.reloads == [res.path] for e in fakes)
    assert fleet.engine_versions == [5, 5] and fleet.serving_version() == 5
    assert fleet.urls == ["http://fake0", "http://fake1"]  # what evaluation is given
    # the manager runs on this fleet: episodes at version 5, nothing restarted or re-loaded
    m = RolloutManager(_cfg(), make_formatter(), finite_tasks(4), fleet=fleet, initial_version=5)
    with m:
        batch = m.get_batch(5, timeout=300)
        assert all(v == 5 for t in batch for n in t.nodes for v in n.policy_versions)
        procs[1].kill()  # the watchdog restarts it; the resync loads the start weights again
        deadline = time.monotonic() + 60
        while not (m.counters["engine_restarts"] and 1 in m.router.healthy_indices()):
            assert time.monotonic() < deadline, m.stats()
            time.sleep(0.05)
        assert fakes[1].reloads == [res.path, res.path] and fakes[1].version == "5"
    assert [p.exit_code for p in procs] == [None, None]  # adopted: left running


def test_a_strict_load_names_the_engine_that_failed(fakes, tmp_path):
    fleet = EngineFleet(_cfg(), run_dir=tmp_path, client_factory=FakeEngineClient)
    try:
        fleet.start()
        fakes[0].mode = "dead"
        with pytest.raises(EngineError, match="engine0"):
            fleet.load({"w": torch.ones(2)}, version=1, strict=True)
        fakes[0].mode = "ok"
        res = fleet.load({"w": torch.zeros(2)}, version=2)  # not strict: failures recovered
        assert "engine1" in [r.engine for r in res.reports]
    finally:
        fleet.stop()
    fleet.stop()  # idempotent
