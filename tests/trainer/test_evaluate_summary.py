"""Held-out evaluation summary: success from the environment's flag, partial progress."""

import pytest

from sao_megatron.data.trajectory import ActionNode, Trajectory
from sao_megatron.envs.base import EnvSpec
from sao_megatron.trainer.evaluate import _summarise, eval_labels
from sao_megatron.trainer.job import RLConfig


def _traj(rewards, info):
    nodes = [
        ActionNode(
            observation_token_ids=[1],
            action_token_ids=[2],
            behaviour_logprobs=[-1.0],
            policy_versions=[0],
            reward=r,
        )
        for r in rewards
    ]
    return Trajectory(task_id="t", nodes=nodes, info=info)


def test_success_comes_from_the_env_flag_and_progress_is_averaged_over_all_tasks():
    third = 1.0 / 3.0
    results = [
        # dense rewards summing to 1 - 1 ulp: solved per the env's flag
        ("hanoi", _traj([third, third, third], {"success": True, "progress": 1.0})),
        ("hanoi", _traj([third, 0.0], {"success": False, "progress": 1 / 3})),
        ("hanoi", None),  # an episode error counts as unsolved with progress 0
        ("chain_sum", _traj([1.0], {})),  # no flag: reward threshold
        ("chain_sum", _traj([0.5], {})),
    ]
    out = _summarise(results, ["hanoi", "chain_sum"], threshold=1.0)
    assert out["eval/hanoi/success_rate"] == pytest.approx(1 / 3)
    assert out["eval/hanoi/mean_progress"] == pytest.approx((1.0 + 1 / 3) / 3)
    # standard error of the mean over the 3 tasks (sample std, ddof=1)
    xs = [1.0, 1 / 3, 0.0]
    m = sum(xs) / 3
    se = (sum((x - m) ** 2 for x in xs) / 2 / 3) ** 0.5
    assert out["eval/hanoi/progress_se"] == pytest.approx(se)
    assert out["eval/hanoi/mean_turns"] == pytest.approx(2.5)
    assert out["eval/chain_sum/success_rate"] == 0.5
    assert "eval/chain_sum/mean_progress" not in out
    assert out["eval/num_errors"] == 1.0
    assert out["eval/success_rate"] == pytest.approx((1 / 3 + 0.5) / 2)


def test_time_budget_must_be_non_negative():
    assert RLConfig(time_budget_s=30).time_budget_s == 30
    with pytest.raises(ValueError, match="rl.time_budget_s"):
        RLConfig(time_budget_s=-1)


def test_two_entries_of_one_environment_get_their_own_metrics():
    """Two GEM games (one `gem` environment, two env_ids) and Hanoi at two horizons were merged
    into one `eval/<name>/...` set before the labels."""
    envs = [
        EnvSpec(name="gem", options={"env_id": "game:GuessTheNumber-v0-easy"}),
        EnvSpec(name="gem", options={"env_id": "game:Mastermind-v0-easy"}),
        EnvSpec(name="hanoi", options={"horizon": 7}),
        EnvSpec(name="hanoi", options={"horizon": 15}),
        EnvSpec(name="chain_sum"),
    ]
    labels = eval_labels(envs)
    assert labels == [
        "gem:game:GuessTheNumber-v0-easy",
        "gem:game:Mastermind-v0-easy",
        "hanoi[0]",
        "hanoi[1]",
        "chain_sum",
    ]
    results = [
        (labels[0], _traj([1.0], {})),
        (labels[1], _traj([0.0], {})),
        (labels[2], _traj([1.0], {"success": True})),
        (labels[3], _traj([0.0], {"success": False})),
        (labels[4], _traj([1.0], {})),
    ]
    out = _summarise(results, labels, threshold=1.0)
    assert out["eval/gem:game:GuessTheNumber-v0-easy/success_rate"] == 1.0
    assert out["eval/gem:game:Mastermind-v0-easy/success_rate"] == 0.0
    assert out["eval/hanoi[0]/success_rate"] == 1.0 and out["eval/hanoi[1]/success_rate"] == 0.0
    assert out["eval/success_rate"] == pytest.approx(3 / 5)
    # the same env_id twice: both fall back to the entry index
    same = [EnvSpec(name="gem", options={"env_id": "game:Mastermind-v0-easy"})] * 2
    assert eval_labels(same) == ["gem[0]", "gem[1]"]


