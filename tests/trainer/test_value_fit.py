"""The critic's plumbing on real Megatron (1 rank): explained variance is measured on the right
positions against the right targets (a float64 loop reference), and a value model given a
learnable target does learn it (EV -> 1 on a fixed batch, > 0 on unseen episodes).

If SAO's critic cannot learn on a task, these tests separate the plumbing (value positions,
masks, Monte-Carlo targets, bootstrap, optimiser, frozen parts) from the task: they use the
trainer's own value model, freezing, `RLStep.value_step` and `RLStep.value_fit`.
"""

import math

import pytest
import torch

from sao_megatron.algorithm import registry
from sao_megatron.algorithm.config import AlgorithmConfig
from sao_megatron.data.batch import pack_trajectories
from sao_megatron.data.trajectory import ActionNode, Trajectory
from sao_megatron.models import (
    VALUE_DEFAULT_FREEZE_PATTERNS,
    ModelInputs,
    apply_freeze,
    build_policy,
    build_value_model,
    compute_values,
    init_value_from_policy,
)
from sao_megatron.optim.builder import build_optimizer
from sao_megatron.optim.config import OptimizerConfig, PrecisionConfig
from sao_megatron.trainer.rl_step import RLStep, StepConfig

KEY_TOKENS = (10, 11)  # the first prompt token: 11 -> the episode succeeds (reward 1), 10 -> 0


