"""Full-tensor name mapping HF <-> canonical Megatron names, driven by the family's rule table.

Pure (no torch.distributed): works on *full* (unsharded) tensors with canonical names (TP=PP=EP=1
names, global layer and expert indices). :mod:`sao_megatron.convert.model_io` adds the sharded
model side (slicing into and gathering from TP/EP/PP shards).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from sao_megatron.convert.families import Rule
from sao_megatron.convert.spec import ConversionSpec
from sao_megatron.convert.transforms import merge_gate_up, merge_qkv, split_gate_up, split_qkv

# HF keys some checkpoints carry that hold no weights of ours.
_IGNORABLE_HF_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Entry:
    """One concrete Megatron tensor and its HF tensors (a :class:`Rule` with indices filled)."""

    rule: Rule
    megatron: str
    hf: tuple[str, ...]
    layer: int | None = None
    expert: int | None = None


def iter_entries(spec: ConversionSpec) -> Iterator[Entry]:
    """All concrete entries of ``spec``'s family, in checkpoint order (embedding, layers by
    index, final norm, output layer), each exactly once.

    Yields:
        :class:`Entry` with global layer / expert indices in the names.
    """
    rules = [r for r in spec.family_table.rules if _applies(r, spec)]
    model_rules = [r for r in rules if r.scope == "model"]
    for rule in model_rules:
        if rule.megatron.startswith("embedding."):
            yield Entry(rule, rule.megatron, rule.hf)
    for layer in range(spec.num_layers):
        moe = spec.is_moe_layer(layer)
        for rule in rules:
            if rule.scope == "model" or (rule.scope == "dense_layer" and moe):
                continue
            if rule.scope in ("moe_layer", "expert") and not moe:
                continue
            experts = range(spec.num_experts) if rule.scope == "expert" else [None]
            for expert in experts:
                yield Entry(
                    rule,
                    rule.megatron.format(layer=layer, expert=expert),
                    tuple(h.format(layer=layer, expert=expert) for h in rule.hf),
                    layer,
                    expert,
                )
    for rule in model_rules:
        if not rule.megatron.startswith("embedding."):
            yield Entry(rule, rule.megatron, rule.hf)


def _applies(rule: Rule, spec: ConversionSpec) -> bool:
    if rule.when is not None and not getattr(spec, rule.when):
        return False
    return not (rule.unless is not None and getattr(spec, rule.unless))


def merge_to_megatron(
    entry: Entry, hf_tensors: list[torch.Tensor], spec: ConversionSpec
) -> torch.Tensor:
    """HF tensors of ``entry`` (in ``entry.hf`` order) -> the full Megatron tensor.

    Raises:
        ValueError: shapes that do not fit the spec (q/k/v heads, gate/up, vocab rows).
    """
    kind = entry.rule.kind
    if kind == "qkv":
        return merge_qkv(
            *hf_tensors, num_query_groups=spec.num_query_groups, head_dim=spec.head_dim
        )
    if kind == "gate_up":
        return merge_gate_up(*hf_tensors)
    (tensor,) = hf_tensors
    if entry.megatron in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if tensor.shape[0] != spec.vocab_size:
            raise ValueError(
                f"{entry.hf[0]} has {tensor.shape[0]} rows but config.json vocab_size="
                f"{spec.vocab_size}: the weights and config.json disagree on the vocabulary"
            )
    return tensor


def split_to_hf(entry: Entry, tensor: torch.Tensor, spec: ConversionSpec) -> list[torch.Tensor]:
    """Inverse of :func:`merge_to_megatron`: full Megatron tensor -> HF tensors of ``entry``.

    Embedding / output rows past ``spec.vocab_size`` (Megatron vocab padding) are dropped.
    """
    kind = entry.rule.kind
    if kind == "qkv":
        return list(
            split_qkv(
                tensor,
                num_attention_heads=spec.num_attention_heads,
                num_query_groups=spec.num_query_groups,
                head_dim=spec.head_dim,
            )
        )
    if kind == "gate_up":
        return list(split_gate_up(tensor))
    if entry.megatron in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if tensor.shape[0] < spec.vocab_size:
            raise ValueError(
                f"{entry.megatron} has {tensor.shape[0]} rows, fewer than vocab_size="
                f"{spec.vocab_size}"
            )
        tensor = tensor[: spec.vocab_size]
    return [tensor]


def check_hf_keys(keys: Iterable[str], spec: ConversionSpec) -> None:
    """Check an HF checkpoint holds exactly the tensors the family table expects.

    A tied model may also carry ``lm_head.weight`` (ignored); rotary ``inv_freq`` buffers are
    ignored.

    Raises:
        ValueError: missing or unexpected tensor names (lists up to 10 of each).
    """
    expected = {h for e in iter_entries(spec) for h in e.hf}
    keys = set(keys)
    missing = sorted(expected - keys)
    unexpected = sorted(
        k
        for k in keys - expected
        if not k.endswith(_IGNORABLE_HF_SUFFIXES)
        and not (spec.tie_word_embeddings and k == "lm_head.weight")
    )
    if missing or unexpected:
        raise ValueError(
            f"HF checkpoint does not match {spec.architecture} (family {spec.family}): "
            f"{len(missing)} missing tensors {missing[:10]}, {len(unexpected)} unexpected tensors "
            f"{unexpected[:10]}. Check config.json matches the weights."
        )


def hf_to_megatron_tensors(
    read: Callable[[str], torch.Tensor],
    spec: ConversionSpec,
    *,
    select: Callable[[Entry], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(canonical Megatron name, full tensor)`` from HF tensors, one at a time.

    Args:
        read: returns one HF tensor by name (e.g. ``HFCheckpointReader.get``).
        spec: the model's :class:`ConversionSpec`.
        select: optional filter; entries it rejects are not read at all (a pipeline stage reads
            only its layers, an EP rank only its experts).
    """
    for entry in iter_entries(spec):
        if select is None or select(entry):
            yield entry.megatron, merge_to_megatron(entry, [read(h) for h in entry.hf], spec)


def megatron_state_dict_to_hf(
    state_dict: Mapping[str, torch.Tensor], spec: ConversionSpec
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(hf_name, tensor)`` from a full canonical-name Megatron state dict.

    Raises:
        ValueError: missing or unexpected Megatron names (lists them).
    """
    entries = list(iter_entries(spec))
    expected = {e.megatron for e in entries}
    got = {k for k in state_dict if not k.endswith("._extra_state")}
    if spec.tie_word_embeddings:
        got.discard("output_layer.weight")
    if got != expected:
        raise ValueError(
            f"Megatron state dict does not match {spec.family}: missing "
            f"{sorted(expected - got)[:10]}, unexpected {sorted(got - expected)[:10]}"
        )
    for entry in entries:
        yield from zip(entry.hf, split_to_hf(entry, state_dict[entry.megatron], spec), strict=True)
