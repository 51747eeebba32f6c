"""Gather the policy's full weights under HF names onto global rank 0 (every rank calls it).

Protocol (one call, the same on every rank; no object all-gather, nothing for the caller to
drain):

1. Inside each pipeline stage, parameter by parameter in shard-map order: all-gather the TP (or
   expert-TP) slices, then the experts across EP (`sao_megatron.parallel.sharding`), and map the
   full tensor to its HF names (`sao_megatron.convert.model_io.megatron_to_hf_tensors`). Every
   rank of the stage's TP/EP groups takes part; only the stage's *owner* keeps the result. The
   owner of stage s is the rank of global rank 0's pipeline group at position s (the rank with
   rank 0's TP/EP/DP coordinates on stage s); stage 0's owner is rank 0 itself.
2. Each owner of a stage s > 0 sends its tensors to global rank 0 point to point, once: first a
   small object ``[(hf_name, shape, dtype), ...]`` (``send_object_list``), then each tensor
   (``send``). Rank 0 receives stage by stage, in order 1 .. pp-1.

Rank 0 thus holds one full copy of the model (CPU tensors); other ranks hold at most one full
tensor at a time and return None.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sao_megatron.convert.model_io import megatron_to_hf_tensors
from sao_megatron.convert.spec import ConversionSpec
from sao_megatron.parallel.state import ParallelState


def _stage_tensors(
    chunks: list[torch.nn.Module], spec: ConversionSpec, keep: bool
) -> dict[str, torch.Tensor]:
    """This stage's HF tensors (collective over its TP/EP groups); kept only when ``keep``."""
    out: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        for name, tensor in megatron_to_hf_tensors(chunk, spec):
            if keep:
                if name in out:
                    raise ValueError(f"HF tensor {name!r} produced twice by one pipeline stage")
                out[name] = tensor.detach()
    return out


def gather_hf_weights(
    chunks: list[torch.nn.Module], spec: ConversionSpec, parallel: ParallelState
) -> dict[str, torch.Tensor] | None:
    """The policy's full weights under HF names on global rank 0; None on every other rank.

    Collective: every rank of the world calls it with its own model chunks.

    Args:
        chunks: this rank's unwrapped policy chunks (all virtual-pipeline chunks).
        spec: the model's `ConversionSpec` (HF names and tensor layout).
        parallel: this rank's `ParallelState` (its pipeline group decides who sends).

    Returns:
        On rank 0 ``{hf_name: tensor}`` (CPU, model dtype, HF shapes; tensors of the 1-rank
        model, tied ``lm_head`` left out as in the HF checkpoint). On CPU, replicated tensors
        of stage 0 may share storage with rank 0's parameters: write or clone them before the
        next optimiser step. None on other ranks.

    Raises:
        ValueError: a parameter the conversion table does not know, or an HF name produced by
            two pipeline stages.
    """
    pp_group = parallel.pg_collection.pp
    pp = parallel.cfg.pp
    owners = [dist.get_global_rank(pp_group, s) for s in range(pp)] if pp > 1 else [parallel.rank]
    is_owner = 0 in owners  # this rank sits in rank 0's pipeline group
    local = _stage_tensors(chunks, spec, keep=is_owner)
    if not is_owner:
        return None
    if parallel.rank != 0:
        meta = [[(name, tuple(t.shape), t.dtype) for name, t in local.items()]]
        dist.send_object_list(meta, dst=0)
        for t in local.values():
            dist.send(t.contiguous(), dst=0)
        return None
    out = {name: t.to("cpu") for name, t in local.items()}
    device = next(p for c in chunks for p in c.parameters()).device
    for src in owners[1:]:
        meta = [None]
        dist.recv_object_list(meta, src=src)
        for name, shape, dtype in meta[0]:
            if name in out:
                raise ValueError(f"HF tensor {name!r} produced by two pipeline stages")
            buf = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(buf, src=src)
            out[name] = buf.to("cpu")
    return out
