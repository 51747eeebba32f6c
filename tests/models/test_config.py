"""Model/parallel/precision configs: HF field mapping and actionable errors naming the field."""

from __future__ import annotations

import pytest

from sao_megatron.models import (
    MoEModelConfig,
    build_transformer_config,
    check_model_parallel_compat,
)
from sao_megatron.optim import OptimizerConfig, PrecisionConfig
from sao_megatron.parallel import ParallelConfig
from tests.conftest import tiny_moe_kwargs

QWEN3_MOE = {
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "intermediate_size": 6144,
    "norm_topk_prob": True,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "max_position_embeddings": 40960,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "router_aux_loss_coef": 0.001,
}
QWEN2_MOE = {
    "model_type": "qwen2_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "intermediate_size": 5632,
    "norm_topk_prob": False,
    "rope_theta": 1000000.0,
}
MIXTRAL = {
    "model_type": "mixtral",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "intermediate_size": 14336,
    "rope_theta": 1e6,
    "rms_norm_eps": 1e-5,
}


def test_from_hf_qwen3_moe():
    c = MoEModelConfig.from_hf_config(QWEN3_MOE)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (128, 8, 768)
    assert c.head_dim == 128 and c.qk_layernorm and c.norm_topk_prob
    assert c.shared_expert_intermediate_size == 0 and c.mlp_only_layers == []
    assert c.intermediate_size == 0  # no dense layers -> unused
    assert c.router_aux_loss_coef == 0.001 and not c.attention_bias


def test_from_hf_qwen2_moe_and_mixtral():
    q2 = MoEModelConfig.from_hf_config(QWEN2_MOE)
    assert q2.head_dim == 128 and not q2.qk_layernorm and q2.attention_bias
    assert q2.shared_expert_intermediate_size == 5632 and q2.shared_expert_gate
    assert not q2.norm_topk_prob
    mx = MoEModelConfig.from_hf_config(MIXTRAL)
    assert (mx.num_experts, mx.moe_intermediate_size, mx.qk_layernorm) == (8, 14336, False)
    assert mx.rms_norm_eps == 1e-5


def test_from_hf_sparse_step_makes_dense_layers():
    c = MoEModelConfig.from_hf_config(
        {**QWEN3_MOE, "num_hidden_layers": 4, "decoder_sparse_step": 2}
    )
    assert c.mlp_only_layers == [0, 2] and c.intermediate_size == 6144


def test_from_hf_errors():
    with pytest.raises(ValueError, match="model_type='llama'"):
        MoEModelConfig.from_hf_config({"model_type": "llama"})
    bad = dict(QWEN3_MOE)
    del bad["num_experts"]
    with pytest.raises(ValueError, match="'num_experts'"):
        MoEModelConfig.from_hf_config(bad)


def test_transformer_config_mapping():
    m = MoEModelConfig(**tiny_moe_kwargs(), mlp_only_layers=[0], intermediate_size=96)
    tc = build_transformer_config(m, ParallelConfig(), PrecisionConfig(params_dtype="bf16"))
    assert tc.moe_layer_freq == [0, 1] and tc.ffn_hidden_size == 96
    assert tc.moe_ffn_hidden_size == 32 and tc.num_query_groups == 2 and tc.kv_channels == 16
    assert tc.moe_router_pre_softmax is False  # norm_topk_prob=True
    assert tc.bf16 and not tc.fp16 and str(tc.params_dtype) == "torch.bfloat16"
    assert tc.normalization == "RMSNorm" and tc.gated_linear_unit and not tc.add_bias_linear


