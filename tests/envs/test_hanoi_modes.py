"""Hanoi start/goal modes, held-out splits, per-move kinds and heavy-tailed horizons."""

import math
import random
import statistics

import pytest

from sao_megatron.data.demonstrations import episode_seeds, run_demonstration
from sao_megatron.envs import make_env
from sao_megatron.envs.hanoi import (
    HanoiConfig,
    HanoiEnv,
    distance_between,
    legal_moves,
    num_distinct_puzzles,
    optimal_distance,
    puzzle_class,
    puzzle_overlap,
    state_after_optimal_moves,
)
from sao_megatron.trainer.evaluate import eval_seeds

MODES = [
    {"start": "canonical"},
    {"start": "random"},
    {"start": "random", "goal": "random"},
]


def _play_gold(env):
    rewards, infos = [], []
    while not env.done:
        r = env.step(env.gold_action())
        rewards.append(r.reward)
        infos.append(r.info)
    return rewards, infos


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("horizon", [1, 7, 50, 200, 500])
def test_every_mode_starts_exactly_h_from_the_goal_and_gold_solves_in_h(mode, horizon):
    env = make_env("hanoi", horizon=horizon, **mode)
    for seed in range(3):
        env.reset(seed)
        assert env.remaining_optimal_moves() == horizon == env.max_steps
        assert distance_between(env.state, env.goal) == horizon
        rewards, infos = _play_gold(env)
        assert len(rewards) == horizon and rewards[-1] == 1.0 and infos[-1]["success"]
        assert [i["move"] for i in infos] == ["optimal"] * horizon
        assert infos[-1]["num_optimal_moves"] == horizon
        assert infos[-1]["num_non_optimal_moves"] == infos[-1]["num_illegal_moves"] == 0


def test_random_start_leaves_the_canonical_path():
    h, n = 50, 6
    canonical = {
        state_after_optimal_moves(n, 2**n - 1 - h, s, t)
        for s in range(3)
        for t in range(3)
        if s != t
    }
    env = HanoiEnv(horizon=h, extra_disks=0, start="random")
    starts = set()
    for seed in range(300):
        env.reset(seed)
        starts.add(env.state)
        assert optimal_distance(env.state, env.target_peg) == h
    assert len(starts) == num_distinct_puzzles(env.config)["puzzles"] == 24
    assert starts > canonical  # every canonical start, and 18 off the path


@pytest.mark.parametrize(
    "options, puzzles, classes",
    [
        ({"horizon": 7, "extra_disks": 0}, 6, 1),
        ({"horizon": 7, "extra_disks": 0, "start": "random"}, 24, 4),
        ({"horizon": 7, "extra_disks": 0, "start": "random", "goal": "random"}, 78, 13),
        ({"horizon": 50, "extra_disks": 1}, 12, 2),
        ({"horizon": 50, "extra_disks": 1, "start": "random"}, 48, 8),
        ({"horizon": 12, "extra_disks": 1, "start": "random", "goal": "random"}, None, None),
    ],
)
def test_distinct_puzzle_counts_match_what_seeds_produce(options, puzzles, classes):
    cfg = HanoiConfig(**options)
    counts = num_distinct_puzzles(cfg)
    if puzzles is not None:
        assert counts == {"puzzles": puzzles, "classes": classes}
    env = HanoiEnv(cfg)
    ids, cls = set(), set()
    for seed in range(6000 if counts["puzzles"] < 100 else 300):
        env.reset(seed)
        ids.add(env.puzzle_id)
        cls.add(puzzle_class(env.state, env.goal))
    if counts["puzzles"] < 100:  # small: the seeds reach every puzzle and nothing else
        assert (len(ids), len(cls)) == (counts["puzzles"], counts["classes"])
    else:  # 456 (4 disks, checked by BFS in test_hanoi_states) + 2,136 (5 disks) puzzles
        assert counts == {"puzzles": 2592, "classes": 432}
        assert len(ids) >= 260  # 300 draws from 2,592: ~283 distinct expected


def test_random_goal_is_shown_and_demonstrations_work():
    env = HanoiEnv(horizon=20, start="random", goal="random", instructions="short")
    obs = env.reset(4)
    head, goal_and_now = obs.split("\nGoal:\n")
    goal, now = goal_and_now.split("\nNow:\n")
    assert head == f"Hanoi {env.num_disks} disks, reach the goal, one move X->Y per turn."
    assert goal == env.render(env.goal) and now == env.render()
    demo = run_demonstration(env, 4, noise_epsilon=0.3)
    assert not all(demo.is_gold)  # noisy moves, then the gold recovery from an off-path state
    wrong = demo.is_gold.count(False)
    assert len(demo.actions) <= env.max_steps and demo.info["num_non_optimal_moves"] == wrong
    with pytest.raises(ValueError, match="start='canonical'"):
        env.reasoning_gym_entry()