def test_each_environment_adds_its_own_metrics_through_the_registry():
    """Hanoi's per-move error rates come from its registry hook (`episode_metrics`), pooled over
    the finished episodes' final infos; an environment without a hook adds none."""
    moves = {"num_optimal_moves": 3, "num_non_optimal_moves": 0, "num_malformed_actions": 0}
    envs = [EnvSpec(name="hanoi", options={"horizon": 3}), EnvSpec(name="chain_sum")]
    results = [
        ("hanoi", _traj([1.0], {**moves, "num_steps": 3, "num_illegal_moves": 0})),
        ("hanoi", _traj([0.0], {**moves, "num_steps": 1, "num_illegal_moves": 1})),
        ("hanoi", None),  # an error: no info to pool
        ("chain_sum", _traj([1.0], {"num_steps": 1})),
    ]
    specs = {"hanoi": envs[0], "chain_sum": envs[1]}
    out = _summarise(results, ["hanoi", "chain_sum"], 1.0, specs)
    assert out["eval/hanoi/illegal_move_rate"] == pytest.approx(1 / 4)
    assert out["eval/hanoi/non_optimal_move_rate"] == 0.0
    assert out["eval/hanoi/num_moves"] == 4.0
    assert not any(k.startswith("eval/chain_sum/") and "move" in k for k in out)


class _Decoder:
    """A formatter stand-in whose tokenizer decodes id k to the k-th letter."""

    class tokenizer:  # noqa: N801 - the attribute name EpisodeFormatter has
        @staticmethod
        def decode(ids):
            return "".join(chr(ord("a") + i) for i in ids)


def test_episode_records_match_the_summary_and_round_trip(tmp_path):
    from sao_megatron.trainer.evaluate import episode_record, read_episodes, write_episodes

    won = _traj([0.25, 0.75], {"success": True, "guess": [3, 5], "score": float("nan")})
    won.nodes[1].observation_token_ids = [7, 4]
    lost = _traj([0.5], {"success": False})
    results = [("gem", won), ("gem", lost), ("gem", None)]
    records = [
        episode_record(label, seed, t, _Decoder, error="engine died" if t is None else None)
        for (label, t), seed in zip(results, [11, 12, 13], strict=True)
    ]
    path = write_episodes(tmp_path / "rl" / "eval_episodes" / "step_00000000.jsonl", records)
    back = read_episodes(path)
    assert back == records and not path.with_name(path.name + ".tmp").exists()
    summary = _summarise(results, ["gem"], threshold=1.0)
    assert sum(r["solved"] for r in back) / len(back) == summary["eval/gem/success_rate"]
    mean_reward = sum(r["total_reward"] for r in back) / 3
    assert mean_reward == pytest.approx(summary["eval/gem/mean_reward"])
    first = back[0]
    assert (first["seed"], first["task_id"], first["num_turns"], first["status"]) == (
        11,
        "t",
        2,
        "completed",
    )
    assert first["turns"] == [
        {"observation": "b", "action": "c", "reward": 0.25},
        {"observation": "he", "action": "c", "reward": 0.75},
    ]
    # info values that are not JSON scalars are strings; a non-finite float too
    assert first["info"] == {"success": True, "guess": "[3, 5]", "score": "nan"}
    assert back[2] == {
        "env": "gem",
        "seed": 13,
        "task_id": None,
        "solved": False,
        "total_reward": 0.0,
        "num_turns": 0,
        "status": "error",
        "error": "engine died",
        "turns": [],
    }
    # gzipped (as a study records them) reads back the same
    import gzip

    gz = tmp_path / "step.jsonl.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert read_episodes(gz) == records
