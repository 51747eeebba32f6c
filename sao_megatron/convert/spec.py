"""The shape facts the name mapping needs, read from an HF ``config.json`` (one per family)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from sao_megatron.convert.families import Family, family_for_architecture

# transformers 5 spelling -> transformers 4 spelling, per model_type, for the expert count.
# 4.x: Mixtral ``num_local_experts``, Qwen2-MoE / Qwen3-MoE ``num_experts``; 5.x configs may use
# either name in any of these families.
_EXPERT_COUNT_KEY = {
    "mixtral": "num_local_experts",
    "qwen2_moe": "num_experts",
    "qwen3_moe": "num_experts",
}
_DEFAULT_ROPE_TYPES = (None, "default")


def hf_config_compat(config: dict[str, Any]) -> dict[str, Any]:
    """A copy of an HF ``config.json`` dict with transformers-4 field names filled in.

    transformers 5 writes the rope settings as ``rope_parameters = {"rope_type": "default",
    "rope_theta": 1e5, ...}`` instead of top-level ``rope_theta`` (+ ``rope_scaling`` for
    non-default rope types), and may name the expert count ``num_local_experts`` in families
    whose 4.x config says ``num_experts`` (and vice versa). Everything in this package reads the
    4.x names, so readers call this first. Mapping (4.x keys already present win when equal):

    - ``rope_parameters["rope_theta"]`` -> ``rope_theta``;
    - ``rope_parameters`` with a ``rope_type`` other than ``"default"`` -> ``rope_scaling``
      (so the checks that refuse rope scaling see it);
    - ``num_local_experts`` <-> ``num_experts``, whichever the family's 4.x config uses.

    Raises:
        ValueError: both spellings present with different values, naming both keys, or
            ``rope_parameters`` that is not a dict.
    """
    out = dict(config)

    def fill(key: str, value: Any, source: str) -> None:
        if out.get(key) is None:
            out[key] = value
        elif out[key] != value:
            raise ValueError(
                f"config.json {key}={out[key]!r} and {source}={value!r} disagree: keep one of them"
            )

    rope = out.get("rope_parameters")
    if rope is not None:
        if not isinstance(rope, dict):
            raise ValueError(f"config.json rope_parameters={rope!r}: expected a dict")
        if rope.get("rope_theta") is not None:
            fill("rope_theta", rope["rope_theta"], "rope_parameters.rope_theta")
        if rope.get("rope_type", rope.get("type")) not in _DEFAULT_ROPE_TYPES:
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
            fill("rope_scaling", scaling, "rope_parameters")
    key = _EXPERT_COUNT_KEY.get(out.get("model_type", ""))
    if key is not None:
        other = "num_experts" if key == "num_local_experts" else "num_local_experts"
        if out.get(other) is not None:
            fill(key, out[other], other)
    return out


@dataclass(kw_only=True)
class ConversionSpec:
    """What :mod:`sao_megatron.convert.mapping` needs to know about a model's tensors.

    Built from an HF config with :meth:`from_hf_config`; everything else about the model (rope,
    router score function, ...) is the model builder's business, not the mapping's.
    """

    family: str
    """Key into :data:`sao_megatron.convert.families.FAMILIES`, e.g. ``"qwen3_moe"``."""
    architecture: str
    """HF ``architectures[0]``, e.g. ``"Qwen3MoeForCausalLM"``; written back on export."""
    num_layers: int
    """Decoder layers (HF ``num_hidden_layers``)."""
    hidden_size: int
    """Model width h."""
    num_attention_heads: int
    """Query heads."""
    num_query_groups: int
    """Key/value heads (HF ``num_key_value_heads``); divides ``num_attention_heads``."""
    head_dim: int
    """Per-head width d (HF ``head_dim``, else ``hidden_size // num_attention_heads``)."""
    vocab_size: int
    """Rows of the HF embedding / lm_head."""
    num_experts: int = 0
    """Routed experts per MoE layer (0: dense model)."""
    moe_layers: list[bool] = field(default_factory=list)
    """Per layer: True when its MLP is an MoE block (empty: all dense)."""
    qkv_bias: bool = False
    """q/k/v projections have biases (Qwen2, Qwen2-MoE)."""
    qk_norm: bool = False
    """Per-head RMSNorm on queries and keys (Qwen3, Qwen3-MoE)."""
    tie_word_embeddings: bool = False
    """lm_head shares the embedding matrix (no ``lm_head.weight`` / ``output_layer.weight``)."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups"):
            if getattr(self, name) <= 0:
                raise ValueError(f"spec.{name}={getattr(self, name)}: must be > 0")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"spec.num_query_groups={self.num_query_groups}: must divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.moe_layers and len(self.moe_layers) != self.num_layers:
            raise ValueError(
                f"spec.moe_layers has {len(self.moe_layers)} entries: need num_layers="
                f"{self.num_layers}"
            )
        if any(self.moe_layers) and self.num_experts <= 0:
            raise ValueError("spec.num_experts must be > 0 when some layer is an MoE layer")

    @property
    def family_table(self) -> Family:
        """The :class:`Family` (rule table) of this spec."""
        return family_for_architecture(self.architecture)

    def is_moe_layer(self, layer: int) -> bool:
        """True when decoder layer ``layer`` (0-based, global) has an MoE MLP."""
        return bool(self.moe_layers) and self.moe_layers[layer]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (inverse of ``ConversionSpec(**d)``)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ConversionSpec:
        """Read the spec from an HF ``config.json`` dict.

        Raises:
            ValueError: unknown architecture, a missing field, or a feature the mapping does not
                cover (biases on o_proj / MLP, sliding-window attention) -- naming the field.

        transformers-5 names (``rope_parameters``, ``num_local_experts`` in Qwen MoE configs)
        are accepted too (:func:`hf_config_compat`).
        """
        config = hf_config_compat(config)
        archs = config.get("architectures") or []
        if len(archs) != 1:
            raise ValueError(
                f"config.json architectures={archs!r}: need exactly one architecture string"
            )
        family = family_for_architecture(archs[0])

        def need(key: str) -> Any:
            if key not in config or config[key] is None:
                raise ValueError(f"config.json has no {key!r} (needed for {family.name})")
            return config[key]

        for key in ("mlp_bias", "use_sliding_window"):
            if config.get(key):
                raise ValueError(f"config.json {key}=true: not supported by the conversion")
        if config.get("attention_bias"):
            raise ValueError(
                "config.json attention_bias=true: biases on o_proj are not supported "
                "(Megatron's local spec has add_bias_linear for all linears at once)"
            )
        num_layers = int(need("num_hidden_layers"))
        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        head_dim = config.get("head_dim") or hidden // heads
        num_experts = 0
        moe_layers: list[bool] = []
        if family.name in ("qwen3_moe", "qwen2_moe"):
            num_experts = int(need("num_experts"))
            step = int(config.get("decoder_sparse_step", 1) or 1)
            dense = set(config.get("mlp_only_layers") or [])
            moe_layers = [
                num_experts > 0 and i not in dense and (i + 1) % step == 0
                for i in range(num_layers)
            ]
        elif family.name == "mixtral":
            num_experts = int(need("num_local_experts"))
            moe_layers = [True] * num_layers
        return cls(
            family=family.name,
            architecture=archs[0],
            num_layers=num_layers,
            hidden_size=hidden,
            num_attention_heads=heads,
            num_query_groups=int(config.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            vocab_size=int(need("vocab_size")),
            num_experts=num_experts,
            moe_layers=moe_layers,
            qkv_bias=family.name in ("qwen2", "qwen2_moe") and bool(config.get("qkv_bias", True)),
            qk_norm=family.name in ("qwen3", "qwen3_moe"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )
