"""The engine side of a weight update: pause, reload, set version, reset prefix cache, resume.

`sync_engine` per engine: ``/pause?mode=keep`` (requests in flight freeze at a step boundary,
nothing is aborted) -> ``/collective_rpc sao_reload_weights(path)`` (in-place reload plus the
CPU MoE repack, see `sao_megatron.rollout.vllm_worker_ext`) -> ``/update_weight_version`` ->
``/reset_prefix_cache`` (cached KV of the old weights must not be reused) -> ``/resume``; then
``/weight_info`` must report the new version (engines that silently keep old weights are caught
here). The pause (pause -> resume) is measured. Tokens generated after the resume carry the new
version in the engine's reply; an action that straddles the update carries both versions, token
by token. Requests in flight wait through the pause: `EngineClient.pause` and `resume` run the
client's `pause_clock`, which its requests (and the manager's) leave out of
``request_timeout_s``, so a reload slower than that timeout fails nothing.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

from sao_megatron.rollout.engine import EngineClient, EngineError


@dataclass
class EngineSyncReport:
    """What one engine did for one update. Times in seconds."""

    engine: str
    version: int
    pause_s: float
    reload_s: float
    num_tensors: int
    num_repacked_layers: int


async def sync_engine(client: EngineClient, path: str | Path, version: int) -> EngineSyncReport:
    """Pause `client`'s engine, reload `path`, set `version`, reset its prefix cache, resume.

    Raises EngineError if a step fails or the engine does not report `version` afterwards (the
    engine is then left for the caller to restart; resume is attempted in any case).
    """
    t0 = time.perf_counter()
    await client.pause()
    try:
        report = await client.reload_weights(str(path))
        await client.set_weight_version(version)
        await client.reset_prefix_cache()
    finally:
        try:
            await client.resume()
        except EngineError:
            pass
    pause_s = time.perf_counter() - t0
    seen = await client.weight_version()
    if seen != version:
        raise EngineError(f"{client.name} reports weight version {seen} after sync to {version}")
    return EngineSyncReport(
        engine=client.name,
        version=version,
        pause_s=pause_s,
        reload_s=float(report.get("seconds", float("nan"))),
        num_tensors=int(report.get("num_tensors", -1)),
        num_repacked_layers=int(report.get("num_repacked_layers", -1)),
    )


async def sync_engines(
    clients: list[EngineClient], path: str | Path, version: int
) -> list[EngineSyncReport | BaseException]:
    """`sync_engine` on all engines concurrently; failures are returned, not raised."""
    return list(
        await asyncio.gather(
            *(sync_engine(c, path, version) for c in clients), return_exceptions=True
        )
    )
