"""The step-latency wrapper: heavy-tailed seeded delays, and episodes that wait concurrently."""

import asyncio
import random
import time

import pytest

from sao_megatron.envs import make_env
from sao_megatron.envs.heavy_tail import heavy_tailed_quantile, sample_heavy_tailed
from sao_megatron.envs.latency import LatencyConfig, LatencyEnv, astep, make_latency_env
from tests.rollout.fakes import CountEnv, FakeEngine, FakeEngineClient


@pytest.mark.parametrize("dist, shape", [("lognormal", 1.0), ("lognormal", 0.5), ("pareto", 1.5)])
def test_draws_match_the_closed_form_quantiles(dist, shape):
    rng = random.Random(0)
    xs = sorted(sample_heavy_tailed(rng, dist, 0.2, shape, 1e9) for _ in range(40000))
    for q in (0.1, 0.5, 0.9, 0.99):
        empirical = xs[int(q * len(xs))]
        assert empirical == pytest.approx(heavy_tailed_quantile(dist, 0.2, shape, q), rel=0.06)
    assert heavy_tailed_quantile(dist, 0.2, shape, 0.5) == pytest.approx(0.2, rel=1e-12)
    capped = [sample_heavy_tailed(rng, dist, 0.2, shape, 1.0) for _ in range(5000)]
    assert max(capped) == 1.0 and min(capped) > 0  # the cap binds on the tail


def test_known_quantiles_by_hand():
    # lognormal: median * exp(sigma * 1.2815515655446004) at q = 0.9
    assert heavy_tailed_quantile("lognormal", 2.0, 0.5, 0.9) == pytest.approx(
        2.0 * 1.8979527074, rel=1e-9
    )
    # Pareto alpha = 2: x_m = median / sqrt(2); q = 0.75 -> x_m * 0.25^(-1/2) = 2 x_m
    assert heavy_tailed_quantile("pareto", 1.0, 2.0, 0.75) == pytest.approx(2 / 2**0.5, rel=1e-12)
    rng = random.Random(0)
    assert sample_heavy_tailed(rng, "constant", 0.3, 1.0, 9.0) == 0.3
    assert sample_heavy_tailed(rng, "none", 0.3, 1.0, 9.0) == 0.0


def test_delays_are_seeded_per_episode_and_forwarded_attributes_work():
    def delays(seed, episode):
        env = LatencyEnv(make_env("hanoi", horizon=5), LatencyConfig(median_s=0.0, seed=seed))
        env.reset(episode)
        return [env.next_delay() for _ in range(5)]

    cfg = LatencyConfig(median_s=0.01, max_s=0.05, seed=3)
    env = LatencyEnv(make_env("hanoi", horizon=5), cfg)
    env.reset(1)
    first = [env.next_delay() for _ in range(5)]
    env.reset(1)
    assert [env.next_delay() for _ in range(5)] == first  # same episode seed: same delays
    env.reset(2)
    assert [env.next_delay() for _ in range(5)] != first
    assert delays(0, 1) == delays(0, 1) == [0.0] * 5  # median 0: no wait
    env.reset(1)
    t0 = time.perf_counter()
    total = 0.0
    while not env.done:  # attribute forwarding: `done`, `gold_action` of the Hanoi env
        r = env.step(env.gold_action())
        total += r.info["env_latency_s"]
    assert r.info["success"] and r.info["env_latency_total_s"] == pytest.approx(total)
    assert time.perf_counter() - t0 >= total  # step() really waited
    assert env.name == "hanoi" and env.max_steps == 5


def test_registry_factory_and_config_errors():
    env = make_latency_env(
        env={"name": "hanoi", "options": {"horizon": 7}}, distribution="pareto", median_s=0.0
    )
    assert isinstance(env, LatencyEnv) and env.config.distribution == "pareto"
    assert make_latency_env(median_s=0.0).env.horizon == 3  # default wrapped env
    for options, field in [
        ({"distribution": "zipf"}, "distribution"),
        ({"median_s": -1.0}, "median_s"),
        ({"shape": 0.0}, "shape"),
        ({"median_s": 2.0, "max_s": 1.0}, "max_s"),
    ]:
        with pytest.raises(ValueError, match=f"latency.{field}"):
            LatencyConfig(**options)
    with pytest.raises(ValueError, match="unknown option"):
        make_latency_env(median=0.1)


