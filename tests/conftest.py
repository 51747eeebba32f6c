"""Shared fixtures: a tiny MoE config, a 1-rank Megatron world, a multi-rank gloo launcher, and
the vLLM engines the whole-job tests share (`engine_pool`); the grouping of tests for
pytest-xdist (`pytest_collection_modifyitems`)."""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable

import pytest
import torch
import torch.multiprocessing as mp

from sao_megatron.models.tiny import TINY_MOE_FIELDS
from sao_megatron.net import with_free_port


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


#: Session- and package-scoped fixtures that start engines, a cluster or a whole job. Under
#: pytest-xdist (`make test`: ``-n 2 --dist loadgroup``) every test that uses one of them runs on
#: the same worker, so each is started once per run, not once per worker; tests that use two of
#: them join the two groups. The other tests are grouped by file (module-scoped fixtures, e.g. a
#: file's own engines, are built once too).
SHARED_RESOURCES = ("engine_pool", "tiny_sft", "vllm_servers", "slurm_cluster")


def xdist_groups(items: list) -> dict[str, str]:
    """``{nodeid: group}``: the union of the `SHARED_RESOURCES` each test uses (union-find over
    the resources a test uses together), else the test's file."""
    parent = {r: r for r in SHARED_RESOURCES}

    def root(r: str) -> str:
        while parent[r] != r:
            r = parent[r]
        return r

    used = {}
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        used[item.nodeid] = [r for r in SHARED_RESOURCES if r in names]
        for a, b in zip(used[item.nodeid], used[item.nodeid][1:], strict=False):
            parent[root(b)] = root(a)
    return {nodeid: root(rs[0]) if rs else nodeid.split("::")[0] for nodeid, rs in used.items()}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the marks
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist's ``loadgroup``: mark each test with its `xdist_groups` group, and
    run the shared-resource groups first (the longest units of work: started first, they do
    not end the run on one worker while the other idles; use ``--no-loadscope-reorder``, else
    xdist orders groups by their number of tests). The workers collect (and group) the tests;
    xdist sets their ``dist`` to "no" and ``loadgroup`` to True."""
    if not (config.getoption("loadgroup", False) or config.getoption("dist", "no") == "loadgroup"):
        return
    groups = xdist_groups(items)
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))
    items.sort(key=lambda i: groups[i.nodeid] not in SHARED_RESOURCES)  # stable: file order kept


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
    module-level function). Raises if any rank fails (its traceback is printed). Starts again on
    a new port when the rendezvous port was taken before rank 0 bound it (`with_free_port`)."""
    with_free_port(
        lambda port: mp.start_processes(
            _entry,
            args=(world_size, port, fn, args),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
    )
