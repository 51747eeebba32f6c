"""RolloutManager against in-process fake engines: batching, GRPO groups, weight-sync protocol,
faults (dead/hung engines, env exceptions, malformed replies) and the staleness bound."""

from __future__ import annotations

import time

import pytest
import torch

from sao_megatron.rollout.config import RolloutConfig
from sao_megatron.rollout.manager import RolloutManager, Task, round_robin_tasks
from tests.rollout.fakes import (
    CountEnv,
    FakeEngineClient,
    FakeProcess,
    make_formatter,
    short_long_tasks,
)


def make_manager(
    tmp_path, tasks=None, initial_version=0, group_size=1, **overrides
) -> RolloutManager:
    kw = dict(
        engine_urls=["http://fake0", "http://fake1"],
        max_model_len=1024,
        max_tokens_per_action=16,
        trajectories_per_batch=4,
        max_concurrent_episodes=8,
        max_staleness=1,
        request_timeout_s=60.0,  # generous: a loaded machine must not time out healthy fakes
        startup_timeout_s=0.5,
        seed=0,
    )
    kw.update(overrides)
    tasks = tasks if tasks is not None else round_robin_tasks({"count": CountEnv})
    return RolloutManager(
        RolloutConfig(**kw),
        make_formatter(),
        tasks,
        client_factory=FakeEngineClient,
        initial_version=initial_version,
        run_dir=tmp_path,
        group_size=group_size,
    )


def finite_tasks(n, **env_kw):
    return [Task(task_id=f"t{i}", make_env=lambda: CountEnv(**env_kw), seed=i) for i in range(n)]


def test_batches_versions_and_weight_sync_protocol(fakes, tmp_path):
    with make_manager(tmp_path) as m:
        b0 = m.get_batch(train_version=0, timeout=300)
        assert len(b0) == 4 and len({t.task_id for t in b0}) == 4
        assert all(v == 0 for t in b0 for n in t.nodes for v in n.policy_versions)
        res = m.publish_weights({"w": torch.zeros(2)}, version=1)
        assert sorted(r.engine for r in res.reports) == ["engine0", "engine1"]
        assert all(e.version == "1" and e.reloads == [res.path] for e in fakes)
        assert all(r.pause_s >= 0 for r in res.reports) and not res.failed_engines
        seen_new = False
        for step in range(1, 4):
            batch = m.get_batch(train_version=step, timeout=300)
            assert all(step - t.max_policy_version <= 1 for t in batch)
            # tokens of the synced weights (any later version too: under load the v1
            # trajectories can all be consumed or overtaken before a batch holds one)
            seen_new |= any(t.max_policy_version >= 1 for t in batch)
            assert all(v <= step for t in batch for n in t.nodes for v in n.policy_versions)
            m.publish_weights({"w": torch.full((2,), float(step))}, version=step + 1)
        assert seen_new
        stats = m.stats()
        assert stats["rollout/trajectories"] >= 16 and stats["engine/engine0/num_requests"] > 0