def _episodes(num: int, seed: int, *, truncate_every: int = 0) -> list[Trajectory]:
    """Episodes whose outcome is decided by the first prompt token (a learnable target).

    2-3 nodes of 2 observation + 3 action tokens each; reward 1 on the last node iff the key is
    11. With ``truncate_every = k``, every k-th episode is truncated (reward 0, so its value
    target is the bootstrap V of the state after its last action)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num):
        key = KEY_TOKENS[int(torch.randint(0, 2, (1,), generator=g))]
        truncated = bool(truncate_every) and i % truncate_every == 0
        k = int(torch.randint(2, 4, (1,), generator=g))
        nodes = []
        for j in range(k):
            obs = ([key] if j == 0 else []) + torch.randint(20, 128, (2,), generator=g).tolist()
            act = torch.randint(20, 128, (3,), generator=g).tolist()
            win = key == KEY_TOKENS[1] and j == k - 1 and not truncated
            nodes.append(
                ActionNode(
                    observation_token_ids=obs,
                    action_token_ids=act,
                    behaviour_logprobs=[-1.0] * 3,
                    policy_versions=[0] * 3,
                    reward=1.0 if win else 0.0,
                )
            )
        out.append(
            Trajectory(task_id=f"t{i}", nodes=nodes, truncated=truncated, terminated=not truncated)
        )
    return out


def _pack(trajs):
    return pack_trajectories(trajs, pad_token_id=0, max_seq_len=64)


def _critic(tiny_moe, parallel, lr=1e-3):
    """Policy and value train states built as the trainer builds them (value trunk from the
    policy, head re-initialised, default freeze patterns)."""
    prec = PrecisionConfig()
    policy = build_policy(tiny_moe, parallel, prec)
    value = build_value_model(tiny_moe, parallel, prec)
    init_value_from_policy(value[0], policy[0].state_dict())
    apply_freeze(value, VALUE_DEFAULT_FREEZE_PATTERNS)
    p_state = build_optimizer(policy, parallel, OptimizerConfig(lr=1e-3), prec)
    v_state = build_optimizer(value, parallel, OptimizerConfig(lr=lr), prec)
    step = RLStep(
        registry.build(AlgorithmConfig()),
        parallel,
        p_state,
        v_state,
        StepConfig(micro_batch_size=8),
    )
    return step, value


def _reference_ev(value_chunks, parallel, trajs) -> float:
    """float64 loop reference of the explained variance over action tokens.

    V at an action token = the value model's output after reading every token before it (an
    independent forward). R = the episode's reward-to-go from that token (node rewards of its
    node and later ones, gamma = 1, lam_value = 1), plus V of the state after the last action
    token for a truncated episode (bootstrap)."""
    batch = _pack(trajs)
    raw = compute_values(
        value_chunks, parallel, ModelInputs(batch.token_ids, batch.loss_mask, batch.position_ids)
    ).double()
    vs, rs = [], []
    for r, traj in enumerate(trajs):
        pos, node_of = 0, []
        positions = []
        for n, node in enumerate(traj.nodes):
            pos += len(node.observation_token_ids)
            for _ in node.action_token_ids:
                positions.append(pos)
                node_of.append(n)
                pos += 1
        last = positions[-1]
        boot = float(raw[r, last]) if traj.truncated else 0.0
        for p, n in zip(positions, node_of, strict=True):
            vs.append(float(raw[r, p - 1]))
            rs.append(sum(x.reward for x in traj.nodes[n:]) + boot)
    mean_r = sum(rs) / len(rs)
    var_r = sum((x - mean_r) ** 2 for x in rs) / len(rs)
    d = [x - v for x, v in zip(rs, vs, strict=True)]
    mean_d = sum(d) / len(d)
    var_d = sum((x - mean_d) ** 2 for x in d) / len(d)
    return 1.0 - var_d / var_r


def test_explained_variance_positions_and_targets(tiny_moe, parallel_1rank):
    """EV of `value_fit` and the step's `value/explained_variance_before` equal the float64
    reference: values read at the state before each action token, Monte-Carlo targets with the
    bootstrap of truncated rows."""
    step, value = _critic(tiny_moe, parallel_1rank)
    trajs = _episodes(12, seed=3, truncate_every=3)
    ref = _reference_ev(value, parallel_1rank, trajs)
    fit = step.value_fit(_pack(trajs))
    assert math.isclose(fit["value/explained_variance"], ref, rel_tol=1e-5, abs_tol=1e-6)
    m = step.value_step(_pack(trajs), fit_after=True)  # EV before its updates: the same critic
    assert math.isclose(m["value/explained_variance_before"], ref, rel_tol=1e-5, abs_tol=1e-6)
    after = _reference_ev(value, parallel_1rank, trajs)  # the critic after its 2 updates
    assert after != ref
    # the step's EV after its updates is against the targets built with V_old's bootstrap
    assert math.isfinite(m["value/explained_variance"])


def test_value_pretraining_step_is_its_updates_alone(tiny_moe, parallel_1rank, monkeypatch):
    """`value_step` runs the K value updates and no value forward besides theirs (issue 30: a
    pre-training step cost 2.3-2.8x one update with the forward after the updates); with
    `fit_after` it runs one more, for the fit after the updates, and trains the same weights."""
    import sao_megatron.trainer.value_phase as value_phase

    (step, value), (step2, value2) = (
        _critic(tiny_moe, parallel_1rank),
        _critic(tiny_moe, parallel_1rank),
    )
    value2[0].load_state_dict(value[0].state_dict())
    calls = []
    real = value_phase.compute_values
    monkeypatch.setattr(
        value_phase, "compute_values", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    trajs = _episodes(12, seed=3)
    m = step.value_step(_pack(trajs))
    assert calls == [] and "value/explained_variance" not in m
    assert math.isfinite(m["value/explained_variance_before"])
    assert {"value/loss_0", "value/loss_1"} <= set(m)  # K = 2 updates
    m2 = step2.value_step(_pack(trajs), fit_after=True)
    assert calls == [1] and math.isfinite(m2["value/explained_variance"])
    assert m2["value/explained_variance_before"] == m["value/explained_variance_before"]
    for (name, a), (_, b) in zip(
        value[0].named_parameters(), value2[0].named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name


def test_value_fit_reports_targets_and_errors(tiny_moe, parallel_1rank):
    step, value = _critic(tiny_moe, parallel_1rank)
    trajs = _episodes(8, seed=5)
    fit = step.value_fit(_pack(trajs))
    rs = []
    for t in trajs:
        n_tokens = [len(n.action_token_ids) for n in t.nodes]
        for n, count in enumerate(n_tokens):
            rs += [sum(x.reward for x in t.nodes[n:])] * count
    mean = sum(rs) / len(rs)
    assert math.isclose(fit["value/return_mean"], mean, rel_tol=1e-9)
    std = math.sqrt(sum((x - mean) ** 2 for x in rs) / len(rs))
    assert math.isclose(fit["value/return_std"], std, rel_tol=1e-6)
    # EV = 1 - Var[R - V] / Var[R] and MSE = E[(V - R)^2] share the residuals
    assert fit["value/mse"] >= 0.0
    grpo = registry.build(AlgorithmConfig(name="grpo"))
    no_critic = RLStep(grpo, parallel_1rank, step.policy, None, StepConfig())
    with pytest.raises(ValueError, match="needs a value model"):
        no_critic.value_fit(_pack(trajs))


def test_critic_learns_a_learnable_target(tiny_moe, parallel_1rank):
    """Value pre-training on a fixed batch whose outcome the first prompt token decides: the
    explained variance rises from <= 0 to > 0.95 on that batch, and > 0.3 on unseen episodes
    of the same kind; each step's EV before its updates is the previous step's EV after them."""
    step, _ = _critic(tiny_moe, parallel_1rank)
    train, held = _pack(_episodes(32, seed=0)), _pack(_episodes(32, seed=1))
    start = step.value_fit(held)["value/explained_variance"]
    assert start < 0.05
    history = [step.value_step(train, fit_after=True) for _ in range(30)]
    for prev, nxt in zip(history, history[1:], strict=False):
        assert math.isclose(
            nxt["value/explained_variance_before"],
            prev["value/explained_variance"],
            rel_tol=1e-4,
            abs_tol=1e-5,
        )
    assert history[0]["value/explained_variance_before"] < 0.05
    assert history[-1]["value/explained_variance"] > 0.95
    assert step.value_fit(held)["value/explained_variance"] > 0.3


def _window_episodes(num: int, seed: int, *, truncate_every: int = 0) -> list[Trajectory]:
    """Windowed episodes (one row per node, as `episode.context_mode: window` records them):
    the key token opens every node's context, so each row carries the outcome."""
    out = []
    for t in _episodes(num, seed, truncate_every=truncate_every):
        key = t.nodes[0].observation_token_ids[0]
        history: list[int] = []
        for node in t.nodes:
            node.context_token_ids = [key] + history[-4:] + node.observation_token_ids
            history += node.action_token_ids + node.observation_token_ids
        t.context_mode = "window"
        out.append(t)
    return out


