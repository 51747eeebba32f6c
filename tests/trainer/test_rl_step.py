"""RL train step on real Megatron (1 rank): alignment, schedules and updates of SAO, GRPO and
GRPO+DIS (whose loss is checked against the DIS formula on GRPO advantages in float64)."""

import math

import pytest
import torch

from sao_megatron.algorithm import registry
from sao_megatron.algorithm.config import AlgorithmConfig, GRPOConfig, ImportanceConfig
from sao_megatron.data.batch import pack_trajectories
from sao_megatron.data.micro_batches import shard_for_data_parallel
from sao_megatron.data.trajectory import ActionNode, Trajectory
from sao_megatron.models import (
    VALUE_DEFAULT_FREEZE_PATTERNS,
    ModelInputs,
    apply_freeze,
    build_policy,
    build_value_model,
    compute_policy_logprobs,
    init_value_from_policy,
)
from sao_megatron.optim.builder import build_optimizer
from sao_megatron.optim.config import OptimizerConfig, PrecisionConfig
from sao_megatron.trainer.rl_step import RLStep, StepConfig


def _random_trajectories(num, seed, group_size=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num):
        for j in range(group_size):
            nodes = []
            for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
                obs = torch.randint(
                    1, 128, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g
                )
                act = torch.randint(
                    1, 128, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g
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
            out.append(Trajectory(task_id=f"t{i}", nodes=nodes, group_index=j))
    return out


def _policy_logprobs(policy_model, parallel, batch):
    """[B, T-1] log-probs of the current policy at prediction positions."""
    lp, _ = compute_policy_logprobs(
        policy_model,
        parallel,
        ModelInputs(
            input_ids=batch.token_ids,
            attention_mask=batch.loss_mask,
            position_ids=batch.position_ids,
        ),
    )
    return lp


def _with_policy_behaviour(policy_model, parallel, trajs, noise=0.0):
    """Set behaviour log-probs to the current policy's own log-probs (on-policy data), plus
    uniform noise in [-noise, noise] per token (a seeded off-policy gap)."""
    batch = pack_trajectories(trajs, pad_token_id=0, max_seq_len=64)
    lp = _policy_logprobs(policy_model, parallel, batch)
    g = torch.Generator().manual_seed(17)
    lp = lp + noise * (2 * torch.rand(lp.shape, generator=g, dtype=lp.dtype) - 1)
    for r, traj in enumerate(trajs):
        pos = torch.nonzero(batch.action_mask[r]).flatten().tolist()
        flat = [float(lp[r, p - 1]) for p in pos]
        k = 0
        for node in traj.nodes:
            n = len(node.action_token_ids)
            node.behaviour_logprobs = flat[k : k + n]
            k += n
    return pack_trajectories(trajs, pad_token_id=0, max_seq_len=64)


def _params(model):
    return {n: p.detach().clone() for c in model for n, p in c.named_parameters()}


def test_sao_step_on_policy(tiny_moe, parallel_1rank):
    prec = PrecisionConfig()
    policy = build_policy(tiny_moe, parallel_1rank, prec)
    value = build_value_model(tiny_moe, parallel_1rank, prec)
    init_value_from_policy(value[0], policy[0].state_dict())
    apply_freeze(value, VALUE_DEFAULT_FREEZE_PATTERNS)
    p_state = build_optimizer(policy, parallel_1rank, OptimizerConfig(lr=1e-3), prec)
    v_state = build_optimizer(value, parallel_1rank, OptimizerConfig(lr=5e-3), prec)
    batch = _with_policy_behaviour(p_state.model, parallel_1rank, _random_trajectories(6, 0))
    before_p, before_v = _params(policy), _params(value)
    step = RLStep(
        registry.build(AlgorithmConfig()),
        parallel_1rank,
        p_state,
        v_state,
        StepConfig(micro_batch_size=4),
    )
    m = step.train_step(batch, train_version=0)
    # the schedule's phases are timed apart; time/policy is the policy update alone
    assert {k for k in m if k.startswith("time/")} == {
        "time/value",
        "time/advantages",
        "time/policy",
    }
    # behaviour = current policy => importance ratio exactly 1 on every action token
    assert m["deviation/abs_one_minus_ratio_mean"] < 1e-5
    assert m["deviation/dropped_fraction"] == 0.0
    assert m["deviation/version_lag_max"] == 0.0
    assert m["batch/num_action_tokens"] == batch.num_action_tokens
    for k in ("value/loss_0", "value/loss_1", "loss/policy", "grad_norm/policy"):
        assert math.isfinite(m[k]), k
    # two value updates on the same data reduce the value loss
    assert m["value/loss_1"] < m["value/loss_0"]
    after_p, after_v = _params(policy), _params(value)
    assert any(not torch.equal(before_p[n], after_p[n]) for n in before_p)
    for n, p in before_v.items():
        frozen = any(__import__("re").search(pat, n) for pat in VALUE_DEFAULT_FREEZE_PATTERNS)
        assert torch.equal(p, after_v[n]) == frozen, n


def test_grpo_step(tiny_moe, parallel_1rank):
    prec = PrecisionConfig()
    policy = build_policy(tiny_moe, parallel_1rank, prec)
    p_state = build_optimizer(policy, parallel_1rank, OptimizerConfig(lr=1e-3), prec)
    trajs = _random_trajectories(3, 1, group_size=4)
    batch = _with_policy_behaviour(p_state.model, parallel_1rank, trajs)
    algo = registry.build(AlgorithmConfig(name="grpo", grpo=GRPOConfig(group_size=4)))
    step = RLStep(algo, parallel_1rank, p_state, None, StepConfig(micro_batch_size=5))
    m = step.train_step(batch, train_version=3)
    assert {k for k in m if k.startswith("time/")} == {
        "time/old_logprobs",
        "time/advantages",
        "time/policy",
    }
    assert m["deviation/abs_one_minus_ratio_mean"] < 1e-5
    assert m["deviation/version_lag_mean"] == 3.0
    # GRPO advantages are zero-mean within each group; per-token mean is a weighted mean
    assert math.isfinite(m["loss/policy"]) and math.isfinite(m["grad_norm/policy"])


def test_sao_step_with_decoupled_ppo_recomputes_old_logprobs(tiny_moe, parallel_1rank, monkeypatch):
    """SAO with importance.weighting=decoupled_ppo on real Megatron: the OLD_LOGPROBS phase runs
    after the value updates and gives the policy's own log-probs before its update (not the
    engine's, which carry seeded noise here); its loss is not SAO's shipped ppo_clip on the same
    batch and weights, and the policy moves."""
    import sao_megatron.trainer.policy_phase as policy_phase

    seen = {}
    original = policy_phase.PolicyPhases.old_logprobs

    def recorded(self, state):
        original(self, state)
        seen["old"], seen["mask"] = state.old_logprobs.clone(), state.batch.rows.action_mask

    losses = {}
    for kind in ("ppo_clip", "decoupled_ppo"):
        if kind == "decoupled_ppo":  # before RLStep binds its phases
            monkeypatch.setattr(policy_phase.PolicyPhases, "old_logprobs", recorded)
        algo_cfg = AlgorithmConfig(importance=ImportanceConfig(weighting=kind))
        step, p_state, _ = _sao_setup(tiny_moe, parallel_1rank, algo_cfg)
        trajs = _random_trajectories(6, 0)
        batch = _with_policy_behaviour(p_state.model, parallel_1rank, trajs, noise=0.2)
        own = _policy_logprobs(p_state.model, parallel_1rank, batch)
        before = _params(p_state.model)
        m = step.train_step(batch, train_version=0)
        losses[kind] = m["loss/policy"]
        after = _params(p_state.model)
        assert any(not torch.equal(before[n], after[n]) for n in before)
        times = {k for k in m if k.startswith("time/")}
        assert ("time/old_logprobs" in times) == (kind == "decoupled_ppo"), times
        assert m["deviation/abs_one_minus_ratio_mean"] > 0.05  # the engine's noise is seen
    mask = batch.action_mask[:, 1:]
    engine = batch.behaviour_logprobs[:, 1:]
    own_sum, engine_sum = float(own[mask].sum()), float(engine[mask].sum())
    old_sum = float(seen["old"][seen["mask"]].sum())
    assert old_sum == pytest.approx(own_sum, rel=1e-5)  # l_old: the trainer's own policy
    assert abs(old_sum - own_sum) < 0.1 * abs(old_sum - engine_sum)  # not the engine's
    assert losses["decoupled_ppo"] != pytest.approx(losses["ppo_clip"], rel=1e-6)


def test_value_model_must_match_the_algorithm(tiny_moe, parallel_1rank):
    with pytest.raises(ValueError, match="algorithm.name='sao' needs a value model"):
        RLStep(registry.build(AlgorithmConfig()), parallel_1rank, None, None, StepConfig())
    grpo = registry.build(AlgorithmConfig(name="grpo_dis"))
    with pytest.raises(ValueError, match="has no value model"):
        RLStep(grpo, parallel_1rank, None, object(), StepConfig())


def test_grpo_dis_step_loss_is_dis_on_group_advantages(tiny_moe, parallel_1rank):
    """GRPO+DIS on real Megatron: one policy update whose loss equals, in float64, the DIS loss
    -sum_t m_t f(r_t) A_t l_theta_t / N on GRPO group advantages, with r = exp(l_theta - l_b)
    on the behaviour log-probs (noised so that the band drops tokens) and no old log-probs."""
    prec = PrecisionConfig()
    policy = build_policy(tiny_moe, parallel_1rank, prec)
    p_state = build_optimizer(policy, parallel_1rank, OptimizerConfig(lr=1e-3), prec)
    trajs = _random_trajectories(3, 5, group_size=4)
    batch = _with_policy_behaviour(p_state.model, parallel_1rank, trajs, noise=0.5)
    lp = _policy_logprobs(p_state.model, parallel_1rank, batch).double()  # before the update
    algo = registry.build(AlgorithmConfig(name="grpo_dis", grpo=GRPOConfig(group_size=4)))
    step = RLStep(algo, parallel_1rank, p_state, None, StepConfig(micro_batch_size=5))
    m = step.train_step(batch, train_version=1)
    assert {k for k in m if k.startswith("time/")} == {"time/advantages", "time/policy"}

    # float64 reference: group advantages per trajectory, then the DIS loss per action token
    totals = [sum(n.reward for n in t.nodes) for t in trajs]
    adv = []
    for i, t in enumerate(trajs):
        group = [totals[j] for j, u in enumerate(trajs) if u.task_id == t.task_id]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (len(group) - 1))
        adv.append((totals[i] - mean) / (std + 1e-6))
    mask, blp = batch.action_mask[:, 1:], batch.behaviour_logprobs[:, 1:].double()
    loss, n, dropped = 0.0, int(mask.sum()), 0
    for r in range(batch.num_rows):
        a = adv[int(batch.row_trajectory[r])]
        for p in torch.nonzero(mask[r]).flatten().tolist():
            ratio = math.exp(float(lp[r, p] - blp[r, p]))
            keep = 1 - 0.3 < ratio < 1 + 5.0
            dropped += not keep
            loss += -(ratio if keep else 0.0) * a * float(lp[r, p]) / n
    assert 0 < dropped < n  # the band dropped some tokens, not all
    assert math.isclose(m["loss/policy"], loss, rel_tol=1e-5, abs_tol=1e-7), (m, loss)
    assert math.isclose(m["deviation/dropped_fraction"], dropped / n, rel_tol=1e-9)
    assert m["deviation/version_lag_mean"] == 1.0


