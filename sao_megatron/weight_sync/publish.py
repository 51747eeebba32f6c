"""The two calls the trainer makes: publish the policy to the rollout engines, export it as HF."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from sao_megatron.convert.hf_io import atomic_output_dir, write_sharded_safetensors
from sao_megatron.convert.spec import ConversionSpec
from sao_megatron.data.tokenizer import Tokenizer, save_tokenizer
from sao_megatron.parallel.state import ParallelState
from sao_megatron.weight_sync.gather import gather_hf_weights


class WeightSink(Protocol):
    """What `publish_policy` needs of the rollout side (``RolloutManager.publish_weights``, which
    hands the weights to its `EngineFleet`): write the slot file, sync every engine, return a
    result with ``max_pause_s``, ``write_s`` and ``failed_engines``."""

    def publish_weights(self, weights: dict[str, torch.Tensor], version: int): ...


def publish_policy(
    policy_chunks: list[torch.nn.Module],
    spec: ConversionSpec,
    parallel: ParallelState,
    rollout: WeightSink | None,
    version: int,
) -> dict[str, float]:
    """Send the policy's weights to the rollout engines as ``version`` (every rank calls it).

    Gathers the HF-named full tensors onto global rank 0 (`gather_hf_weights`), where
    ``rollout.publish_weights`` writes them into the next double-buffered slot and pauses,
    reloads, versions and resumes each engine.

    Args:
        policy_chunks: this rank's unwrapped policy chunks.
        spec: the policy's `ConversionSpec`.
        parallel: this rank's `ParallelState`.
        rollout: the `RolloutManager` on global rank 0, None on every other rank.
        version: the policy version the engines will report after the update.

    Returns:
        On rank 0: ``sync/gather_s`` (gather time, s), ``sync/write_s`` (slot file, s),
        ``sync/max_pause_s`` (longest engine pause, s), ``sync/failed_engines`` (count).
        ``{}`` on other ranks.

    Raises:
        ValueError: ``rollout`` given on a rank other than 0, or missing on rank 0.
    """
    if (rollout is not None) != (parallel.rank == 0):
        raise ValueError(
            f"publish_policy on rank {parallel.rank}: pass the RolloutManager on global rank 0 "
            "and rollout=None on every other rank"
        )
    t0 = time.perf_counter()
    weights = gather_hf_weights(policy_chunks, spec, parallel)
    gather_s = time.perf_counter() - t0
    if rollout is None:
        return {}
    sync = rollout.publish_weights(weights, version)
    return {
        "sync/gather_s": gather_s,
        "sync/max_pause_s": float(sync.max_pause_s),
        "sync/write_s": float(sync.write_s),
        "sync/failed_engines": float(len(sync.failed_engines)),
    }


def export_hf(
    policy_chunks: list[torch.nn.Module],
    spec: ConversionSpec,
    hf_config: dict,
    tokenizer: Tokenizer,
    parallel: ParallelState,
    out_dir: str | Path,
) -> None:
    """Write the policy as a Hugging Face checkpoint folder (every rank calls it).

    Rank 0 writes ``config.json`` (``hf_config``), sharded safetensors with an index, and the
    tokenizer under ``sao_tokenizer/``, atomically (temporary folder, then rename; an existing
    folder is replaced); all ranks leave once it is written. "All ranks" are those of
    ``parallel.model_group`` (the world, or the policy ranks of ``value.placement: separate``,
    whose value ranks do not call it).
    """
    weights = gather_hf_weights(policy_chunks, spec, parallel)
    if weights is not None:
        with atomic_output_dir(out_dir, overwrite=True) as tmp:
            write_sharded_safetensors(iter(weights.items()), tmp)
            (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
            save_tokenizer(tokenizer, str(tmp / "sao_tokenizer"))
    group = parallel.model_group
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.barrier(group=group)
