"""Each failure status injected into agent episodes run by the real `RolloutManager` (router,
buffer, requeue policy; fake engines): ``env_error``, ``agent_error``, ``engine_error``,
``timeout`` and ``aborted_stale`` episodes are counted per status and never reach a training
batch, so none of their tokens or rewards reaches the loss; only ``completed`` and ``truncated``
episodes are packed, with the rewards their agents returned."""

from __future__ import annotations

import asyncio

import openai

from sao_megatron.data.batch import pack_trajectories
from sao_megatron.envs.base import task_id
from sao_megatron.rollout.config import RolloutConfig
from sao_megatron.rollout.engine import EngineError
from sao_megatron.rollout.gateway import AgentEnvironment
from sao_megatron.rollout.manager import RolloutManager, agent_tasks
from sao_megatron.rollout.status import call_step
from tests.rollout.fakes import FakeEngine, FakeEngineClient
from tests.rollout.test_gateway import formatter, smollm2_tok_dir  # noqa: F401 (fixtures)

#: the status injected into the episode of seed s is KINDS[s % 7]
KINDS = (
    "completed",
    "truncated",
    "env_error",
    "agent_error",
    "engine_error",
    "timeout",
    "aborted_stale",
)
FAILURES = KINDS[2:]
REQUEUED = {"engine_error", "aborted_stale"}  # rollout.requeue_statuses (the default)
MAX_TURNS = 2


def kind_of(seed: int) -> str:
    return KINDS[seed % len(KINDS)]


def reward_of(seed: int) -> float:
    return 0.125 * (1 + seed % 5)


def _broken_tool(arg: str) -> str:
    raise OSError("sandbox crashed (injected)")


async def agent(task: dict, client) -> float:
    """Two turns, then the reward; each kind of failure injected after the first reply."""
    kind, msgs = task["kind"], [{"role": "user", "content": f"task {task['seed']}"}]
    for turn in range(10):
        try:
            r = await client.chat.completions.create(model="policy", messages=msgs)
        except openai.BadRequestError:  # the turn budget is spent: the episode is truncated
            return task["reward"]
        msgs.append({"role": "assistant", "content": r.choices[0].message.content})
        if kind == "env_error":
            await call_step(_broken_tool, "x", timeout_s=5.0, what="tool")
        if kind == "agent_error":
            raise KeyError("agent bug (injected)")
        if kind == "timeout":
            await asyncio.sleep(60.0)  # past rollout.step_timeout_s
        if kind != "truncated" and turn == 1:
            return task["reward"]
        msgs.append({"role": "user", "content": f"turn {turn + 1}"})
    raise AssertionError("unreachable: max_turns truncates the episode")


class InjectingAgentEnvironment(AgentEnvironment):
    """Engine failures and stale tokens come from the rollout side: the engine call of an
    ``engine_error`` episode raises `EngineError`; every token of an ``aborted_stale`` episode
    counts as too old."""

    async def run(self, *, seed, generate, is_stale=lambda version: False, **kw):
        if kind_of(seed) == "engine_error":

            async def generate(episode_id, prompt, max_tokens, request_seed):
                raise EngineError("engine0: connection refused (injected)")

        if kind_of(seed) == "aborted_stale":
            is_stale = lambda version: True  # noqa: E731
        return await super().run(seed=seed, generate=generate, is_stale=is_stale, **kw)


def make_task(seed: int) -> dict:
    return {"seed": seed, "kind": kind_of(seed), "reward": reward_of(seed)}


def test_no_failed_episode_reaches_the_loss(formatter, tmp_path):  # noqa: F811
    FakeEngineClient.registry = {"http://fake0": FakeEngine("engine0", vocab=300)}
    cfg = RolloutConfig(
        engine_urls=["http://fake0"],
        max_model_len=1024,
        max_tokens_per_action=8,
        trajectories_per_batch=4,
        max_concurrent_episodes=4,
        request_timeout_s=5.0,
        seed=0,
        step_timeout_s=2.0,  # well above the agent's own time on a loaded 2-core machine
        max_episode_attempts=3,
    )
    tasks = agent_tasks(
        "inject", lambda: InjectingAgentEnvironment(agent, make_task, max_turns=MAX_TURNS)
    )
    try:
        with RolloutManager(
            cfg, formatter, tasks, client_factory=FakeEngineClient, run_dir=tmp_path
        ) as m:
            batches = [m.get_batch(train_version=0, timeout=60) for _ in range(3)]
            stats = m.stats()
            attempts = dict(m.attempts)
    finally:
        FakeEngineClient.registry = {}

    trained = [t for b in batches for t in b]
    assert len(trained) == 12
    for t in trained:
        seed = int(t.task_id.rsplit(":", 1)[1])
        assert kind_of(seed) in ("completed", "truncated"), t.task_id
        assert t.status == kind_of(seed) == t.info["status"]
        assert t.nodes[-1].reward == reward_of(seed) and t.total_reward == reward_of(seed)
        assert len(t.nodes) == MAX_TURNS
        assert t.truncated == (t.status == "truncated")
    # what the loss is computed from: the packed batches hold exactly the trained trajectories
    for b in batches:
        packed = pack_trajectories(b, pad_token_id=formatter.hf.pad_token_id, max_seq_len=1024)
        assert packed.task_ids == [t.task_id for t in b]
        assert packed.num_action_tokens == sum(t.num_action_tokens for t in b)
        totals = packed.node_rewards.sum(1).tolist()
        assert totals == [reward_of(int(t.task_id.rsplit(":", 1)[1])) for t in b]

    # every injected failure happened, was counted under its status, and never reached a batch
    for kind in FAILURES:
        assert stats[f"episodes/{kind}"] >= 1, (kind, stats)
    assert stats["episodes/completed"] + stats["episodes/truncated"] >= 12
    assert stats["episodes/completed"] >= 1 and stats["episodes/truncated"] >= 1
    # the requeue policy: engine_error / aborted_stale retried up to max_episode_attempts,
    # the others dropped after one attempt (seeds of the first cycle have long finished)
    for seed in range(2, 7):
        want = cfg.max_episode_attempts if kind_of(seed) in REQUEUED else 1
        assert attempts[task_id("inject", seed)] == want, (seed, kind_of(seed), attempts)
    assert stats["rollout/failed_groups"] >= len(FAILURES)
    assert stats["episodes/trainable_fraction"] < 1.0
