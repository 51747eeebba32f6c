"""Initialise torch.distributed and Megatron ``parallel_state`` (the only module touching it)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sao_megatron.parallel.config import ParallelConfig
from sao_megatron.platform import Platform, setup_platform


@dataclass
class ParallelState:
    """Handle returned by ``initialize_parallel``: sizes, this rank's coordinates, groups.

    Attributes:
        cfg: the layout it was built from.
        platform: device/backend/TE choice of this process.
        world_size, rank: global torch.distributed values.
        dp: derived data-parallel size.
        tp_rank, pp_rank, ep_rank, etp_rank, dp_rank: this rank's coordinates.
        pg_collection: Megatron ``ProcessGroupCollection`` with every group (tp, pp, dp, ep,
            expt_tp, expt_dp, dp_cp, tp_ep, ...), to pass explicitly to Megatron APIs.
        model_group: every rank that trains this rank's models; None = the default group (the
            whole world). A role of a separate critic (`sao_megatron.parallel.roles`) sets its
            own ranks, so sums over "all ranks" stay within the role.
    """

    cfg: ParallelConfig
    platform: Platform
    world_size: int
    rank: int
    dp: int
    tp_rank: int
    pp_rank: int
    ep_rank: int
    etp_rank: int
    dp_rank: int
    pg_collection: object
    model_group: object | None = None

    @property
    def is_first_pp_stage(self) -> bool:
        """True on the first pipeline stage (holds the embedding)."""
        return self.pp_rank == 0

    @property
    def is_last_pp_stage(self) -> bool:
        """True on the last pipeline stage (holds the output layer / value head)."""
        return self.pp_rank == self.cfg.pp - 1

    def shard_coords(self) -> dict[str, int]:
        """Keyword arguments of `sao_megatron.parallel.sharding.shard_state_dict` for this rank."""
        return dict(
            tp_rank=self.tp_rank,
            tp_size=self.cfg.tp,
            ep_rank=self.ep_rank,
            etp_rank=self.etp_rank,
            etp_size=self.cfg.expert_tp,
        )

    def pre_post_process(self, vp_stage: int | None = None) -> tuple[bool, bool]:
        """``(pre_process, post_process)`` for a (virtual) pipeline stage of this rank."""
        from megatron.core import parallel_state as ps

        return (
            ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        )


def _init_torch_distributed(platform: Platform) -> None:
    if dist.is_initialized():
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend=platform.backend)  # env:// from torchrun
    else:
        # a 1-rank world needs no rendezvous: an in-memory store, no port to race for
        dist.init_process_group(
            backend=platform.backend, store=dist.HashStore(), rank=0, world_size=1
        )


def initialize_parallel(cfg: ParallelConfig) -> ParallelState:
    """Set up the platform, torch.distributed and Megatron's model-parallel groups and RNG.

    Uses torchrun's env vars (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR/PORT``)
    when present, else a 1-rank world. Backend: nccl on CUDA, gloo on CPU. If torch.distributed
    is already initialised (e.g. by a test launcher), it is reused. Call ``destroy_parallel()``
    before initialising again with another layout.

    Raises:
        ValueError: world size not divisible by ``tp*pp`` or ``expert_tp*ep*pp``.
        RuntimeError: Megatron model parallel already initialised (call destroy_parallel()).
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    platform = setup_platform(local_rank)
    world_size = (
        dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    )
    dp = cfg.data_parallel_size(world_size)  # validate before starting anything
    _init_torch_distributed(platform)
    if ps.model_parallel_is_initialized():
        raise RuntimeError(
            "Megatron model parallel is already initialised; call destroy_parallel()"
        )
    ps.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tp,
        pipeline_model_parallel_size=cfg.pp,
        virtual_pipeline_model_parallel_size=cfg.virtual_pp,
        expert_model_parallel_size=cfg.ep,
        expert_tensor_parallel_size=cfg.expert_tp,
        create_gloo_process_groups=not platform.is_cuda,
    )
    torch.manual_seed(cfg.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
    return ParallelState(
        cfg=cfg,
        platform=platform,
        world_size=world_size,
        rank=dist.get_rank(),
        dp=dp,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )


def tensor_parallel_group() -> dist.ProcessGroup:
    """Megatron's tensor-parallel group of this rank (requires ``initialize_parallel``)."""
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group()


def destroy_parallel(destroy_process_group: bool = False) -> None:
    """Tear down Megatron's model-parallel state (and optionally torch.distributed).

    Keeps torch.distributed by default so a test can re-initialise another layout on the same
    ranks.
    """
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if not dist.is_initialized():
        return
    if destroy_process_group:
        dist.destroy_process_group()  # the default group and every subgroup
        return
    # Megatron's destroy only forgets its groups: torch keeps each one, with its gloo threads
    # (two per group), so a process that re-initialises layouts (the tests, benchmarks) would
    # accumulate thousands of idle-polling threads. Destroy every group but the default one.
    default = dist.distributed_c10d._get_default_group()
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not default and group is not None:
            dist.destroy_process_group(group)
