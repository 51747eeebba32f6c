"""Megatron-Core policy and value models, freezing, and log-prob/entropy computation.

Exports are lazy: ``sao_megatron.models.config`` (``MoEModelConfig``, its HF config) is
imported by tools that run in the vLLM virtualenv, which has no Megatron-Core.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ValueGPTModel": "builders",
    "build_policy": "builders",
    "build_value_model": "builders",
    "MoEModelConfig": "config",
    "ModelInputs": "forward",
    "causal_padding_mask": "forward",
    "compute_policy_logprobs": "forward",
    "compute_values": "forward",
    "forward_backward": "forward",
    "VALUE_DEFAULT_FREEZE_PATTERNS": "freeze",
    "FreezeReport": "freeze",
    "apply_freeze": "freeze",
    "token_logprobs_and_entropy": "logprobs",
    "build_transformer_config": "transformer_config",
    "check_model_parallel_compat": "transformer_config",
    "ValueHead": "value_head",
    "ValueInitReport": "value_init",
    "init_value_from_policy": "value_init",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'sao_megatron.models' has no attribute {name!r}")
    return getattr(importlib.import_module(f"sao_megatron.models.{_EXPORTS[name]}"), name)
