"""Value pre-training until the critic is ready: the config's validation, the stop rule, and the
stage (`sao_megatron.trainer.value_pretrain.ValuePretrain`) on a scripted step function and a
fake rollout: the held-out set is drawn once before the first update and never trained on, the
stage stops at the first evaluation that reaches the target or at the cap, without a target it
runs exactly `steps` updates, and a resumed run (its run state through a pickled checkpoint
round trip) evaluates on the same held-out set."""

from __future__ import annotations

import dataclasses
import io
import json
import math

import pytest
import torch

from sao_megatron.configs import load_config
from sao_megatron.data.batch import pack_trajectories
from sao_megatron.data.trajectory import ActionNode, Trajectory
from sao_megatron.trainer.checkpoint import CommonState
from sao_megatron.trainer.job import JobConfig, ValuePretrainConfig
from sao_megatron.trainer.metrics import LoggingConfig, MetricsLogger
from sao_megatron.trainer.run_state import RLRunState
from sao_megatron.trainer.value_pretrain import (
    FIXED_STEPS,
    HELDOUT_EV,
    MAX_HELDOUT_FACTOR,
    STEP_CAP,
    TARGET_REACHED,
    ValuePretrain,
    evaluates_at,
    returns_vary,
    stop_reason,
)

# ---------------------------------------------------------------------------------- config


def _job(*overrides: str) -> JobConfig:
    return load_config(JobConfig, None, ["algorithm.name=sao", *overrides])


def test_old_configs_keep_their_meaning():
    """`steps` alone is today's fixed number of updates; 0 and null targets are off."""
    for extra in ([], ["value_pretrain.target_explained_variance=0"]):
        cfg = _job("value_pretrain.steps=3", *extra).value_pretrain
        assert cfg.steps == 3 and not cfg.has_target
    cfg = _job("value_pretrain.steps=40", "value_pretrain.target_explained_variance=0.3")
    assert cfg.value_pretrain.has_target and cfg.value_pretrain.target_explained_variance == 0.3


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("target_explained_variance=1.0", r"value_pretrain.target_explained_variance=1.0: use a "),
        (
            "target_explained_variance=1.5",
            r"target_explained_variance=1.5: use a value in \(0, 1\)",
        ),
        ("target_explained_variance=-0.1", r"target_explained_variance=-0.1: .*0/null for no"),
        ("target_explained_variance=nan", r"target_explained_variance=nan: use a value in"),
        ("eval_interval=0", r"value_pretrain.eval_interval=0: must be >= 1"),
        ("num_heldout_trajectories=0", r"value_pretrain.num_heldout_trajectories=0: must be >= 1"),
        ("steps=-1", r"value_pretrain.steps=-1: must be >= 0"),
    ],
)
def test_bad_values_name_the_field_and_the_fix(override, match):
    with pytest.raises(ValueError, match=match):
        _job(f"value_pretrain.{override}")


def test_max_steps_is_steps():
    """The step cap is `steps` (a guessed `max_steps` key says so)."""
    with pytest.raises(ValueError, match=r"value_pretrain.max_steps.*is value_pretrain.steps"):
        _job("value_pretrain.max_steps=60")


# ---------------------------------------------------------------------------------- stop rule


def _cfg(**kw) -> ValuePretrainConfig:
    return ValuePretrainConfig(**({"steps": 10, "eval_interval": 2} | kw))


def _stops(cfg: ValuePretrainConfig, evs: list[float]) -> tuple[int, str, list[int]]:
    """Drive the rule as the stage does: (updates run, reason, steps evaluated) when the
    evaluations return `evs` in order."""
    evs, evaluated = iter(evs), []
    for step in range(1, 1000):
        ev = None
        if evaluates_at(cfg, step):
            ev = next(evs)
            evaluated.append(step)
        if (reason := stop_reason(cfg, step, ev)) is not None:
            return step, reason, evaluated
    raise AssertionError("never stopped")


def test_stops_at_the_first_evaluation_that_reaches_the_target():
    cfg = _cfg(target_explained_variance=0.3)
    assert _stops(cfg, [0.05, 0.2, 0.3, 0.6]) == (6, TARGET_REACHED, [2, 4, 6])
    assert _stops(cfg, [0.31]) == (2, TARGET_REACHED, [2])


def test_stops_at_the_cap_when_no_evaluation_reaches_the_target():
    cfg = _cfg(target_explained_variance=0.3, steps=7)  # 7 is not a multiple of 2: evaluated too
    assert _stops(cfg, [0.1, 0.2, 0.29, 0.25]) == (7, STEP_CAP, [2, 4, 6, 7])
    # NaN (constant returns on the held-out set) never reaches the target
    assert _stops(cfg, [math.nan] * 4) == (7, STEP_CAP, [2, 4, 6, 7])
    # the cap is evaluated even when it is below the interval; reaching it there counts
    assert _stops(_cfg(target_explained_variance=0.3, steps=1, eval_interval=5), [0.4]) == (
        1,
        TARGET_REACHED,
        [1],
    )


