"""Freeze parameters by regex over their names; report trainable/frozen counts."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

VALUE_DEFAULT_FREEZE_PATTERNS: tuple[str, ...] = (
    r"(^|\.)embedding\.",
    r"\.self_attention\.linear_qkv\.(weight|bias)$",
    r"\.self_attention\.linear_proj\.(weight|bias)$",
)
"""Value-model default: embeddings and the self-attention projections are frozen; MoE experts,
router, all norms (including q/k norms and TE's fused ``linear_qkv.layer_norm_weight``) and the
value head train."""


@dataclass
class FreezeReport:
    """Result of ``apply_freeze`` (counts are of this rank's local parameter elements)."""

    num_trainable_params: int
    num_frozen_params: int
    frozen_names: list[str] = field(default_factory=list)
    trainable_names: list[str] = field(default_factory=list)
    matches_per_pattern: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        """One line for logs."""
        total = self.num_trainable_params + self.num_frozen_params
        return (
            f"trainable {self.num_trainable_params:,} / {total:,} params "
            f"({len(self.trainable_names)} tensors), frozen {self.num_frozen_params:,} "
            f"({len(self.frozen_names)} tensors)"
        )


def apply_freeze(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    patterns: Iterable[str],
    *,
    require_match: bool = True,
    group: torch.distributed.ProcessGroup | None = None,
) -> FreezeReport:
    """Set ``requires_grad=False`` on every parameter whose name matches a pattern.

    Call before wrapping in DDP (DDP allocates gradient buffers for ``requires_grad`` params
    only). Names are as in ``model.named_parameters()`` (e.g.
    ``decoder.layers.0.self_attention.linear_qkv.weight``); patterns use ``re.search``.
    Parameters not matched are set trainable.

    Args:
        model: a module or a list of model chunks.
        patterns: regular expressions.
        require_match: raise if a pattern matches no parameter.
        group: if given, a pattern counts as matched when it matches on any rank of this group
            (collective: every rank of the group must call ``apply_freeze``). Pass the pipeline
            group (``ParallelState.pg_collection.pp``), or the world, when pipeline stages lack
            e.g. the embedding.

    Raises:
        ValueError: an invalid regex, or (``require_match``) a pattern matching no parameter.
    """
    chunks = list(model) if isinstance(model, Sequence) else [model]
    compiled = []
    for p in patterns:
        try:
            compiled.append((p, re.compile(p)))
        except re.error as e:
            raise ValueError(f"freeze pattern {p!r} is not a valid regular expression: {e}") from e
    report = FreezeReport(0, 0, matches_per_pattern={p: 0 for p, _ in compiled})
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            hits = [p for p, rx in compiled if rx.search(name)]
            for p in hits:
                report.matches_per_pattern[p] += 1
            param.requires_grad_(not hits)
            if hits:
                report.num_frozen_params += param.numel()
                report.frozen_names.append(name)
            else:
                report.num_trainable_params += param.numel()
                report.trainable_names.append(name)
    counts = [report.matches_per_pattern[p] for p, _ in compiled]
    if group is not None and counts:
        device = next(iter(chunks[0].parameters())).device
        total = torch.tensor(counts, dtype=torch.int64, device=device)
        torch.distributed.all_reduce(total, group=group)
        counts = total.tolist()
    unmatched = [p for (p, _), n in zip(compiled, counts, strict=True) if n == 0]
    if require_match and unmatched:
        raise ValueError(
            f"freeze pattern(s) {unmatched} match no parameter name; check model.value."
            "freeze_patterns against names like 'decoder.layers.0.self_attention."
            "linear_qkv.weight'"
        )
    return report
