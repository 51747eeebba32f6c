"""Per-token staleness bound in the trainer (issue 19.1): action tokens sampled more than
`rollout.max_staleness` versions before the trained one leave the policy loss (advantage 0,
kept in the token-mean denominator) and the deviation metrics; fresh tokens train as before."""

from __future__ import annotations

import torch

from sao_megatron.algorithm import registry
from sao_megatron.algorithm.config import AlgorithmConfig, GRPOConfig
from sao_megatron.data.batch import pack_trajectories
from sao_megatron.models import build_policy
from sao_megatron.optim.builder import build_optimizer
from sao_megatron.optim.config import OptimizerConfig, PrecisionConfig
from sao_megatron.trainer.rl_step import RLStep, StepConfig
from tests.trainer.test_rl_step import _random_trajectories, _with_policy_behaviour


def _grpo_step(tiny_moe, parallel, max_staleness):
    prec = PrecisionConfig()
    policy = build_policy(tiny_moe, parallel, prec)
    state = build_optimizer(policy, parallel, OptimizerConfig(lr=1e-3, clip_grad=0.0), prec)
    algo = registry.build(AlgorithmConfig(name="grpo_dis", grpo=GRPOConfig(group_size=2)))
    step = RLStep(
        algo, parallel, state, None, StepConfig(micro_batch_size=4, max_staleness=max_staleness)
    )
    return step


def _versions(trajs, stale_tasks, old, new):
    """Tokens of the trajectories of `stale_tasks` get version `old`, the others `new`."""
    for t in trajs:
        v = old if t.task_id in stale_tasks else new
        for node in t.nodes:
            node.policy_versions = [v] * len(node.action_token_ids)
    return pack_trajectories(trajs, pad_token_id=0, max_seq_len=64)


def test_stale_tokens_leave_the_policy_loss(tiny_moe, parallel_1rank):
    step = _grpo_step(tiny_moe, parallel_1rank, max_staleness=1)
    trajs = _random_trajectories(4, 3, group_size=2)
    _with_policy_behaviour(step.policy.model, parallel_1rank, trajs, noise=0.3)
    batch = _versions(trajs, {"t0", "t1"}, old=0, new=4)  # train version 5: lag 5 vs lag 1
    stale_tokens = sum(
        t.num_action_tokens for t in trajs if t.task_id in {"t0", "t1"}
    )  # fmt: skip
    m = step.train_step(batch, train_version=5)
    assert m["deviation/stale_token_fraction"] == stale_tokens / batch.num_action_tokens
    assert 0 < m["deviation/stale_token_fraction"] < 1
    assert m["deviation/version_lag_max"] == 1.0  # the deviation metrics see fresh tokens only


def test_all_stale_batch_gives_no_gradient(tiny_moe, parallel_1rank):
    step = _grpo_step(tiny_moe, parallel_1rank, max_staleness=1)
    trajs = _random_trajectories(3, 4, group_size=2)
    _with_policy_behaviour(step.policy.model, parallel_1rank, trajs, noise=0.3)
    batch = _versions(trajs, {t.task_id for t in trajs}, old=0, new=0)
    m = step.train_step(batch, train_version=3)
    assert m["deviation/stale_token_fraction"] == 1.0
    assert m["loss/policy"] == 0.0 and m["grad_norm/policy"] == 0.0


def test_without_a_bound_old_tokens_train(tiny_moe, parallel_1rank):
    step = _grpo_step(tiny_moe, parallel_1rank, max_staleness=None)
    trajs = _random_trajectories(3, 4, group_size=2)
    _with_policy_behaviour(step.policy.model, parallel_1rank, trajs, noise=0.3)
    batch = _versions(trajs, {t.task_id for t in trajs}, old=0, new=0)
    m = step.train_step(batch, train_version=3)
    assert m["deviation/stale_token_fraction"] == 0.0
    assert m["grad_norm/policy"] > 0.0
    assert torch.isfinite(torch.tensor(m["loss/policy"]))


def test_a_per_batch_bound_tightens_the_configured_one(tiny_moe, parallel_1rank):
    """The deviation controller's bound (`RLStep.start(..., max_staleness=eta)`) masks tokens
    the configured bound would train, and never loosens it."""
    step = _grpo_step(tiny_moe, parallel_1rank, max_staleness=3)
    trajs = _random_trajectories(4, 3, group_size=2)
    _with_policy_behaviour(step.policy.model, parallel_1rank, trajs, noise=0.3)
    batch = _versions(trajs, {"t0", "t1"}, old=3, new=5)  # train version 5: lag 2 vs lag 0
    lagged = sum(t.num_action_tokens for t in trajs if t.task_id in {"t0", "t1"})

    def stale_fraction(bound):
        state = step.start(batch, 5, max_staleness=bound)
        return float(state.stale.sum()) / batch.num_action_tokens

    assert stale_fraction(None) == 0.0  # lag 2 <= 3
    assert stale_fraction(1) == lagged / batch.num_action_tokens
    assert stale_fraction(0) == lagged / batch.num_action_tokens
    assert stale_fraction(10) == 0.0  # min(3, 10): a per-batch bound never loosens
    state = step.start(batch, 5, max_staleness=1)
    for phase in step.algorithm.schedule:
        step.run(phase, state)
    m = step.finish(state)
    assert m["deviation/stale_token_fraction"] == lagged / batch.num_action_tokens
    assert m["deviation/version_lag_max"] == 0.0
