"""The name table: ONE mapping per model family between HF tensor names and Megatron names.

Both directions (HF -> Megatron for conversion, Megatron -> HF for export and for the weight
sync to rollout engines) read the same :class:`Rule` list, so they cannot drift apart.

Megatron names are the *canonical* names of a Megatron-Core GPT model built with the local
(non-Transformer-Engine) layer spec at TP=PP=EP=1: global layer index, global expert index
(``decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc1.weight`` with ``expert``
in ``[0, num_experts)``). :mod:`sao_megatron.convert.mapping` translates a sharded model's
local names to these.

Rule kinds (the tensor transforms live in :mod:`sao_megatron.convert.transforms`):

- ``copy``: one HF tensor is the Megatron tensor.
- ``qkv``: HF ``q_proj``/``k_proj``/``v_proj`` -> Megatron ``linear_qkv`` interleaved per query
  group (Megatron-Core ``SelfAttention.get_query_key_value_tensors`` splits it that way).
- ``gate_up``: HF ``gate_proj`` and ``up_proj`` -> Megatron ``linear_fc1`` = ``cat([gate, up])``
  (Megatron-Core ``MLP`` applies ``glu``: ``act(x[:half]) * x[half:]``).
"""

from __future__ import annotations

from dataclasses import dataclass

# Where a rule applies; decides which placeholders its templates have.
SCOPES = ("model", "layer", "dense_layer", "moe_layer", "expert")
KINDS = ("copy", "qkv", "gate_up")


@dataclass(frozen=True)
class Rule:
    """One Megatron tensor and the HF tensor(s) it is made of.

    Attributes:
        megatron: canonical Megatron name template (placeholders ``{layer}``, ``{expert}``).
        hf: HF name templates, in the order the transform takes them (q, k, v / gate, up).
        kind: one of :data:`KINDS`.
        scope: one of :data:`SCOPES` (``model``: once; ``layer``: every decoder layer;
            ``dense_layer``/``moe_layer``: layers with a dense MLP / MoE MLP; ``expert``: every
            expert of every MoE layer).
        when: optional name of a boolean :class:`~sao_megatron.convert.spec.ConversionSpec`
            field that must be true for the rule to apply (e.g. ``qkv_bias``).
        unless: optional name of a boolean field that must be false (e.g.
            ``tie_word_embeddings`` for the output layer).
    """

    megatron: str
    hf: tuple[str, ...]
    kind: str = "copy"
    scope: str = "layer"
    when: str | None = None
    unless: str | None = None

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind
        assert self.scope in SCOPES, self.scope
        assert len(self.hf) == {"copy": 1, "qkv": 3, "gate_up": 2}[self.kind], self


@dataclass(frozen=True)
class Family:
    """A model family: the HF architectures it covers and its rule table."""

    name: str
    architectures: tuple[str, ...]
    rules: tuple[Rule, ...]
    moe: bool


_L = "decoder.layers.{layer}."
_H = "model.layers.{layer}."


