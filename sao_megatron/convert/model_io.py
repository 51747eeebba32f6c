"""Sharded Megatron model side of the mapping: load HF tensors into TP/EP/PP shards, and stream
HF tensors out of a (possibly sharded) model -- the function the weight sync reuses.

How each parameter is split comes from the shard map (`sao_megatron.parallel.sharding`); its
process groups come from the model's own modules (``ColumnParallelLinear.tp_group``,
``SequentialMLP.ep_group``/``tp_group`` in Megatron-Core 0.16), never from module globals, so the
same code serves the trainer's groups and a single-process conversion (groups of size 1).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from sao_megatron.convert.hf_io import HFCheckpointReader
from sao_megatron.convert.mapping import (
    check_hf_keys,
    hf_to_megatron_tensors,
    iter_entries,
    megatron_state_dict_to_hf,
    split_to_hf,
)
from sao_megatron.convert.spec import ConversionSpec
from sao_megatron.parallel.sharding import (
    ParamShard,
    gather_experts,
    gather_full_tensor,
    shard_full_tensor,
    shard_map,
)


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
    targets: dict[str, list[ParamShard]] = {}
    for slot in _param_shards(model):
        key = slot.global_name
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
            if shard.shape != slot.value.shape:
                raise ValueError(
                    f"{known[name].hf}: HF gives {tuple(full.shape)} -> shard {tuple(shard.shape)}"
                    f", but Megatron parameter {slot.local_name} is {tuple(slot.value.shape)}"
                )
            slot.value.copy_(shard)


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
    for slot in _param_shards(source):
        if slot.global_name == "output_layer.weight" and spec.tie_word_embeddings:
            continue  # the embedding already went out under model.embed_tokens.weight
        for name, tensor in gather_experts(slot, gather_full_tensor(slot)):
            if name not in entries:
                raise ValueError(f"Megatron parameter {slot.local_name} ({name}) has no HF name")
            entry = entries[name]
            yield from zip(entry.hf, split_to_hf(entry, tensor, spec), strict=True)


def _param_shards(model: torch.nn.Module) -> list[ParamShard]:
    """The shard map's parameter entries (extra state and buffers are not converted)."""
    return [s for s in shard_map(model) if s.is_param]
