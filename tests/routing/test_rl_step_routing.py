"""The RL step with recorded routing (1 rank, GRPO+DIS): behaviour log-probs from the float64
reference under the recorded routing; with `routing_replay` the trainer's ratio is 1 (mean
|1 - r| < 1e-5), without it the deviation appears, is attributed to the tokens whose routing
differed, and the mismatch fraction equals the reference's."""

from __future__ import annotations

import pytest

from sao_megatron.algorithm import registry
from sao_megatron.algorithm.config import AlgorithmConfig, GRPOConfig
from sao_megatron.data.batch import pack_trajectories
from sao_megatron.data.trajectory import ActionNode, Trajectory
from tests.conftest import tiny_moe_kwargs
from tests.routing.replay_case import B, T, hf_weights, make_case

PROMPT = 8  # tokens 0..7 prompt, 8..15 sampled


def _trajectories(case) -> list[Trajectory]:
    out = []
    for r in range(B):
        ids = case["ids"][r].tolist()
        node = ActionNode(
            observation_token_ids=ids[:PROMPT],
            action_token_ids=ids[PROMPT:],
            behaviour_logprobs=[float(x) for x in case["ref_lp"][r, PROMPT - 1 :]],
            policy_versions=[0] * (T - PROMPT),
            reward=float(r % 2),
            routed_experts=case["recorded"][r, : T - 1].clone(),
        )
        out.append(Trajectory(task_id=f"t{r // 2}", nodes=[node], group_index=r % 2))
    return out


def _step_metrics(parallel, replay: bool) -> tuple[dict, dict]:
    from sao_megatron.models import MoEModelConfig, build_policy
    from sao_megatron.optim.builder import build_optimizer
    from sao_megatron.optim.config import OptimizerConfig, PrecisionConfig
    from sao_megatron.trainer.rl_step import RLStep, StepConfig

    cfg = MoEModelConfig(**tiny_moe_kwargs())
    policy = build_policy(cfg, parallel)
    case = make_case(hf_weights(policy[0], cfg), cfg)
    state = build_optimizer(policy, parallel, OptimizerConfig(lr=1e-3), PrecisionConfig())
    algo = registry.build(AlgorithmConfig(name="grpo_dis", grpo=GRPOConfig(group_size=2)))
    step = RLStep(
        algo, parallel, state, None, StepConfig(micro_batch_size=2, routing_replay=replay)
    )
    trajs = _trajectories(case)
    for t in trajs:
        t.validate()
    batch = pack_trajectories(trajs, pad_token_id=0, max_seq_len=64)
    assert batch.has_routing
    return step.train_step(batch, train_version=0), case


def test_replay_removes_the_routing_deviation(parallel_1rank):
    m, case = _step_metrics(parallel_1rank, replay=True)
    print({k: v for k, v in m.items() if k.startswith(("deviation/", "routing/"))})
    assert m["deviation/abs_one_minus_ratio_mean"] < 1e-5
    assert m["deviation/mean_abs_logprob_diff"] < 1e-5
    assert m["routing/replayed"] == 1.0
    assert m["routing/recorded_token_fraction"] == pytest.approx((T - 1) / T)
    layers = tiny_moe_kwargs()["num_hidden_layers"]
    assert m["deviation/routing_mismatch_frac"] == pytest.approx(
        case["num_flips_replayed"] / (B * (T - 1) * layers)
    )
    assert m["deviation/lag0/token_fraction"] == 1.0
    assert "deviation/lag1plus/abs_one_minus_ratio_mean" not in m  # empty group: no mean
    assert m["deviation/lag1plus/token_fraction"] == 0.0


def test_without_replay_the_deviation_is_the_routing(parallel_1rank):
    m, case = _step_metrics(parallel_1rank, replay=False)
    print({k: v for k, v in m.items() if k.startswith(("deviation/", "routing/"))})
    assert m["routing/replayed"] == 0.0
    assert m["deviation/routing_mismatch_frac"] == pytest.approx(case["flip_frac"])
    assert m["deviation/abs_one_minus_ratio_mean"] > 1e-4
    differs = m["deviation/lag0_routing_differs/abs_one_minus_ratio_mean"]
    same = m["deviation/lag0_routing_same/abs_one_minus_ratio_mean"]
    assert 0 < m["deviation/lag0_routing_differs/token_fraction"] < 1
    assert m["deviation/lag0_routing_differs/token_fraction"] + m[
        "deviation/lag0_routing_same/token_fraction"
    ] == pytest.approx(1.0)
    assert differs > same  # the tokens whose experts differed carry the deviation


def test_routing_replay_needs_an_moe_model(parallel_1rank):
    from sao_megatron.models import MoEModelConfig, build_policy
    from sao_megatron.optim.builder import build_optimizer
    from sao_megatron.optim.config import OptimizerConfig, PrecisionConfig
    from sao_megatron.trainer.rl_step import RLStep, StepConfig

    dense = MoEModelConfig(
        **{**tiny_moe_kwargs(), "mlp_only_layers": [0, 1], "intermediate_size": 64}
    )
    state = build_optimizer(
        build_policy(dense, parallel_1rank), parallel_1rank, OptimizerConfig(), PrecisionConfig()
    )
    algo = registry.build(AlgorithmConfig(name="grpo_dis", grpo=GRPOConfig(group_size=2)))
    with pytest.raises(ValueError, match="rollout.routing_replay=true .* needs an MoE"):
        RLStep(algo, parallel_1rank, state, None, StepConfig(routing_replay=True))
