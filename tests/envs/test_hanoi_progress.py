"""Hanoi's dense reward mode and the distance/progress facts every step reports."""

import math

import pytest

from sao_megatron.envs import make_env
from sao_megatron.envs.hanoi import (
    apply_move,
    gold_move,
    legal_moves,
    optimal_distance,
)


@pytest.mark.parametrize("horizon", [7, 50, 200])
def test_gold_play_earns_one_over_h_per_move_and_sums_to_one(horizon):
    env = make_env("hanoi", horizon=horizon, reward_mode="progress", success_reward=1.0)
    env.reset(seed=3)
    rewards, infos = [], []
    while not env.done:
        r = env.step(env.gold_action())
        rewards.append(r.reward)
        infos.append(r.info)
    assert len(rewards) == horizon and infos[-1]["success"]
    assert all(math.isclose(x, 1.0 / horizon, rel_tol=1e-12) for x in rewards)
    assert math.isclose(sum(rewards), 1.0, rel_tol=1e-9)
    assert [i["distance_to_goal"] for i in infos] == list(range(horizon - 1, -1, -1))
    assert infos[-1]["progress"] == 1.0


def test_moving_away_costs_and_illegal_move_ends_with_invalid_reward():
    env = make_env(
        "hanoi", horizon=20, reward_mode="progress", success_reward=2.0, invalid_action_reward=-0.5
    )
    env.reset(seed=11)
    state, target = env.state, env.target_peg
    gold = gold_move(state, target)
    away = next(m for m in legal_moves(state) if m != gold)
    d_after = optimal_distance(apply_move(state, away), target)
    r = env.step(env.format_move(away))
    assert d_after > 20
    assert r.reward == pytest.approx(2.0 * (20 - d_after) / 20)
    assert r.info["distance_to_goal"] == d_after
    assert r.info["progress"] == pytest.approx(1 - d_after / 20)
    assert not r.done
    r = env.step("not a move")
    assert r.done and r.reward == -0.5 and r.info["distance_to_goal"] == d_after


def test_sparse_mode_still_reports_progress_and_pays_only_on_success():
    env = make_env("hanoi", horizon=5)
    env.reset(seed=0)
    out = [env.step(env.gold_action()) for _ in range(5)]
    assert [o.reward for o in out] == [0.0, 0.0, 0.0, 0.0, 1.0]
    assert [o.info["progress"] for o in out] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])


def test_bad_reward_mode_names_the_field():
    with pytest.raises(ValueError, match="hanoi.reward_mode"):
        make_env("hanoi", horizon=5, reward_mode="dense")


def test_short_instructions_name_disks_and_goal_and_keep_the_state():
    full = make_env("hanoi", horizon=30)
    short = make_env("hanoi", horizon=30, instructions="short")
    a, b = full.reset(seed=4), short.reset(seed=4)
    assert short.state == full.state and short.target_peg == full.target_peg
    goal = "ABC"[short.target_peg]
    assert (
        b.splitlines()[0]
        == f"Hanoi {short.num_disks} disks, goal peg {goal}, one move X->Y per turn."
    )
    assert b.splitlines()[1:] == a.splitlines()[1:] and len(b) < len(a) / 2
    with pytest.raises(ValueError, match="hanoi.instructions"):
        make_env("hanoi", horizon=5, instructions="terse")
