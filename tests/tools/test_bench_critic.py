"""tools/bench_critic.py: episodes sampled once with the progress reward and a terminal budget
end become exactly what the Hanoi environment returns in the other modes (`retarget`), and the
tabular Monte-Carlo critic explains a deterministic outcome completely."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path

import pytest

from sao_megatron.data.trajectory import ActionNode, Trajectory
from sao_megatron.envs.hanoi import HanoiConfig, HanoiEnv, legal_moves

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
_spec = importlib.util.spec_from_file_location("bench_critic", ROOT / "tools" / "bench_critic.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_critic"] = bench
_spec.loader.exec_module(bench)

LABELS = "ABC"


def _play(reward_mode: str, budget_end: str, seed: int, moves: list[str | None]):
    """Play `moves` (None: the gold move; "bad": the first legal non-gold move) and return the
    Trajectory the rollout runner would record (dummy token ids) and the rewards/flags."""
    env = HanoiEnv(
        HanoiConfig(
            horizon=7,
            extra_disks=0,
            max_steps_factor=1.0,
            reward_mode=reward_mode,
            budget_end=budget_end,
        )
    )
    env.reset(seed)
    nodes, info, terminated, truncated = [], {}, False, False
    for i, m in enumerate(itertools.chain(moves, itertools.repeat(None))):
        if m is None:
            action = env.gold_action()
        elif m == "bad":
            gold = env.gold_action()
            options = [f"{LABELS[a]}->{LABELS[b]}" for a, b in legal_moves(env.state)]
            action = next(a for a in options if a != gold)
        else:
            action = m
        res = env.step(action)
        nodes.append(
            ActionNode(
                observation_token_ids=[1 + i],
                action_token_ids=[100 + i, 200],
                behaviour_logprobs=[-1.0, -1.0],
                policy_versions=[0, 0],
                reward=float(res.reward),
            )
        )
        info = dict(res.info or {})
        if res.done:
            terminated = True
            break
        if res.truncated:
            truncated = True
            break
    traj = Trajectory(
        task_id=f"hanoi:{seed}", nodes=nodes, terminated=terminated, truncated=truncated, info=info
    )
    return traj


@pytest.mark.parametrize(
    "moves",
    [
        [],  # gold all the way: solved
        ["bad"],  # one wrong legal move: the 7-move budget is spent
        [None, None, "bad", None],  # a wrong move later: budget spent
        [None, "A->A"],  # malformed: ends the episode (terminal in every mode)
    ],
)
@pytest.mark.parametrize("reward_mode", ["success", "progress"])
@pytest.mark.parametrize("budget_end", ["truncate", "terminate"])
def test_retarget_reproduces_the_environment(moves, reward_mode, budget_end):
    for seed in range(3):
        sampled = _play("progress", "terminate", seed, moves)
        want = _play(reward_mode, budget_end, seed, moves)
        got = bench.retarget(sampled, reward_mode, budget_end, 1.0)
        if "bad" in moves and budget_end == "truncate":  # the budget-spent case is exercised
            assert want.truncated and not sampled.truncated
        assert [n.reward for n in got.nodes] == [n.reward for n in want.nodes]
        assert (got.terminated, got.truncated) == (want.terminated, want.truncated)
        assert [n.reward for n in sampled.nodes] == [
            n.reward for n in _play("progress", "terminate", seed, moves).nodes
        ]  # the input is not modified


def test_tabular_ceiling_explains_a_deterministic_outcome():
    # the outcome is decided by the first observation token, seen in training and held out
    def episode(i):
        win = i % 2 == 0
        t = _play("progress", "terminate", 0, [] if win else ["bad"])
        t.nodes[0].observation_token_ids = [7 if win else 8]
        return t

    batches = [[episode(i) for i in range(4)] for _ in range(3)]
    ev = bench.tabular_ceiling(batches, 1, ("success", "terminate"), 1.0)
    assert ev == pytest.approx(1.0)


@pytest.mark.parametrize("reward_mode", ["progress", "success"])
@pytest.mark.parametrize("p", [0.02, 0.1])
def test_iid_ev_ceiling_matches_a_simulation(reward_mode, p):
    import random

    h, rng = 20, random.Random(0)
    rows = []  # (t, return)
    for _ in range(20_000):
        k = next((t for t in range(h) if rng.random() < p), h)
        for t in range(min(k, h - 1) + 1):
            rows.append((t, (1.0 if k == h else 0.0) if reward_mode == "success" else (k - t) / h))
    by_t: dict[int, list[float]] = {}
    for t, r in rows:
        by_t.setdefault(t, []).append(r)
    value = {t: sum(v) / len(v) for t, v in by_t.items()}
    mean = sum(r for _, r in rows) / len(rows)
    var = sum((r - mean) ** 2 for _, r in rows) / len(rows)
    mse = sum((r - value[t]) ** 2 for t, r in rows) / len(rows)
    assert bench.iid_ev_ceiling(p, h, reward_mode) == pytest.approx(1 - mse / var, abs=0.015)


def test_iid_ev_ceiling_limits():
    assert bench.iid_ev_ceiling(0.0, 50) == pytest.approx(1.0)  # deterministic: all explained
    assert bench.iid_ev_ceiling(0.0, 50, "success") == 0.0  # no variance at all
    assert bench.iid_ev_ceiling(0.02, 50) > bench.iid_ev_ceiling(0.05, 50)
    with pytest.raises(ValueError, match="p="):
        bench.iid_ev_ceiling(1.5, 50)
