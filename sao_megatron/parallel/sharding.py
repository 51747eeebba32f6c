"""The shard map: how each Megatron parameter is split across TP / EP / PP (and VPP), with the
slicing and gathering that follow from it (CPU init, HF conversion, weight sync, layout tests).

One entry (`ParamShard`) per state-dict key of a model chunk. It is read from the model itself,
not from name rules: Megatron-Core 0.16 marks every TP-split parameter with
``tensor_model_parallel=True`` and ``partition_dim`` (``tensor_parallel/layers.py``
``set_tensor_model_parallel_attributes``), the owning module holds the group it is split over
(``tp_group``: the TP group, or the expert-TP group inside ``SequentialMLP``), a MoE layer knows
its experts' global indices (``MoELayer.local_expert_indices``, offset ``ep_rank *
num_local_experts``) and each ``TransformerLayer.layer_number`` is the 1-based global layer index
(pipeline and virtual-pipeline offsets included). For the models built here this gives:

=================================================  =============================  ===========
parameter (suffix)                                 Megatron module                split
=================================================  =============================  ===========
embedding.word_embeddings.weight, output_layer.w   VocabParallelEmbedding/Column  dim 0, TP
self_attention.linear_qkv.{weight,bias}            ColumnParallelLinear           dim 0, TP
self_attention.linear_proj.weight                  RowParallelLinear              dim 1, TP
mlp.linear_fc1 / shared_experts.linear_fc1         ColumnParallel, SwiGLU [g; u]  g, u dim 0, TP
mlp.linear_fc2 / shared_experts.linear_fc2         RowParallelLinear              dim 1, TP
experts.local_experts.{e}.linear_fc1               ColumnParallel, SwiGLU [g; u]  g, u dim 0, ETP
experts.local_experts.{e}.linear_fc2               RowParallelLinear              dim 1, ETP
experts.local_experts.{e}.*                        SequentialMLP                  expert e, EP
decoder.layers.{i}.*                               TransformerBlock               layer i, PP/VPP
norms, router, q/k norms, shared-expert gate       -                              replicated
value head: output_layer.{weight,bias}             ValueHead (ValueGPTModel)      replicated
=================================================  =============================  ===========

Megatron's fused qkv rows are grouped per query group ([q_g, k_g, v_g] for each group g), so
contiguous dim-0 chunks give each TP rank whole groups; a gated ``linear_fc1`` holds ``[gate;
up]`` and each TP rank keeps ``[gate_r; up_r]``. Global ("canonical") names are the 1-rank
local-spec names: Transformer Engine names (GPU) are mapped to them by `local_spec_name`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")
# Transformer Engine spec names (GPU) -> local spec names (Megatron-Core 0.16
# gpt_layer_specs: norms fused into the next linear, grouped experts as weight{i}).
_TE_NAMES = (
    (re.compile(r"^self_attention\.linear_qkv\.layer_norm_weight$"), "input_layernorm.weight"),
    (re.compile(r"^mlp\.linear_fc1\.layer_norm_weight$"), "pre_mlp_layernorm.weight"),
    (
        re.compile(r"^mlp\.experts\.linear_fc([12])\.weight(\d+)$"),
        r"mlp.experts.local_experts.\2.linear_fc\1.weight",
    ),
)
VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


def local_spec_name(layer_param: str) -> str:
    """Name of a decoder-layer parameter (relative to ``decoder.layers.{i}.``) in the local spec.

    Transformer Engine specs fuse norms into the next linear (``linear_qkv.layer_norm_weight``,
    ``mlp.linear_fc1.layer_norm_weight``) and store grouped experts as
    ``mlp.experts.linear_fc1.weight{e}``; these become ``input_layernorm.weight``,
    ``pre_mlp_layernorm.weight`` and ``mlp.experts.local_experts.{e}.linear_fc1.weight`` so one
    name table serves both specs. Other names are returned unchanged.
    """
    for pattern, replacement in _TE_NAMES:
        if pattern.match(layer_param):
            return pattern.sub(replacement, layer_param)
    return layer_param


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP / Float16Module style wrappers (anything exposing ``.module``)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


@dataclass
class ParamShard:
    """How one state-dict entry of a model chunk sits in the 1-rank model.

    Attributes:
        local_name: key in ``chunk.state_dict()`` (== ``named_parameters()`` name for params).
        global_name: canonical 1-rank name (global layer index, global expert index,
            local-spec names).
        value: the local tensor (the ``Parameter`` itself for parameters) or non-tensor extra
            state (Megatron's ``_extra_state`` entries, e.g. None on CPU).
        is_param: True for a parameter (False: extra state or buffer, never split).
        tp_dim: dimension split over ``tp_group``; None when replicated across it.
        tp_group: the group ``tp_dim`` is split over (expert-TP group for experts), or None.
        glu: a gated ``linear_fc1``: each TP rank holds ``[gate_r; up_r]``.
        expert: a per-expert tensor (split over EP: this rank holds ``local_expert``).
        ep_group: expert-parallel group of a per-expert tensor, else None.
        num_local_experts: experts per EP rank (per-expert tensors only).
        local_expert: local expert index (per-expert tensors only).
        global_expert: global expert index (per-expert tensors only).
        global_layer: 0-based global decoder layer (PP/VPP offset applied), None outside layers.
    """

    local_name: str
    global_name: str
    value: object
    is_param: bool
    tp_dim: int | None = None
    tp_group: object | None = None
    glu: bool = False
    expert: bool = False
    ep_group: object | None = None
    num_local_experts: int = 1
    local_expert: int | None = None
    global_expert: int | None = None
    global_layer: int | None = None

    def with_expert(self, expert: int) -> str:
        """``global_name`` with the global expert index replaced by ``expert``."""
        return re.sub(
            r"local_experts\.\d+\.", f"local_experts.{expert}.", self.global_name, count=1
        )


def group_size(group: object | None) -> int:
    return 1 if group is None else group.size()  # type: ignore[attr-defined]


def group_rank(group: object | None) -> int:
    return 0 if group is None else group.rank()  # type: ignore[attr-defined]


def shard_map(chunk: torch.nn.Module) -> list[ParamShard]:
    """The shard map of one (possibly wrapped) model chunk: one `ParamShard` per state-dict key,
    in ``state_dict()`` order (the same on every rank of a TP/EP group)."""
    chunk = unwrap_model(chunk)
    modules = dict(chunk.named_modules())
    params = dict(chunk.named_parameters())
    layers = list(chunk.decoder.layers) if hasattr(chunk, "decoder") else []
    out = []
    for name, value in chunk.state_dict(keep_vars=True).items():
        shard = ParamShard(name, name, value, is_param=name in params)
        match = _LAYER.match(name)
        if match:
            layer = layers[int(match.group(1))]
            rest = local_spec_name(match.group(2))
            expert = _EXPERT.match(rest)
            if expert:
                local = int(expert.group(1))
                shard.expert, shard.local_expert = True, local
                shard.global_expert = int(layer.mlp.local_expert_indices[local])
                shard.num_local_experts = len(layer.mlp.local_expert_indices)
                shard.ep_group = layer.mlp.experts.ep_group
                rest = f"mlp.experts.local_experts.{shard.global_expert}.{expert.group(2)}"
            shard.global_layer = layer.layer_number - 1
            shard.global_name = f"decoder.layers.{shard.global_layer}.{rest}"
        if shard.is_param and getattr(value, "tensor_model_parallel", False):
            owner = modules[name.rsplit(".", 1)[0]] if "." in name else chunk
            shard.tp_dim = value.partition_dim
            shard.tp_group = getattr(owner, "tp_group", None)
            config = getattr(owner, "config", None) or getattr(chunk, "config", None)
            shard.glu = shard.global_name.endswith(
                ("linear_fc1.weight", "linear_fc1.bias")
            ) and bool(getattr(config, "gated_linear_unit", False))
        out.append(shard)
    return out


def split_tensor(full: torch.Tensor, shard: ParamShard, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s slice (of ``size``) of the full tensor of ``shard`` (a view).

    Raises:
        ValueError: the split dimension is not divisible by ``size``.
    """
    if shard.tp_dim is None or size == 1:
        return full
    dim = shard.tp_dim
    if full.shape[dim] % (2 * size if shard.glu else size):
        raise ValueError(
            f"{shard.global_name}: dim {dim} of size {full.shape[dim]} is not divisible by {size}"
        )
    if shard.glu:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]])
    return full.chunk(size, dim=dim)[rank]