def test_split_makes_held_out_puzzles_disjoint_from_training():
    opts = {"horizon": 50, "start": "random", "goal": "random"}
    train_seeds = episode_seeds(0, 0, 300)
    held_out = eval_seeds(1_000_003, 0, 128)
    mixed = puzzle_overlap(opts, train_seeds, opts, held_out)
    split = puzzle_overlap(
        {**opts, "split": "train"}, train_seeds, {**opts, "split": "eval"}, held_out
    )
    assert mixed["held_out_episodes"] == split["held_out_episodes"] == 128
    assert mixed["held_out_episodes_seen_class"] > 0  # relabelled copies occur without a split
    assert split["held_out_episodes_seen_class"] == split["held_out_episodes_seen_exact"] == 0
    assert split["held_out_puzzles"] == 128  # and 128 distinct held-out puzzles
    canonical = puzzle_overlap({"horizon": 7, "extra_disks": 0}, train_seeds, {}, [])
    assert canonical["train_puzzles"] == 6
    quick = {"horizon": 7, "extra_disks": 0}
    assert puzzle_overlap(quick, train_seeds, quick, held_out)["fraction_seen_exact"] == 1.0


def test_split_of_a_mode_with_one_class_raises_naming_the_field():
    env = HanoiEnv(horizon=7, extra_disks=0, split="eval", eval_fraction=0.01)
    with pytest.raises(ValueError, match="hanoi.split"):
        env.reset(0)


def test_move_kinds_and_episode_counts():
    env = HanoiEnv(horizon=10, max_steps_factor=5.0, invalid_action_ends_episode=False)
    env.reset(2)
    gold = env.gold_action()
    r = env.step(gold)
    assert r.info["move"] == "optimal" and r.info["distance_to_goal"] == 9
    wrong = [m for m in legal_moves(env.state) if env.format_move(m) != env.gold_action()][0]
    r = env.step(env.format_move(wrong))
    assert r.info["move"] == "non_optimal" and r.info["distance_to_goal"] >= 9
    illegal = next(
        f"{a}->{b}"
        for a in "ABC"
        for b in "ABC"
        if a != b
        and env.parse_action(f"{a}->{b}")
        and env.parse_action(f"{a}->{b}") not in legal_moves(env.state)
    )
    r = env.step(illegal)
    assert r.info["move"] == "illegal" and r.info["error"] == "illegal"
    r = env.step("nonsense")
    assert r.info["move"] == "malformed"
    assert {k: r.info[k] for k in r.info if k.startswith("num_")} == {
        "num_steps": 4,
        "num_optimal_moves": 1,
        "num_non_optimal_moves": 1,
        "num_illegal_moves": 1,
        "num_malformed_actions": 1,
    }
    assert r.info["horizon"] == 10 and r.info["puzzle_id"] == env.puzzle_id
    env.reset(2)  # counts restart with the episode
    assert env.step(env.gold_action()).info["num_optimal_moves"] == 1


@pytest.mark.parametrize("dist, shape", [("lognormal", 1.0), ("pareto", 1.5)])
def test_heavy_tailed_horizons(dist, shape):
    env = HanoiEnv(horizon=20, horizon_distribution=dist, horizon_shape=shape, max_horizon=400)
    hs = []
    for seed in range(400):
        env.reset(seed)
        hs.append(env.horizon)
        assert env.remaining_optimal_moves() == env.horizon == env.max_steps
        assert 2**env.num_disks - 1 >= env.horizon
    assert 1 <= min(hs) and max(hs) <= 400
    assert 15 <= statistics.median(hs) <= 26  # median 20, +- sampling error of 400 draws
    assert max(hs) >= 100  # the tail: P(H > 100) ~ 5% (lognormal) / 7% (Pareto) per episode
    env.reset(int(max(range(400), key=lambda s: hs[s])))
    rewards, infos = _play_gold(env)
    assert len(rewards) == env.horizon and infos[-1]["horizon"] == env.horizon
    progress = HanoiEnv(horizon=20, horizon_distribution=dist, reward_mode="progress")
    progress.reset(3)
    rewards, _ = _play_gold(progress)
    assert math.isclose(sum(rewards), 1.0, rel_tol=1e-9)


