"""Golden runs: 3 synchronous SAO steps and 3 GRPO steps on the tiny MoE with fixed seeds.

Every rank runs the same steps; rank 0 returns the figures that define the trainer's behaviour:
per step the losses, gradient norms and deviation metrics, and after the last step the trained
policy's log-probs on a fixed probe batch. `tests/golden/test_golden.py` compares them bit for
bit (fp32) with `golden_values.json`, recorded before the restructure of the trainer; rerun
`python -m tests.golden.record` only when a change of numerics is intended, and say why.

The behaviour log-probs are the initial policy's own plus deterministic noise, so importance
ratios differ from 1 (some fall outside the DIS band) and the ratio code paths are exercised.
"""

from __future__ import annotations

import torch

from tests.conftest import tiny_moe_kwargs
from tests.train_states import build_train_states

NUM_STEPS = 3
#: metrics that depend on wall-clock or are counts the restructure may rename: not compared
SKIP_PREFIXES = ("time/",)
LAYOUTS = {"1rank": {}, "ep2": {"ep": 2}}


def _trajectories(seed: int, num: int, group_size: int, vocab: int):
    from sao_megatron.data.trajectory import ActionNode, Trajectory

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num):
        for j in range(group_size):
            nodes = []
            for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
                obs = torch.randint(
                    1, vocab, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g
                )
                act = torch.randint(
                    1, vocab, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g
                )
                nodes.append(
                    ActionNode(
                        observation_token_ids=obs.tolist(),
                        action_token_ids=act.tolist(),
                        behaviour_logprobs=[-1.0] * len(act),
                        policy_versions=[0] * len(act),
                        reward=float(torch.rand((), generator=g) < 0.5),
                    )
                )
            truncated = bool(torch.rand((), generator=g) < 0.25)
            out.append(
                Trajectory(
                    task_id=f"task:{seed}:{i}",
                    nodes=nodes,
                    group_index=j,
                    truncated=truncated,
                    terminated=not truncated,
                    temperature=0.9,
                )
            )
    return out


def _pack(trajs):
    from sao_megatron.data.batch import pack_trajectories

    return pack_trajectories(trajs, pad_token_id=0, max_seq_len=64)


def _set_behaviour(policy_model, parallel, trajs, seed: int):
    """Behaviour log-probs = the policy's own (at temperature 0.9) + N(0, 0.15) noise, capped at
    0; every node keeps its version 0."""
    from sao_megatron.models import ModelInputs, compute_policy_logprobs

    batch = _pack(trajs)
    lp, _ = compute_policy_logprobs(
        policy_model,
        parallel,
        ModelInputs(batch.token_ids, batch.loss_mask, position_ids=batch.position_ids),
        0.9,
    )
    g = torch.Generator().manual_seed(1000 + seed)
    for r, traj in enumerate(trajs):
        pos = torch.nonzero(batch.action_mask[r]).flatten().tolist()
        flat = [
            min(float(lp[r, p - 1]) + 0.15 * float(torch.randn((), generator=g)), 0.0) for p in pos
        ]
        k = 0
        for node in traj.nodes:
            n = len(node.action_token_ids)
            node.behaviour_logprobs = flat[k : k + n]
            k += n
    return _pack(trajs)


def _build(parallel, algorithm: str):
    """Policy (and, for SAO, value) train states in fp32; the value initialised from the policy
    and frozen by the default patterns; LR warm-up over 2 steps."""
    return build_train_states(parallel, with_value=algorithm == "sao", warmup_steps=2)


def _step_fn(algorithm: str, parallel, p_state, v_state):
    from sao_megatron.algorithm import registry
    from sao_megatron.algorithm.config import (
        AlgorithmConfig,
        GRPOConfig,
        ImportanceConfig,
        SAOConfig,
    )
    from sao_megatron.trainer.rl_step import RLStep, StepConfig

    # SAO with the DIS band, as recorded (SAO's default weighting became ppo_clip later)
    algo = (
        AlgorithmConfig(name=algorithm, grpo=GRPOConfig(group_size=4))
        if algorithm == "grpo"
        else AlgorithmConfig(
            sao=SAOConfig(length_adaptive_alpha=0.5),
            importance=ImportanceConfig(weighting="dis_band"),
        )
    )
    return RLStep(registry.build(algo), parallel, p_state, v_state, StepConfig(micro_batch_size=3))


def run(algorithm: str, pkw: dict) -> dict:
    """Run the golden steps of `algorithm` ("sao" or "grpo") in the layout `pkw`
    (ParallelConfig kwargs); returns {"steps": [metrics...], "probe_logprobs": [B, T-1]}."""
    from sao_megatron.models import ModelInputs, compute_policy_logprobs
    from sao_megatron.parallel import ParallelConfig, destroy_parallel, initialize_parallel

    parallel = initialize_parallel(ParallelConfig(**pkw))
    try:
        vocab = tiny_moe_kwargs()["vocab_size"]
        group = 4 if algorithm == "grpo" else 1
        num = 3 if algorithm == "grpo" else 8
        p_state, v_state = _build(parallel, algorithm)
        step = _step_fn(algorithm, parallel, p_state, v_state)
        batches = [
            _set_behaviour(p_state.model, parallel, _trajectories(s, num, group, vocab), s)
            for s in range(NUM_STEPS)
        ]
        steps = []
        for k, batch in enumerate(batches):
            m = step.train_step(batch, train_version=k)
            steps.append(
                {n: float(v) for n, v in sorted(m.items()) if not n.startswith(SKIP_PREFIXES)}
            )
        probe = _pack(_trajectories(99, 4, 1, vocab))
        lp, _ = compute_policy_logprobs(
            p_state.model,
            parallel,
            ModelInputs(probe.token_ids, probe.loss_mask, position_ids=probe.position_ids),
            1.0,
        )
        mask = probe.loss_mask[:, 1:]
        return {"steps": steps, "probe_logprobs": lp[mask].tolist()}
    finally:
        destroy_parallel()


def worker(rank: int, world_size: int, out_dir: str) -> None:
    """2-rank entry (tests.conftest.launch): every golden run of the 2-rank layouts."""
    results = {
        f"{a}/{name}": run(a, pkw) for a in ("sao", "grpo") for name, pkw in LAYOUTS.items() if pkw
    }
    torch.save(results, f"{out_dir}/rank{rank}.pt")