def _common_rules() -> list[Rule]:
    """Embeddings, final norm, output layer, attention and the two layer norms (all families)."""
    attn = _H + "self_attn."
    return [
        Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), scope="model"),
        Rule("decoder.final_layernorm.weight", ("model.norm.weight",), scope="model"),
        Rule(
            "output_layer.weight", ("lm_head.weight",), scope="model", unless="tie_word_embeddings"
        ),
        Rule(_L + "input_layernorm.weight", (_H + "input_layernorm.weight",)),
        Rule(_L + "pre_mlp_layernorm.weight", (_H + "post_attention_layernorm.weight",)),
        Rule(
            _L + "self_attention.linear_qkv.weight",
            (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
            kind="qkv",
        ),
        Rule(
            _L + "self_attention.linear_qkv.bias",
            (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"),
            kind="qkv",
            when="qkv_bias",
        ),
        Rule(_L + "self_attention.linear_proj.weight", (attn + "o_proj.weight",)),
        Rule(_L + "self_attention.q_layernorm.weight", (attn + "q_norm.weight",), when="qk_norm"),
        Rule(_L + "self_attention.k_layernorm.weight", (attn + "k_norm.weight",), when="qk_norm"),
    ]


def _dense_mlp_rules(scope: str) -> list[Rule]:
    """HF ``mlp.{gate,up,down}_proj`` <-> Megatron dense ``mlp.linear_fc1/fc2``."""
    return [
        Rule(
            _L + "mlp.linear_fc1.weight",
            (_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"),
            kind="gate_up",
            scope=scope,
        ),
        Rule(_L + "mlp.linear_fc2.weight", (_H + "mlp.down_proj.weight",), scope=scope),
    ]


def _moe_rules(block: str, gate: str, up: str, down: str) -> list[Rule]:
    """Router + per-expert weights. ``block`` is the HF MoE module name (``mlp`` or
    ``block_sparse_moe``); ``gate/up/down`` the per-expert HF projection names."""
    experts = _H + block + ".experts.{expert}."
    local = _L + "mlp.experts.local_experts.{expert}."
    return [
        Rule(_L + "mlp.router.weight", (_H + block + ".gate.weight",), scope="moe_layer"),
        Rule(
            local + "linear_fc1.weight",
            (experts + gate + ".weight", experts + up + ".weight"),
            kind="gate_up",
            scope="expert",
        ),
        Rule(local + "linear_fc2.weight", (experts + down + ".weight",), scope="expert"),
    ]


def _shared_expert_rules() -> list[Rule]:
    """Qwen2-MoE shared expert and its sigmoid gate (Megatron ``moe_shared_expert_gate``)."""
    shared = _H + "mlp.shared_expert."
    return [
        Rule(
            _L + "mlp.shared_experts.linear_fc1.weight",
            (shared + "gate_proj.weight", shared + "up_proj.weight"),
            kind="gate_up",
            scope="moe_layer",
        ),
        Rule(
            _L + "mlp.shared_experts.linear_fc2.weight",
            (shared + "down_proj.weight",),
            scope="moe_layer",
        ),
        Rule(
            _L + "mlp.shared_experts.gate_weight",
            (_H + "mlp.shared_expert_gate.weight",),
            scope="moe_layer",
        ),
    ]


_DENSE = tuple(_common_rules() + _dense_mlp_rules("layer"))
_QWEN_MOE = _moe_rules("mlp", "gate_proj", "up_proj", "down_proj")

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "qwen3_moe",
            ("Qwen3MoeForCausalLM",),
            tuple(_common_rules() + _dense_mlp_rules("dense_layer") + _QWEN_MOE),
            moe=True,
        ),
        Family(
            "qwen2_moe",
            ("Qwen2MoeForCausalLM",),
            tuple(
                _common_rules()
                + _dense_mlp_rules("dense_layer")
                + _QWEN_MOE
                + _shared_expert_rules()
            ),
            moe=True,
        ),
        Family(
            "mixtral",
            ("MixtralForCausalLM",),
            tuple(_common_rules() + _moe_rules("block_sparse_moe", "w1", "w3", "w2")),
            moe=True,
        ),
        Family("qwen3", ("Qwen3ForCausalLM",), _DENSE, moe=False),
        Family("qwen2", ("Qwen2ForCausalLM",), _DENSE, moe=False),
        Family(
            "llama",
            ("LlamaForCausalLM",),
            _DENSE,
            moe=False,
        ),
    )
}

ARCHITECTURE_TO_FAMILY: dict[str, str] = {
    arch: fam.name for fam in FAMILIES.values() for arch in fam.architectures
}


def family_for_architecture(architecture: str) -> Family:
    """Return the :class:`Family` of an HF ``architectures[0]`` string.

    Raises:
        ValueError: unknown architecture (the message lists the supported ones).
    """
    if architecture not in ARCHITECTURE_TO_FAMILY:
        raise ValueError(
            f"config.json architectures={architecture!r}: not supported by sao_megatron.convert; "
            f"supported: {sorted(ARCHITECTURE_TO_FAMILY)}. Add a Family to "
            "sao_megatron/convert/families.py to support it."
        )
    return FAMILIES[ARCHITECTURE_TO_FAMILY[architecture]]
