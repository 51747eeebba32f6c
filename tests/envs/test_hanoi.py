import itertools
import random
from collections import deque

import pytest
import reasoning_gym

from sao_megatron.envs import make_env
from sao_megatron.envs.hanoi import (
    HanoiConfig,
    HanoiEnv,
    gold_move,
    is_legal,
    legal_moves,
    optimal_distance,
    optimal_moves,
    state_after_optimal_moves,
)

RG_HANOI = reasoning_gym.create_dataset("tower_of_hanoi", seed=0, size=1)


def _bfs_distances(n: int, target: int) -> dict:
    """Reference: exact distances to 'all disks on target' over all 3^n states (BFS)."""
    goal = tuple([target] * n)
    dist = {goal: 0}
    queue = deque([goal])
    while queue:
        s = queue.popleft()
        for mv in legal_moves(s):  # moves are reversible, so BFS from the goal is exact
            d = next(i for i, p in enumerate(s) if p == mv[0])
            t = list(s)
            t[d] = mv[1]
            t = tuple(t)
            if t not in dist:
                dist[t] = dist[s] + 1
                queue.append(t)
    return dist


def _simulate(n, moves, src):
    state = [src] * n
    for a, b in moves:
        d = min(i for i, p in enumerate(state) if p == a)
        state[d] = b
    return tuple(state)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7])
def test_state_after_k_optimal_moves_matches_simulation(n):
    for src, dst in [(0, 2), (1, 0), (2, 1)]:
        moves = optimal_moves(n, src, dst)
        assert len(moves) == 2**n - 1
        for k in range(len(moves) + 1):
            assert state_after_optimal_moves(n, k, src, dst) == _simulate(n, moves[:k], src)


@pytest.mark.parametrize("n", [1, 3, 5])
def test_distance_and_gold_move_agree_with_bfs_on_every_state(n):
    for target in range(3):
        dist = _bfs_distances(n, target)
        assert len(dist) == 3**n  # every state is reachable
        for state, d in dist.items():
            assert optimal_distance(state, target) == d
            mv = gold_move(state, target)
            if d == 0:
                assert mv is None
                continue
            assert is_legal(state, mv)
            s = list(state)
            s[min(i for i, p in enumerate(state) if p == mv[0])] = mv[1]
            assert dist[tuple(s)] == d - 1


@pytest.mark.parametrize("horizon", [1, 7, 50, 64, 200, 500])
def test_reset_leaves_exactly_h_optimal_moves(horizon):
    env = HanoiEnv(horizon=horizon)
    for seed in range(5):
        env.reset(seed)
        assert 2**env.num_disks - 1 >= horizon
        assert env.remaining_optimal_moves() == horizon
        assert env.max_steps == horizon


def test_reproducible_by_seed():
    a, b = HanoiEnv(horizon=50), HanoiEnv(horizon=50)
    obs = {a.reset(s) for s in range(10)}
    assert len(obs) > 1  # seeds vary disk count / pegs
    for s in range(10):
        assert a.reset(s) == b.reset(s)
        rng_a, rng_b = random.Random(1), random.Random(1)
        for _ in range(20):
            act_a, _ = a.noisy_gold_action(rng_a, 0.3)
            act_b, _ = b.noisy_gold_action(rng_b, 0.3)
            assert act_a == act_b
            ra, rb = a.step(act_a), b.step(act_b)
            assert ra == rb
            if ra.done or ra.truncated:
                break


@pytest.mark.parametrize("horizon", [50, 200, 500])
def test_gold_solver_reaches_reward_one_and_scorer_agrees(horizon):
    env = make_env("hanoi", horizon=horizon)
    for seed in range(2):
        env.reset(seed)
        total, steps = 0.0, 0
        while True:
            r = env.step(env.gold_action())
            total += r.reward
            steps += 1
            if r.done or r.truncated:
                break
        assert (total, steps, r.done, r.truncated, r.info["success"]) == (
            1.0,
            horizon,
            True,
            False,
            True,
        )
        answer = env.reasoning_gym_answer()
        assert len(answer.splitlines()) == 2**env.num_disks - 1
        assert RG_HANOI.score_answer(answer, env.reasoning_gym_entry()) == 1.0


def test_scorer_agrees_on_noisy_runs():
    """reward 1 <=> reasoning-gym scores the full move list 1.0 (defaults: budget = H)."""
    outcomes = set()
    env = HanoiEnv(horizon=12, max_steps_factor=1.0)
    for seed in range(30):
        env.reset(seed)
        rng = random.Random(seed)
        eps = 0.0 if seed % 3 == 0 else 0.2
        while True:
            act, _ = env.noisy_gold_action(rng, eps)
            r = env.step(act)
            if r.done or r.truncated:
                break
        score = RG_HANOI.score_answer(env.reasoning_gym_answer(), env.reasoning_gym_entry())
        assert (r.reward == 1.0) == (score == 1.0)
        if r.reward == 0.0:
            assert score == 0.05  # legal moves that did not finish: scorer's "valid, unsolved"
        outcomes.add(r.reward)
    assert outcomes == {0.0, 1.0}


