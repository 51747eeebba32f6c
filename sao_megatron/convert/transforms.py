"""Tensor transforms between HF and Megatron layouts (pure functions, no torch.distributed).

Each merge has an exact inverse split, so a round trip is bit-exact (only views, cat and slices).
"""

from __future__ import annotations

import torch


def merge_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, num_query_groups: int, head_dim: int
) -> torch.Tensor:
    """HF ``q_proj, k_proj, v_proj`` -> Megatron ``linear_qkv`` interleaved per query group.

    Megatron-Core (``SelfAttention.get_query_key_value_tensors``, core 0.16) views the fused
    output as ``[num_query_groups, (heads_per_group + 2) * head_dim]`` and splits each group into
    its ``heads_per_group`` query heads, then one key head, then one value head. So the rows of
    the fused weight are ``[q_g0, k_g0, v_g0, q_g1, k_g1, v_g1, ...]``.

    Args:
        q: ``[num_heads * head_dim, h]`` (weight) or ``[num_heads * head_dim]`` (bias).
        k, v: ``[num_query_groups * head_dim, ...]`` same trailing shape as ``q``.
        num_query_groups: g, the number of key/value heads.
        head_dim: d.

    Returns:
        ``[(num_heads + 2 * g) * d, ...]``, same dtype as the inputs.

    Raises:
        ValueError: shapes that do not fit ``g`` and ``d`` (names the tensors' shapes).
    """
    g, d = num_query_groups, head_dim
    if (
        k.shape != v.shape
        or k.shape[0] != g * d
        or q.shape[0] % (g * d)
        or q.shape[1:] != k.shape[1:]
    ):
        raise ValueError(
            f"q/k/v shapes {tuple(q.shape)}/{tuple(k.shape)}/{tuple(v.shape)} do not fit "
            f"num_query_groups={g}, head_dim={d}"
        )
    rest = q.shape[1:]
    qg = q.reshape(g, -1, *rest)
    kg = k.reshape(g, d, *rest)
    vg = v.reshape(g, d, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)


def split_qkv(
    qkv: torch.Tensor, *, num_attention_heads: int, num_query_groups: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`merge_qkv`: Megatron ``linear_qkv`` -> HF ``(q, k, v)``.

    Args:
        qkv: ``[(num_heads + 2 * g) * d, ...]``.

    Returns:
        q ``[num_heads * d, ...]``, k and v ``[g * d, ...]`` (contiguous copies).

    Raises:
        ValueError: when ``qkv.shape[0]`` does not match the head counts.
    """
    g, d = num_query_groups, head_dim
    per_group = num_attention_heads // g
    if qkv.shape[0] != (num_attention_heads + 2 * g) * d:
        raise ValueError(
            f"linear_qkv has {qkv.shape[0]} rows: expected (num_attention_heads="
            f"{num_attention_heads} + 2 * num_query_groups={g}) * head_dim={d}"
        )
    rest = qkv.shape[1:]
    grouped = qkv.reshape(g, (per_group + 2) * d, *rest)
    q, k, v = torch.split(grouped, [per_group * d, d, d], dim=1)
    return (
        q.reshape(-1, *rest).contiguous(),
        k.reshape(-1, *rest).contiguous(),
        v.reshape(-1, *rest).contiguous(),
    )


def merge_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF ``gate_proj`` ``[f, h]`` and ``up_proj`` ``[f, h]`` -> Megatron ``linear_fc1``
    ``[2f, h]`` = ``cat([gate, up])``.

    Megatron-Core's ``MLP`` with ``gated_linear_unit`` computes
    ``act(x1) * x2`` with ``x1, x2 = chunk(fc1(x), 2)``; HF computes
    ``act(gate_proj(x)) * up_proj(x)`` (SwiGLU, Shazeer 2020, eq. 6).

    Raises:
        ValueError: gate/up shapes differ.
    """
    if gate.shape != up.shape:
        raise ValueError(f"gate_proj {tuple(gate.shape)} and up_proj {tuple(up.shape)} differ")
    return torch.cat([gate, up], dim=0)


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`merge_gate_up`: ``[2f, h]`` -> gate ``[f, h]``, up ``[f, h]``.

    Raises:
        ValueError: odd number of rows.
    """
    if fc1.shape[0] % 2:
        raise ValueError(f"linear_fc1 has {fc1.shape[0]} rows: must be even (gate and up)")
    gate, up = fc1.chunk(2, dim=0)
    return gate.contiguous(), up.contiguous()