def test_dp_sharding_keeps_groups_and_balances():
    trajs = _random_trajectories(5, 2, group_size=2)
    batch = pack_trajectories(trajs, pad_token_id=0, max_seq_len=64)
    seen = []
    for rank in range(2):
        rows, ts = shard_for_data_parallel(batch, rank, 2, by_group=True)
        tids = {batch.task_ids[t] for t in ts.tolist()}
        seen += ts.tolist()
        for tid in tids:  # whole group on this rank
            assert all(t in ts.tolist() for t, x in enumerate(batch.task_ids) if x == tid)
    assert sorted(seen) == list(range(batch.num_trajectories))


# ------------------------------------------------------------------ no redundant value passes
def _sao_setup(tiny_moe, parallel, algo_cfg=None, mbs=4):
    """Fresh, seeded policy/value train states and an SAO RLStep (same weights every call)."""
    torch.manual_seed(1234)
    prec = PrecisionConfig()
    policy = build_policy(tiny_moe, parallel, prec)
    value = build_value_model(tiny_moe, parallel, prec)
    init_value_from_policy(value[0], policy[0].state_dict())
    apply_freeze(value, VALUE_DEFAULT_FREEZE_PATTERNS)
    p_state = build_optimizer(policy, parallel, OptimizerConfig(lr=1e-3), prec)
    v_state = build_optimizer(value, parallel, OptimizerConfig(lr=5e-3), prec)
    algo = registry.build(algo_cfg or AlgorithmConfig())
    step = RLStep(algo, parallel, p_state, v_state, StepConfig(micro_batch_size=mbs))
    return step, p_state, v_state


def _truncated_batch(step, parallel, seed=3):
    trajs = _random_trajectories(7, seed)
    for i, t in enumerate(trajs):  # rows 0, 3, 6 truncated: they bootstrap from V(last state)
        t.truncated, t.terminated = i % 3 == 0, i % 3 != 0
    return _with_policy_behaviour(step.policy.model, parallel, trajs, noise=0.2)


def _count_value_passes(monkeypatch):
    """Patch the step's value-model calls; returns a list that records 'fwd' / 'fwd+bwd' per
    pass."""
    import sao_megatron.trainer.step_context as context
    import sao_megatron.trainer.value_phase as value_phase

    calls = []
    fb, cv = context.forward_backward, value_phase.compute_values

    def counted_fb(*a, kind, **kw):
        if kind == "value":
            calls.append("fwd+bwd")
        return fb(*a, kind=kind, **kw)

    def counted_cv(*a, **kw):
        calls.append("fwd")
        return cv(*a, **kw)

    monkeypatch.setattr(context, "forward_backward", counted_fb)
    monkeypatch.setattr(value_phase, "compute_values", counted_cv)
    return calls


def _run_two_steps(step, parallel, seeds=(3, 4)):
    out = []
    for k, s in enumerate(seeds):
        m = step.train_step(_truncated_batch(step, parallel, s), train_version=k)
        out.append({n: v for n, v in m.items() if not n.startswith("time/")})
    return out