def test_without_a_target_exactly_steps_and_no_evaluation():
    assert _stops(_cfg(steps=4), []) == (4, FIXED_STEPS, [])
    assert _stops(_cfg(steps=4, target_explained_variance=0), []) == (4, FIXED_STEPS, [])


# ---------------------------------------------------------------------------------- the stage


def _trajectory(index: int, reward=lambda i: float(i % 2)) -> Trajectory:
    g = torch.Generator().manual_seed(index)
    nodes = [
        ActionNode(
            observation_token_ids=torch.randint(3, 50, (2,), generator=g).tolist(),
            action_token_ids=torch.randint(3, 50, (3,), generator=g).tolist(),
            behaviour_logprobs=[-1.0] * 3,
            policy_versions=[0] * 3,
            reward=reward(index),
        )
    ]
    return Trajectory(task_id=f"chain_sum:{1000 + index}:{index}", nodes=nodes, terminated=True)


class FakeRollout:
    """Batches of `batch_size` fresh trajectories (task ids in draw order); `replay` ids are
    handed out again first (a task drawn again after a resume)."""

    def __init__(
        self, batch_size: int, start: int = 0, replay: list[Trajectory] = (), reward=None
    ) -> None:
        self.batch_size, self.next_index, self.calls = batch_size, start, 0
        self.replay = list(replay)
        self.reward = reward or (lambda i: float(i % 2))

    def __call__(self, version: int) -> list[Trajectory]:
        assert version == 0  # the frozen policy
        self.calls += 1
        out = [self.replay.pop(0) for _ in range(min(len(self.replay), self.batch_size))]
        while len(out) < self.batch_size:
            out.append(_trajectory(self.next_index, self.reward))
            self.next_index += 1
        return out


class FakeStep:
    """Records the task ids of every batch trained on and evaluated; the evaluations return
    `evs` in order."""

    def __init__(self, evs=()) -> None:
        self.evs, self.trained, self.evaluated, self.order = list(evs), [], [], []

    def value_step(self, batch):
        self.trained.append(list(batch.task_ids))
        self.order.append("step")
        return {"loss/value": 0.5, "value/explained_variance_before": 0.0}

    def value_eval(self, batch):
        self.evaluated.append(list(batch.task_ids))
        self.order.append("eval")
        return {
            "value/explained_variance": self.evs.pop(0),
            "value/mse": 0.25,
            "value/num_tokens": 3.0,
        }


def _pack(trajs):
    return pack_trajectories(trajs, pad_token_id=0, max_seq_len=64)


def _stage(tmp_path, cfg, step, rollout, run=None):
    log_cfg = LoggingConfig(tensorboard=False, console=False)
    return ValuePretrain(
        cfg,
        step,
        run if run is not None else RLRunState(),
        next_trajectories=rollout,
        pack=_pack,
        gather_metrics=lambda m: m,
        logger=lambda total, initial: MetricsLogger(
            log_cfg, tmp_path, is_logging_rank=True, total_steps=total, initial_step=initial
        ),
    )