def test_grpo_groups_are_contiguous_and_complete(fakes, tmp_path):
    with make_manager(tmp_path, trajectories_per_batch=8, group_size=4) as m:
        batch = m.get_batch(0, timeout=300)
    ids = [t.task_id for t in batch]
    assert ids[:4] == [ids[0]] * 4 and ids[4:] == [ids[4]] * 4 and ids[0] != ids[4]
    assert [t.group_index for t in batch] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_dead_engine_loses_no_task_and_counts_none_twice(fakes, tmp_path):
    n = 24
    with make_manager(
        tmp_path, tasks=finite_tasks(n, max_len=4), max_concurrent_episodes=8, max_staleness=100
    ) as m:
        for e in fakes:
            e.token_latency_s = 0.002
        got = m.get_batch(0, timeout=300)
        fakes[1].mode = "dead"  # dies with requests in flight; no restart possible (remote)
        for _ in range(n // 4 - 1):
            got += m.get_batch(0, timeout=300)
        deadline = time.monotonic() + 5  # remote engine: dropped after startup_timeout_s
        while not m.counters["engines_dropped"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert m.counters["requeued_engine"] >= 1 and m.counters["engines_dropped"] == 1
        assert m.router.loads[1].healthy is False
    assert sorted(t.task_id for t in got) == sorted(f"t{i}" for i in range(n))


def test_local_engine_that_dies_while_idle_is_restarted_at_once(fakes, tmp_path):
    """Before the watchdog a dead engine was found only by the next request sent to it: one
    that died with nothing in flight stayed down, marked healthy (a 900-s hang of the vLLM
    test when no request of the killed engine was in flight)."""
    procs = [FakeProcess(f"http://fake{i}", e) for i, e in enumerate(fakes)]
    cfg = RolloutConfig(
        engine_urls=[p.url for p in procs],
        max_model_len=1024,
        max_tokens_per_action=16,
        trajectories_per_batch=4,
        max_concurrent_episodes=4,
        max_staleness=100,
        max_engine_restarts=1,
        request_timeout_s=60.0,
        seed=0,
    )
    with RolloutManager(
        cfg,
        make_formatter(),
        finite_tasks(4),
        client_factory=FakeEngineClient,
        processes=procs,
        run_dir=tmp_path,
    ) as m:
        m.publish_weights({"w": torch.zeros(2)}, version=1)
        m.get_batch(1, timeout=300)  # the four tasks are done: no request is in flight now
        requests = [len(e.requests) for e in fakes]
        procs[1].kill()
        deadline = time.monotonic() + 60
        while not (m.counters["engine_restarts"] and 1 in m.router.healthy_indices()):
            assert time.monotonic() < deadline, m.stats()
            time.sleep(0.05)
        assert [len(e.requests) for e in fakes] == requests  # found with no request sent
        assert procs[1].starts == 1 and m.counters["engine_failures"] == 1
        assert fakes[1].version == "1" and m.engine_versions == [1, 1]  # resynced to v1
        assert procs[0].starts == 0


def test_hung_engine_times_out_and_recovers(fakes, tmp_path):
    with make_manager(
        tmp_path, tasks=finite_tasks(12), request_timeout_s=0.3, max_staleness=100
    ) as m:
        fakes[0].mode = "hang"
        got = m.get_batch(0, timeout=300)
        fakes[0].mode = "ok"
        got += m.get_batch(0, timeout=300) + m.get_batch(0, timeout=300)
        assert m.counters["requeued_engine"] >= 1
    assert sorted(t.task_id for t in got) == sorted(f"t{i}" for i in range(12))


def test_env_exception_and_malformed_reply_drop_only_that_episode(fakes, tmp_path):
    tasks = [
        Task(
            task_id=f"t{i}",
            make_env=(lambda i=i: CountEnv(max_len=3, raise_on_step=1 if i % 4 == 0 else None)),
            seed=i,
        )
        for i in range(20)
    ]
    with make_manager(tmp_path, tasks=tasks, max_staleness=100) as m:
        got = m.get_batch(0, timeout=300) + m.get_batch(0, timeout=300)
        fakes[1].mode = "malformed"  # every later reply of engine1 is garbled
        # How many tasks land on engine1 max_episode_attempts times (and are dropped) depends
        # on the router's timing; what must hold is the accounting below.
        with pytest.raises(RuntimeError, match="task source is exhausted"):
            while True:
                got += m.get_batch(0, timeout=300)
        left, failed = m.buffer.num_ready(), m.counters["failed_groups"]
        assert m.counters["requeued_engine"] >= 1  # a garbled reply retries the task first
    ids = [t.task_id for t in got]
    assert len(ids) == len(set(ids)) and len(ids) >= 8
    assert not {f"t{i}" for i in range(0, 20, 4)} & set(ids)  # the env bug drops its task
    assert failed >= 5 and left < 4
    assert len(ids) + left + failed == 20  # every other task was trained on or is waiting


def test_staleness_bound_holds_under_a_slow_trainer(fakes, tmp_path):
    with make_manager(
        tmp_path,
        tasks=finite_tasks(400, max_len=5),
        max_staleness=1,
        trajectories_per_batch=4,
        max_concurrent_episodes=8,
    ) as m:
        lags = []
        for step in range(5):
            batch = m.get_batch(train_version=step, timeout=300)
            lags += [step - t.max_policy_version for t in batch]
            time.sleep(0.3)  # slow trainer: the rollout would run far ahead without the rule
            m.publish_weights({"w": torch.zeros(1)}, version=step + 1)
            started = m.buffer.num_started()
            assert started <= (step + 1 + 1 + 1) * 4  # AReaL capacity (v + eta + 1) * B
        assert 0 <= min(lags) and max(lags) <= 1


def test_resumed_run_starts_at_its_version_and_counts_capacity_from_there(fakes, tmp_path):
    m = make_manager(
        tmp_path, max_staleness=0, trajectories_per_batch=4, max_concurrent_episodes=32
    )
    m.initial_version = 7  # as RolloutManager(..., initial_version=7) from a checkpoint
    m.buffer.set_train_version(7)
    with m:
        batch = m.get_batch(train_version=7, timeout=300)
        time.sleep(0.3)
        # AReaL rule from this run's start: (0 + eta + 1) * B = 4 started before any update
        assert m.buffer.num_started() == 4
    assert all(v == 7 for t in batch for n in t.nodes for v in n.policy_versions)
    assert all(e.version == "7" for e in fakes)


def test_long_episodes_are_not_starved_by_the_staleness_bound(fakes, tmp_path):
    """Issue 19.1: one task in 8 lasts 150 turns (~5 trainer steps). With max_staleness=1 such
    episodes used to be aborted as stale, requeued and finally dropped, so only the short ones
    were trained (0 long of 80 here). Now they keep generating across versions and are trained
    in proportion to the mix (minus the ones still running at the end); every trained
    trajectory's newest token is within the bound (older ones are the trainer's to mask)."""
    tasks = short_long_tasks(4000, long_every=8, long_steps=150)
    with make_manager(
        tmp_path,
        tasks=tasks,
        max_model_len=8192,
        max_staleness=1,
        trajectories_per_batch=4,
        max_concurrent_episodes=16,
    ) as m:
        for e in fakes:
            e.token_latency_s = 0.002
        trained = []
        for step in range(20):
            batch = m.get_batch(train_version=step, timeout=300)
            assert all(step - t.max_policy_version <= 1 for t in batch)
            trained += batch
            time.sleep(0.25)  # slow trainer: a long episode outlives several versions
            m.publish_weights({"w": torch.zeros(1)}, version=step + 1)
        counters = dict(m.counters)
    long = [t for t in trained if t.task_id.startswith("long/")]
    assert counters.get("failed_groups", 0) == 0 and counters.get("requeued_stale", 0) == 0
    assert len(long) >= 3, (len(long), len(trained), counters)  # 1/8 of 80 = 10 in the mix
    assert all(len(t.nodes) == 150 and t.terminated for t in long)
    assert max(t.max_policy_version - t.min_policy_version for t in long) >= 2


class _BrokenEnv(CountEnv):
    def reset(self, seed: int) -> str:
        raise KeyError(f"no task for seed {seed}")


def test_a_rollout_failing_every_episode_stops_with_the_first_error(fakes, tmp_path):
    """Issue 19.5: instead of spinning (and flooding the log) until the trainer's timeout, the
    rollout stops after MAX_CONSECUTIVE_FAILURES failed groups with no success in between."""
    from sao_megatron.rollout.manager import MAX_CONSECUTIVE_FAILURES

    tasks = (Task(task_id=f"b{i}", make_env=_BrokenEnv, seed=i) for i in range(10**6))
    with make_manager(tmp_path, tasks=tasks) as m:
        with pytest.raises(RuntimeError, match=r"16 episode groups in a row failed") as e:
            m.get_batch(0, timeout=60)
        assert MAX_CONSECUTIVE_FAILURES == 16
        assert "the first error: EpisodeError: b0: env.reset(0) raised KeyError" in str(e.value)
        assert MAX_CONSECUTIVE_FAILURES <= m.counters["failed_groups"] < 40
    # (spinning until the trainer's timeout would have raised TimeoutError, not RuntimeError)


def test_occasional_failures_do_not_stop_the_rollout(fakes, tmp_path):
    tasks = [
        Task(task_id=f"t{i}", make_env=(_BrokenEnv if i % 2 else CountEnv), seed=i)
        for i in range(200)
    ]
    with make_manager(tmp_path, tasks=tasks, max_staleness=100) as m:
        for _ in range(5):
            assert len(m.get_batch(0, timeout=300)) == 4
        assert m.counters["failed_groups"] >= 16  # more failures than the limit, interleaved


def test_get_batch_timeout_reports_the_time_waited_and_the_counts(fakes, tmp_path):
    """Issue 19.5: the message used to give the last 1-second poll's time ("after 0.69 s")."""
    for e in fakes:  # before the manager starts: no episode may finish first (a race on a
        e.mode = "hang"  # loaded machine: 3 did when this was set inside the block)
    with make_manager(tmp_path, request_timeout_s=60.0) as m:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError) as e:
            m.get_batch(0, timeout=2.5)
        waited = time.monotonic() - t0
    msg = str(e.value)
    assert waited >= 2.4  # it waited its timeout (no upper bound: a loaded machine is slow)
    assert "no batch of 4 trajectories at train_version=0 after 2.5 s" in msg
    assert "0 admissible ready, 8 episodes in flight, 0 trajectories finished" in msg
    assert "0 groups failed" in msg and "2/2 engines healthy" in msg


def test_observe_step_measures_the_busy_fraction_of_the_step(fakes, tmp_path):
    with make_manager(tmp_path, max_staleness=0) as m:  # no controller: the measurement alone
        m.get_batch(train_version=0, timeout=300)
        m.observe_step({})  # the window starts here
        time.sleep(0.5)  # synchronous: nothing may start before version 1 is published
        out = m.observe_step({})
        assert set(out) == {"rollout/busy_fraction"}
        assert 0.0 <= out["rollout/busy_fraction"] < 0.05, out
        for e in fakes:
            e.token_latency_s = 0.05
        seen = [len(e.requests) for e in fakes]
        m.publish_weights({"w": torch.zeros(2)}, version=1)  # (resumes the engines) admits more
        for e in fakes:  # requests in flight now stay outstanding: the engines count as busy
            e.unpaused.clear()
        deadline = time.monotonic() + 300  # wait for a request on every engine, not a fixed nap
        while any(len(e.requests) <= n for e, n in zip(fakes, seen, strict=True)):
            assert time.monotonic() < deadline, "no request reached every engine in 300 s"
            time.sleep(0.05)
        m.observe_step({})
        time.sleep(0.5)
        busy = m.observe_step({})["rollout/busy_fraction"]
        for e in fakes:
            e.unpaused.set()
        assert busy > 0.95, busy


class _SecondMemberFails:
    """make_env of a task whose every second episode (GRPO member 1 of 2) raises on step 2."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> CountEnv:
        self.calls += 1
        return CountEnv(max_len=3, raise_on_step=2 if self.calls % 2 == 0 else None)


def _tokens(trajectories) -> int:
    return sum(len(n.action_token_ids) for t in trajectories for n in t.nodes)


def test_token_accounting_generated_consumed_discarded(fakes, tmp_path):
    """Every sampled token ends up handed to the trainer, discarded with a failed group (its
    finished members included) or dropped as stale; here with exactly 1 token per action:
    tasks t0..t9 last 1 + i % 3 actions; t2 and t5 (3 actions) fail in member 1 at step 2, so
    each wastes 3 (member 0, finished) + 2 (member 1) tokens; the rest train 2 x 13 tokens."""
    tasks = [
        Task(
            task_id=f"t{i}",
            make_env=_SecondMemberFails() if i in (2, 5) else (lambda: CountEnv(max_len=3)),
            seed=i,
        )
        for i in range(10)
    ]
    with make_manager(
        tmp_path,
        tasks=tasks,
        group_size=2,
        max_tokens_per_action=1,
        max_staleness=100,
    ) as m:
        got = []
        for _ in range(4):
            got += m.get_batch(0, timeout=300)
        with pytest.raises(RuntimeError, match="task source is exhausted"):
            m.get_batch(0, timeout=60)  # also waits until nothing is in flight
        stats = m.stats()
    assert sorted({t.task_id for t in got}) == sorted(f"t{i}" for i in range(10) if i not in (2, 5))
    assert _tokens(got) == 2 * 13 == stats["rollout/consumed_tokens"]
    assert stats["rollout/discarded_tokens"] == 2 * (3 + 2) and stats["rollout/failed_groups"] == 2
    assert stats["rollout/generated_tokens"] == 36 == sum(e.generated for e in fakes)
    assert (
        stats.get("rollout/stale_dropped_tokens", 0) == 0 and stats["rollout/pending_tokens"] == 0
    )


def test_stale_dropped_groups_count_their_tokens(fakes, tmp_path):
    with make_manager(tmp_path, trajectories_per_batch=4, max_concurrent_episodes=8) as m:
        m.get_batch(0, timeout=300)
        deadline = time.monotonic() + 60
        while m.buffer.num_ready() < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        stale = m.buffer.set_train_version(3)  # the trainer moved on: version-0 data is stale
        stats = m.stats()
    assert len(stale) >= 4 and stats["rollout/requeued_stale"] == len(stale)
    assert stats["rollout/stale_dropped_tokens"] == _tokens(t for g in stale for t in g) > 0
    assert stats["rollout/generated_tokens"] == (
        stats["rollout/consumed_tokens"]
        + stats["rollout/stale_dropped_tokens"]
        + stats["rollout/pending_tokens"]
    )