@pytest.mark.parametrize(
    "sao", [{}, {"gamma": 0.9, "advantage_granularity": "node_mean", "value_clip": 0.05}]
)
def test_sao_first_update_gives_v_old(tiny_moe, parallel_1rank, monkeypatch, sao):
    """lam_value = 1: K + 1 value forwards (no VALUE_TARGETS forward), and the same step, bit
    for bit, as the path with a no-grad V_old forward (forced by value_targets -> None), with
    truncated rows bootstrapping from V(last state)."""
    from sao_megatron.algorithm.config import SAOConfig

    cfg = AlgorithmConfig(sao=SAOConfig(**sao))
    calls = _count_value_passes(monkeypatch)
    fast, _, v_fast = _sao_setup(tiny_moe, parallel_1rank, cfg)
    got = _run_two_steps(fast, parallel_1rank)
    assert calls == ["fwd+bwd", "fwd+bwd", "fwd"] * 2  # K updates, then the fresh critic
    calls.clear()
    ref, _, v_ref = _sao_setup(tiny_moe, parallel_1rank, cfg)
    monkeypatch.setattr(ref.algorithm, "value_targets", lambda inputs: None)
    want = _run_two_steps(ref, parallel_1rank)
    assert calls == ["fwd", "fwd+bwd", "fwd+bwd", "fwd"] * 2
    assert got == want
    assert math.isfinite(got[0]["value/explained_variance_before"])
    for (n, a), (_, b) in zip(
        v_fast.model[0].named_parameters(), v_ref.model[0].named_parameters(), strict=True
    ):
        assert torch.equal(a, b), n


