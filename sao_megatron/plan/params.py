"""The parameters one rank holds, by name, counted from the configs (no model is built).

`rank_parameters` lists, for one pipeline stage of a layout, every parameter Megatron-Core's
`GPTModel` (our `build_policy` / `build_value_model`) creates on that rank: its name as
``named_parameters()`` gives it on CPU (Megatron-Core local specs: ``local_experts.<j>``), the
number of elements of this rank's shard and whether it is an expert parameter (sharded over
``ep x expert_tp``, reduced over the expert data-parallel group) or a dense one (sharded over
``tp``, reduced over the data-parallel group). Layer indices in names are local to the
pipeline chunk, as in Megatron (``decoder.layers.0`` is the chunk's first layer), so freeze
patterns match here exactly as `sao_megatron.models.freeze.apply_freeze` matches them on a
built model. With Transformer Engine specs (GPU) some names differ (the input norm is fused into
``linear_qkv.layer_norm_weight``, grouped experts are ``experts.linear_fc1.weight<j>``); counts
are the same.

tests/plan/test_params.py checks every name and size against a real 1-rank build.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from sao_megatron.models.config import MoEModelConfig
from sao_megatron.parallel.config import ParallelConfig


@dataclass(frozen=True)
class ParamShard:
    """One parameter of one rank.

    Attributes:
        name: as in ``named_parameters()`` of the model chunk (chunk-local layer index).
        numel: elements on this rank (the TP / EP / expert-TP shard).
        expert: an expert weight (under ``mlp.experts``), else a dense parameter.
        chunk: the virtual-pipeline chunk it belongs to (0 without virtual_pp).
    """

    name: str
    numel: int
    expert: bool
    chunk: int = 0


def _split(value: int, size: int, what: str) -> int:
    assert value % size == 0, f"{what}={value} not divisible by {size}"  # checked by layout
    return value // size


def stage_layers(model: MoEModelConfig, parallel: ParallelConfig, pp_rank: int) -> list[list[int]]:
    """Global layer indices of each model chunk of pipeline rank `pp_rank`.

    Megatron splits the layers into ``pp * virtual_pp`` equal chunks; rank r holds chunks
    ``r, r + pp, r + 2 pp, ...`` (one chunk of ``L / pp`` layers without virtual_pp).
    """
    vpp = parallel.virtual_pp or 1
    per_chunk = _split(model.num_hidden_layers, parallel.pp * vpp, "num_hidden_layers")
    return [
        list(
            range(
                (c * parallel.pp + pp_rank) * per_chunk, (c * parallel.pp + pp_rank + 1) * per_chunk
            )
        )
        for c in range(vpp)
    ]


def _layer(
    model: MoEModelConfig, parallel: ParallelConfig, index: int
) -> list[tuple[str, int, bool]]:
    tp, etp = parallel.tp, parallel.expert_tp
    h, hd = model.hidden_size, model.head_dim
    qkv = (model.num_attention_heads + 2 * model.num_key_value_heads) * hd
    q = _split(model.num_attention_heads * hd, tp, "num_attention_heads * head_dim")
    out: list[tuple[str, int, bool]] = [("input_layernorm.weight", h, False)]
    out.append(("self_attention.linear_proj.weight", h * q, False))
    out.append(("self_attention.linear_qkv.weight", _split(qkv, tp, "qkv") * h, False))
    if model.attention_bias:
        out.append(("self_attention.linear_qkv.bias", _split(qkv, tp, "qkv"), False))
    if model.qk_layernorm:
        out += [("self_attention.q_layernorm.weight", hd, False)]
        out += [("self_attention.k_layernorm.weight", hd, False)]
    out.append(("pre_mlp_layernorm.weight", h, False))
    if index in model.mlp_only_layers:
        ffn = _split(model.intermediate_size, tp, "intermediate_size")
        out += [
            ("mlp.linear_fc1.weight", 2 * ffn * h, False),
            ("mlp.linear_fc2.weight", h * ffn, False),
        ]
        return out
    out.append(("mlp.router.weight", model.num_experts * h, False))
    f = _split(model.moe_intermediate_size, etp, "moe_intermediate_size")
    for j in range(_split(model.num_experts, parallel.ep, "num_experts")):
        out.append((f"mlp.experts.local_experts.{j}.linear_fc1.weight", 2 * f * h, True))
        out.append((f"mlp.experts.local_experts.{j}.linear_fc2.weight", h * f, True))
    if model.shared_expert_intermediate_size:
        fs = _split(model.shared_expert_intermediate_size, tp, "shared_expert_intermediate_size")
        out.append(("mlp.shared_experts.linear_fc1.weight", 2 * fs * h, False))
        out.append(("mlp.shared_experts.linear_fc2.weight", h * fs, False))
        if model.shared_expert_gate:
            out.append(("mlp.shared_experts.gate_weight", h, False))
    return out


def rank_parameters(
    model: MoEModelConfig, parallel: ParallelConfig, *, role: str, pp_rank: int = 0
) -> list[ParamShard]:
    """Every parameter of `role` ("policy" or "value") on a rank of pipeline stage `pp_rank`.

    The first stage holds the embedding, the last the final norm and the output layer (the
    policy's vocabulary projection, absent when tied to the embedding on one stage; the value
    model's scalar head ``[1, h]`` + bias, replicated over TP). The sizes do not depend on the
    TP/EP/DP rank within the stage.
    """
    if role not in ("policy", "value"):
        raise ValueError(f"role={role!r}: 'policy' or 'value'")
    h, tp = model.hidden_size, parallel.tp
    vocab = _split(model.vocab_size, tp, "vocab_size")
    chunks = stage_layers(model, parallel, pp_rank)
    first_stage, last_stage = pp_rank == 0, pp_rank == parallel.pp - 1
    out: list[ParamShard] = []
    for c, layers in enumerate(chunks):
        pre = first_stage and c == 0
        post = last_stage and c == len(chunks) - 1
        if pre:
            out.append(ParamShard("embedding.word_embeddings.weight", vocab * h, False, c))
        for local, index in enumerate(layers):
            for name, numel, expert in _layer(model, parallel, index):
                out.append(ParamShard(f"decoder.layers.{local}.{name}", numel, expert, c))
        if post:
            out.append(ParamShard("decoder.final_layernorm.weight", h, False, c))
            if role == "value":
                out.append(ParamShard("output_layer.weight", h, False, c))
                out.append(ParamShard("output_layer.bias", 1, False, c))
            elif not (model.tie_word_embeddings and pre):
                out.append(ParamShard("output_layer.weight", vocab * h, False, c))
    return out


def split_frozen(
    params: Iterable[ParamShard], patterns: Iterable[str]
) -> tuple[list[ParamShard], list[ParamShard]]:
    """(trainable, frozen): a parameter is frozen when a pattern ``re.search``-matches its name
    (`sao_megatron.models.freeze.apply_freeze`)."""
    compiled = [re.compile(p) for p in patterns]
    trainable, frozen = [], []
    for p in params:
        (frozen if any(rx.search(p.name) for rx in compiled) else trainable).append(p)
    return trainable, frozen


def count_all(model: MoEModelConfig) -> int:
    """Parameters of the whole (unsharded) policy."""
    return sum(p.numel for p in rank_parameters(model, ParallelConfig(), role="policy"))
