"""The small MoE shapes of the tests, the tiny HF checkpoint and the job default, in one place.

All three are Qwen3-MoE-shaped with 4 query heads, 2 key/value heads and top-2 routing; each
variant below names only the fields where it differs from the tests' shape.
"""

from __future__ import annotations

from typing import Any

TINY_MOE_FIELDS: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    max_position_embeddings=64,
)
"""The tests' Megatron model (~80k parameters): `MoEModelConfig` fields (the rest default)."""

HF_TINY_MOE_FIELDS: dict[str, Any] = TINY_MOE_FIELDS | dict(
    vocab_size=300,
    hidden_size=128,
    head_dim=64,
    intermediate_size=256,
    moe_intermediate_size=128,
    num_experts=8,
    max_position_embeddings=4096,
    rope_theta=10000.0,
)
"""The tiny HF checkpoint of `sao_megatron.rollout.tiny_model` (~3M parameters), a shape both
Megatron and vLLM's CPU backend take: head_dim 64 (a head size the CPU attention kernel takes),
8 experts top-2, MoE ffn 128 (a multiple of 32, so the CPU MoE kernel packs the experts without
padding); vocabulary 300, the smallest sentencepiece vocabulary `sao_megatron.data.tokenizer`
trains. Top-k renormalised, RMSNorm eps 1e-6, untied embeddings: the `MoEModelConfig` defaults."""

JOB_DEFAULT_MOE_FIELDS: dict[str, Any] = TINY_MOE_FIELDS | dict(
    vocab_size=1024,
    hidden_size=256,
    num_hidden_layers=4,
    head_dim=64,
    num_experts=8,
    moe_intermediate_size=256,
    max_position_embeddings=2048,
)
"""The model of a `sao-train` job config that sets none of ``model.*`` (a 4-layer MoE)."""
