"""Sharded Megatron model side of the mapping: load HF tensors into TP/EP/PP shards, and stream
HF tensors out of a (possibly sharded) model -- the function the weight sync reuses.

Process groups come from the model's own modules (``ColumnParallelLinear.tp_group``,
``SequentialMLP.ep_group``/``tp_group`` in Megatron-Core 0.16), never from module globals, so the
same code serves the trainer's groups and a single-process conversion (groups of size 1).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sao_megatron.convert.hf_io import HFCheckpointReader
from sao_megatron.convert.mapping import (
    check_hf_keys,
    hf_to_megatron_tensors,
    iter_entries,
    megatron_state_dict_to_hf,
    split_to_hf,
)
from sao_megatron.convert.spec import ConversionSpec

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
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")


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
class ParamSlot:
    """Where one local parameter sits in the full canonical tensor.

    Attributes:
        local_name: name in ``model.named_parameters()``.
        canonical: canonical Megatron name (global layer / expert index).
        param: the local parameter (a shard).
        partition_dim: TP split dimension, None when replicated across TP.
        tp_group: the group the parameter is split over (expert-TP group for experts).
        glu: True for a gated ``linear_fc1`` (each TP rank holds ``[gate_r; up_r]``).
        ep_group: expert-parallel group for per-expert weights, else None.
        num_local_experts: experts per EP rank (per-expert weights only).
        local_expert: local expert index (per-expert weights only).
    """

    local_name: str
    canonical: str
    param: torch.nn.Parameter
    partition_dim: int | None = None
    tp_group: object | None = None
    glu: bool = False
    ep_group: object | None = None
    num_local_experts: int = 1
    local_expert: int | None = None


def _size(group: object | None) -> int:
    return 1 if group is None else group.size()  # type: ignore[attr-defined]


def _rank(group: object | None) -> int:
    return 0 if group is None else group.rank()  # type: ignore[attr-defined]


def param_slots(model: torch.nn.Module) -> list[ParamSlot]:
    """Describe every parameter of a GPT model with its canonical name and sharding.

    Canonical names: local-spec names (see :func:`local_spec_name` for Transformer Engine specs)
    with the global layer index (``TransformerLayer.layer_number - 1``) and the global expert index
    (``MoELayer.local_expert_indices``). Names the family table does not know are reported by
    the callers.
    """
    model = unwrap_model(model)
    modules = dict(model.named_modules())
    layers = list(model.decoder.layers) if hasattr(model, "decoder") else []
    slots = []
    for name, param in model.named_parameters():
        owner = modules[name.rsplit(".", 1)[0]] if "." in name else model
        canonical, slot = name, ParamSlot(name, name, param)
        match = _LAYER.match(name)
        if match:
            layer = layers[int(match.group(1))]
            rest = local_spec_name(match.group(2))
            expert = _EXPERT.match(rest)
            if expert:
                local = int(expert.group(1))
                experts = layer.mlp.experts
                global_idx = layer.mlp.local_expert_indices[local]
                rest = f"mlp.experts.local_experts.{global_idx}.{expert.group(2)}"
                slot.ep_group = experts.ep_group
                slot.num_local_experts = len(layer.mlp.local_expert_indices)
                slot.local_expert = local
            canonical = f"decoder.layers.{layer.layer_number - 1}.{rest}"
        slot.canonical = canonical
        if getattr(param, "tensor_model_parallel", False):
            slot.partition_dim = param.partition_dim
            slot.tp_group = getattr(owner, "tp_group", None)
            config = getattr(owner, "config", None) or getattr(model, "config", None)
            slot.glu = canonical.endswith("linear_fc1.weight") and bool(
                getattr(config, "gated_linear_unit", False)
            )
        slots.append(slot)
    return slots


def shard_full_tensor(full: torch.Tensor, slot: ParamSlot, vocab_size: int) -> torch.Tensor:
    """Cut this rank's TP shard of the full canonical tensor for ``slot``.

    Embedding / output rows are zero-padded up to the model's (padded) vocabulary first.

    Raises:
        ValueError: the full tensor's shape does not fit the parameter and TP size.
    """
    n, r = _size(slot.tp_group), _rank(slot.tp_group)
    if slot.canonical in _VOCAB:
        rows = slot.param.shape[0] * (n if slot.partition_dim == 0 else 1)
        if rows > full.shape[0] >= vocab_size:
            pad = full.new_zeros(rows - full.shape[0], *full.shape[1:])
            full = torch.cat([full, pad])
    if slot.partition_dim is None or n == 1:
        return full
    dim = slot.partition_dim
    if full.shape[dim] % n:
        raise ValueError(
            f"{slot.canonical}: dim {dim} of size {full.shape[dim]} is not divisible by TP={n}"
        )
    if slot.glu:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(n)[r], up.chunk(n)[r]])
    return full.chunk(n, dim=dim)[r]


def gather_full_tensor(slot: ParamSlot) -> torch.Tensor:
    """All-gather ``slot``'s TP shards into the full tensor (inverse of
    :func:`shard_full_tensor`, padding kept). Collective over ``slot.tp_group``."""
    local = slot.param.detach()
    n = _size(slot.tp_group)
    if slot.partition_dim is None or n == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(n)]
    dist.all_gather(parts, local.contiguous(), group=slot.tp_group)
    if slot.glu:
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(parts, dim=slot.partition_dim)


@torch.no_grad()
def load_hf_into_model(
    model: torch.nn.Module, reader: HFCheckpointReader, spec: ConversionSpec
) -> None:
    """Copy an HF checkpoint into a (possibly TP/EP/PP-sharded) Megatron model in place.

    Each rank reads only the HF tensors of its own parameters (its pipeline stage's layers,
    its EP rank's experts), one Megatron tensor at a time; tied output layers on the last
    pipeline stage get the embedding.

    Raises:
        ValueError: missing/unexpected HF tensors, a model parameter the table does not know, or
            a shape that does not match the model (names the HF tensors and both shapes).
    """
    check_hf_keys(reader.keys(), spec)
    targets: dict[str, list[ParamSlot]] = {}
    for slot in param_slots(model):
        key = slot.canonical
        if key == "output_layer.weight" and spec.tie_word_embeddings:
            key = "embedding.word_embeddings.weight"
        targets.setdefault(key, []).append(slot)
    known = {e.megatron: e for e in iter_entries(spec)}
    unknown = sorted(set(targets) - set(known))
    if unknown:
        raise ValueError(
            f"model parameters with no HF source in the {spec.family} table: {unknown[:10]} "
            "(does the model config match config.json?)"
        )
    for name, full in hf_to_megatron_tensors(
        reader.get, spec, select=lambda e: e.megatron in targets
    ):
        for slot in targets[name]:
            shard = shard_full_tensor(full, slot, spec.vocab_size)
            if shard.shape != slot.param.shape:
                raise ValueError(
                    f"{known[name].hf}: HF gives {tuple(full.shape)} -> shard {tuple(shard.shape)}"
                    f", but Megatron parameter {slot.local_name} is {tuple(slot.param.shape)}"
                )
            slot.param.copy_(shard)


@torch.no_grad()
def megatron_to_hf_tensors(
    source: torch.nn.Module | dict[str, torch.Tensor], spec: ConversionSpec
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(hf_name, tensor)`` pairs from a Megatron model or a full state dict.

    This is the mapping the weight sync to rollout engines uses (HF names are the exchange
    format): one Megatron tensor is gathered and split at a time, so no rank holds an extra full
    copy of the model.

    Args:
        source: a GPT model (possibly wrapped, possibly TP/EP/PP sharded) or a state dict with
            full tensors under canonical names (TP=PP=EP=1 names).
        spec: the model's :class:`ConversionSpec`.

    Yields:
        HF names and tensors (model dtype). With a sharded model this is a collective: every
        rank of a TP and EP group must iterate together; each rank yields the full tensors of
        its own pipeline stage (per-expert tensors for all experts, global indices).
        Replicated, unsplit tensors may share storage with the parameters: write or clone them
        before the next optimiser step.

    Raises:
        ValueError: a parameter the family table does not know.
    """
    if isinstance(source, dict):
        yield from megatron_state_dict_to_hf(source, spec)
        return
    entries = {e.megatron: e for e in iter_entries(spec)}
    for slot in param_slots(source):
        if slot.canonical == "output_layer.weight" and spec.tie_word_embeddings:
            continue  # the embedding already went out under model.embed_tokens.weight
        full = gather_full_tensor(slot)
        names = [slot.canonical]
        fulls = [full]
        if slot.ep_group is not None and _size(slot.ep_group) > 1:
            fulls = [torch.empty_like(full) for _ in range(_size(slot.ep_group))]
            dist.all_gather(fulls, full.contiguous(), group=slot.ep_group)
            names = [
                _with_expert(slot.canonical, r * slot.num_local_experts + slot.local_expert)
                for r in range(len(fulls))
            ]
        for name, tensor in zip(names, fulls, strict=True):
            if name not in entries:
                raise ValueError(f"Megatron parameter {slot.local_name} ({name}) has no HF name")
            entry = entries[name]
            yield from zip(entry.hf, split_to_hf(entry, tensor, spec), strict=True)


def _with_expert(canonical: str, expert: int) -> str:
    return re.sub(r"local_experts\.\d+\.", f"local_experts.{expert}.", canonical)
