"""Unit tests of the rollout logic: config, router, buffer/admission, runner, weight slots."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from sao_megatron.data.trajectory import ActionNode, Trajectory
from sao_megatron.rollout.buffer import StalenessBuffer
from sao_megatron.rollout.config import RolloutConfig
from sao_megatron.rollout.engine import Generation, MalformedReplyError
from sao_megatron.rollout.router import Router
from sao_megatron.rollout.runner import EpisodeError, run_episode
from sao_megatron.rollout.staleness import stale_token_fraction, stale_token_mask
from sao_megatron.weight_sync.publisher import WeightPublisher
from tests.rollout.fakes import CountEnv, make_formatter


def traj(task_id: str, versions: list[int], group_index: int = 0) -> Trajectory:
    node = ActionNode(
        observation_token_ids=[1, 5],
        action_token_ids=[7] * len(versions),
        behaviour_logprobs=[-0.5] * len(versions),
        policy_versions=versions,
        reward=1.0,
    )
    return Trajectory(task_id=task_id, nodes=[node], group_index=group_index, info={"seed": 0})


# ------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "field,value,match",
    [
        ("temperature", 0.0, "rollout.temperature=0.0"),
        ("top_p", 1.5, "rollout.top_p=1.5"),
        ("dtype", "fp8", "rollout.dtype='fp8'"),
        ("max_staleness", -1, "rollout.max_staleness=-1"),
        ("engine_urls", ["localhost:8000"], "rollout.engine_urls"),
        ("num_engines", 0, "rollout.num_engines=0"),
        ("max_tokens_per_action", 5000, "rollout.max_tokens_per_action=5000"),
    ],
)
def test_config_errors_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=match.replace("[", r"\[")):
        RolloutConfig(**{field: value})


def test_config_batch_must_hold_whole_groups():
    assert RolloutConfig(trajectories_per_batch=8).launches_engines


# ------------------------------------------------------------------------------- router
def test_router_least_outstanding_tokens_then_affinity_then_overload():
    r = Router(["a", "b"], ["a", "b"], affinity_overload_factor=2.0)
    assert r.choose("ep1", 100) == 0  # tie -> first
    r.begin(0, "ep1", 50, 100)
    assert r.choose("ep2", 100) == 1  # a has 100 outstanding, b 0
    r.begin(1, "ep2", 50, 100)
    r.end(0, 100, 30)
    # ep2's engine b has 100 outstanding, a has 0: 100+100 <= 2*(0+100) -> affinity holds
    assert r.choose("ep2", 100) == 1
    assert r.loads[1].affinity_hits == 1
    r.begin(1, "x", 10, 300)  # b now 400 outstanding: 400+100 > 2*(0+100) -> overloaded
    assert r.choose("ep2", 100) == 0
    r.set_healthy(0, False)
    assert r.choose("ep9", 10) == 1
    r.set_healthy(1, False)
    with pytest.raises(RuntimeError, match="no healthy engine"):
        r.choose("ep9", 10)
    u = r.utilisation()
    assert u["a"]["generated_tokens"] == 30 and u["b"]["num_requests"] == 2
    assert 0.0 <= u["a"]["utilisation"] <= 1.0 and u["b"]["utilisation"] > 0


def test_router_spreads_uniform_load_evenly():
    r = Router([0, 1, 2], ["e0", "e1", "e2"])
    for k in range(30):  # 30 concurrent requests of equal cost, then all finish
        r.begin(r.choose(f"ep{k}", 64), f"ep{k}", 32, 64)
    assert [ld.outstanding_requests for ld in r.loads] == [10, 10, 10]


# ------------------------------------------------------------------------------- buffer
def test_areal_capacity_rule():
    b = StalenessBuffer(trajectories_per_batch=4, group_size=2, max_staleness=1)
    started = 0
    while b.can_start(engine_version=0):
        b.mark_started()
        started += 2
    assert started == (0 + 1 + 1) * 4  # (v + eta + 1) * B
    assert not b.can_start(0) and b.can_start(1)
    b.mark_discarded()  # a discarded group frees its capacity
    assert b.can_start(0)


def test_admission_needs_engines_within_the_bound_and_counts_from_the_base_version():
    b = StalenessBuffer(trajectories_per_batch=2, max_staleness=1)
    b.set_train_version(5)
    assert not b.can_start(engine_version=3, base_version=3)  # engines 2 versions behind
    assert b.can_start(engine_version=4, base_version=3)
    for _ in range(4):  # (4 - 3 + 1 + 1) * 2 = 6 started allowed
        b.mark_started()
    assert b.can_start(4, base_version=3)
    b.mark_started()
    b.mark_started()
    assert not b.can_start(4, base_version=3) and b.can_start(5, base_version=3)


def test_hand_off_drops_only_groups_without_a_token_within_the_bound():
    """Issue 19.1: a trajectory is kept while its newest token is within the bound (its older
    tokens are masked by the trainer); only one with every token too old is dropped."""
    dropped = []
    b = StalenessBuffer(trajectories_per_batch=2, max_staleness=1, on_stale=dropped.append)
    for _ in range(4):
        b.mark_started()
    b.put_group([traj("old", [0, 0])])
    b.put_group([traj("long", [0, 1])])  # started 2 versions ago, still generating at v1
    b.put_group([traj("new", [2, 2])])
    batch = b.get_batch(train_version=2, timeout=1)
    assert [t.task_id for t in batch] == ["long", "new"]
    assert [g[0].task_id for g in dropped] == ["old"]
    assert all(2 - t.max_policy_version <= 1 for t in batch)
    assert b.stats["last_lag_max"] == 2 and b.stats["num_stale_dropped"] == 1
    assert b.stats["last_stale_token_fraction"] == pytest.approx(1 / 4)  # the v0 token of "long"
    assert b.num_started() == 3  # the dropped one no longer counts as started
    with pytest.raises(TimeoutError, match="no batch of 2"):
        b.get_batch(train_version=2, timeout=0.05)


def test_stale_token_mask_and_fraction_by_hand():
    versions = torch.tensor([[-1, 0, 1, 2, -1], [-1, -1, 3, 3, 1]])
    stale = stale_token_mask(versions, train_version=3, max_staleness=1)
    assert stale.tolist() == [
        [False, True, True, False, False],
        [False, False, False, False, True],
    ]
    assert not stale_token_mask(versions, 3, max_staleness=3).any()
    assert stale_token_mask(versions, 3, max_staleness=0).sum() == 4  # all but the v3 tokens
    mask = versions >= 0
    assert stale_token_fraction(versions, mask, 3, 1) == pytest.approx(3 / 6)
    with pytest.raises(ValueError, match="rollout.max_staleness=-1"):
        stale_token_mask(versions, 3, -1)
    with pytest.raises(ValueError, match="integer"):
        stale_token_mask(versions.float(), 3, 1)


def test_double_buffer_next_batch_fills_while_trainer_holds_previous():
    b = StalenessBuffer(trajectories_per_batch=2, group_size=2, max_staleness=5)
    b.put_group([traj("a", [0]), traj("a", [0], 1)])
    b.put_group([traj("b", [0]), traj("b", [0], 1)])
    first = b.get_batch(0, timeout=1)
    assert [t.task_id for t in first] == ["a", "a"] and b.num_ready() == 2  # next one sealed
    with pytest.raises(ValueError, match="expected 2"):
        b.put_group([traj("c", [0])])
    assert [t.task_id for t in b.get_batch(0, timeout=1)] == ["b", "b"]


def test_buffer_is_thread_safe_under_concurrent_producers_and_consumer():
    b = StalenessBuffer(trajectories_per_batch=5, max_staleness=100)
    n_prod, per = 4, 50

    def produce(p):
        for k in range(per):
            b.put_group([traj(f"{p}/{k}", [0])])

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(n_prod)]
    for t in threads:
        t.start()
    got = []
    for _ in range(n_prod * per // 5):
        got += [t.task_id for t in b.get_batch(0, timeout=300)]
    for t in threads:
        t.join()
    assert sorted(got) == sorted(f"{p}/{k}" for p in range(n_prod) for k in range(per))


# ------------------------------------------------------------------------------- runner
def _fake_generate(versions=(0,), malformed_at=None, cut_at=None):
    calls = []

    async def generate(eid, prompt, max_tokens, seed):
        calls.append(list(prompt))
        if malformed_at is not None and len(calls) == malformed_at:
            raise MalformedReplyError("bad json")
        k = len(calls)
        v = list(versions)[min(k - 1, len(versions) - 1)]
        if cut_at is not None and len(calls) == cut_at:  # max_tokens reached before <|eoa|>
            n = max_tokens
            return Generation([10 + k] * n, [-0.1] * n, [v] * n, "length")
        ids = [10 + k, 20 + k, 6]  # 6 = <|eoa|> of the test tokenizer
        return Generation(ids, [-0.1 * k, -0.2, -0.3], [v, v, v + 1], "stop")

    return generate, calls


def test_runner_full_history_records_tokens_logprobs_versions_rewards():
    fmt = make_formatter()
    cfg = RolloutConfig(temperature=0.7, top_p=0.9, max_model_len=512, max_tokens_per_action=16)
    gen, calls = _fake_generate(versions=(3, 4, 5))
    env = CountEnv(max_len=3)
    t = asyncio.run(
        run_episode(env=env, seed=2, task_id="count/2", formatter=fmt, generate=gen, config=cfg)
    )
    assert len(t.nodes) == 3 and t.terminated and not t.truncated
    assert (t.temperature, t.top_p, t.context_mode) == (0.7, 0.9, "full_history")
    assert [n.reward for n in t.nodes] == [1.0, 1.0, 11.0]
    assert t.nodes[1].policy_versions == [4, 4, 5] and t.nodes[2].behaviour_logprobs[
        0
    ] == pytest.approx(-0.3)
    seq = t.to_token_sequence()
    # each prompt sent to the engine is exactly the trajectory prefix before that action
    for prompt in calls:
        act_start = len(prompt)
        assert seq.token_ids[:act_start].tolist() == prompt
        assert seq.action_mask[act_start : act_start + 3].all()
        assert not seq.action_mask[: len(fmt.prompt_ids("count 3 steps"))].any()
    assert t.nodes[0].observation_token_ids == fmt.prompt_ids("count 3 steps")
    assert t.nodes[1].observation_token_ids == fmt.observation_ids("state=1")


def test_runner_window_mode_keeps_prompt_plus_last_turns():
    fmt = make_formatter(context_mode="window", window_size=1)
    cfg = RolloutConfig(max_model_len=512, max_tokens_per_action=16)
    gen, calls = _fake_generate()
    t = asyncio.run(
        run_episode(
            env=CountEnv(max_len=3), seed=2, task_id="w", formatter=fmt, generate=gen, config=cfg
        )
    )
    p0 = fmt.prompt_ids("count 3 steps")
    assert calls[2] == p0 + t.nodes[1].action_token_ids + fmt.observation_ids("state=2")
    assert t.context_mode == "window" and t.nodes[2].context_token_ids == calls[2]


def test_runner_errors_end_only_the_episode():
    fmt = make_formatter()
    cfg = RolloutConfig(max_model_len=512, max_tokens_per_action=16)
    with pytest.raises(EpisodeError, match="env.step raised RuntimeError"):
        asyncio.run(
            run_episode(
                env=CountEnv(max_len=3, raise_on_step=2),
                seed=2,
                task_id="e",
                formatter=fmt,
                generate=_fake_generate()[0],
                config=cfg,
            )
        )
    with pytest.raises(EpisodeError, match="bad json"):
        asyncio.run(
            run_episode(
                env=CountEnv(),
                seed=2,
                task_id="m",
                formatter=fmt,
                generate=_fake_generate(malformed_at=2)[0],
                config=cfg,
            )
        )


def test_runner_truncates_at_turn_budget_and_context_length():
    fmt = make_formatter()
    gen, _ = _fake_generate()
    cfg = RolloutConfig(max_model_len=512, max_tokens_per_action=16, max_turns=2)
    t = asyncio.run(
        run_episode(
            env=CountEnv(max_len=3), seed=2, task_id="t", formatter=fmt, generate=gen, config=cfg
        )
    )
    assert len(t.nodes) == 2 and t.truncated and not t.terminated
    p0 = len(fmt.prompt_ids("count 3 steps"))
    cfg = RolloutConfig(max_model_len=p0 + 4, max_tokens_per_action=2)
    t = asyncio.run(
        run_episode(
            env=CountEnv(max_len=3),
            seed=2,
            task_id="t",
            formatter=fmt,
            generate=_fake_generate()[0],
            config=cfg,
        )
    )
    assert len(t.nodes) == 1 and t.truncated and t.info["truncated_by"] == "max_model_len"


# ------------------------------------------------------------------------------- weight slots
def test_publisher_alternates_slots_atomically(tmp_path):
    pub = WeightPublisher(tmp_path)
    w1 = {"a.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3).t()}  # non-contiguous
    p1 = pub.publish(w1, version=1)
    p2 = pub.publish(iter([("a.weight", torch.ones(3, 2, dtype=torch.bfloat16))]), version=2)
    assert p1.parent.name == "slot1" and p2.parent.name == "slot0"
    assert torch.equal(load_file(p1)["a.weight"], w1["a.weight"])  # v1 intact beside v2
    assert load_file(p2)["a.weight"].dtype == torch.bfloat16
    assert not list(tmp_path.rglob(".tmp-*"))
    with pytest.raises(ValueError, match="does not advance"):
        pub.publish(w1, version=2)
    with pytest.raises(TypeError, match="not a torch.Tensor"):
        pub.publish({"x": [1.0]}, version=3)


def test_router_time_averaged_load():
    r = Router(["a", "b"], ["a", "b"])
    r.reset_stats()
    r.begin(0, "x", 1, 10)
    r.begin(0, "y", 1, 10)
    time.sleep(0.2)
    r.end(0, 10, 5)
    r.end(0, 10, 5)
    time.sleep(0.2)
    u = r.utilisation()
    # 2 requests for 0.2 s out of ~0.4 s: mean 1.0 in flight, busy half the time
    assert u["a"]["mean_outstanding_requests"] == pytest.approx(1.0, abs=0.15)
    assert u["a"]["utilisation"] == pytest.approx(0.5, abs=0.1)
    assert u["b"]["mean_outstanding_requests"] == 0.0 and u["b"]["utilisation"] == 0.0


def test_runner_action_cut_at_its_token_budget_truncates_the_episode():
    """Issue 19.7: finish_reason 'length' is an incomplete action: not passed to the env,
    recorded as a truncated last node, and the trajectory is truncated (GAE bootstraps)."""
    fmt = make_formatter()
    cfg = RolloutConfig(max_model_len=512, max_tokens_per_action=5)
    steps = []
    env = CountEnv(max_len=3)
    real_step = env.step
    env.step = lambda a: steps.append(a) or real_step(a)
    gen, calls = _fake_generate(cut_at=2)
    t = asyncio.run(
        run_episode(env=env, seed=2, task_id="c", formatter=fmt, generate=gen, config=cfg)
    )
    assert len(calls) == 2 and len(steps) == 1  # the cut action never reached the env
    assert len(t.nodes) == 2 and t.truncated and not t.terminated
    assert [n.truncated for n in t.nodes] == [False, True]
    assert t.nodes[1].action_token_ids == [12] * 5 and t.nodes[1].reward == 0.0
    assert t.info["truncated_by"] == "max_tokens_per_action"
    t.validate()
    t.nodes[0].truncated = True  # a cut node may sit anywhere (a gateway agent goes on)
    t.validate()


class _SlowCountEnv(CountEnv):
    """CountEnv whose step blocks for `delay_s` (a tool call, a sandbox command)."""

    def __init__(self, delay_s: float, **kw) -> None:
        super().__init__(**kw)
        self.delay_s = delay_s

    def step(self, action):
        time.sleep(self.delay_s)
        return super().step(action)


def test_runner_slow_blocking_env_steps_do_not_block_other_episodes():
    """8 episodes x 3 blocking steps of 0.2 s: concurrently they overlap (worker threads), so
    they take well under the sequential time measured in the same test."""
    fmt, cfg = make_formatter(), RolloutConfig(max_model_len=512, max_tokens_per_action=16)

    async def one(i):
        gen, _ = _fake_generate(versions=(0,))
        env = _SlowCountEnv(0.2, max_len=3)
        return await run_episode(
            env=env, seed=2, task_id=f"count/{i}", formatter=fmt, generate=gen, config=cfg
        )

    async def sequential():
        return [await one(i) for i in range(8)]

    async def concurrent():
        return await asyncio.gather(*[one(i) for i in range(8)])

    t0 = time.perf_counter()
    assert all(len(t.nodes) == 3 for t in asyncio.run(sequential()))
    t_seq = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert all(len(t.nodes) == 3 for t in asyncio.run(concurrent()))
    t_conc = time.perf_counter() - t0
    assert t_seq >= 8 * 3 * 0.2
    assert t_conc < 0.6 * t_seq, (t_conc, t_seq)  # >= 5 worker threads overlap on 2 cores