def _reference_ev_window(value_chunks, parallel, trajs) -> float:
    """float64 loop reference for windowed rows: V at an action token = the row's output after
    every token before it; R = reward-to-go from its node, plus (truncated) the V of the state
    after the last action token of the last row."""
    batch = _pack(trajs)
    raw = compute_values(
        value_chunks, parallel, ModelInputs(batch.token_ids, batch.loss_mask, batch.position_ids)
    ).double()
    vs, rs, row = [], [], 0
    for traj in trajs:
        first_row = row
        last_row = first_row + len(traj.nodes) - 1
        last_pos = len(traj.nodes[-1].context_token_ids) + len(traj.nodes[-1].action_token_ids) - 1
        boot = float(raw[last_row, last_pos]) if traj.truncated else 0.0
        for n, node in enumerate(traj.nodes):
            ctx = len(node.context_token_ids)
            for i in range(len(node.action_token_ids)):
                vs.append(float(raw[first_row + n, ctx + i - 1]))
                rs.append(sum(x.reward for x in traj.nodes[n:]) + boot)
        row = last_row + 1
    mean_r = sum(rs) / len(rs)
    var_r = sum((x - mean_r) ** 2 for x in rs) / len(rs)
    d = [x - v for x, v in zip(rs, vs, strict=True)]
    mean_d = sum(d) / len(d)
    return 1.0 - sum((x - mean_d) ** 2 for x in d) / len(d) / var_r


def test_windowed_rows_positions_targets_and_learning(tiny_moe, parallel_1rank):
    """The same checks on windowed rows (the long-horizon configs): the logged EV equals the
    float64 reference, and a learnable target is learnt (EV > 0.9 on the batch)."""
    step, value = _critic(tiny_moe, parallel_1rank)
    trajs = _window_episodes(12, seed=3, truncate_every=3)
    ref = _reference_ev_window(value, parallel_1rank, trajs)
    fit = step.value_fit(_pack(trajs))
    assert math.isclose(fit["value/explained_variance"], ref, rel_tol=1e-5, abs_tol=1e-6)
    step, _ = _critic(tiny_moe, parallel_1rank)
    train = _pack(_window_episodes(32, seed=0))
    history = [step.value_step(train, fit_after=True) for _ in range(30)]
    assert history[0]["value/explained_variance_before"] < 0.05
    assert history[-1]["value/explained_variance"] > 0.9
