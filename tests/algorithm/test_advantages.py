"""Advantages vs plain-loop float64 references (GAE over tokens and nodes, GRPO, whitening)."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from sao_megatron.algorithm.advantages import (
    action_token_gae,
    final_next_values,
    grpo_advantages,
    length_adaptive_lambda,
    masked_whiten,
    node_gae,
    token_rewards_from_nodes,
)
from sao_megatron.algorithm.scan import compact, discounted_reverse_cumsum, expand
from sao_megatron.data.trajectory import ActionNode, Trajectory
from tests.algorithm.batches import random_batch

# ---------------------------------------------------------------- references (plain loops)


def ref_lambda(length, lam, alpha):
    if alpha is None:
        return lam
    return min(max(1.0 - 1.0 / (alpha * max(length, 1)), 0.0), 1.0)


def ref_token_gae(bt, gamma, lam_pi, lam_v, bootstrap, alpha=None):
    """Walk each row backwards token by token; observation tokens pass V_next / A_next through."""
    bsz, t_len = bt.action_mask.shape
    adv = torch.zeros(bsz, t_len, dtype=torch.float64)
    ret = torch.zeros(bsz, t_len, dtype=torch.float64)
    for b in range(bsz):
        m = bt.action_mask[b].tolist()
        nidx = bt.node_index[b].tolist()
        reward = [0.0] * t_len
        for n in range(bt.num_nodes[b]):
            last = max(t for t in range(t_len) if m[t] and nidx[t] == n)
            reward[last] = float(bt.node_rewards[b, n])
        v = bt.values[b].tolist()
        lam = ref_lambda(sum(m), lam_pi, alpha)
        for lam_used, out, add_v in ((lam, adv, False), (lam_v, ret, True)):
            v_next = float(bt.bootstrap_values[b]) if (bootstrap and bt.truncated[b]) else 0.0
            a_next = 0.0
            for t in reversed(range(t_len)):
                if not m[t]:
                    continue
                delta = reward[t] + gamma * v_next - v[t]
                a = delta + gamma * lam_used * a_next
                out[b, t] = a + (v[t] if add_v else 0.0)
                a_next, v_next = a, v[t]
    return adv, ret


def ref_node_gae(bt, gamma, lam_pi, lam_v, bootstrap, mode, alpha=None):
    bsz, t_len = bt.action_mask.shape
    adv = torch.zeros(bsz, t_len, dtype=torch.float64)
    ret = torch.zeros(bsz, t_len, dtype=torch.float64)
    vmask = torch.zeros(bsz, t_len, dtype=torch.bool)
    for b in range(bsz):
        k = bt.num_nodes[b]
        toks = [
            [t for t in range(t_len) if bt.action_mask[b, t] and bt.node_index[b, t] == n]
            for n in range(k)
        ]
        if mode == "last_token":
            vn = [float(bt.values[b, ts[-1]]) for ts in toks]
            for ts in toks:
                vmask[b, ts[-1]] = True
        else:
            vn = [sum(float(bt.values[b, t]) for t in ts) / len(ts) for ts in toks]
            for ts in toks:
                for t in ts:
                    vmask[b, t] = True
        lam = ref_lambda(k, lam_pi, alpha)
        for lam_used, out, add_v in ((lam, adv, False), (lam_v, ret, True)):
            v_next = float(bt.bootstrap_values[b]) if (bootstrap and bt.truncated[b]) else 0.0
            a_next = 0.0
            for n in reversed(range(k)):
                delta = float(bt.node_rewards[b, n]) + gamma * v_next - vn[n]
                a = delta + gamma * lam_used * a_next
                for t in toks[n]:
                    out[b, t] = a + (vn[n] if add_v else 0.0)
                a_next, v_next = a, vn[n]
    return adv, ret, vmask


def next_values(bt, bootstrap):
    return final_next_values(bt.truncated, bt.bootstrap_values, bootstrap)


# ---------------------------------------------------------------- scan primitives


@pytest.mark.parametrize("length", [0, 1, 7, 8, 9, 64, 65, 300, 4100])
@pytest.mark.parametrize("chunk", [2, 8, 64])
def test_discounted_reverse_cumsum_matches_loop(length, chunk):
    g = torch.Generator().manual_seed(length * 100 + chunk)
    x = torch.randn(4, length, generator=g, dtype=torch.float64)
    coef = torch.tensor([0.0, 0.5, 0.97, 1.0], dtype=torch.float64)
    y = discounted_reverse_cumsum(x, coef, chunk=chunk)
    ref = torch.zeros_like(x)
    for b in range(4):
        acc = 0.0
        for t in reversed(range(length)):
            acc = float(x[b, t]) + float(coef[b]) * acc
            ref[b, t] = acc
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-9)


def test_scan_keeps_float32_dtype_and_accuracy():
    x = torch.randn(2, 5000, dtype=torch.float32)
    coef = torch.tensor([0.999, 1.0])
    y = discounted_reverse_cumsum(x, coef)
    assert y.dtype == torch.float32
    ref = discounted_reverse_cumsum(x.double(), coef.double())
    torch.testing.assert_close(y.double(), ref, rtol=1e-6, atol=1e-4)


def test_compact_expand_round_trip():
    mask = torch.tensor([[0, 1, 1, 0, 1], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    x = torch.arange(15, dtype=torch.float64).view(3, 5)
    packed, counts = compact(x, mask)
    assert counts.tolist() == [3, 0, 1]
    assert packed.tolist() == [[1, 2, 4], [0, 0, 0], [10, 0, 0]]
    assert expand(packed, mask).tolist() == (x * mask).tolist()


# ---------------------------------------------------------------- GAE


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("bootstrap", [True, False])
@pytest.mark.parametrize("alpha", [None, 0.3])
def test_action_token_gae_matches_reference(seed, bootstrap, alpha):
    bt = random_batch(seed)
    gamma, lam_pi, lam_v = 0.97, 0.9, 1.0
    out = action_token_gae(
        values=bt.values,
        node_rewards=bt.node_rewards,
        node_index=bt.node_index,
        action_mask=bt.action_mask,
        next_values=next_values(bt, bootstrap),
        gamma=gamma,
        lam_policy=lam_pi,
        lam_value=lam_v,
        length_adaptive_alpha=alpha,
    )
    adv, ret = ref_token_gae(bt, gamma, lam_pi, lam_v, bootstrap, alpha)
    torch.testing.assert_close(out.advantages, adv, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out.returns, ret, rtol=1e-10, atol=1e-10)
    assert torch.equal(out.value_mask, bt.action_mask)
    assert torch.isfinite(out.advantages).all() and not out.advantages[0].any()  # empty row


def test_gae_hand_case_observation_in_middle_and_end():
    # tokens: obs a0 a0 obs obs a1 obs ; reward 1 after node 0, 2 after node 1 (truncated)
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 0]], dtype=torch.bool)
    node_index = torch.tensor([[0, 0, 0, 1, 1, 1, -1]])
    values = torch.tensor([[9.0, 0.5, 0.25, 9.0, 9.0, 1.0, 9.0]], dtype=torch.float64)
    rewards = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    g, lam, boot = 0.5, 0.5, 4.0
    out = action_token_gae(
        values=values,
        node_rewards=rewards,
        node_index=node_index,
        action_mask=mask,
        next_values=torch.tensor([boot]),
        gamma=g,
        lam_policy=lam,
        lam_value=1.0,
    )
    d2 = 2.0 + g * boot - 1.0  # last action token: reward 2, bootstrap 4
    d1 = 1.0 + g * 1.0 - 0.25  # a0's last token carries reward 1, V_next skips the obs block
    d0 = 0.0 + g * 0.25 - 0.5
    a2, a1 = d2, d1 + g * lam * d2
    a0 = d0 + g * lam * a1
    expect = torch.tensor([[0, a0, a1, 0, 0, a2, 0]], dtype=torch.float64)
    torch.testing.assert_close(out.advantages, expect)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("mode", ["last_token", "mean"])
@pytest.mark.parametrize("bootstrap", [True, False])
def test_node_gae_matches_reference(seed, mode, bootstrap):
    bt = random_batch(seed + 10)
    alpha = 0.5 if seed % 2 else None
    out = node_gae(
        values=bt.values,
        node_rewards=bt.node_rewards,
        node_index=bt.node_index,
        action_mask=bt.action_mask,
        next_values=next_values(bt, bootstrap),
        gamma=0.9,
        lam_policy=0.8,
        lam_value=1.0,
        node_value=mode,
        length_adaptive_alpha=alpha,
    )
    adv, ret, vmask = ref_node_gae(bt, 0.9, 0.8, 1.0, bootstrap, mode, alpha)
    torch.testing.assert_close(out.advantages, adv, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(torch.where(vmask, out.returns, 0.0), torch.where(vmask, ret, 0.0))
    assert torch.equal(out.value_mask, vmask)


def test_length_adaptive_lambda_values():
    lam = length_adaptive_lambda(torch.tensor([0, 1, 20, 100, 1000]), 0.05)
    expect = [0.0, 0.0, 0.0, 1 - 1 / 5, 1 - 1 / 50]
    torch.testing.assert_close(lam, torch.tensor(expect, dtype=torch.float64))


def test_truncated_row_without_bootstrap_value_raises():
    with pytest.raises(ValueError, match="bootstrap_values"):
        final_next_values(torch.tensor([False, True]), None, True)
    assert final_next_values(torch.tensor([True]), None, False).tolist() == [0.0]


def test_reward_on_node_without_action_tokens_raises():
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    with pytest.raises(ValueError, match="no action token"):
        token_rewards_from_nodes(torch.tensor([[1.0, 2.0]]), torch.tensor([[0, 0, 1]]), mask)
    with pytest.raises(ValueError, match="node_index"):
        token_rewards_from_nodes(torch.tensor([[1.0]]), torch.tensor([[0, 3, 0]]), mask)
    with pytest.raises(ValueError, match="decreases"):
        token_rewards_from_nodes(torch.tensor([[1.0, 2.0]]), torch.tensor([[1, 0, 0]]), mask)
    with pytest.raises(ValueError, match="shapes"):
        token_rewards_from_nodes(torch.tensor([[1.0]]), torch.tensor([[0, 0]]), mask)


def test_gae_from_trajectory_contract():
    """A Trajectory flattened by the data contract feeds the GAE directly."""
    traj = Trajectory(
        task_id="t",
        truncated=False,
        nodes=[
            ActionNode(
                observation_token_ids=[5, 6],
                action_token_ids=[7, 8],
                behaviour_logprobs=[-0.1, -0.2],
                policy_versions=[0, 0],
                reward=0.5,
            ),
            ActionNode(
                observation_token_ids=[9],
                action_token_ids=[10],
                behaviour_logprobs=[-0.3],
                policy_versions=[1],
                reward=1.0,
            ),
        ],
    )
    seq = traj.to_token_sequence()
    rewards = torch.tensor([[n.reward for n in traj.nodes]], dtype=torch.float64)
    values = torch.zeros(1, len(seq), dtype=torch.float64)
    out = action_token_gae(
        values=values,
        node_rewards=rewards,
        node_index=seq.node_index[None],
        action_mask=seq.action_mask[None],
        next_values=torch.zeros(1),
        gamma=1.0,
        lam_policy=1.0,
        lam_value=1.0,
    )
    # with V = 0, gamma = lambda = 1 the advantage is the reward-to-go over action tokens
    assert out.advantages[0].tolist() == [0, 0, 1.5, 1.5, 0, 1.0]


# ---------------------------------------------------------------- GRPO and whitening


def ref_grpo(scores, groups, std_normalize, eps):
    out = []
    for s, gid in zip(scores, groups, strict=True):
        members = [x for x, g in zip(scores, groups, strict=True) if g == gid]
        mean = sum(members) / len(members)
        if not std_normalize:
            out.append(s - mean)
            continue
        std = statistics.stdev(members) if len(members) > 1 else 0.0
        out.append((s - mean) / (std + eps))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("std_normalize", [True, False])
def test_grpo_matches_reference_including_singleton_and_constant_groups(std_normalize):
    g = torch.Generator().manual_seed(3)
    groups = torch.tensor([4, 4, 4, 9, 1, 1, 1, 1, 7, 7])  # 9: size 1; 7: equal scores
    scores = torch.randn(10, generator=g, dtype=torch.float64)
    scores[8] = scores[9] = 0.5
    out = grpo_advantages(scores, groups, std_normalize=std_normalize, eps=1e-6)
    ref = ref_grpo(scores.tolist(), groups.tolist(), std_normalize, 1e-6)
    torch.testing.assert_close(out, ref)
    assert out[3] == 0 and out[8] == 0 and out[9] == 0 and torch.isfinite(out).all()


def test_masked_whiten_matches_reference():
    bt = random_batch(5)
    x = bt.values
    vals = [
        float(x[b, t]) for b in range(x.shape[0]) for t in range(x.shape[1]) if bt.action_mask[b, t]
    ]
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals) + 1e-8)
    ref = torch.where(bt.action_mask, (x - mean) / std, 0.0)
    torch.testing.assert_close(masked_whiten(x, bt.action_mask), ref)
    assert not masked_whiten(x, torch.zeros_like(bt.action_mask)).any()
