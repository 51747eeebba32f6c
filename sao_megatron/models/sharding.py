"""Slice full (1-rank) Megatron state dicts into one rank's TP/EP/PP shard.

The full state dict is what ``model.state_dict()`` gives at tp=pp=ep=1 with the local (CPU)
layer spec (SequentialMLP experts ``mlp.experts.local_experts.{e}``). For a rank's model chunk
the helper maps each local key back to its global key (pipeline layer offset from
``TransformerLayer.layer_number``, expert offset ``ep_rank * num_local_experts``) and slices
the full tensor:

=================================================  =============================  =========
parameter (suffix)                                 Megatron module                split
=================================================  =============================  =========
embedding.word_embeddings.weight, output_layer.w   VocabParallelEmbedding/Column  dim 0, TP
self_attention.linear_qkv.{weight,bias}            ColumnParallelLinear           dim 0, TP
self_attention.linear_proj.weight                  RowParallelLinear              dim 1, TP
mlp.linear_fc1 / shared_experts.linear_fc1         ColumnParallel, SwiGLU [g; u]  g, u dim 0, TP
mlp.linear_fc2 / shared_experts.linear_fc2         RowParallelLinear              dim 1, TP
experts.local_experts.{e}.linear_fc1               ColumnParallel, SwiGLU [g; u]  g, u dim 0, ETP
experts.local_experts.{e}.linear_fc2               RowParallelLinear              dim 1, ETP
norms, router, q/k norms, shared-expert gate       -                              replicated
value head: output_layer.{weight,bias}            ValueHead (ValueGPTModel)      replicated
=================================================  =============================  =========

Megatron's fused qkv rows are grouped per query group ([q_g, k_g, v_g] for each group g), so
contiguous dim-0 chunks give each TP rank whole groups. The same rules serve checkpoint
conversion (HF -> full Megatron layout -> shards).
"""

from __future__ import annotations

import re

import torch

_LAYER = re.compile(r"^(.*decoder\.layers\.)(\d+)(\..*)$")
_EXPERT = re.compile(r"^(.*\.experts\.local_experts\.)(\d+)(\..*)$")


def _split(t: torch.Tensor, dim: int, rank: int, size: int, glu: bool = False) -> torch.Tensor:
    if size == 1:
        return t
    if glu:
        gate, up = torch.chunk(t, 2, dim=0)
        return torch.cat([_split(gate, 0, rank, size), _split(up, 0, rank, size)], dim=0)
    if t.shape[dim] % size:
        raise ValueError(f"dimension {dim} of size {t.shape[dim]} not divisible by {size}")
    return torch.chunk(t, size, dim=dim)[rank]


def shard_rule(global_name: str) -> tuple[str, int | None, bool]:
    """How a full tensor is split: ``(group "tp"|"etp"|"none", dim or None, is_swiglu_fc1)``."""
    if global_name.endswith("_extra_state"):
        return "none", None, False
    expert = ".experts.local_experts." in global_name
    group = "etp" if expert else "tp"
    if global_name.endswith(("word_embeddings.weight", "output_layer.weight")):
        return "tp", 0, False
    if ".linear_qkv." in global_name:
        return "tp", 0, False
    if global_name.endswith("linear_proj.weight"):
        return "tp", 1, False
    if global_name.endswith("linear_fc1.weight") or global_name.endswith("linear_fc1.bias"):
        return group, 0, True
    if global_name.endswith("linear_fc2.weight"):
        return group, 1, False
    return "none", None, False


def local_to_global_names(chunk: torch.nn.Module, ep_rank: int) -> dict[str, str]:
    """Map this chunk's state-dict keys to the 1-rank model's keys.

    ``chunk`` is an unwrapped model chunk (GPTModel/ValueGPTModel); layer offsets come from
    each ``TransformerLayer.layer_number`` (1-based global index), expert offsets from
    ``ep_rank * num_local_experts``.
    """
    layers = chunk.decoder.layers
    mapping = {}
    for key in chunk.state_dict():
        name = key
        m = _LAYER.match(name)
        if m:
            global_layer = layers[int(m.group(2))].layer_number - 1
            name = f"{m.group(1)}{global_layer}{m.group(3)}"
            e = _EXPERT.match(name)
            if e:
                local_layer = layers[int(m.group(2))]
                num_local = local_layer.mlp.num_local_experts
                name = f"{e.group(1)}{ep_rank * num_local + int(e.group(2))}{e.group(3)}"
        mapping[key] = name
    return mapping


def shard_state_dict(
    full_state_dict: dict[str, torch.Tensor],
    chunk: torch.nn.Module,
    *,
    tp_rank: int,
    tp_size: int,
    ep_rank: int,
    etp_rank: int = 0,
    etp_size: int = 1,
) -> dict[str, torch.Tensor]:
    """This rank's state dict for ``chunk`` sliced from the full 1-rank state dict.

    Args:
        full_state_dict: the tp=pp=ep=1 model's ``state_dict()`` (local-spec names).
        chunk: this rank's (unwrapped) model chunk, used for its keys and layer numbers.
        tp_rank, tp_size: tensor-parallel coordinates; ep_rank: expert-parallel rank;
        etp_rank, etp_size: expert-tensor-parallel coordinates.

    Returns:
        ``{local key: tensor}`` ready for ``chunk.load_state_dict(..., strict=True)``.

    Raises:
        KeyError: a local key whose global name is missing in ``full_state_dict``.
        ValueError: a sliced tensor whose shape differs from the chunk's.
    """
    from sao_megatron.models.builders import ValueHead

    value_head = isinstance(getattr(chunk, "output_layer", None), ValueHead)
    local_state = chunk.state_dict()
    out = {}
    for local, global_name in local_to_global_names(chunk, ep_rank).items():
        if global_name not in full_state_dict:
            raise KeyError(f"{global_name!r} (local {local!r}) not in the full state dict")
        t = full_state_dict[global_name]
        group, dim, glu = shard_rule(global_name)
        if value_head and global_name.startswith("output_layer."):
            group = "none"  # the scalar value head is replicated on every TP rank
        if group == "tp":
            t = _split(t, dim, tp_rank, tp_size, glu)
        elif group == "etp":
            t = _split(t, dim, etp_rank, etp_size, glu)
        if torch.is_tensor(t):
            want = local_state[local].shape
            if t.shape != want:
                raise ValueError(f"{global_name}: sliced shape {tuple(t.shape)} != local {want}")
            t = t.clone()
        out[local] = t
    return out
