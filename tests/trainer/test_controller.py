"""Controller: run state and task stream round trips, the job config is never rewritten, and the
saved config.yaml is the config the checkpoint was trained with (1 rank, real Megatron, no vLLM:
the rollout is built but not started)."""

from __future__ import annotations

import copy
import json

import pytest

from sao_megatron.configs import load_config, to_yaml
from sao_megatron.trainer.checkpoint.train_states import _tensor_parts
from sao_megatron.trainer.controller import Controller
from sao_megatron.trainer.job import JobConfig, TasksConfig
from sao_megatron.trainer.rl_parts import save_rl
from sao_megatron.trainer.run_state import RLRunState, TaskStream
from tests.conftest import tiny_moe_kwargs


def test_run_state_round_trip():
    run = RLRunState(step=7, policy_version=7, value_pretrain_steps=3)
    state = run.state_dict()
    assert state == {
        "step": 7,
        "policy_version": 7,
        "value_pretrain_steps": 3,
        "value_pretrain_stop_reason": "",
        "value_pretrain_heldout": None,
    }
    back = RLRunState()
    back.load_state_dict(json.loads(json.dumps(state)))
    assert back == run
    with pytest.raises(ValueError, match="RLRunState"):
        RLRunState().load_state_dict({"step": 1})


def test_task_stream_resumes_after_the_consumed_tasks():
    cfg = TasksConfig(train=[{"name": "chain_sum"}, {"name": "hanoi", "weight": 2.0}])
    first = TaskStream(cfg)
    drawn = [next(first) for _ in range(10)]  # 10 drawn, 6 trained on, 4 in flight
    first.consume(6)
    state = first.state_dict()
    assert state == {"tasks_consumed": 6}
    resumed = TaskStream(cfg)
    resumed.load_state_dict(state)
    again = [next(resumed) for _ in range(4)]
    assert [(t.task_id, t.seed) for t in again] == [(t.task_id, t.seed) for t in drawn[6:]]
    assert resumed.state_dict() == state  # drawing is not consuming
    with pytest.raises(ValueError, match="after tasks were drawn"):
        resumed.load_state_dict(state)


def _job(run_dir, algorithm: str) -> JobConfig:
    model = [f"model.{k}={v}" for k, v in tiny_moe_kwargs().items() if k != "vocab_size"]
    return load_config(
        JobConfig,
        None,
        [
            *model,
            "model.vocab_size=1024",  # the trained tokenizer will be smaller
            "model.max_position_embeddings=512",
            "tokenizer.vocab_size=1000",
            "demonstrations.num_episodes=8",
            "demonstrations.envs=[{name: chain_sum}]",
            f"run_dir={run_dir}",
            f"algorithm.name={algorithm}",
            "stages=[rl]",
            "algorithm.grpo.group_size=2" if algorithm == "grpo_dis" else "rl.steps=2",
            "rollout.trajectories_per_batch=4",
            "checkpoint.save_dir=ckpt",
        ],
    )


