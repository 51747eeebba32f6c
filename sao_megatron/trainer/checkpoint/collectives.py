"""The rank-0 broadcast, gather and barrier the checkpoint protocol needs (identity on 1 process).

All on the default process group: every rank of the world takes part in a save or a load.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def is_initialized() -> bool:
    """True when torch.distributed has a default process group."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank in the default group (0 without torch.distributed)."""
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    """Ranks in the default group (1 without torch.distributed)."""
    return dist.get_world_size() if is_initialized() else 1


def barrier() -> None:
    """Wait for every rank (no-op on one process)."""
    if world_size() > 1:
        dist.barrier()


def broadcast_from_rank0(obj: Any) -> Any:
    """Rank 0's picklable ``obj`` on every rank (identity on one process)."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's picklable ``obj``, indexed by rank (``[obj]`` on one process)."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def require_initialized(what: str) -> None:
    """Raise unless torch.distributed is initialised (Megatron dist_checkpointing needs it).

    Raises:
        RuntimeError: naming ``what`` and the fix.
    """
    if not is_initialized():
        raise RuntimeError(
            f"{what} needs torch.distributed initialised (Megatron dist_checkpointing); call "
            "torch.distributed.init_process_group first (a 1-rank gloo group is enough)"
        )
