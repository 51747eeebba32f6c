"""Megatron-Core policy and value models, freezing, and log-prob/entropy computation.

Exports are lazy: ``sao_megatron.models.config`` (``MoEModelConfig``, its HF config) is
imported by tools that run in the vLLM virtualenv, which has no Megatron-Core.
"""

from __future__ import annotations

from sao_megatron.lazy import lazy_exports

_MODULES = {
    "builders": ("ValueGPTModel", "build_policy", "build_value_model"),
    "config": ("MoEModelConfig",),
    "forward": (
        "ModelInputs",
        "causal_padding_mask",
        "compute_policy_logprobs",
        "compute_values",
        "forward_backward",
    ),
    "freeze": ("VALUE_DEFAULT_FREEZE_PATTERNS", "FreezeReport", "apply_freeze"),
    "logprobs": ("token_logprobs_and_entropy",),
    "transformer_config": ("build_transformer_config", "check_model_parallel_compat"),
    "value_head": ("ValueHead",),
    "value_init": ("ValueInitReport", "init_value_from_policy"),
}
__getattr__, __all__ = lazy_exports(__name__, _MODULES)