def test_larger_budget_solves_after_a_mistake():
    env = HanoiEnv(horizon=10, max_steps_factor=3.0)
    assert env.max_steps == 30
    env.reset(4)
    wrong = [m for m in legal_moves(env.state) if m != gold_move(env.state, env.target_peg)][0]
    r = env.step(env.format_move(wrong))
    assert r.reward == 0.0 and not r.done and "error" not in r.info
    assert env.remaining_optimal_moves() > 9  # the mistake cost moves
    while not (r.done or r.truncated):
        r = env.step(env.gold_action())  # gold from an off-path state
    assert r.reward == 1.0 and r.info["success"]
    # reasoning-gym then gives proportional credit (more moves than optimal); ours is binary
    score = RG_HANOI.score_answer(env.reasoning_gym_answer(), env.reasoning_gym_entry())
    assert score == pytest.approx((2**env.num_disks - 1) / (env.num_prefix_moves + len(env.moves)))


@pytest.mark.parametrize(
    "action",
    [
        "",
        "   ",
        "garbage",
        "move disk 1",
        "a->c",
        "A->A",
        "A -> C",
        "A->D",
        "A->C B->A",
        "A->C\nB->C",
        None,
        17,
    ],
)
def test_malformed_actions_end_episode_with_zero(action):
    env = HanoiEnv(horizon=20)
    env.reset(0)
    state = env.state
    r = env.step(action)
    assert (r.reward, r.done, r.truncated, r.observation) == (0.0, True, False, "")
    assert r.info["error"] == "malformed" and r.info["success"] is False
    assert env.state == state
    with pytest.raises(RuntimeError, match="finished episode"):
        env.step("A->B")


def test_whole_solution_in_one_step_is_rejected():
    env = HanoiEnv(horizon=30)
    env.reset(2)
    gold = [env.format_move(m) for m in _gold_sequence(env)]
    assert len(gold) == 30
    for text in ["\n".join(gold), " ".join(gold), ", ".join(gold), ";".join(gold)]:
        env.reset(2)
        r = env.step(text)
        assert (r.reward, r.done, r.info["error"]) == (0.0, True, "malformed")


def _gold_sequence(env):
    state, out = env.state, []
    while (mv := gold_move(state, env.target_peg)) is not None:
        out.append(mv)
        s = list(state)
        s[min(i for i, p in enumerate(state) if p == mv[0])] = mv[1]
        state = tuple(s)
    return out


def test_illegal_moves_and_whitespace():
    env = HanoiEnv(horizon=20)
    env.reset(1)
    illegal = [m for m in itertools.permutations(range(3), 2) if not is_legal(env.state, m)]
    assert illegal
    r = env.step(env.format_move(illegal[0]))
    assert (r.reward, r.done, r.info["error"]) == (0.0, True, "illegal")
    env.reset(1)
    r = env.step("  " + env.gold_action() + "\n")  # surrounding whitespace is allowed
    assert "error" not in r.info and not r.done and env.remaining_optimal_moves() == 19


def test_invalid_action_can_be_a_costly_no_op():
    env = HanoiEnv(horizon=5, invalid_action_ends_episode=False, invalid_action_reward=-0.5)
    env.reset(0)
    before = env.render()
    r = env.step("nonsense")
    assert (r.reward, r.done, r.truncated, r.observation) == (-0.5, False, False, before)
    for _ in range(3):
        r = env.step(env.gold_action())
    r = env.step("nonsense")  # step 5 = budget: truncated, not solved
    assert (r.reward, r.done, r.truncated) == (-0.5, False, True)


def test_truncation_when_budget_runs_out():
    env = HanoiEnv(horizon=8)
    env.reset(3)
    rng = random.Random(0)
    results = []
    for _ in range(8):
        act, _ = env.noisy_gold_action(rng, 0.999)  # always a legal, wrong move
        results.append(env.step(act))
        if results[-1].done or results[-1].truncated:
            break
    last = results[-1]
    assert len(results) == 8
    assert (last.reward, last.done, last.truncated, last.info["success"]) == (
        0.0,
        False,
        True,
        False,
    )


def test_observation_format_and_labels():
    env = HanoiEnv(horizon=3, extra_disks=0, peg_labels="XYZ")
    obs = env.reset(0)
    assert env.num_disks == 2
    lines = obs.splitlines()
    assert [ln[:2] for ln in lines[-3:]] == ["X:", "Y:", "Z:"]
    disks = sorted(int(t) for ln in lines[-3:] for t in ln[2:].split())
    assert disks == [1, 2]
    r = env.step(env.gold_action())
    assert r.observation == env.render() and len(r.observation.splitlines()) == 3
    assert env.parse_action("X->Z") == (0, 2) and env.parse_action("A->C") is None


@pytest.mark.parametrize(
    "options, field",
    [
        ({"horizon": 0}, "horizon"),
        ({"max_steps_factor": 0.5}, "max_steps_factor"),
        ({"peg_labels": "AAB"}, "peg_labels"),
        ({"horizon": 5000, "max_disks": 10}, "max_disks"),
        ({"extra_disks": -1}, "extra_disks"),
    ],
)
def test_config_errors_name_the_field(options, field):
    with pytest.raises(ValueError, match=f"hanoi.{field}"):
        HanoiConfig(**options)
    with pytest.raises(ValueError, match="unknown option"):
        make_env("hanoi", horizn=5)