def test_sao_lam_value_below_one_keeps_the_targets_forward(tiny_moe, parallel_1rank, monkeypatch):
    from sao_megatron.algorithm.config import SAOConfig

    calls = _count_value_passes(monkeypatch)
    step, _, _ = _sao_setup(tiny_moe, parallel_1rank, AlgorithmConfig(sao=SAOConfig(lam_value=0.9)))
    step.train_step(_truncated_batch(step, parallel_1rank), train_version=0)
    assert calls == ["fwd", "fwd+bwd", "fwd+bwd", "fwd"]


def test_sao_without_value_updates(tiny_moe, parallel_1rank, monkeypatch):
    """K = 0: the targets take V_last from the fresh forward, as the critic never changed; the
    'before' and 'after' explained variances are then the same figure."""
    from sao_megatron.algorithm.config import SAOConfig

    cfg = AlgorithmConfig(sao=SAOConfig(value_updates_per_policy_update=0))
    calls = _count_value_passes(monkeypatch)
    step, _, _ = _sao_setup(tiny_moe, parallel_1rank, cfg)
    m = step.train_step(_truncated_batch(step, parallel_1rank), train_version=0)
    assert calls == ["fwd"]
    assert m["value/explained_variance_before"] == m["value/explained_variance"]
    ref, _, _ = _sao_setup(tiny_moe, parallel_1rank, cfg)
    monkeypatch.setattr(ref.algorithm, "value_targets", lambda inputs: None)
    want = ref.train_step(_truncated_batch(ref, parallel_1rank), train_version=0)
    drop = ("time/",)
    assert {k: v for k, v in m.items() if not k.startswith(drop)} == {
        k: v for k, v in want.items() if not k.startswith(drop)
    }


def test_frozen_value_parameters_get_no_gradient_buffer(tiny_moe, parallel_1rank):
    """Megatron DDP allocates main_grad only for requires_grad parameters, and frozen linear
    layers go through LinearWithFrozenWeight (no weight gradient): after a step the frozen
    parameters have neither .grad nor .main_grad, the trainable ones have main_grad."""
    step, _, v_state = _sao_setup(tiny_moe, parallel_1rank)
    step.train_step(_truncated_batch(step, parallel_1rank), train_version=0)
    frozen = trainable = 0
    for n, p in v_state.model[0].named_parameters():
        if p.requires_grad:
            trainable += 1
            assert getattr(p, "main_grad", None) is not None, n
        else:
            frozen += 1
            assert p.grad is None and getattr(p, "main_grad", None) is None, n
    assert frozen > 0 and trainable > 0


def _v_old_worker(rank: int, world_size: int, out_dir: str) -> None:
    """The golden SAO steps at PP=2 and DP=2, with V_old from the first update's forward and
    with the no-grad V_old forward forced (value_targets -> None)."""
    from sao_megatron.algorithm.sao import SAO
    from tests.golden import golden_worker

    results = {}
    for name, pkw in (("pp2", {"pp": 2}), ("dp2", {})):
        results[f"{name}/fast"] = golden_worker.run("sao", pkw)
        original = SAO.value_targets
        SAO.value_targets = lambda self, inputs: None
        try:
            results[f"{name}/forward"] = golden_worker.run("sao", pkw)
        finally:
            SAO.value_targets = original
    torch.save(results, f"{out_dir}/rank{rank}.pt")


@pytest.mark.distributed
def test_v_old_from_the_first_update_across_ranks(tmp_path):
    """PP=2 (values broadcast from the last stage) and DP=2 (the forward decision all-reduced):
    the same losses, metrics and trained log-probs bit for bit as with the V_old forward."""
    from tests.conftest import launch

    launch(_v_old_worker, 2, str(tmp_path))
    for rank in range(2):
        res = torch.load(tmp_path / f"rank{rank}.pt")
        for name in ("pp2", "dp2"):
            fast, ref = res[f"{name}/fast"], res[f"{name}/forward"]
            assert fast["probe_logprobs"] == ref["probe_logprobs"], (name, rank)
            for a, b in zip(fast["steps"], ref["steps"], strict=True):
                same = {k for k in b if a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k]))}
                assert same == set(b), (name, rank, sorted(set(b) - same))
