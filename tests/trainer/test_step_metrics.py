"""A train step's metrics carry the per-episode-length staleness figures (issue 31.8): the
fraction of action tokens within the bound and the episode count per turns bucket, computed by
`RLStep` on its batch and written to metrics.jsonl and TensorBoard like every step metric."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sao_megatron.data.batch import pack_trajectories
from sao_megatron.data.trajectory import ActionNode, Trajectory
from sao_megatron.trainer.metrics import LoggingConfig, MetricsLogger, read_metrics
from tests.conftest import launch
from tests.trainer.test_stale_tokens import _grpo_step

F = "rollout/staleness/in_bound_fraction/turns_"
N = "rollout/staleness/num_episodes/turns_"


def _trajectory(task_id: str, group_index: int, node_versions: list[list[int]]) -> Trajectory:
    """One episode with a node per entry of `node_versions` (one action token per version)."""
    nodes = [
        ActionNode(
            observation_token_ids=[3 + i % 50],
            action_token_ids=[60 + (i + k) % 50 for k in range(len(vs))],
            behaviour_logprobs=[-1.0] * len(vs),
            policy_versions=vs,
            reward=float(i == len(node_versions) - 1),
        )
        for i, vs in enumerate(node_versions)
    ]
    return Trajectory(task_id=task_id, nodes=nodes, group_index=group_index)


#: train version 6, max_staleness 1: versions 5 and 6 are within the bound
EXPECTED = {
    N + "1": 2.0,
    F + "1": 2 / 3,
    N + "2-4": 2.0,
    F + "2-4": 6 / 12,
    N + "17-64": 2.0,
    F + "17-64": 16 / 40,
}


def _batch():
    """Three GRPO groups of two: 1, 3 and 20 turns (`EXPECTED`)."""
    long_versions = [[2 + i // 4] for i in range(20)]  # versions 2..6, 4 turns each: 8 in bound
    trajs = [
        _trajectory("t0", 0, [[6, 6]]),  # 1 turn, 2 of 2 in bound
        _trajectory("t0", 1, [[4]]),  # 1 turn, 0 of 1
        _trajectory("t1", 0, [[3, 3], [4, 5], [5, 6]]),  # 3 turns, 3 of 6
        _trajectory("t1", 1, [[3, 3], [4, 5], [5, 6]]),
        _trajectory("t2", 0, long_versions),  # 20 turns, 8 of 20
        _trajectory("t2", 1, long_versions),
    ]
    return pack_trajectories(trajs, pad_token_id=0, max_seq_len=64)


def _staleness(m: dict) -> dict:
    return {k: v for k, v in m.items() if k.startswith("rollout/staleness/")}


def test_step_metrics_have_in_bound_fraction_per_length(tiny_moe, parallel_1rank, tmp_path):
    batch = _batch()
    step = _grpo_step(tiny_moe, parallel_1rank, max_staleness=1)
    m = step.train_step(batch, train_version=6)

    expected = EXPECTED
    assert _staleness(m) == expected
    # the same tokens the trainer masks: in bound + stale = all action tokens
    n, in_bound = batch.num_action_tokens, 2 + 6 + 16
    assert m["deviation/stale_token_fraction"] == (n - in_bound) / n

    cfg = LoggingConfig(console=False)
    with MetricsLogger(cfg, tmp_path, is_logging_rank=True) as logger:
        logger.log(1, m)
    (record,) = read_metrics(tmp_path)
    assert {k: record[k] for k in expected} == expected
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    for key, value in expected.items():  # tags kept as written (no character replaced)
        (event,) = acc.Scalars(key)
        assert event.step == 1 and event.value == pytest.approx(value, rel=1e-6)


def _dp2_worker(rank: int, world_size: int, out_dir: str) -> None:
    from sao_megatron.models import MoEModelConfig
    from sao_megatron.parallel import ParallelConfig, destroy_parallel, initialize_parallel
    from tests.conftest import tiny_moe_kwargs

    parallel = initialize_parallel(ParallelConfig())
    try:
        assert parallel.dp == 2
        step = _grpo_step(MoEModelConfig(**tiny_moe_kwargs()), parallel, max_staleness=1)
        state = step.start(_batch(), train_version=6)  # each rank holds some of the groups
        local = sorted(set(state.batch.trajectories.task_ids))
        out = {"metrics": _staleness(state.metrics), "tasks": local}
        out["stale"] = state.metrics["deviation/stale_token_fraction"]
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        destroy_parallel()


def test_in_bound_fraction_is_global_under_data_parallel(tmp_path):
    """On 2 DP ranks each holding some groups, every rank reports the whole batch's figures."""
    launch(_dp2_worker, 2, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert sorted(ranks[0]["tasks"] + ranks[1]["tasks"]) == ["t0", "t1", "t2"]
    n = 3 + 12 + 40
    for r in ranks:
        assert r["metrics"] == EXPECTED
        assert r["stale"] == (n - 24) / n
