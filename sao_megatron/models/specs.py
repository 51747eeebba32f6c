"""Layer specs: TE specs on CUDA; Megatron local specs with an SP-aware RMSNorm on CPU."""

from __future__ import annotations

import copy

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` built from Megatron's norm arguments that supports sequence parallel.

    y = weight * (x / sqrt(mean(x^2) + eps)) (Zhang & Sennrich 2019, eq. 4); the normalisation is
    computed in fp32 and cast back to the input dtype before the weight, as HF Qwen3's RMSNorm.

    Megatron-Core 0.16.1's ``WrappedTorchNorm`` (transformer/torch_norm.py) asserts
    ``not config.sequence_parallel``; MoE with TP > 1 requires sequence parallel. With SP every
    TP rank sees a different slice of the sequence, so the weight's gradient is partial per rank;
    tagging ``weight.sequence_parallel = True`` makes Megatron's ``finalize_model_grads``
    all-reduce it over the TP group (same mechanism as TE's norms).
    """

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-6,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "RMSNorm",
    ) -> None:
        if zero_centered_gamma or config.layernorm_zero_centered_gamma:
            raise ValueError("SequenceParallelRMSNorm does not support zero_centered_gamma")
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., hidden] -> same shape and dtype."""
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def _with_cpu_norms(layer_spec: ModuleSpec) -> ModuleSpec:
    spec = copy.deepcopy(layer_spec)
    sub = spec.submodules
    sub.input_layernorm = SequenceParallelRMSNorm
    sub.pre_mlp_layernorm = SequenceParallelRMSNorm
    attn = sub.self_attention.submodules
    for name in ("q_layernorm", "k_layernorm"):
        current = getattr(attn, name, None)
        if current is not None and getattr(current, "__name__", "") != "IdentityOp":
            setattr(attn, name, SequenceParallelRMSNorm)
    return spec


def build_block_spec(
    config: TransformerConfig,
    use_te: bool,
    vp_stage: int | None = None,
    pp_rank: int | None = None,
) -> TransformerBlockSubmodules:
    """Decoder block spec for the layers of one (virtual) pipeline stage.

    ``use_te``: Megatron's Transformer Engine GPT specs (fused norm+linear, grouped experts,
    FP8-capable). Otherwise Megatron's local specs with every norm replaced by
    ``SequenceParallelRMSNorm`` (works with and without sequence parallel).
    """
    block = get_gpt_decoder_block_spec(
        config,
        use_transformer_engine=use_te,
        normalization="RMSNorm",
        vp_stage=vp_stage,
        pp_rank=pp_rank,
    )
    if use_te:
        return block
    return TransformerBlockSubmodules(
        layer_specs=[_with_cpu_norms(s) for s in block.layer_specs],
        layer_norm=SequenceParallelRMSNorm,
    )
