"""HF ``config.json`` -> the trainer's ``MoEModelConfig`` (MoE and dense Qwen2/Qwen3/Llama).

``MoEModelConfig.from_hf_config`` (sao_megatron.models.config) reads the MoE families. Dense
families become an MoE config whose every layer is listed in ``mlp_only_layers`` (Megatron builds
a dense MLP there, ``moe_layer_freq`` all zeros), so one model builder serves both.
"""

from __future__ import annotations

from typing import Any

from sao_megatron.convert.spec import ConversionSpec, hf_config_compat
from sao_megatron.models.config import MoEModelConfig


def model_config_from_hf(hf: dict[str, Any], **overrides: Any) -> MoEModelConfig:
    """Build the ``MoEModelConfig`` for an HF ``config.json`` dict.

    Args:
        hf: parsed ``config.json``, with transformers-4 or transformers-5 field names
            (``rope_theta`` or ``rope_parameters.rope_theta``; ``num_experts`` or
            ``num_local_experts``; see :func:`~sao_megatron.convert.spec.hf_config_compat`).
        overrides: ``MoEModelConfig`` fields to set (e.g. ``moe_token_dispatcher_type``).

    Raises:
        ValueError: unknown architecture or unsupported feature (see
            :meth:`ConversionSpec.from_hf_config`), or a missing field.
    """
    hf = hf_config_compat(hf)
    spec = ConversionSpec.from_hf_config(hf)  # validates architecture and features
    if spec.num_experts:
        return MoEModelConfig.from_hf_config(hf, **overrides)
    n = spec.num_layers
    kw: dict[str, Any] = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=n,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_query_groups,
        head_dim=spec.head_dim,
        # One placeholder expert that no layer uses: every layer is dense.
        num_experts=1,
        num_experts_per_tok=1,
        norm_topk_prob=False,  # Megatron requires a pre-softmax router when top-k is 1
        moe_intermediate_size=int(hf["intermediate_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        mlp_only_layers=list(range(n)),
        rope_theta=float(hf.get("rope_theta", 10000.0)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=spec.tie_word_embeddings,
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        qk_layernorm=spec.qk_norm,
        attention_bias=spec.qkv_bias,
        initializer_range=float(hf.get("initializer_range", 0.02)),
    )
    kw.update(overrides)
    return MoEModelConfig(**kw)