def test_reproducible_by_seed_in_every_mode():
    for mode in MODES:
        a, b = HanoiEnv(horizon=30, **mode), HanoiEnv(horizon=30, **mode)
        ids = set()
        for s in range(20):
            assert a.reset(s) == b.reset(s) and a.puzzle_id == b.puzzle_id
            ids.add(a.puzzle_id)
            rng_a, rng_b = random.Random(s), random.Random(s)
            for _ in range(10):
                act_a, _ = a.noisy_gold_action(rng_a, 0.3)
                act_b, _ = b.noisy_gold_action(rng_b, 0.3)
                ra, rb = a.step(act_a), b.step(act_b)
                assert ra == rb
                if ra.done or ra.truncated:
                    break
        assert len(ids) > 1


def test_canonical_default_reproduces_the_previous_puzzles():
    """The default mode draws exactly what it drew before the modes existed (same rng calls)."""
    env = HanoiEnv(horizon=50)
    for seed in range(20):
        env.reset(seed)
        rng = random.Random(f"hanoi:{seed}")
        n = 6 + rng.randint(0, 1)
        src, dst = rng.sample(range(3), 2)
        assert (env.num_disks, env.start_peg, env.target_peg) == (n, src, dst)
        assert env.state == state_after_optimal_moves(n, 2**n - 1 - 50, src, dst)


@pytest.mark.parametrize(
    "options, field",
    [
        ({"start": "anywhere"}, "start"),
        ({"goal": "random"}, "goal"),
        ({"goal": "peg"}, "goal"),
        ({"split": "test"}, "split"),
        ({"eval_fraction": 1.0}, "eval_fraction"),
        ({"horizon_distribution": "zipf"}, "horizon_distribution"),
        ({"horizon_shape": 0.0}, "horizon_shape"),
        ({"horizon": 50, "max_horizon": 10}, "max_horizon"),
        ({"horizon": 50, "horizon_distribution": "pareto", "max_disks": 8}, "max_disks"),
    ],
)
def test_mode_config_errors_name_the_field(options, field):
    with pytest.raises(ValueError, match=f"hanoi.{field}"):
        HanoiConfig(**options)


def test_budget_end_terminate_and_moves_left():
    rng = random.Random(0)
    results = {}
    for end in ("truncate", "terminate"):
        env = HanoiEnv(horizon=8, budget_end=end, show_moves_left=True, instructions="short")
        obs = env.reset(3)
        assert obs.splitlines()[1] == "Moves left: 8"
        for k in range(8):
            act, _ = env.noisy_gold_action(rng, 0.999)  # always a legal, wrong move
            r = env.step(act)
            if k < 7:
                assert r.observation.splitlines()[0] == f"Moves left: {7 - k}"
        results[end] = (r.reward, r.done, r.truncated, r.info["success"], env.done)
    assert results["truncate"] == (0.0, False, True, False, True)
    assert results["terminate"] == (0.0, True, False, False, True)
    with pytest.raises(ValueError, match="hanoi.budget_end"):
        HanoiConfig(budget_end="stop")


def test_move_error_rates_pool_final_infos():
    from sao_megatron.envs.hanoi import move_error_rates

    env = HanoiEnv(horizon=6, max_steps_factor=3.0)
    finals = []
    env.reset(0)  # optimal, non-optimal, then illegal: 3 moves
    env.step(env.gold_action())
    wrong = [m for m in legal_moves(env.state) if env.format_move(m) != env.gold_action()][0]
    env.step(env.format_move(wrong))
    bad = next(
        f"{a}->{b}"
        for a in "ABC"
        for b in "ABC"
        if a != b and env.parse_action(f"{a}->{b}") not in legal_moves(env.state)
    )
    finals.append(env.step(bad).info)
    env.reset(1)  # solved: 6 optimal moves
    finals.append(_play_gold(env)[1][-1])
    env.reset(2)  # malformed first move
    finals.append(env.step("nonsense").info)
    rates = move_error_rates(finals + [{"success": True}])  # a non-Hanoi info is ignored
    assert rates == {
        "illegal_move_rate": 2 / 10,
        "non_optimal_move_rate": 1 / 10,
        "malformed_action_rate": 1 / 10,
        "num_moves": 10.0,
    }
    assert move_error_rates([{"success": False}]) == {}
