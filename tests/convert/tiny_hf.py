"""Tiny random HF models built locally from configs (no downloads), saved as HF folders."""

from __future__ import annotations

import json
from pathlib import Path

import torch

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "qwen2", "llama")
VOCAB = 96
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=64,
)


def build_hf_model(
    family: str,
    *,
    tie: bool = False,
    seed: int = 0,
    num_experts: int = 4,
    dense_layers: tuple[int, ...] = (),
):
    """A random fp32 HF model of ``family`` (norm weights and biases randomised too, so a
    wrong mapping of any tensor changes the logits). ``dense_layers``: Qwen-MoE
    ``mlp_only_layers`` (layers with a dense MLP of size 48)."""
    import transformers as tf

    torch.manual_seed(seed)
    kw = dict(_COMMON, tie_word_embeddings=tie)
    if family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(
            **kw,
            head_dim=16,
            moe_intermediate_size=16,
            num_experts=num_experts,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=list(dense_layers),
            intermediate_size=48,
        )
        model = tf.Qwen3MoeForCausalLM(cfg)
    elif family == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(
            **kw,
            moe_intermediate_size=16,
            num_experts=num_experts,
            num_experts_per_tok=2,
            shared_expert_intermediate_size=24,
            norm_topk_prob=False,
        )
        model = tf.Qwen2MoeForCausalLM(cfg)
    elif family == "mixtral":
        cfg = tf.MixtralConfig(
            **kw, intermediate_size=16, num_local_experts=num_experts, num_experts_per_tok=2
        )
        model = tf.MixtralForCausalLM(cfg)
    elif family == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**kw, intermediate_size=48))
    elif family == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**kw, intermediate_size=48))
    else:
        raise ValueError(family)
    model.config.architectures = [type(model).__name__]
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.2)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.2)
    return model.eval()


def write_tokenizer(folder: Path, num_tokens: int) -> None:
    """A word-level ``tokenizer.json`` with ``num_tokens`` ids (``<unk>`` + ``t1``...)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {"<unk>": 0, **{f"t{i}": i for i in range(1, num_tokens)}}
    Tokenizer(WordLevel(vocab, unk_token="<unk>")).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))


def save_hf(family: str, folder: Path, *, tie: bool = False, shard: str | None = None, **kw):
    """Build and save a tiny model + tokenizer to ``folder``; returns the model."""
    model = build_hf_model(family, tie=tie, **kw)
    model.save_pretrained(folder, max_shard_size=shard or "50MB")
    write_tokenizer(folder, VOCAB)
    return model


def fixed_batch(seed: int = 1, batch: int = 2, seq: int = 10) -> torch.Tensor:
    """Token ids ``[batch, seq]`` int64."""
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