def join_tensor(parts: list[torch.Tensor], shard: ParamShard) -> torch.Tensor:
    """Inverse of `split_tensor`: the full tensor from every rank's slice, in rank order."""
    if shard.tp_dim is None or len(parts) == 1:
        return parts[0]
    if shard.glu:
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(parts, dim=shard.tp_dim)


def full_shape(shard: ParamShard, size: int) -> list[int]:
    """Shape of the full tensor of ``shard`` split ``size`` ways (its TP or expert-TP size)."""
    shape = list(shard.value.shape)  # type: ignore[attr-defined]
    if shard.tp_dim is not None:
        shape[shard.tp_dim] *= size
    return shape


def slice_coords(
    shard: ParamShard, tp_rank: int, tp_size: int, etp_rank: int, etp_size: int
) -> tuple[int, int]:
    """``(rank, size)`` of the split of ``shard``: expert-TP coordinates for experts, else TP."""
    return (etp_rank, etp_size) if shard.expert else (tp_rank, tp_size)


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
        chunk: this rank's (unwrapped) model chunk, used for its keys, layer numbers, experts.
        tp_rank, tp_size: tensor-parallel coordinates; ep_rank: expert-parallel rank (checked
            against the chunk's experts); etp_rank, etp_size: expert-tensor-parallel coordinates.

    Returns:
        ``{local key: tensor}`` (tensors cloned) for ``chunk.load_state_dict(..., strict=True)``.

    Raises:
        KeyError: a local key whose global name is missing in ``full_state_dict``.
        ValueError: a sliced tensor whose shape differs from the chunk's, or experts that do not
            belong to ``ep_rank``.
    """
    out = {}
    for shard in shard_map(chunk):
        if shard.global_name not in full_state_dict:
            raise KeyError(
                f"{shard.global_name!r} (local {shard.local_name!r}) not in the full state dict"
            )
        if shard.expert and shard.global_expert != ep_rank * shard.num_local_experts + (
            shard.local_expert or 0
        ):
            raise ValueError(
                f"{shard.local_name}: expert {shard.global_expert} not on EP rank {ep_rank}"
            )
        t = full_state_dict[shard.global_name]
        if torch.is_tensor(t):
            t = split_tensor(t, shard, *slice_coords(shard, tp_rank, tp_size, etp_rank, etp_size))
            want = shard.value.shape  # type: ignore[attr-defined]
            if t.shape != want:
                raise ValueError(
                    f"{shard.global_name}: sliced shape {tuple(t.shape)} != local {tuple(want)}"
                )
            t = t.clone()
        out[shard.local_name] = t
    return out


def shard_full_tensor(
    full: torch.Tensor, shard: ParamShard, vocab_size: int | None = None
) -> torch.Tensor:
    """This rank's slice of ``full`` for ``shard``, with the rank and size of its own group.

    With ``vocab_size`` given, embedding / output rows of an HF checkpoint
    (``vocab_size <= rows``) are zero-padded up to the model's padded vocabulary first.

    Raises:
        ValueError: the full tensor's split dimension is not divisible by the group size.
    """
    n = group_size(shard.tp_group) if shard.tp_dim is not None else 1
    if vocab_size is not None and shard.global_name in VOCAB_PARAMS:
        rows = shard.value.shape[0] * (n if shard.tp_dim == 0 else 1)  # type: ignore[attr-defined]
        if rows > full.shape[0] >= vocab_size:
            full = torch.cat([full, full.new_zeros(rows - full.shape[0], *full.shape[1:])])
    return split_tensor(full, shard, group_rank(shard.tp_group), n)


def gather_full_tensor(shard: ParamShard) -> torch.Tensor:
    """The full tensor of ``shard`` from its TP (or expert-TP) slices, padding kept (inverse of
    `shard_full_tensor`). Collective (all-gather) over ``shard.tp_group`` when split."""
    local = shard.value.detach()  # type: ignore[attr-defined]
    n = group_size(shard.tp_group)
    if shard.tp_dim is None or n == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(n)]
    dist.all_gather(parts, local.contiguous(), group=shard.tp_group)
    return join_tensor(parts, shard)


def gather_experts(shard: ParamShard, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """``[(global name, tensor)]`` of the same local expert slot on every EP rank.

    ``full`` is this rank's (TP-gathered) tensor; for a per-expert tensor with EP > 1 this is a
    collective (all-gather) over ``shard.ep_group`` and returns one entry per EP rank (global
    expert ``r * num_local_experts + local_expert``). Other tensors: ``[(global_name, full)]``.
    """
    n = group_size(shard.ep_group)
    if not shard.expert or n == 1:
        return [(shard.global_name, full)]
    parts = [torch.empty_like(full) for _ in range(n)]
    dist.all_gather(parts, full.contiguous(), group=shard.ep_group)
    local = shard.local_expert or 0
    return [
        (shard.with_expert(r * shard.num_local_experts + local), t) for r, t in enumerate(parts)
    ]
