"""Advantages and value targets: token- and node-level GAE, GRPO group advantages, whitening.

Batch convention (one trajectory per row, right-padded; see docs/ALGORITHM.md "Batch layout"):

* ``action_mask [B, T] bool``: True on tokens the policy sampled (m_t); prompt, observation and
  padding tokens are False and are skipped by GAE (they pass V_next and A_next through).
* ``node_index [B, T] int64``: the action node of each token (read on action tokens only; any
  value, e.g. -1, elsewhere). Nodes of a row are ordered by index; N = node_rewards.shape[1].
* ``node_rewards [B, N] float``: the reward the environment returned after action n, as in
  `sao_megatron.data.trajectory.ActionNode.reward`. Padding nodes (no action token) must be 0.
  For token-level GAE the reward of node n sits on node n's last action token, so the terminal
  reward sits on the trajectory's last action token, never on a trailing observation token.
* ``values [B, T] float``: V(s_t) from the value model at each token (read on action tokens).
* ``next_values [B] float``: V of the state after the last action: 0 for a terminated episode,
  the bootstrap value for a truncated one (built by `final_next_values`).

Outputs are [B, T] with 0 on non-action tokens. Everything runs in float64 inside the scan and is
returned in the dtype of ``values``; nothing loops over rows or tokens in Python.

GAE and GRPO's group statistics read one trajectory (one group) at a time, so a rank computes
them on its own share of the batch; whitening is a statistic of the whole batch and takes a
`BatchReducer` (sums over the data-parallel ranks) to be the same at every layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .scan import Packer, discounted_reverse_cumsum


@dataclass(kw_only=True)
class AdvantageOutput:
    """Result of an algorithm's advantages (`sao_megatron.algorithm.base.Algorithm.advantages`).

    advantages: [B, T] policy advantages, 0 off the action mask.
    returns: [B, T] value targets R = A(lam_value) + V where value_mask is True (None for GRPO).
    value_mask: [B, T] bool, the positions the value loss is taken on (None for GRPO).
    lam_policy: [B] the policy lambda used per row (length-adaptive or constant; None for GRPO).
    """

    advantages: torch.Tensor
    returns: torch.Tensor | None = None
    value_mask: torch.Tensor | None = None
    lam_policy: torch.Tensor | None = None


def final_next_values(
    truncated: torch.Tensor, bootstrap_values: torch.Tensor | None, bootstrap_truncated: bool
) -> torch.Tensor:
    """V after the last action per row: bootstrap_values where truncated (if enabled), else 0.

    Args:
        truncated: [B] bool, the episode hit its budget rather than terminating.
        bootstrap_values: [B] float V(last state) or None (allowed only if nothing is truncated or
            bootstrapping is off).
        bootstrap_truncated: algorithm.sao.bootstrap_truncated; False treats truncation as
            termination.

    Returns: [B] float64. Raises ValueError if a truncated row needs a missing bootstrap value.
    """
    truncated = truncated.to(torch.bool)
    if not bootstrap_truncated or not bool(truncated.any()):
        return torch.zeros(truncated.shape, dtype=torch.float64, device=truncated.device)
    if bootstrap_values is None:
        raise ValueError(
            "truncated rows need bootstrap_values ([B] V of the last state) when "
            "algorithm.sao.bootstrap_truncated is true; pass them or set "
            "algorithm.sao.bootstrap_truncated=false"
        )
    return torch.where(truncated, bootstrap_values.to(torch.float64), 0.0)


def length_adaptive_lambda(lengths: torch.Tensor, alpha: float) -> torch.Tensor:
    """VAPO length-adaptive lambda: clamp(1 - 1 / (alpha * l), 0, 1) per row.

    Source: Yue et al. 2025, VAPO (arXiv 2504.05118), section 3.2, lambda_policy = 1 - 1/(alpha l).
    Args: lengths [B] int, GAE steps per row (0 is treated as 1: such a row has no step), alpha > 0.
    Returns: [B] float64.
    """
    lengths = lengths.to(torch.float64).clamp(min=1.0)
    return (1.0 - 1.0 / (alpha * lengths)).clamp(0.0, 1.0)


def gae_packed(
    rewards: torch.Tensor,
    values: torch.Tensor,
    lengths: torch.Tensor,
    next_values: torch.Tensor,
    gamma: float,
    lam: torch.Tensor | float,
) -> torch.Tensor:
    """GAE on packed (left-aligned, right-padded) step sequences.

    delta_t = r_t + gamma V_{t+1} - V_t (V_{l} = next_values), A_t = delta_t + gamma lam A_{t+1}.
    Source: Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE", eq. 16.

    Args:
        rewards, values: [B, L] float; entries at j >= lengths[b] are ignored.
        lengths: [B] int64 number of valid steps per row (0 allowed: the row is all zeros).
        next_values: [B] float, V after the last valid step.
        gamma: discount in [0, 1]. lam: float or [B] in [0, 1].

    Returns: [B, L] float64 advantages, 0 at j >= lengths[b].
    """
    b, length = rewards.shape
    r = rewards.to(torch.float64)
    v = values.to(torch.float64)
    valid = torch.arange(length, device=r.device)[None, :] < lengths[:, None]
    r = torch.where(valid, r, 0.0)
    v = torch.where(valid, v, 0.0)
    v_ext = torch.nn.functional.pad(v, (0, 1)).scatter(
        1, lengths[:, None].long(), next_values.to(torch.float64)[:, None]
    )
    delta = torch.where(valid, r + gamma * v_ext[:, 1:] - v, 0.0)
    lam_t = torch.as_tensor(lam, dtype=torch.float64, device=r.device).expand(b)
    return discounted_reverse_cumsum(delta, gamma * lam_t)


@dataclass(kw_only=True)
class PackedNodes:
    """Action tokens of each row gathered to the left (see scan.Packer), with their nodes.

    node_ids: [B, L] int64 node of each packed action token (0 past the row's length).
    lengths: [B] int64 action tokens per row. valid: [B, L] bool, j < lengths[b].
    is_last: [B, L] bool, the packed token is its node's last action token.
    node_mask: [B, N] bool, node n has at least one action token.
    rewards: [B, L] float64, node reward on each node's last action token, 0 elsewhere.
    packer: the `Packer` of the action mask (packs/unpacks other [B, T] tensors).
    """

    node_ids: torch.Tensor
    lengths: torch.Tensor
    valid: torch.Tensor
    is_last: torch.Tensor
    node_mask: torch.Tensor
    rewards: torch.Tensor
    packer: Packer


def pack_nodes(
    node_rewards: torch.Tensor, node_index: torch.Tensor, action_mask: torch.Tensor
) -> PackedNodes:
    """Pack the action tokens and locate node ends; validates the node layout.

    Args: node_rewards [B, N] float, node_index [B, T] int64, action_mask [B, T] bool.
    Raises ValueError if shapes disagree, a node index on an action token is outside [0, N), the
    node index decreases along a row's action tokens (a row must be one trajectory in order), or a
    node without action tokens has a nonzero reward (it would be lost).
    """
    mask = action_mask.to(torch.bool)
    if node_index.shape != mask.shape or node_rewards.shape[0] != mask.shape[0]:
        raise ValueError(
            f"shapes differ: node_index {tuple(node_index.shape)}, action_mask "
            f"{tuple(mask.shape)}, node_rewards {tuple(node_rewards.shape)} (want [B, T], "
            "[B, T], [B, N])"
        )
    n = node_rewards.shape[1]
    packer = Packer(mask)
    node_ids, lengths = packer.pack(node_index.long()), packer.counts
    valid = torch.arange(node_ids.shape[1], device=mask.device)[None, :] < lengths[:, None]
    if node_ids.numel():
        lo = int(torch.where(valid, node_ids, 0).min())
        hi = int(torch.where(valid, node_ids, -1).max())
        if lo < 0 or hi >= n:
            raise ValueError(
                f"node_index on action tokens must be in [0, {n}) (N = node_rewards.shape[1]); "
                f"got range [{lo}, {hi}]"
            )
    nxt = torch.nn.functional.pad(node_ids[:, 1:], (0, 1))
    valid_next = torch.nn.functional.pad(valid[:, 1:], (0, 1))
    if bool((valid_next & (nxt < node_ids)).any()):
        raise ValueError(
            "node_index decreases along a row's action tokens: each row must hold one "
            "trajectory with its nodes in order"
        )
    is_last = valid & (~valid_next | (nxt != node_ids))
    spill = torch.where(valid, node_ids, n)
    node_mask = mask.new_zeros(mask.shape[0], n + 1).scatter(1, spill, True)[:, :n]
    if bool((node_rewards.ne(0) & ~node_mask).any()):
        raise ValueError(
            "node_rewards holds a nonzero reward for a node with no action token in node_index; "
            "give every rewarded node at least one action token (padding nodes must be 0)"
        )
    rewards = torch.where(is_last, node_rewards.to(torch.float64).gather(1, node_ids), 0.0)
    return PackedNodes(
        node_ids=node_ids,
        lengths=lengths,
        valid=valid,
        is_last=is_last,
        node_mask=node_mask,
        rewards=rewards,
        packer=packer,
    )


def token_rewards_from_nodes(
    node_rewards: torch.Tensor, node_index: torch.Tensor, action_mask: torch.Tensor
) -> torch.Tensor:
    """Place each node's reward on that node's last action token.

    Args: node_rewards [B, N] float, node_index [B, T] int64, action_mask [B, T] bool.
    Returns: [B, T] (dtype of node_rewards), 0 elsewhere. Raises ValueError as `pack_nodes`.
    """
    pk = pack_nodes(node_rewards, node_index, action_mask)
    return pk.packer.unpack(pk.rewards.to(node_rewards.dtype))


def action_token_gae(
    *,
    values: torch.Tensor,
    node_rewards: torch.Tensor,
    node_index: torch.Tensor,
    action_mask: torch.Tensor,
    next_values: torch.Tensor,
    gamma: float,
    lam_policy: float,
    lam_value: float,
    length_adaptive_alpha: float | None = None,
) -> AdvantageOutput:
    """Token-level GAE over action tokens only (SAO default, `advantage_granularity=action_token`).

    Observation/prompt tokens are skipped: they keep V_next and A_next unchanged, so the recursion
    delta_t = r_t + gamma V_next(t) - V_t, A_t = delta_t + gamma lam A_next(t) runs over the
    action tokens in order, with r_t = node reward on a node's last action token, 0 otherwise.
    Sources: GAE eq. 16 (Schulman et al. 2016); token-level GAE with lam_value = 1 for the value
    targets and length-adaptive lam_policy: VAPO (Yue et al. 2025, arXiv 2504.05118) sec. 3.

    Shapes: values [B, T], node_rewards [B, N], node_index [B, T], action_mask [B, T],
    next_values [B] (see module docstring). Returns advantages/returns [B, T] (dtype of values),
    value_mask = action_mask. Raises ValueError as `pack_nodes`.
    """
    mask = action_mask.to(torch.bool)
    pk = pack_nodes(node_rewards, node_index, mask)
    v_packed = pk.packer.pack(values).to(torch.float64)
    lam_pi = _policy_lambda(pk.lengths, lam_policy, length_adaptive_alpha)
    adv = gae_packed(pk.rewards, v_packed, pk.lengths, next_values, gamma, lam_pi)
    returns = gae_packed(pk.rewards, v_packed, pk.lengths, next_values, gamma, lam_value)
    returns = returns + v_packed
    return AdvantageOutput(
        advantages=pk.packer.unpack(adv.to(values.dtype)),
        returns=pk.packer.unpack(returns.to(values.dtype)),
        value_mask=mask,
        lam_policy=lam_pi,
    )


def node_gae(
    *,
    values: torch.Tensor,
    node_rewards: torch.Tensor,
    node_index: torch.Tensor,
    action_mask: torch.Tensor,
    next_values: torch.Tensor,
    gamma: float,
    lam_policy: float,
    lam_value: float,
    node_value: str = "last_token",
    length_adaptive_alpha: float | None = None,
) -> AdvantageOutput:
    """Node-level GAE: one value and one advantage per action node, broadcast to its tokens.

    V_n = values at node n's last action token (node_value="last_token") or the mean of values
    over node n's action tokens ("mean"). delta_n = R_n + gamma V_{n+1} - V_n over the nodes that
    have action tokens, in node order; A_n = delta_n + gamma lam A_{n+1} (GAE eq. 16, Schulman et
    al. 2016, with an action node as the MDP step). Every action token of node n gets A_n and the
    value target A_n(lam_value) + V_n. value_mask: the last action token of each node for
    "last_token", every action token for "mean". Length-adaptive lambda counts nodes.

    Shapes as `action_token_gae`. Raises ValueError for an unknown node_value or as `pack_nodes`.
    """
    if node_value not in ("last_token", "mean"):
        raise ValueError(f"node_value={node_value!r}: use 'last_token' or 'mean'")
    mask = action_mask.to(torch.bool)
    pk = pack_nodes(node_rewards, node_index, mask)
    n = node_rewards.shape[1]
    b = mask.shape[0]
    v_c = pk.packer.pack(values).to(torch.float64)
    if node_value == "last_token":
        spill = torch.where(pk.is_last, pk.node_ids, n)
        v_node = v_c.new_zeros(b, n + 1).scatter(1, spill, v_c)[:, :n]
    else:
        spill = torch.where(pk.valid, pk.node_ids, n)
        sums = v_c.new_zeros(b, n + 1).scatter_add(1, spill, v_c)[:, :n]
        counts = v_c.new_zeros(b, n + 1).scatter_add(1, spill, pk.valid.to(v_c.dtype))[:, :n]
        v_node = sums / counts.clamp(min=1)
    nodes = Packer(pk.node_mask)
    r_packed, v_packed = nodes.pack(node_rewards.to(torch.float64)), nodes.pack(v_node)
    lengths = nodes.counts
    lam_pi = _policy_lambda(lengths, lam_policy, length_adaptive_alpha)
    adv_n = gae_packed(r_packed, v_packed, lengths, next_values, gamma, lam_pi)
    ret_n = gae_packed(r_packed, v_packed, lengths, next_values, gamma, lam_value) + v_packed
    adv_n, ret_n = nodes.unpack(adv_n), nodes.unpack(ret_n)  # [B, N]
    adv = pk.packer.unpack(adv_n.gather(1, pk.node_ids).to(values.dtype))
    ret = pk.packer.unpack(ret_n.gather(1, pk.node_ids).to(values.dtype))
    value_mask = pk.packer.unpack(pk.is_last) if node_value == "last_token" else mask
    return AdvantageOutput(
        advantages=adv,
        returns=ret,
        value_mask=value_mask,
        lam_policy=lam_pi,
    )


def _policy_lambda(lengths: torch.Tensor, lam: float, alpha: float | None) -> torch.Tensor:
    if alpha is None:
        return torch.full(lengths.shape, float(lam), dtype=torch.float64, device=lengths.device)
    return length_adaptive_lambda(lengths, alpha)


def grpo_advantages(
    scores: torch.Tensor, group_ids: torch.Tensor, *, std_normalize: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO outcome advantages: (R_i - mean_G R) / (std_G R + eps), or R_i - mean_G R (Dr.GRPO).

    Sources: Shao et al. 2024, DeepSeekMath (arXiv 2402.03300) sec. 4.1.2 (outcome supervision);
    Liu et al. 2025, Dr.GRPO (arXiv 2503.20783) eq. for the std-free variant. std is the unbiased
    (n-1) sample std of the group, as torch.std; a group of size 1 gets advantage 0 (not NaN).

    Args:
        scores: [B] float, total reward of each trajectory.
        group_ids: [B] int64, rows with equal id form one group (e.g. one task).
    Returns: [B] float (dtype of scores).
    """
    if scores.dim() != 1 or group_ids.shape != scores.shape:
        raise ValueError(
            f"scores and group_ids must both be [B]; got {tuple(scores.shape)}, "
            f"{tuple(group_ids.shape)}"
        )
    s = scores.to(torch.float64)
    _, inv = torch.unique(group_ids, return_inverse=True)
    g = int(inv.max()) + 1 if inv.numel() else 0
    count = s.new_zeros(g).scatter_add(0, inv, torch.ones_like(s))
    mean = s.new_zeros(g).scatter_add(0, inv, s) / count
    centred = s - mean[inv]
    if not std_normalize:
        return centred.to(scores.dtype)
    ss = s.new_zeros(g).scatter_add(0, inv, centred**2)
    std = torch.where(count > 1, ss / (count - 1).clamp(min=1), 0.0).sqrt()
    return (centred / (std[inv] + eps)).to(scores.dtype)


class BatchReducer(Protocol):
    """Sums over every rank that holds a distinct share of the batch's trajectories.

    A statistic of the whole batch (a mean, a variance) is a ratio of such sums: each rank sums
    over its own share, `sum` adds the partial sums of all ranks, so the statistic equals that of
    the concatenated global batch whatever the data-parallel layout. `sum` is a collective:
    every rank calls it the same number of times, in the same order, with tensors of one shape.
    The trainer's is `sao_megatron.trainer.step_context.DataParallelSum`; `LOCAL_BATCH` is the
    identity (one process holds the whole batch).
    """

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """`x` (float64, any shape) summed elementwise over the ranks; same shape and device."""
        ...


class LocalBatch:
    """The `BatchReducer` of a batch held whole by this process: the identity."""

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return x


LOCAL_BATCH = LocalBatch()


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, reducer: BatchReducer = LOCAL_BATCH
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked entries of the global batch (population
    variance); 0 off the mask.

    The global batch is the union of every rank's `x` under `reducer` (`BatchReducer`; the
    default `LOCAL_BATCH`: this tensor alone). Two-pass, in float64, two reductions:

        n = sum_ranks |mask|,  mean = sum_ranks sum_mask x / n,
        var = sum_ranks sum_mask (x - mean)^2 / n

    which equals whitening the concatenated batch up to float64 rounding. The second pass,
    rather than var = E[x^2] - mean^2 from one reduction of (n, sum x, sum x^2), avoids the
    cancellation of the one-pass formula when |mean| >> std: Chan, Golub & LeVeque 1983,
    "Algorithms for computing the sample variance: analysis and recommendations" (The American
    Statistician 37(3)), the two-pass algorithm.

    Args: x [B, T] float, mask [B, T] bool. Returns [B, T] (dtype of x); all zeros if the
    global mask is empty. Pass a whole batch (this rank's share of it), not one micro-batch.
    """
    mask = mask.to(torch.bool)
    x64 = torch.where(mask, x.to(torch.float64), 0.0)
    n, total = reducer.sum(torch.stack([mask.sum().to(torch.float64), x64.sum()])).unbind()
    if float(n) == 0:  # the same on every rank: no rank skips the second reduction alone
        return torch.zeros_like(x)
    mean = total / n
    sq = torch.where(mask, (x64 - mean) ** 2, 0.0).sum()
    var = reducer.sum(sq.reshape(1))[0] / n
    return torch.where(mask, (x64 - mean) * torch.rsqrt(var + eps), 0.0).to(x.dtype)
