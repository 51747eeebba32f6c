"""Critic placement ``separate`` (`sao_megatron.trainer.critic_placement`): the value model on its
own gloo ranks, pipelined with the policy, gives the colocated step's numbers bit for bit.

Bit for bit because the arithmetic is the same: each role runs the same phases of the same
`RLStep` code on the same DP shard (DP sizes equal in both roles), with single-rank model-parallel
groups, and the advantages travel as the float32 tensor itself (`torch.save` bytes). Torch runs
on one thread in every process (the launcher's and the reference's), so CPU kernels also reduce
in the same order.
"""

from __future__ import annotations

import math

import pytest
import torch

from sao_megatron.algorithm import registry
from sao_megatron.algorithm.base import Phase
from sao_megatron.algorithm.config import AlgorithmConfig
from sao_megatron.parallel import ParallelConfig
from sao_megatron.parallel.roles import check_separate_layout
from tests.conftest import launch
from tests.trainer import critic_placement_worker as worker


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _assert_same_metrics(got: dict, want: dict) -> None:
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    differ = [k for k in want if not k.startswith("time/") and not _same(got[k], want[k])]
    assert not differ, {k: (got[k], want[k]) for k in differ}


def _assert_same_tensors(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, differ


@pytest.fixture
def reference(parallel_1rank, tmp_path):
    """The colocated run on 1 rank (one torch thread, like the spawned ranks) and the batches
    it trained on (written to tmp_path/batches.pt for the separate run)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        p_state, _ = worker.build(parallel_1rank, "policy")
        batches = worker.make_batches(p_state, parallel_1rank)
        torch.save(batches, tmp_path / "batches.pt")
        from megatron.core import parallel_state as ps

        from sao_megatron.parallel import destroy_parallel, initialize_parallel

        destroy_parallel()  # the same seeded init as the spawned ranks for the models trained
        assert not ps.model_parallel_is_initialized()
        parallel = initialize_parallel(ParallelConfig())
        yield worker.colocated(parallel, batches) | {"batches_path": tmp_path / "batches.pt"}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.distributed
def test_separate_critic_equals_colocated_and_overlaps(reference, tmp_path):
    """Rank 0 trains the policy, rank 1 the critic, one value pre-training step (on the critic
    only) then 3 SAO steps (K = 2): policy loss, value losses, every metric, the advantages and
    the final policy and value weights equal the colocated run's bit for bit; and with the gate
    on, the policy update of step n waits for the critic to have started step n + 1, so the two
    overlap (no wall-clock threshold: a critic that waited for the policy would never release
    the gate)."""
    (tmp_path / "gate").touch()
    launch(worker.separate_worker, 2, str(tmp_path))
    policy = torch.load(tmp_path / "rank0.pt", weights_only=False)
    critic = torch.load(tmp_path / "rank1.pt", weights_only=False)
    assert (policy["role"], critic["role"]) == ("policy", "value")
    assert len(policy["metrics"]) == worker.NUM_STEPS
    # value pre-training ran on the critic; the policy rank returns the same metrics
    _assert_same_metrics(critic["pretrain"], reference["pretrain"])
    _assert_same_metrics(policy["pretrain"], reference["pretrain"])
    assert "loss/value" in reference["pretrain"]
    for n in range(worker.NUM_STEPS):
        want = reference["metrics"][n]
        _assert_same_metrics(policy["metrics"][n], want)
        # the value side's own metrics are the colocated ones, without the policy's
        value_side = {k: v for k, v in want.items() if k in critic["metrics"][n]}
        _assert_same_metrics(critic["metrics"][n], value_side)
        assert "loss/value" in critic["metrics"][n] and "loss/policy" not in critic["metrics"][n]
        assert torch.equal(policy["advantages"][n], reference["advantages"][n])
        assert torch.equal(critic["advantages"][n], reference["advantages"][n])
        assert reference["advantages"][n].abs().sum() > 0
        for k in ("loss/policy", "value/loss_0", "value/loss_1"):
            assert math.isfinite(want[k]), k
    _assert_same_tensors(policy["policy"], reference["policy"])
    _assert_same_tensors(critic["value"], reference["value"])
    # the weights moved: the comparison is not between two untrained models
    for name in ("policy", "value"):
        start, end = reference[f"initial_{name}"], reference[name]
        assert any(not torch.equal(start[k], end[k]) for k in end), name
    print(f"exchange one-way (gloo, 2 local ranks): {policy['exchange_s'] * 1e3:.3f} ms")
    assert policy["exchange_s"] > 0
    # overlap: the critic started step n + 1 before the policy finished step n
    t = {(e, n): ts for e, n, ts in policy["events"] + critic["events"]}
    for n in range(worker.NUM_STEPS - 1):
        assert t[("value_start", n + 1)] < t[("policy_end", n)], n
        assert t[("value_start", n + 1)] < t[("policy_start_released", n)], n


def test_value_and_policy_halves_pipelined_equal_colocated_in_one_process(reference):
    """The phase split without ranks: a value-only and a policy-only `RLStep`
    (separate_critic=True) on one process, run in the pipelined order (the critic's batch n+1
    before the policy's batch n), the advantages handed over directly: the colocated numbers
    bit for bit (what the 2-rank test adds is the transport)."""
    from sao_megatron.parallel import destroy_parallel, initialize_parallel
    from sao_megatron.trainer.rl_step import RLStep

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        destroy_parallel()
        parallel = initialize_parallel(ParallelConfig())
        batches = torch.load(reference["batches_path"], weights_only=False)
        p_state, v_state = worker.build(parallel, None)
        algo, cfg = worker.algorithm(), worker.step_config()
        critic = RLStep(algo, parallel, None, v_state, cfg, separate_critic=True)
        actor = RLStep(algo, parallel, p_state, None, cfg, separate_critic=True)
        value_side = []
        _assert_same_metrics(critic.value_step(batches[0]), reference["pretrain"])

        def critic_step(n):
            state = critic.start(batches[n], n)
            for phase in algo.schedule:
                if phase is not Phase.POLICY_UPDATE:
                    critic.run(phase, state)
            value_side.append(critic.finish(state) | {"adv": state.advantages})

        critic_step(0)
        for n in range(worker.NUM_STEPS):
            if n + 1 < worker.NUM_STEPS:
                critic_step(n + 1)  # before the policy's step n
            state = actor.start(batches[n], n)
            state.advantages = value_side[n]["adv"]
            state.metrics |= {k: v for k, v in value_side[n].items() if k != "adv"}
            actor.run(Phase.POLICY_UPDATE, state)
            _assert_same_metrics(actor.finish(state), reference["metrics"][n])
            assert torch.equal(state.advantages, reference["advantages"][n])
        _assert_same_tensors(worker.params(p_state), reference["policy"])
        _assert_same_tensors(worker.params(v_state), reference["value"])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.distributed
def test_separate_critic_with_data_parallel_roles(tmp_path, parallel_1rank):
    """4 ranks, 2 policy + 2 value (DP = 2 in each role) against the colocated run at DP = 2 on
    2 ranks: the same metrics on every rank, the same advantages per DP rank, the same final
    weights, bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        p_state, _ = worker.build(parallel_1rank, "policy")
        torch.save(worker.make_batches(p_state, parallel_1rank), tmp_path / "batches.pt")
    finally:
        torch.set_num_threads(threads)
    launch(worker.colocated_worker, 2, str(tmp_path))
    launch(worker.separate_worker, 4, str(tmp_path))
    for i in range(2):
        ref = torch.load(tmp_path / f"colocated{i}.pt", weights_only=False)
        pol = torch.load(tmp_path / f"rank{i}.pt", weights_only=False)
        val = torch.load(tmp_path / f"rank{2 + i}.pt", weights_only=False)
        assert (pol["role"], val["role"]) == ("policy", "value")
        _assert_same_metrics(pol["pretrain"], ref["pretrain"])
        _assert_same_metrics(val["pretrain"], ref["pretrain"])
        for n in range(worker.NUM_STEPS):
            _assert_same_metrics(pol["metrics"][n], ref["metrics"][n])
            assert torch.equal(pol["advantages"][n], ref["advantages"][n]), (i, n)
            assert torch.equal(val["advantages"][n], ref["advantages"][n]), (i, n)
        _assert_same_tensors(pol["policy"], ref["policy"])
        _assert_same_tensors(val["value"], ref["value"])


# ------------------------------------------------------------------ validation (no ranks)
@pytest.mark.parametrize(
    "kwargs, world, field",
    [
        ({"tp": 2}, 4, "parallel.tp=2"),
        ({"pp": 2}, 4, "parallel.pp=2"),
        ({"ep": 2}, 4, "parallel.ep=2"),
        ({}, 3, "world size 3"),
        ({}, 1, "world size 1"),
    ],
)
def test_separate_layout_rejects_what_it_does_not_support(kwargs, world, field):
    with pytest.raises(ValueError, match="value.placement") as err:
        check_separate_layout(world, ParallelConfig(**kwargs))
    assert field in str(err.value)
    check_separate_layout(2, ParallelConfig())  # the supported layout passes
    check_separate_layout(8, ParallelConfig())


def test_separate_critic_needs_a_value_model(parallel_1rank):
    from sao_megatron.algorithm.config import GRPOConfig
    from sao_megatron.trainer.rl_step import RLStep, StepConfig

    grpo = registry.build(AlgorithmConfig(name="grpo", grpo=GRPOConfig(group_size=2)))
    with pytest.raises(ValueError, match="value.placement=separate.*no value model"):
        RLStep(grpo, parallel_1rank, None, None, StepConfig(), separate_critic=True)
    p_state, v_state = worker.build(parallel_1rank, None)
    sao = worker.algorithm()
    with pytest.raises(ValueError, match="exactly one"):
        RLStep(sao, parallel_1rank, p_state, v_state, StepConfig(), separate_critic=True)
    with pytest.raises(ValueError, match="policy=None only with separate_critic"):
        RLStep(sao, parallel_1rank, None, v_state, StepConfig())
    # a value-rank step runs the value phases and ADVANTAGES, not the policy's
    step = RLStep(sao, parallel_1rank, None, v_state, StepConfig(), separate_critic=True)
    batch = worker.make_batches(p_state, parallel_1rank)[0]
    state = step.start(batch, 0)
    with pytest.raises(ValueError, match="POLICY_UPDATE runs on the other ranks"):
        step.run(Phase.POLICY_UPDATE, state)


def test_value_placement_config(parallel_1rank):
    from sao_megatron.configs import load_config
    from sao_megatron.trainer.controller import Controller
    from sao_megatron.trainer.job import JobConfig

    assert load_config(JobConfig, None).value.placement == "colocated"
    job = load_config(JobConfig, None, ["value.placement=separate"])
    assert job.value.placement == "separate"
    with pytest.raises(ValueError, match="value.placement='sideways'"):
        load_config(JobConfig, None, ["value.placement=sideways"])
    with pytest.raises(ValueError, match="value.placement=separate but algorithm.name='grpo'"):
        load_config(
            JobConfig,
            None,
            ["value.placement=separate", "algorithm.name=grpo", "stages=[sft,rl]"],
        )
    # the job runs a separate critic (tests/trainer/test_separate_job.py), not on one rank
    with pytest.raises(ValueError, match="value.placement=separate splits.*world size 1"):
        Controller(job, parallel_1rank)
