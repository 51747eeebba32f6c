"""Hanoi `observation: disks` and `action_format: plan`: the plan's goals against breadth-first
search over every state, the parser, the rendering and the config errors."""

import collections
import itertools
import random

import pytest

from sao_megatron.data.demonstrations import run_demonstration
from sao_megatron.envs.hanoi import HanoiEnv, apply_move, is_legal, legal_moves, tower


def _bfs_distances(n, target):
    """Exact distances to the tower on `target` over all 3^n states (float-free reference)."""
    goal = tower(n, target)
    dist = {goal: 0}
    queue = collections.deque([goal])
    while queue:
        s = queue.popleft()
        for m in legal_moves(s):
            t = apply_move(s, m)
            if t not in dist:
                dist[t] = dist[s] + 1
                queue.append(t)
    return dist


def _parse_plan(text, labels="ABC"):
    """[(disk, peg, goal)] and the move from a plan action."""
    *plan, move = text.split()
    entries = [
        (int(plan[i]), labels.index(plan[i + 1]), labels.index(plan[i + 2]))
        for i in range(0, len(plan), 3)
    ]
    return entries, (labels.index(move[0]), labels.index(move[3]))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_plan_goals_give_the_bfs_distance_and_an_optimal_move_from_every_state(n):
    env = HanoiEnv(horizon=1, start="random", observation="disks", action_format="plan")
    env.reset(0)
    for target in range(3):
        dist = _bfs_distances(n, target)
        assert len(dist) == 3**n  # every state reaches the tower
        for state in itertools.product(range(3), repeat=n):
            if dist[state] == 0:
                continue
            env.state, env.target_peg = state, target
            entries, move = _parse_plan(env.gold_action())
            assert [d for d, _, _ in entries] == list(range(n, 0, -1))
            assert all(peg == state[d - 1] for d, peg, _ in entries)
            # the mismatched disks of the plan give the distance: sum of 2^(d-1)
            assert sum(2 ** (d - 1) for d, p, g in entries if p != g) == dist[state]
            assert is_legal(state, move)
            assert dist[apply_move(state, move)] == dist[state] - 1
            smallest = min(d for d, p, g in entries if p != g)
            assert move == (state[smallest - 1], entries[n - smallest][2])


def test_disks_observation_lists_every_disk_largest_first():
    env = HanoiEnv(horizon=5, start="random", observation="disks")
    env.reset(0)
    env.state = (0, 1, 1, 0, 0)
    assert env.render() == "Disks: 5 A 4 A 3 B 2 B 1 A"
    env.target_peg = 2
    assert env._observation() == "Goal C, disks: 5 A 4 A 3 B 2 B 1 A"
    moves = HanoiEnv(horizon=5, start="random", observation="disks", show_moves_left=True)
    moves.reset(0)
    lines = moves._observation().split("\n")
    assert lines[0] == "Moves left: 5" and lines[1].startswith("Goal ")
    pegs = HanoiEnv(horizon=5, start="random")
    pegs.reset(0)
    pegs.state = env.state
    assert pegs.render() == "A: 5 4 1\nB: 3 2\nC:"


def test_plan_parser_acts_on_the_final_move_only():
    env = HanoiEnv(horizon=7, action_format="plan")
    env.reset(0)
    assert env.parse_action("3 A C 2 A B 1 A C A->C") == (0, 2)
    assert env.parse_action("  think first\nthen B->A \n") == (1, 0)
    assert env.parse_action("A->B") == (0, 1)
    for bad in ["A->B A->C", "plan only", "", "A->A", "1 A C a->c", "A->C then more"]:
        assert env.parse_action(bad) is None, bad
    strict = HanoiEnv(horizon=7)
    strict.reset(0)
    assert strict.parse_action("3 A C A->C") is None


def test_plan_demonstrations_solve_every_puzzle_and_noise_keeps_the_plan():
    for seed in range(5):
        env = HanoiEnv(
            horizon=20,
            extra_disks=3,
            start="random",
            observation="disks",
            action_format="plan",
            instructions="short",
        )
        demo = run_demonstration(env, seed=seed)
        assert demo.total_reward == 1.0 and len(demo.actions) == 20
        assert "plan then one move" in demo.observations[0]
        goal = "ABC"[env.target_peg]
        assert demo.observations[1].startswith(f"Goal {goal}, disks: ")
        assert demo.observations[0].endswith("\n" + demo.observations[0].split("\n")[-1])
    env = HanoiEnv(horizon=20, start="random", action_format="plan", max_steps_factor=3.0)
    env.reset(1)
    rng = random.Random(0)
    text, gold = env.noisy_gold_action(rng, 0.999)
    assert not gold and text.startswith(env.plan_text())
    assert env.parse_action(text) != env.parse_action(env.gold_action())


@pytest.mark.parametrize(
    "options, field",
    [
        ({"observation": "grid"}, "hanoi.observation"),
        ({"action_format": "cot"}, "hanoi.action_format"),
    ],
)
def test_plan_config_errors_name_the_field(options, field):
    with pytest.raises(ValueError, match=field):
        HanoiEnv(horizon=7, **options)


def test_plan_needs_a_tower_goal():
    env = HanoiEnv(horizon=7, start="random", goal="random", action_format="plan")
    env.reset(0)
    with pytest.raises(ValueError, match="action_format='move'"):
        env.gold_action()
