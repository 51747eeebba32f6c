"""Misbehaving GEM environments end their episode with the right status, through our runner and
the real `RolloutManager` (fake engines), on real GEM games: malformed actions (GEM's format
penalty, a real reward), a game that raises in step or reset or returns a NaN reward (env_error,
never trained), one that never terminates (our step cap truncates it), GEM's truncation without
termination (bootstrapped), observations past the context limit (truncated, or dropped when the
first prompt does not fit), actions cut at the token limit."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from gem.envs.game_env.guess_the_number import GuessTheNumberEnv
from gem.envs.registration import ENV_REGISTRY, register

from sao_megatron.data.batch import pack_trajectories
from sao_megatron.envs import make_env
from sao_megatron.rollout.config import RolloutConfig
from sao_megatron.rollout.episode_status import EpisodeStatus, is_trainable
from sao_megatron.rollout.manager import RolloutManager, Task
from sao_megatron.rollout.runner import EpisodeError, run_episode
from sao_megatron.rollout.status import EnvStepError, classify_exception
from tests.rollout.fakes import FakeEngine, FakeEngineClient, make_formatter

GUESS = "game:GuessTheNumber-v0-easy"


class RaisingGuess(GuessTheNumberEnv):
    """GEM's GuessTheNumber whose step raises (a bug in the game)."""

    def step(self, action):
        raise KeyError("board state lost (injected)")


class ResetRaisingGuess(GuessTheNumberEnv):
    """Raises in reset for odd seeds (seed 0, which the options check builds, works)."""

    def reset(self, seed=None):
        if seed is not None and seed % 2:
            raise OSError("asset missing (injected)")
        return super().reset(seed)


class NanGuess(GuessTheNumberEnv):
    def step(self, action):
        obs, _, terminated, truncated, info = super().step(action)
        return obs, float("nan"), terminated, truncated, info


class TimeLimitGuess(GuessTheNumberEnv):
    """GEM's GuessTheNumber that reports a time limit as gymnasium does: truncated only."""

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        if self.turn_count >= 2 and not terminated:
            return obs, reward, False, True, info
        return obs, reward, terminated, truncated, info


for _cls in (RaisingGuess, ResetRaisingGuess, NanGuess, TimeLimitGuess):
    if f"test:{_cls.__name__}-v0" not in ENV_REGISTRY:  # GEM's registry is process-wide
        register(f"test:{_cls.__name__}-v0", _cls, min_number=1, max_number=10, max_turns=4)


def scripted(formatter, actions):
    """A stand-in engine replying with the given action texts in turn (the last one repeated)."""
    it = itertools.chain(actions, itertools.repeat(actions[-1]))

    async def generate(episode_id, prompt, max_tokens, seed):
        ids = formatter.action_ids(next(it))
        reason = "stop"
        if len(ids) > max_tokens:
            ids, reason = ids[:max_tokens], "length"
        from sao_megatron.rollout.engine import Generation

        return Generation(ids, [-0.5] * len(ids), [0] * len(ids), reason)

    return generate


def run(env, actions, seed=3, formatter=None, **rollout):
    formatter = formatter or make_formatter()
    cfg = RolloutConfig(**{"max_model_len": 4096, "max_tokens_per_action": 64, **rollout})
    return asyncio.run(
        run_episode(
            env=env,
            seed=seed,
            task_id=f"t:{seed}",
            formatter=formatter,
            generate=scripted(formatter, actions),
            config=cfg,
        )
    )


def failure(env, actions, **rollout) -> EpisodeError:
    with pytest.raises(EpisodeError) as info:
        run(env, actions, **rollout)
    return info.value


def test_malformed_action_is_gems_format_penalty_and_ends_the_episode():
    traj = run(make_env("gem", env_id=GUESS), ["I think it is five"])
    assert traj.status == "completed" and traj.terminated and not traj.truncated
    assert [n.reward for n in traj.nodes] == [-0.1]  # GEM's format_error_reward, a real reward
    assert traj.info["error"] == "malformed" and traj.info["success"] is False


def test_a_game_that_raises_is_an_env_error_never_trained():
    for env_id, match in [
        ("test:RaisingGuess-v0", "env.step raised KeyError"),
        ("test:ResetRaisingGuess-v0", r"env.reset\(3\) raised OSError"),
        ("test:NanGuess-v0", "GEM returned the reward nan"),
    ]:
        err = failure(make_env("gem", env_id=env_id), ["\\boxed{1}", "\\boxed{2}"])
        assert classify_exception(err) is EpisodeStatus.ENV_ERROR, env_id
        assert not is_trainable(classify_exception(err))
        assert err.args and match.replace("\\", "") in str(err).replace("\\", ""), str(err)
    err = failure(make_env("gem", env_id="test:RaisingGuess-v0"), ["\\boxed{1}"])
    assert isinstance(err, EnvStepError)


