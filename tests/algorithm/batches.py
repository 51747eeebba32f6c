"""Random padded trajectory batches for the algorithm tests, with the awkward cases built in.

Each row is obs_0 act_0 obs_1 act_1 ... [trailing obs] [padding]: observation blocks at the start,
in the middle and at the end, rows of a single action token, all-masked rows (no nodes), and
full-length rows. Everything is returned as plain tensors plus the per-row python lists the
loop references read.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch


@dataclass
class Batch:
    action_mask: torch.Tensor  # [B, T] bool
    node_index: torch.Tensor  # [B, T] int64, -1 on padding / trailing observation
    node_rewards: torch.Tensor  # [B, N] float64
    values: torch.Tensor  # [B, T] float64
    truncated: torch.Tensor  # [B] bool
    bootstrap_values: torch.Tensor  # [B] float64
    num_nodes: list[int]  # nodes per row


def random_batch(seed: int, batch: int = 12, max_nodes: int = 6, max_len: int = 4) -> Batch:
    """Random batch; rows 0..3 are fixed special cases (empty, length 1, trailing obs, no obs)."""
    rng = random.Random(seed)
    rows = []
    for b in range(batch):
        if b == 0:
            nodes = []  # all-masked row (only a prompt)
            trailing = 3
        elif b == 1:
            nodes = [(0, 1)]  # a trajectory of one token: no prompt, one action token
            trailing = 0
        elif b == 2:
            nodes = [(rng.randint(1, max_len), rng.randint(1, max_len)) for _ in range(3)]
            trailing = 4  # observation block at the end
        elif b == 3:
            nodes = [(0, rng.randint(1, max_len)) for _ in range(4)]  # no observation tokens
            trailing = 0
        else:
            k = rng.randint(1, max_nodes)
            nodes = [(rng.randint(0, max_len), rng.randint(1, max_len)) for _ in range(k)]
            trailing = rng.choice([0, 0, 2])
        rows.append((nodes, trailing))
    t_len = max(sum(o + a for o, a in nodes) + tr for nodes, tr in rows) + 2  # + padding
    n_max = max(max(len(nodes) for nodes, _ in rows), 1)
    mask = torch.zeros(batch, t_len, dtype=torch.bool)
    node_index = torch.full((batch, t_len), -1, dtype=torch.long)
    for b, (nodes, _trailing) in enumerate(rows):
        t = 0
        for n, (o, a) in enumerate(nodes):
            node_index[b, t : t + o] = n
            t += o
            mask[b, t : t + a] = True
            node_index[b, t : t + a] = n
            t += a
    g = torch.Generator().manual_seed(seed)
    node_rewards = torch.zeros(batch, n_max, dtype=torch.float64)
    for b, (nodes, _) in enumerate(rows):
        node_rewards[b, : len(nodes)] = torch.randn(len(nodes), generator=g, dtype=torch.float64)
    values = torch.randn(batch, t_len, generator=g, dtype=torch.float64)
    truncated = torch.rand(batch, generator=g) < 0.5
    truncated[2] = True
    bootstrap = torch.randn(batch, generator=g, dtype=torch.float64)
    return Batch(
        mask,
        node_index,
        node_rewards,
        values,
        truncated,
        bootstrap,
        [len(nodes) for nodes, _ in rows],
    )


def random_logprobs(mask: torch.Tensor, seed: int, spread: float = 0.3):
    """(logprobs, behaviour_logprobs) [B, T] float64 with some ratios far outside any band."""
    g = torch.Generator().manual_seed(seed)
    blp = -torch.rand(mask.shape, generator=g, dtype=torch.float64) * 3
    lp = blp + spread * torch.randn(mask.shape, generator=g, dtype=torch.float64)
    far = torch.rand(mask.shape, generator=g) < 0.1
    lp = torch.where(far, blp + 30 * torch.sign(torch.randn(mask.shape, generator=g)), lp)
    return lp, blp
