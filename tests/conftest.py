"""Shared fixtures: a tiny MoE config, a 1-rank Megatron world, a multi-rank gloo launcher, and
the vLLM engines the whole-job tests share (`engine_pool`)."""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable

import pytest
import torch
import torch.multiprocessing as mp

from sao_megatron.models.tiny import TINY_MOE_FIELDS
from sao_megatron.net import free_port


def tiny_moe_kwargs() -> dict:
    """Fields of a tiny Qwen3-MoE-shaped model (~80k params) used by the Megatron tests (a copy
    of `sao_megatron.models.tiny.TINY_MOE_FIELDS`)."""
    return dict(TINY_MOE_FIELDS)


@pytest.fixture
def tiny_moe():
    """A tiny ``MoEModelConfig``."""
    from sao_megatron.models import MoEModelConfig

    return MoEModelConfig(**tiny_moe_kwargs())


@pytest.fixture
def parallel_1rank():
    """A 1-rank Megatron world (tp=pp=ep=1, gloo on CPU); re-initialised per test."""
    from megatron.core import parallel_state as ps

    from sao_megatron.parallel import ParallelConfig, destroy_parallel, initialize_parallel

    if ps.model_parallel_is_initialized():
        destroy_parallel()
    state = initialize_parallel(ParallelConfig())
    yield state
    destroy_parallel()


@pytest.fixture(scope="session")
def engine_pool(tmp_path_factory):
    """vLLM engines the whole-job tests attach like remote engines (`tests.engine_pool`), one
    set per model config and engine flags, started on first use, stopped at the session's end."""
    from tests.engine_pool import EnginePool

    pool = EnginePool(tmp_path_factory.mktemp("engine_pool"))
    yield pool
    pool.close()


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def launch(fn: Callable, world_size: int, *args) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes with torchrun-style
    env vars (so ``initialize_parallel`` uses env://, gloo). ``fn`` must be importable (a
    module-level function). Raises if any rank fails (its traceback is printed)."""
    mp.start_processes(
        _entry,
        args=(world_size, free_port(), fn, args),
        nprocs=world_size,
        join=True,
        start_method="spawn",
    )