def test_a_game_that_never_ends_is_truncated_by_our_step_cap():
    """Repeating a guess or guessing out of range is legal in GEM (reward 0, the game goes on);
    with a turn limit of 1000 our max_turns (and rollout.max_turns, and the context limit) end
    the episode as truncated: bootstrapped."""
    env = make_env("gem", env_id=GUESS, kwargs={"max_turns": 1000}, max_turns=5)
    env.reset(3)
    wrong = 1 if env.game.game_number != 1 else 2
    traj = run(env, [f"\\boxed{{{wrong}}}"])
    assert traj.status == "truncated" and traj.truncated and not traj.terminated
    assert len(traj.nodes) == 5 and traj.total_reward == 0.0
    # without our cap the game's own 1000 turns apply; the context limit ends it first
    traj = run(make_env("gem", env_id=GUESS, kwargs={"max_turns": 1000}), ["\\boxed{11}"])
    assert traj.status == "truncated" and traj.info["truncated_by"] == "max_model_len"
    assert 10 < len(traj.nodes) < 1000
    traj = run(env, [f"\\boxed{{{wrong}}}"], max_turns=3)
    assert len(traj.nodes) == 3 and traj.truncated


def test_gems_truncation_without_termination_is_bootstrapped():
    traj = run(make_env("gem", env_id="test:TimeLimitGuess-v0"), ["\\boxed{11}"])
    assert traj.status == "truncated" and traj.truncated and not traj.terminated
    assert len(traj.nodes) == 2 and traj.info["gem_truncated"] and not traj.info["success"]


def test_observations_past_the_context_limit():
    """A later observation that leaves no room to generate truncates the episode at the context
    limit; a first observation that does not fit drops the episode (never trained)."""
    formatter = make_formatter()
    env = make_env("gem", env_id=GUESS)
    first = len(formatter.prompt_ids(env.reset(3)))
    action = len(formatter.action_ids("\\boxed{11}"))
    limit = first + action + 4  # the next observation does not fit
    traj = run(env, ["\\boxed{11}"], formatter=formatter, max_model_len=limit)
    assert traj.status == "truncated" and traj.info["truncated_by"] == "max_model_len"
    assert len(traj.nodes) == 1
    big = make_env("gem", env_id="game:Minesweeper-v0-hard")  # an 8x8 board in every turn
    err = failure(big, ["\\boxed{1 1}"], max_model_len=first)
    assert "first prompt leaves no room" in str(err)
    assert classify_exception(err) is EpisodeStatus.ENV_ERROR


def test_an_action_cut_at_the_token_limit_never_reaches_the_game():
    env = make_env("gem", env_id=GUESS)
    traj = run(env, ["let me think about this very carefully " * 4], max_tokens_per_action=8)
    assert traj.status == "truncated" and traj.nodes[-1].truncated
    assert traj.info["truncated_by"] == "max_tokens_per_action" and env.game.turn_count == 0


def test_misbehaving_games_never_reach_a_batch(tmp_path):
    """The real manager over GEM tasks (fake engines sample garbage: GEM's format penalty):
    games that raise or pay NaN are counted as env_error and dropped; every trained trajectory
    carries the reward GEM paid."""
    kinds = [GUESS, "test:RaisingGuess-v0", "test:NanGuess-v0", "test:ResetRaisingGuess-v0"]

    def tasks():
        for k in itertools.count():
            env_id = kinds[k % len(kinds)]
            yield Task(
                task_id=f"{env_id}/{k}", make_env=lambda e=env_id: make_env("gem", env_id=e), seed=k
            )

    FakeEngineClient.registry = {"http://fake0": FakeEngine("engine0", vocab=300)}
    cfg = RolloutConfig(
        engine_urls=["http://fake0"],
        max_model_len=2048,
        max_tokens_per_action=8,
        trajectories_per_batch=4,
        max_concurrent_episodes=4,
        request_timeout_s=30.0,
        seed=0,
    )
    formatter = make_formatter()
    try:
        with RolloutManager(
            cfg, formatter, tasks(), client_factory=FakeEngineClient, run_dir=tmp_path
        ) as m:
            batches = [m.get_batch(train_version=0, timeout=300) for _ in range(2)]
            stats = m.stats()
    finally:
        FakeEngineClient.registry = {}
    trained = [t for b in batches for t in b]
    assert len(trained) == 8
    assert all(t.task_id.startswith(GUESS + "/") for t in trained)
    assert all(t.status in ("completed", "truncated") for t in trained)
    for b in batches:
        packed = pack_trajectories(b, pad_token_id=0, max_seq_len=2048)
        totals = packed.node_rewards.sum(1).tolist()
        assert totals == pytest.approx([t.total_reward for t in b])
        assert all(x in (-0.1, 0.0) or x == pytest.approx(-0.1) for x in totals)
    assert stats["episodes/env_error"] >= 3
