"""Small collectives of the trainer world: a barrier and Python objects sent from one rank.

Each is a no-op in a one-process world (or without torch.distributed), so callers need no
``if world_size > 1`` of their own.
"""

from __future__ import annotations

from typing import TypeVar

import torch.distributed as dist

from sao_megatron.parallel.state import ParallelState

T = TypeVar("T")


def _multi_rank() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def barrier() -> None:
    """Wait for every rank of the default group."""
    if _multi_rank():
        dist.barrier()


def broadcast_from_rank0(obj: T) -> T:
    """Global rank 0's `obj` on every rank (pickled; for small Python objects)."""
    if not _multi_rank():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def broadcast_from_last_stage(obj: T, parallel: ParallelState) -> T:
    """The last pipeline stage's `obj` on every stage of this rank's pipeline group (loss
    metrics live on the last stage; the logging rank may sit on the first)."""
    if parallel.cfg.pp == 1:
        return obj
    box = [obj]
    src = dist.get_global_rank(parallel.pg_collection.pp, parallel.cfg.pp - 1)
    dist.broadcast_object_list(box, src=src, group=parallel.pg_collection.pp)
    return box[0]
