"""Megatron-Core policy and value models, freezing, and log-prob/entropy computation."""

from sao_megatron.models.builders import ValueGPTModel, build_policy, build_value_model
from sao_megatron.models.config import MoEModelConfig
from sao_megatron.models.forward import (
    ModelInputs,
    causal_padding_mask,
    compute_policy_logprobs,
    compute_values,
    forward_backward,
)
from sao_megatron.models.freeze import VALUE_DEFAULT_FREEZE_PATTERNS, FreezeReport, apply_freeze
from sao_megatron.models.logprobs import token_logprobs_and_entropy
from sao_megatron.models.transformer_config import (
    build_transformer_config,
    check_model_parallel_compat,
)
from sao_megatron.models.value_head import ValueHead
from sao_megatron.models.value_init import ValueInitReport, init_value_from_policy

__all__ = [
    "VALUE_DEFAULT_FREEZE_PATTERNS",
    "FreezeReport",
    "ModelInputs",
    "MoEModelConfig",
    "ValueGPTModel",
    "ValueHead",
    "ValueInitReport",
    "apply_freeze",
    "build_policy",
    "build_transformer_config",
    "build_value_model",
    "causal_padding_mask",
    "check_model_parallel_compat",
    "compute_policy_logprobs",
    "compute_values",
    "forward_backward",
    "init_value_from_policy",
    "token_logprobs_and_entropy",
]