@pytest.mark.parametrize(
    "model_kw, parallel_kw, message",
    [
        (
            {"num_attention_heads": 6, "num_key_value_heads": 6, "head_dim": 8},
            {"tp": 4, "sequence_parallel": True},
            "num_attention_heads=6 not divisible by tensor_model_parallel_size=4",
        ),
        (
            {"num_experts": 6},
            {"ep": 4},
            "num_experts=6 not divisible by expert_model_parallel_size=4",
        ),
        ({"num_hidden_layers": 3}, {"pp": 2}, "num_hidden_layers=3 not divisible"),
        ({}, {"tp": 2}, "sequence_parallel=True"),
        (
            {"num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 8},
            {"tp": 2, "sequence_parallel": True},
            "num_key_value_heads=3 must be a multiple or a divisor",
        ),
        (
            {"num_attention_heads": 12, "num_key_value_heads": 3, "head_dim": 8},
            {"tp": 4, "sequence_parallel": True},
            "num_key_value_heads=3 must be a multiple or a divisor",
        ),
    ],
)
def test_incompatible_layouts_name_the_field(model_kw, parallel_kw, message):
    m = MoEModelConfig(**{**tiny_moe_kwargs(), **model_kw})
    with pytest.raises(ValueError, match=message):
        check_model_parallel_compat(m, ParallelConfig(**parallel_kw))


def test_fewer_kv_heads_than_tp_is_allowed():
    m = MoEModelConfig(**{**tiny_moe_kwargs(), "num_key_value_heads": 1})
    check_model_parallel_compat(m, ParallelConfig(tp=2, sequence_parallel=True))


def test_parallel_config_errors():
    with pytest.raises(ValueError, match="world size 6 is not divisible by tp\\*pp=4"):
        ParallelConfig(tp=2, pp=2, sequence_parallel=True).data_parallel_size(6)
    with pytest.raises(ValueError, match="expert_tp\\*ep\\*pp=4"):
        ParallelConfig(ep=4).data_parallel_size(6)
    assert ParallelConfig(tp=2, sequence_parallel=True).data_parallel_size(8) == 4
    with pytest.raises(ValueError, match="parallel.tp=0"):
        ParallelConfig(tp=0)
    with pytest.raises(ValueError, match="parallel.expert_tp=1 differs"):
        ParallelConfig(tp=2, expert_tp=1, sequence_parallel=True)
    with pytest.raises(ValueError, match="sequence_parallel=True needs parallel.tp > 1"):
        ParallelConfig(sequence_parallel=True)


def test_model_config_errors():
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        MoEModelConfig(**{**tiny_moe_kwargs(), "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="num_experts_per_tok=5"):
        MoEModelConfig(**{**tiny_moe_kwargs(), "num_experts_per_tok": 5})
    with pytest.raises(ValueError, match="moe_token_dispatcher_type='flex'"):
        MoEModelConfig(**{**tiny_moe_kwargs(), "moe_token_dispatcher_type": "flex"})


def test_precision_and_optimizer_errors():
    with pytest.raises(ValueError, match="precision.params_dtype='fp64'"):
        PrecisionConfig(params_dtype="fp64")
    with pytest.raises(ValueError, match="precision.fp8=True needs CUDA"):
        PrecisionConfig(fp8=True).check_platform(is_cuda=False, use_te=False)
    with pytest.raises(ValueError, match="optimizer.decay_steps"):
        OptimizerConfig(decay_style="cosine")
    with pytest.raises(ValueError, match="optimizer.lr=0"):
        OptimizerConfig(lr=0)


def test_hf_config_round_trips_and_rejects_what_qwen3_moe_cannot_express():
    m = MoEModelConfig(**tiny_moe_kwargs(), mlp_only_layers=[1], intermediate_size=96)
    hf = m.to_hf_config(bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="bfloat16")
    assert (hf["model_type"], hf["torch_dtype"], hf["eos_token_id"]) == ("qwen3_moe", "bfloat16", 2)
    assert MoEModelConfig.from_hf_config(hf) == m
    with pytest.raises(ValueError, match="model.attention_bias=false"):
        MoEModelConfig(**tiny_moe_kwargs(), attention_bias=True).to_hf_config(
            bos_token_id=1, eos_token_id=2, pad_token_id=0
        )
