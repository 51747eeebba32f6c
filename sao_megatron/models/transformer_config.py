"""The ONE place that builds Megatron's ``TransformerConfig`` (model x parallel x precision)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig

from sao_megatron.models.config import MoEModelConfig
from sao_megatron.optim.config import PrecisionConfig
from sao_megatron.parallel.config import ParallelConfig


def check_model_parallel_compat(model: MoEModelConfig, parallel: ParallelConfig) -> None:
    """Raise a ValueError naming the fields when the model cannot be split this way.

    Checks: heads divisible by tp, kv heads a multiple or divisor of tp, experts divisible by
    ep, layers divisible by pp (x virtual_pp), vocab divisible by tp, expert ffn divisible by
    expert_tp, and sequence parallel for MoE with tp > 1 (Megatron requires it).
    """
    tp, ep, pp = parallel.tp, parallel.ep, parallel.pp
    checks = [
        (model.num_attention_heads, tp, "num_attention_heads", "tensor_model_parallel_size"),
        (model.num_experts, ep, "num_experts", "expert_model_parallel_size"),
        (model.vocab_size, tp, "vocab_size", "tensor_model_parallel_size"),
        (
            model.moe_intermediate_size,
            parallel.expert_tp,
            "moe_intermediate_size",
            "expert_tensor_parallel_size",
        ),
        (
            model.num_hidden_layers,
            pp * (parallel.virtual_pp or 1),
            "num_hidden_layers",
            "pipeline_model_parallel_size*virtual_pp",
        ),
    ]
    for value, size, field_name, what in checks:
        if value % size:
            raise ValueError(
                f"model.{field_name}={value} not divisible by {what}={size}; change the parallel "
                "layout (parallel.tp/ep/pp/expert_tp/virtual_pp) or the model size"
            )
    kv = model.num_key_value_heads
    if kv % tp and tp % kv:
        raise ValueError(
            f"model.num_key_value_heads={kv} must be a multiple or a divisor of "
            f"tensor_model_parallel_size={tp} (Megatron replicates k/v heads when there are "
            "fewer than tp); change parallel.tp"
        )
    if tp > 1 and not parallel.sequence_parallel:
        raise ValueError(
            f"parallel.sequence_parallel=False with parallel.tp={tp}: Megatron MoE layers need "
            "sequence parallelism when tp > 1; set parallel.sequence_parallel=True"
        )


def build_transformer_config(
    model: MoEModelConfig,
    parallel: ParallelConfig,
    precision: PrecisionConfig | None = None,
    *,
    use_cuda: bool | None = None,
    use_te: bool | None = None,
) -> TransformerConfig:
    """Megatron ``TransformerConfig`` for ``model`` split by ``parallel`` in ``precision``.

    Architecture: pre-RMSNorm, RoPE, GQA, optional q/k RMSNorm, SwiGLU experts
    (Shazeer 2020, "GLU Variants Improve Transformer"), softmax top-k router, no dropout
    (RL fine-tuning), no linear biases except optional q/k/v biases.

    Args:
        use_cuda: override the platform (default: ``torch.cuda.is_available()``). On CPU weights
            are initialised on CPU and CUDA-only fusions are off.
        use_te: Transformer Engine specs (default: CUDA and TE importable); selects TE's
            grouped expert GEMM.

    Raises:
        ValueError: incompatible sizes (see ``check_model_parallel_compat``); fp8 on CPU.
    """
    precision = precision or PrecisionConfig()
    use_cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
    if use_te is None:
        from sao_megatron.platform import transformer_engine_available

        use_te = use_cuda and transformer_engine_available()
    check_model_parallel_compat(model, parallel)
    dtype = precision.torch_dtype
    moe_pattern = [0 if i in model.mlp_only_layers else 1 for i in range(model.num_hidden_layers)]
    kwargs = {}
    if precision.fp8:
        kwargs.update(fp8="hybrid", fp8_recipe="delayed")
    return TransformerConfig(
        # architecture
        num_layers=model.num_hidden_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_key_value_heads,
        kv_channels=model.head_dim,
        ffn_hidden_size=model.intermediate_size or model.moe_intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=model.rms_norm_eps,
        qk_layernorm=model.qk_layernorm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model.attention_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.initializer_range,
        # MoE
        num_moe_experts=model.num_experts,
        moe_router_topk=model.num_experts_per_tok,
        moe_ffn_hidden_size=model.moe_intermediate_size,
        moe_shared_expert_intermediate_size=model.shared_expert_intermediate_size or None,
        moe_shared_expert_gate=model.shared_expert_gate,
        moe_layer_freq=moe_pattern,
        moe_router_pre_softmax=not model.norm_topk_prob,
        moe_router_load_balancing_type="aux_loss" if model.router_aux_loss_coef else "none",
        moe_aux_loss_coeff=model.router_aux_loss_coef,
        moe_token_dispatcher_type=model.moe_token_dispatcher_type,
        moe_router_dtype="fp32",
        moe_grouped_gemm=use_te,
        # parallelism
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.virtual_pp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.expert_tp,
        sequence_parallel=parallel.sequence_parallel,
        # precision
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=precision.params_dtype == "bf16",
        fp16=precision.params_dtype == "fp16",
        # platform
        use_cpu_initialization=not use_cuda,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        cuda_graph_scope=[],  # = Megatron's default "full" without its deprecation warning
        # gloo matches point-to-point messages per peer in posting order; batched isend/irecv
        # can swap the activation and the gradient that the interleaved schedule exchanges
        # with the same peer (pp=2), so CPU uses Megatron's ordered (even/odd) p2p instead.
        batch_p2p_comm=use_cuda,
        **kwargs,
    )
