"""MoEModelConfig: a Qwen3-MoE-shaped model description with HF field names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_DISPATCHERS = ("alltoall", "allgather")


@dataclass(kw_only=True)
class MoEModelConfig:
    """Decoder-only MoE transformer (pre-RMSNorm, RoPE, GQA, SwiGLU experts, top-k router).

    Field names follow Hugging Face ``Qwen3MoeConfig`` so a ``config.json`` maps one to one
    (``from_hf_config`` also reads Qwen2-MoE and Mixtral names).
    """

    vocab_size: int
    """Vocabulary size (rows of the embedding / output layer)."""
    hidden_size: int
    """Model width."""
    num_hidden_layers: int
    """Number of transformer layers."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """Key/value heads (GQA groups); must divide num_attention_heads."""
    head_dim: int | None = None
    """Per-head size; None = hidden_size // num_attention_heads."""
    num_experts: int
    """Routed experts per MoE layer."""
    num_experts_per_tok: int
    """Top-k experts per token."""
    moe_intermediate_size: int
    """FFN size of each routed expert."""
    shared_expert_intermediate_size: int = 0
    """FFN size of the shared expert (0 = no shared expert; Qwen2-MoE has one)."""
    shared_expert_gate: bool = False
    """Sigmoid gate on the shared expert output (Qwen2-MoE)."""
    intermediate_size: int = 0
    """FFN size of dense (non-MoE) layers listed in ``mlp_only_layers`` (0 if there are none)."""
    mlp_only_layers: list[int] = field(default_factory=list)
    """Layer indices (0-based) that use a dense MLP instead of MoE."""
    rope_theta: float = 1_000_000.0
    """RoPE base (Su et al. 2021, RoFormer)."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon (Zhang & Sennrich 2019)."""
    tie_word_embeddings: bool = False
    """Share the input embedding and the output layer."""
    max_position_embeddings: int = 4096
    """Maximum sequence length."""
    qk_layernorm: bool = True
    """RMSNorm on per-head queries and keys (Qwen3 True; Qwen2-MoE and Mixtral False)."""
    attention_bias: bool = False
    """Bias on the q/k/v projections (Qwen2-MoE True)."""
    norm_topk_prob: bool = True
    """Renormalise the top-k router probabilities to sum to 1 (softmax over the top-k logits).
    False = softmax over all experts, then top-k (Megatron ``moe_router_pre_softmax``)."""
    router_aux_loss_coef: float = 0.0
    """Load-balancing aux loss coefficient (Switch Transformer, Fedus et al. 2021, eq. 4)."""
    moe_token_dispatcher_type: str = "alltoall"
    """Megatron token dispatcher: "alltoall" or "allgather"."""
    initializer_range: float = 0.02
    """Std of the normal initialisation of weights."""

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "max_position_embeddings",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name}={getattr(self, name)}: must be >= 1")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"model.hidden_size={self.hidden_size} is not divisible by "
                    f"model.num_attention_heads={self.num_attention_heads}; set model.head_dim"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model.num_attention_heads={self.num_attention_heads} is not divisible by "
                f"model.num_key_value_heads={self.num_key_value_heads}"
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"model.num_experts_per_tok={self.num_experts_per_tok} exceeds "
                f"model.num_experts={self.num_experts}"
            )
        if self.shared_expert_intermediate_size < 0 or self.intermediate_size < 0:
            raise ValueError("model.shared_expert_intermediate_size/intermediate_size must be >= 0")
        if self.shared_expert_gate and not self.shared_expert_intermediate_size:
            raise ValueError(
                "model.shared_expert_gate=True needs model.shared_expert_intermediate_size > 0"
            )
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"model.mlp_only_layers={bad}: indices out of range")
        if self.mlp_only_layers and self.intermediate_size < 1:
            raise ValueError("model.mlp_only_layers is set: model.intermediate_size must be > 0")
        if self.moe_token_dispatcher_type not in _DISPATCHERS:
            raise ValueError(
                f"model.moe_token_dispatcher_type={self.moe_token_dispatcher_type!r}: must be "
                f"one of {_DISPATCHERS}"
            )
        if self.router_aux_loss_coef < 0:
            raise ValueError(f"model.router_aux_loss_coef={self.router_aux_loss_coef}: >= 0")

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], **overrides: Any) -> MoEModelConfig:
        """Build from a Hugging Face ``config.json`` dict (Qwen3-MoE, Qwen2-MoE or Mixtral).

        Args:
            hf: the parsed ``config.json``; ``model_type`` selects the family defaults.
            overrides: fields to set explicitly (e.g. ``moe_token_dispatcher_type``).

        Raises:
            ValueError: unknown ``model_type`` or a missing required field.
        """
        model_type = hf.get("model_type", "qwen3_moe")
        if model_type not in ("qwen3_moe", "qwen2_moe", "mixtral"):
            raise ValueError(
                f"model_type={model_type!r}: supported are 'qwen3_moe', 'qwen2_moe', 'mixtral'"
            )

        def need(key: str) -> Any:
            if key not in hf:
                raise ValueError(f"HF config ({model_type}) lacks required field {key!r}")
            return hf[key]

        kw: dict[str, Any] = dict(
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            num_hidden_layers=need("num_hidden_layers"),
            num_attention_heads=need("num_attention_heads"),
            num_key_value_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
            head_dim=hf.get("head_dim"),
            num_experts_per_tok=need("num_experts_per_tok"),
            rope_theta=float(hf.get("rope_theta", 1_000_000.0)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)),
            initializer_range=float(hf.get("initializer_range", 0.02)),
        )
        if model_type == "mixtral":
            kw.update(
                num_experts=need("num_local_experts"),
                moe_intermediate_size=need("intermediate_size"),
                qk_layernorm=False,
                norm_topk_prob=True,  # Mixtral: softmax over the top-k logits
            )
        else:
            sparse_step = hf.get("decoder_sparse_step", 1)
            mlp_only = list(hf.get("mlp_only_layers", []))
            n = kw["num_hidden_layers"]
            mlp_only += [i for i in range(n) if sparse_step > 1 and (i + 1) % sparse_step]
            kw.update(
                num_experts=need("num_experts"),
                moe_intermediate_size=need("moe_intermediate_size"),
                intermediate_size=hf.get("intermediate_size", 0) if mlp_only else 0,
                mlp_only_layers=sorted(set(mlp_only)),
                norm_topk_prob=bool(hf.get("norm_topk_prob", model_type == "qwen3_moe")),
            )
            if model_type == "qwen3_moe":
                kw.update(qk_layernorm=True, attention_bias=bool(hf.get("attention_bias", False)))
            else:
                shared = hf.get("shared_expert_intermediate_size", 0)
                kw.update(
                    qk_layernorm=False,
                    attention_bias=True,  # Qwen2 always has q/k/v biases
                    shared_expert_intermediate_size=shared,
                    shared_expert_gate=bool(shared),
                )
        kw.update(overrides)
        return cls(**kw)

    def to_hf_config(
        self,
        *,
        bos_token_id: int,
        eos_token_id: int,
        pad_token_id: int,
        torch_dtype: str = "float32",
    ) -> dict[str, Any]:
        """The Hugging Face ``config.json`` (Qwen3-MoE) of this model, so vLLM and transformers
        load its exported weights; ``from_hf_config`` reads it back to an equal config.

        Args:
            bos_token_id, eos_token_id, pad_token_id: the tokenizer's special ids.
            torch_dtype: HF dtype name of the weights ("float32", "bfloat16", "float16").

        Raises:
            ValueError: shapes Qwen3-MoE cannot express (shared experts, attention bias, no q/k
                norm).
        """
        if self.shared_expert_intermediate_size or self.attention_bias or not self.qk_layernorm:
            raise ValueError(
                "exporting a from-scratch model writes a Qwen3-MoE config: set "
                "model.shared_expert_intermediate_size=0, model.attention_bias=false and "
                "model.qk_layernorm=true (or start from a converted HF checkpoint)"
            )
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size or self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(self.mlp_only_layers),
            "norm_topk_prob": self.norm_topk_prob,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "hidden_act": "silu",
            "initializer_range": self.initializer_range,
            "router_aux_loss_coef": self.router_aux_loss_coef,
            "output_router_logits": False,
            "use_sliding_window": False,
            "bos_token_id": bos_token_id,
            "eos_token_id": eos_token_id,
            "pad_token_id": pad_token_id,
            "torch_dtype": torch_dtype,
        }