def _records(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_heldout_set_drawn_once_first_and_never_trained_on(tmp_path, caplog):
    """6 held-out trajectories from batches of 4: 2 batches pulled before the first update, the
    last 2 of the second dropped; every evaluation sees the same 6, no training batch one."""
    cfg = ValuePretrainConfig(
        steps=6, target_explained_variance=0.9, eval_interval=2, num_heldout_trajectories=6
    )
    step, rollout = FakeStep([0.1, 0.2, 0.3]), FakeRollout(4)
    run = RLRunState()
    with caplog.at_level("INFO", logger="sao_megatron.trainer"):
        summary = _stage(tmp_path, cfg, step, rollout, run).run()
    held = [t.task_id for t in run.value_pretrain_heldout]
    assert held == [_trajectory(i).task_id for i in range(6)]
    assert step.evaluated == [held] * 3
    trained = {tid for batch in step.trained for tid in batch}
    assert not trained & set(held)
    assert len(trained) == 6 * 4  # 6 batches of 4 fresh trajectories, none repeated
    assert rollout.calls == 2 + 6
    assert step.order == ["step", "step", "eval"] * 3
    assert summary == {
        "value_pretrain/stop_reason": STEP_CAP,
        "value_pretrain/steps": 6.0,
        HELDOUT_EV: 0.3,
    }
    assert "value pre-training ended (step_cap) after 6 steps" in caplog.text
    assert "held out 6 trajectories of the frozen policy (2 rollout batches, 2" in caplog.text
    recs = _records(tmp_path)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
    assert [r.get(HELDOUT_EV) for r in recs] == [None, 0.1, None, 0.2, None, 0.3]
    assert recs[1]["value_pretrain/heldout_mse"] == 0.25
    assert all(r["loss/value"] == 0.5 for r in recs)


def test_heldout_set_grows_until_its_returns_vary(tmp_path, caplog):
    """A sparse reward whose first draws all failed (the quickstart: 16 held-out trajectories of
    a 12.5% policy, every return 0, explained variance NaN at every evaluation, the stage ran to
    its cap): whole batches are added, all kept, until a return differs."""
    cfg = ValuePretrainConfig(
        steps=2, target_explained_variance=0.3, eval_interval=1, num_heldout_trajectories=4
    )
    step, rollout = FakeStep([0.1, 0.4]), FakeRollout(4, reward=lambda i: float(i == 9))
    run = RLRunState()
    with caplog.at_level("INFO", logger="sao_megatron.trainer"):
        summary = _stage(tmp_path, cfg, step, rollout, run).run()
    held = [t.task_id for t in run.value_pretrain_heldout]
    assert held == [_trajectory(i).task_id for i in range(12)]  # 3 batches, the 3rd has i = 9
    assert returns_vary(run.value_pretrain_heldout)
    assert not returns_vary(run.value_pretrain_heldout[:8])
    assert "held out 12 trajectories of the frozen policy (3 rollout batches, 0" in caplog.text
    assert summary["value_pretrain/stop_reason"] == TARGET_REACHED
    assert "WARNING" not in caplog.text


def test_heldout_set_whose_returns_never_vary_is_said_and_capped(tmp_path, caplog):
    cfg = ValuePretrainConfig(
        steps=2, target_explained_variance=0.3, eval_interval=1, num_heldout_trajectories=4
    )
    step, rollout = FakeStep([math.nan, math.nan]), FakeRollout(4, reward=lambda i: 0.0)
    run = RLRunState()
    with caplog.at_level("INFO", logger="sao_megatron.trainer"):
        summary = _stage(tmp_path, cfg, step, rollout, run).run()
    assert len(run.value_pretrain_heldout) == MAX_HELDOUT_FACTOR * 4
    assert rollout.calls == MAX_HELDOUT_FACTOR + 2
    assert summary["value_pretrain/stop_reason"] == STEP_CAP
    assert "the 16 held-out trajectories all have return 0: explained variance is undefined" in (
        caplog.text
    )
    assert "raise value_pretrain.num_heldout_trajectories" in caplog.text


def test_returns_vary_reads_the_reward_to_go_of_every_node():
    def traj(rewards):
        t = _trajectory(0)
        node = t.nodes[0]
        t.nodes = [dataclasses.replace(node, reward=r) for r in rewards]
        return t

    assert not returns_vary([traj([0.0, 0.0]), traj([0.0])])
    assert returns_vary([traj([0.5, 0.0])])  # 0.5 then 0 to go: within one trajectory
    assert not returns_vary([traj([0.0, 1.0]), traj([1.0])])  # 1 to go at every node
    assert returns_vary([traj([1.0]), traj([0.0])])


def test_stops_when_the_target_is_reached(tmp_path, caplog):
    cfg = ValuePretrainConfig(
        steps=50, target_explained_variance=0.3, eval_interval=3, num_heldout_trajectories=4
    )
    step = FakeStep([0.05, 0.29, 0.31, 0.9])
    run = RLRunState()
    with caplog.at_level("INFO", logger="sao_megatron.trainer"):
        summary = _stage(tmp_path, cfg, step, FakeRollout(4), run).run()
    assert summary == {
        "value_pretrain/stop_reason": TARGET_REACHED,
        "value_pretrain/steps": 9.0,
        HELDOUT_EV: 0.31,
    }
    assert len(step.trained) == 9 and step.evs == [0.9]
    assert run.value_pretrain_stop_reason == TARGET_REACHED and run.value_pretrain_steps == 9
    assert "ended (target_reached) after 9 steps: held-out explained variance 0.3100" in caplog.text
    assert [r[HELDOUT_EV] for r in _records(tmp_path) if HELDOUT_EV in r] == [0.05, 0.29, 0.31]


def test_without_a_target_the_stage_is_as_before(tmp_path):
    """No held-out set, no evaluation, one rollout batch per update, `steps` updates."""
    step, rollout = FakeStep(), FakeRollout(4)
    run = RLRunState()
    summary = _stage(tmp_path, ValuePretrainConfig(steps=3), step, rollout, run).run()
    assert len(step.trained) == 3 and step.evaluated == [] and rollout.calls == 3
    assert run.value_pretrain_heldout is None
    assert summary == {"value_pretrain/stop_reason": FIXED_STEPS, "value_pretrain/steps": 3.0}
    assert all(HELDOUT_EV not in r for r in _records(tmp_path))


def test_skipped_stage_draws_nothing(tmp_path):
    """steps=0 (or the stage not listed: the controller passes a default config) with a target:
    no rollout, no summary entries."""
    for cfg in (ValuePretrainConfig(), ValuePretrainConfig(target_explained_variance=0.3)):
        step, rollout = FakeStep(), FakeRollout(4)
        assert _stage(tmp_path, cfg, step, rollout).run() == {}
        assert rollout.calls == 0 and step.trained == []


def _checkpoint_round_trip(run: RLRunState) -> RLRunState:
    """The run state as a resumed run gets it: in the common state the checkpoint writes
    (`CheckpointManager.save`: torch.save of dataclasses.asdict(CommonState), which turns
    nested dataclasses into dicts) and reads back (`CommonState.from_saved`)."""
    buf = io.BytesIO()
    common = CommonState(train_step=0, extra={"rl_run_state": run.state_dict()})
    torch.save(dataclasses.asdict(common), buf)
    buf.seek(0)
    saved = CommonState.from_saved(torch.load(buf, weights_only=False))
    back = RLRunState()
    back.load_state_dict(saved.extra["rl_run_state"])
    return back


def test_resumed_run_evaluates_on_the_same_heldout_set(tmp_path):
    """A stage that hit its cap, resumed with a raised cap, continues on the checkpoint's
    held-out set (no new draw), and a held-out task handed out again after the resume is left
    out of the training batch."""
    cfg = ValuePretrainConfig(
        steps=2, target_explained_variance=0.9, eval_interval=1, num_heldout_trajectories=4
    )
    first = FakeStep([0.1, 0.2])
    run = RLRunState()
    assert (
        _stage(tmp_path / "a", cfg, first, FakeRollout(4), run).run()["value_pretrain/stop_reason"]
        == STEP_CAP
    )
    resumed = _checkpoint_round_trip(run)
    assert resumed == run
    assert all(isinstance(t, Trajectory) for t in resumed.value_pretrain_heldout)

    held = run.value_pretrain_heldout
    later = FakeStep([0.5, 0.95])
    rollout = FakeRollout(4, start=500, replay=held[:2])  # 2 held-out tasks come back first
    cfg4 = ValuePretrainConfig(
        steps=4, target_explained_variance=0.9, eval_interval=1, num_heldout_trajectories=4
    )
    summary = _stage(tmp_path / "b", cfg4, later, rollout, resumed).run()
    assert later.evaluated == first.evaluated[:1] * 2 == [[t.task_id for t in held]] * 2
    assert rollout.calls == 2  # training batches only: the held-out set was not drawn again
    assert later.trained[0] == [_trajectory(500).task_id, _trajectory(501).task_id]
    assert summary == {
        "value_pretrain/stop_reason": TARGET_REACHED,
        "value_pretrain/steps": 4.0,
        HELDOUT_EV: 0.95,
    }
    # ended at the target: a later resume runs nothing, whatever the cap
    again = _checkpoint_round_trip(resumed)
    cfg9 = ValuePretrainConfig(steps=9, target_explained_variance=0.9)
    assert _stage(tmp_path / "c", cfg9, FakeStep(), FakeRollout(4), again).run() == {}


def test_once_rl_started_a_target_stage_does_not_run():
    run = RLRunState(step=3, policy_version=3, value_pretrain_steps=2)
    cfg = ValuePretrainConfig(steps=10, target_explained_variance=0.5)
    stage = ValuePretrain(
        cfg, FakeStep(), run, next_trajectories=None, pack=None, gather_metrics=None, logger=None
    )
    assert stage.steps_left() == 0
    # without a target the count decides, as before targets existed
    stage.cfg = ValuePretrainConfig(steps=10)
    assert stage.steps_left() == 8


def test_heldout_size_must_keep_groups_whole(tmp_path):
    cfg = ValuePretrainConfig(steps=2, target_explained_variance=0.5, num_heldout_trajectories=6)
    stage = _stage(tmp_path, cfg, FakeStep(), FakeRollout(8))
    stage.group_size = 4
    with pytest.raises(ValueError, match=r"num_heldout_trajectories=6 is not a multiple of the"):
        stage.run()


def test_run_state_of_older_checkpoints_loads():
    """Checkpoints written before the stop reason and the held-out set keep loading."""
    run = RLRunState()
    run.load_state_dict({"step": 4, "policy_version": 4, "value_pretrain_steps": 2})
    assert run == RLRunState(step=4, policy_version=4, value_pretrain_steps=2)
    with pytest.raises(ValueError, match="RLRunState"):
        run.load_state_dict({"step": 4, "policy_version": 4})
    with pytest.raises(ValueError, match="RLRunState"):
        run.load_state_dict(
            {"step": 4, "policy_version": 4, "value_pretrain_steps": 2, "unknown": 1}
        )