@pytest.mark.parametrize("algorithm", ["sao", "grpo_dis"])
def test_components_get_run_time_paths_and_the_job_is_unchanged(
    tmp_path, parallel_1rank, algorithm
):
    job = _job(tmp_path / "run", algorithm)
    before_yaml, before = to_yaml(job), copy.deepcopy(job)
    ctrl = Controller(job, parallel_1rank)
    ctrl.prepare()
    rl = ctrl.build_rl(None, None)
    logger = ctrl.ctx.logger("rl", total=1, initial=0)
    logger.close()

    # the user's config objects are untouched (no field silently rewritten)
    assert job == before and to_yaml(job) == before_yaml
    assert job.model.vocab_size == 1024 and job.tokenizer.path is None
    # run-time paths and the group size are constructor arguments of the components
    run_dir = tmp_path / "run"
    assert rl.rollout.run_dir == run_dir / "rollout"
    assert rl.rollout.model_path == str(run_dir / "hf_policy")
    assert (run_dir / "hf_policy" / "config.json").is_file()  # what the engines will load
    assert rl.rollout.group_size == rl.rollout.buffer.group_size == ctrl.algorithm.group_size
    assert ctrl.algorithm.group_size == (2 if algorithm == "grpo_dis" else 1)
    assert rl.rollout.buffer.max_staleness == job.rollout.max_staleness
    assert logger.run_dir == run_dir / "rl"
    assert (rl.step_fn.value is not None) == (algorithm == "sao")

    # the trained config: the vocabulary fitted to the trained tokenizer, recorded explicitly
    tp = parallel_1rank.cfg.tp
    fitted = -(-ctrl.tokenizer.vocab_size // tp) * tp
    assert ctrl.job.model.vocab_size == fitted < 1024
    assert ctrl.job.tokenizer.path == str(run_dir / "tokenizer")
    emb = rl.step_fn.policy.unwrapped[0].embedding.word_embeddings.weight
    assert emb.shape[0] == fitted
    hf = json.loads((run_dir / "hf_policy" / "config.json").read_text())
    assert hf["vocab_size"] == fitted


def test_saved_config_is_the_config_the_checkpoint_was_trained_with(tmp_path, parallel_1rank):
    job = _job(tmp_path / "run", "grpo_dis")
    ctrl = Controller(job, parallel_1rank)
    ctrl.prepare()
    rl = ctrl.build_rl(None, None)
    rl.run.step, rl.run.policy_version = 3, 3
    rl.tasks.consume(5)
    save_rl(ctrl.ctx, rl)

    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert saved == to_yaml(ctrl.job)
    step_dir = next((tmp_path / "run" / "ckpt" / "rl").glob("step_*"))
    assert (step_dir / "config.yaml").read_text() == saved
    reloaded = load_config(JobConfig, tmp_path / "run" / "config.yaml")  # loads as it is
    assert reloaded == ctrl.job and reloaded.model.vocab_size < 1024

    # resuming restores the run state and the task cursor
    again = Controller(job, parallel_1rank)
    again.prepare()
    resumed = again.build_rl(None, step_dir)
    assert resumed.run == rl.run
    assert resumed.tasks.state_dict() == {"tasks_consumed": 5}


def test_episode_status_counts_survive_checkpoint_and_resume(tmp_path, parallel_1rank):
    """The rollout's cumulative ``episodes/<status>`` counts are saved with the RL checkpoint and
    continue from there in the resumed run's rollout (they restarted at 0 before)."""
    from sao_megatron.rollout.status import EpisodeStatus
    from sao_megatron.trainer.checkpoint import CommonState, step_dir_name

    job = _job(tmp_path / "run", "sao")
    ctrl = Controller(job, parallel_1rank)
    ctrl.prepare()
    rl = ctrl.build_rl(None, None)
    counters = rl.rollout.status_counters
    for status, n in [("completed", 40), ("truncated", 3), ("agent_error", 2), ("timeout", 1)]:
        counters.record(status, n)
    counters.record(EpisodeStatus.ENGINE_ERROR)
    before = counters.metrics()
    assert before["episodes/completed"] == 40 and before["episodes/engine_error"] == 1
    rl.run.step, rl.run.policy_version = 2, 2
    save_rl(ctrl.ctx, rl)
    step_dir = next((tmp_path / "run" / "ckpt" / "rl").glob("step_*"))

    again = Controller(job, parallel_1rank)
    again.prepare()
    resumed = again.build_rl(None, step_dir)
    after = resumed.rollout.status_counters.metrics()
    assert after == before  # all seven counts and the trainable fraction
    assert after["episodes/trainable_fraction"] == 43 / 47
    resumed.rollout.status_counters.record("completed")  # and they keep counting
    assert resumed.rollout.status_counters.metrics()["episodes/completed"] == 41

    # a checkpoint written before the counts were saved (no key) resumes with zeros; it kept
    # the run state and task cursor in CommonState, not as Stateful parts (`LEGACY`)
    rl.run.step = rl.run.policy_version = 4
    rl.tasks.consume(3)
    old = CommonState(
        train_step=4,
        policy_version=4,
        data_cursor=rl.tasks.state_dict(),
        extra={"rl_run_state": rl.run.state_dict()},
    )
    rl.checkpoints.save(_tensor_parts(rl.states), old)
    old_dir = tmp_path / "run" / "ckpt" / "rl" / step_dir_name(4)
    assert old_dir.is_dir()
    third = Controller(job, parallel_1rank)
    third.prepare()
    legacy = third.build_rl(None, old_dir)
    assert legacy.rollout.status_counters.state_dict() == {s.value: 0 for s in EpisodeStatus}
    assert legacy.run == rl.run and legacy.tasks.state_dict() == {"tasks_consumed": 3}


def test_value_pretrain_alone_saves_the_critic_a_later_rl_job_resumes_from(
    tmp_path, parallel_1rank, monkeypatch
):
    """`stages: [value_pretrain]` keeps its work: an RL checkpoint at step 0 holding the
    pre-trained critic (and its step count), which a `stages: [rl]` job in the same run_dir
    resumes from (one cold start shared by several RL runs). The rollout is not started and the
    pre-training itself is replaced by a known change of the critic's head."""
    import torch

    from sao_megatron.rollout.manager import RolloutManager

    monkeypatch.setattr(RolloutManager, "start", lambda self: self)
    monkeypatch.setattr(RolloutManager, "stop", lambda self: None)
    job = _job(tmp_path / "run", "sao")
    job.stages = ["value_pretrain"]
    job.value_pretrain.steps = 3
    ctrl = Controller(job, parallel_1rank)
    ctrl.prepare()
    ctrl.summary = {}
    head = {}

    def fake_pretrain(rl, batches):  # what 3 value pre-training steps leave: a trained critic
        value = rl.step_fn.value.unwrapped[-1]
        with torch.no_grad():
            for name, p in value.named_parameters():
                if name.startswith("output_layer."):
                    p.add_(0.25)
                    head[name] = p.detach().clone()
        rl.run.value_pretrain_steps = 3

    monkeypatch.setattr(ctrl, "_value_pretrain", fake_pretrain)
    ctrl.rl_stage(None, None)
    assert head, "the critic has a head parameter"
    step_dir = ctrl.ctx.checkpoints("rl").resolve_resume()
    assert step_dir is not None and step_dir.name.endswith("0")

    job_rl = _job(tmp_path / "run", "sao")
    again = Controller(job_rl, parallel_1rank)
    again.prepare()
    assert again.ctx.checkpoints("rl").resolve_resume() == step_dir  # what run() resumes from
    resumed = again.build_rl(None, step_dir)
    assert resumed.run == RLRunState(step=0, policy_version=0, value_pretrain_steps=3)
    value = dict(resumed.step_fn.value.unwrapped[-1].named_parameters())
    for name, p in head.items():
        assert torch.equal(value[name].detach(), p)
    # neither optimiser had stepped, so neither is in the checkpoint: both start fresh and
    # step (a half-initialised Adam state failed here with KeyError: 'step')
    for st in (resumed.step_fn.policy, resumed.step_fn.value):
        for chunk in st.model:
            for p in chunk.parameters():
                if p.requires_grad:
                    p.main_grad = torch.full_like(p, 1e-3, dtype=torch.float32)
        ok, _, _ = st.optimizer.step()
        assert ok