class _BlockingEnv(CountEnv):
    """A CountEnv whose step blocks the calling thread (a synchronous tool call)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(max_len=3)
        self.delay_s = delay_s

    def step(self, action):
        time.sleep(self.delay_s)
        return super().step(action)


async def _episode(env, seed, client):
    """The rollout loop's calls for one episode (reset, generate, step) with a fake engine."""
    env.reset(seed)
    steps = 0
    while True:
        gen = await client.generate(
            [1, 2, 3], max_tokens=4, temperature=1.0, top_p=1.0, stop_token_ids=[2], seed=seed
        )
        result = await astep(env, str(gen.token_ids))
        steps += 1
        if result.done:
            return steps


@pytest.mark.parametrize("kind", ["astep", "thread", "wrapped_blocking"])
def test_eight_episodes_with_slow_steps_wait_concurrently(kind):
    FakeEngineClient.registry["fake://latency"] = FakeEngine("e0", token_latency_s=0.001)
    FakeEngineClient.registry["fake://latency"].version = "0"
    client = FakeEngineClient("fake://latency", "e0")

    def make():
        if kind == "astep":  # the wrapper's async step
            return LatencyEnv(CountEnv(max_len=3), LatencyConfig(distribution="constant"))
        if kind == "wrapped_blocking":  # no delay of its own; the wrapped step blocks 0.2 s
            return LatencyEnv(_BlockingEnv(0.2), LatencyConfig(distribution="none"))
        return _BlockingEnv(0.2)  # no astep: run in a worker thread

    seeds = [2] * 8  # 3 steps each, 0.2 s per step

    async def sequential():
        return [await _episode(make(), s, client) for s in seeds]

    async def concurrent():
        return await asyncio.gather(*[_episode(make(), s, client) for s in seeds])

    t0 = time.perf_counter()
    assert asyncio.run(sequential()) == [3] * 8
    t_seq = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert asyncio.run(concurrent()) == [3] * 8
    t_conc = time.perf_counter() - t0
    assert t_seq >= 8 * 3 * 0.2  # the delays are real
    # 8 episodes overlap: ~1/8 of sequential with astep; the default thread pool has
    # min(32, cpus + 4) workers, so >= 5 overlap with threads (<= 2/5 of sequential + slack)
    print(f"{kind}: sequential {t_seq:.2f} s, concurrent {t_conc:.2f} s")
    limit = 0.35 if kind == "astep" else 0.6  # (a wrapped blocking step runs in a thread too)
    assert t_conc < limit * t_seq, (t_conc, t_seq)
    assert t_conc >= 3 * 0.2  # one episode's own delays are still sequential


def test_register_makes_the_wrapper_buildable_by_name(monkeypatch):
    from sao_megatron.envs import base, latency

    assert "latency" in base.registered_envs()  # importing sao_megatron.envs registers it
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))  # leave the real one untouched
    del base._REGISTRY["latency"]
    assert "latency" not in base.registered_envs()
    latency.register()
    latency.register()  # idempotent
    env = make_env("latency", env={"name": "hanoi", "options": {"horizon": 4}}, median_s=0.0)
    assert isinstance(env, LatencyEnv) and env.reset(0) and env.max_steps == 4


def test_the_rollout_manager_runs_latency_envs_concurrently(tmp_path):
    """Through the real RolloutManager (runner -> call_step -> LatencyEnv.astep): 16 one-step
    episodes with a 0.5 s delay each fill a batch of 16 in about 0.5 s, not 16 x 0.5 s."""
    from sao_megatron.rollout.config import RolloutConfig
    from sao_megatron.rollout.manager import RolloutManager, Task
    from tests.rollout.fakes import make_formatter

    FakeEngineClient.registry = {"http://fake-latency": FakeEngine("e0", token_latency_s=0.001)}
    delay = LatencyConfig(distribution="constant", median_s=0.5, max_s=0.5)
    tasks = [
        Task(task_id=f"t{i}", make_env=lambda: LatencyEnv(CountEnv(max_len=1), delay), seed=i)
        for i in range(16)
    ]
    cfg = RolloutConfig(
        engine_urls=["http://fake-latency"],
        max_model_len=256,
        max_tokens_per_action=8,
        trajectories_per_batch=16,
        max_concurrent_episodes=16,
        max_staleness=1,
        request_timeout_s=60.0,
        seed=0,
    )
    formatter = make_formatter()
    try:
        t0 = time.perf_counter()
        with RolloutManager(
            cfg, formatter, tasks, client_factory=FakeEngineClient, run_dir=tmp_path
        ) as m:
            batch = m.get_batch(0, timeout=120)
            waited = time.perf_counter() - t0
    finally:
        FakeEngineClient.registry = {}
    assert len(batch) == 16 and all(len(t.nodes) == 1 for t in batch)
    assert all(t.info["env_latency_total_s"] == 0.5 for t in batch)
    assert 0.5 <= waited < 16 * 0.5 / 2, waited  # one step's delay; sequential would be 8 s
