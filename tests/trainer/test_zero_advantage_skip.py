"""A batch without policy signal must not move the policy (algorithm.skip_zero_advantage_updates).

When every group of a GRPO batch has equal rewards, every advantage is 0 and the policy loss's
gradient is exactly 0; Adam would still move each weight by its first moment (lr * m_hat /
sqrt(v_hat) with m decaying by beta1). In the quickstart's stability runs GRPO kept drifting
for tens of such updates after its last non-zero one (docs/BENCHMARKS.md, the
"Stability control: GRPO ..." sections). These tests show the drift with the skip off and
its absence with the skip on."""

from __future__ import annotations

import pytest
import torch

from sao_megatron.algorithm import registry
from sao_megatron.algorithm.config import AlgorithmConfig, GRPOConfig
from sao_megatron.data.batch import pack_trajectories
from sao_megatron.models import build_policy
from sao_megatron.optim.builder import build_optimizer
from sao_megatron.optim.config import OptimizerConfig, PrecisionConfig
from sao_megatron.trainer.rl_step import RLStep, StepConfig
from tests.trainer.test_rl_step import _random_trajectories, _with_policy_behaviour


def _grpo_step(tiny_moe, parallel, *, skip, entropy_coef=0.0):
    prec = PrecisionConfig()
    policy = build_policy(tiny_moe, parallel, prec)
    state = build_optimizer(policy, parallel, OptimizerConfig(lr=1e-3, clip_grad=0.0), prec)
    config = AlgorithmConfig(
        name="grpo",
        grpo=GRPOConfig(group_size=2),
        entropy_coef=entropy_coef,
        skip_zero_advantage_updates=skip,
    )
    return RLStep(registry.build(config), parallel, state, None, StepConfig(micro_batch_size=4))


def _batch(step, parallel, seed, *, equal_rewards):
    trajs = _random_trajectories(3, seed, group_size=2)
    if equal_rewards:  # every trajectory fails: each group's rewards are equal, advantages 0
        for t in trajs:
            for node in t.nodes:
                node.reward = 0.0
    _with_policy_behaviour(step.policy.model, parallel, trajs)
    return pack_trajectories(trajs, pad_token_id=0, max_seq_len=64)


def _weights(step):
    return torch.cat(
        [p.detach().float().flatten().clone() for p in step.policy.model[0].parameters()]
    )


@pytest.mark.parametrize("skip", [True, False])
def test_a_batch_of_equal_rewards_moves_the_policy_only_without_the_skip(
    tiny_moe, parallel_1rank, skip
):
    step = _grpo_step(tiny_moe, parallel_1rank, skip=skip)
    m = step.train_step(_batch(step, parallel_1rank, 3, equal_rewards=False), train_version=0)
    assert m["policy/skipped_zero_advantage"] == 0.0 and m["policy/update_ok"] == 1.0
    assert m["grad_norm/policy"] > 0  # a real update: Adam now has momentum
    lr_steps = step.policy.scheduler.num_steps
    before = _weights(step)

    m = step.train_step(_batch(step, parallel_1rank, 4, equal_rewards=True), train_version=1)
    assert m["loss/policy"] == 0.0 and m["grad_norm/policy"] == 0.0
    moved = (_weights(step) - before).abs().max().item()
    if skip:
        assert m["policy/skipped_zero_advantage"] == 1.0 and m["policy/update_ok"] == 0.0
        assert moved == 0.0  # bit-for-bit the same policy
        assert step.policy.scheduler.num_steps == lr_steps  # the LR schedule did not advance
    else:
        assert m["policy/skipped_zero_advantage"] == 0.0 and m["policy/update_ok"] == 1.0
        # no gradient, yet Adam's first moment moved weights by about lr (1e-3) * m_hat/sqrt(v_hat)
        assert moved > 1e-4
        assert step.policy.scheduler.num_steps == lr_steps + 1


def test_the_entropy_bonus_is_a_signal(tiny_moe, parallel_1rank):
    step = _grpo_step(tiny_moe, parallel_1rank, skip=True, entropy_coef=0.01)
    before = _weights(step)
    m = step.train_step(_batch(step, parallel_1rank, 4, equal_rewards=True), train_version=0)
    assert m["policy/skipped_zero_advantage"] == 0.0 and m["grad_norm/policy"] > 0
    assert (_weights(step) - before).abs().max().item() > 0


def test_the_switch_is_checked():
    with pytest.raises(
        TypeError, match="algorithm.skip_zero_advantage_updates=.yes.: must be true"
    ):
        AlgorithmConfig(name="grpo", skip_zero_advantage_updates="yes")
