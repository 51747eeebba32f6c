"""Versioned, double-buffered weight sync from the trainer to the vLLM engines (file hand-off).

Protocol for version k+1 (DESIGN.md section 4, "Weight sync"):

1. `WeightPublisher.publish` writes the HF-named tensors as safetensors into the slot that does
   *not* hold version k (``<dir>/slot{(k+1) % 2}/model.safetensors``): first to a temporary file
   in the same folder, then ``os.replace`` — readers never see a half-written file, and version k
   stays intact for an engine that restarts while k+1 is being written.
2. `sync_engine` per engine: ``/pause?mode=keep`` (requests in flight freeze at a step boundary,
   nothing is aborted) -> ``/collective_rpc sao_reload_weights(path)`` (in-place reload plus the
   CPU MoE repack, see `vllm_worker_ext`) -> ``/update_weight_version`` -> ``/reset_prefix_cache``
   (cached KV of the old weights must not be reused) -> ``/resume``; then ``/weight_info`` must
   report the new version (engines that silently keep old weights are caught here). The pause
   (pause -> resume) is measured.

Tokens generated after the resume carry the new version in the engine's reply; an action that
straddles the update carries both versions, token by token.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from sao_megatron.rollout.engine import EngineClient, EngineError

WeightSource = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


@dataclass
class EngineSyncReport:
    """What one engine did for one update. Times in seconds."""

    engine: str
    version: int
    pause_s: float
    reload_s: float
    num_tensors: int
    num_repacked_layers: int


class WeightPublisher:
    """Writes weight versions into two alternating slots under `root`.

    Args:
        root: folder of the two slots (created).
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.latest_version: int | None = None
        self.latest_path: Path | None = None

    def slot_path(self, version: int) -> Path:
        return self.root / f"slot{version % 2}" / "model.safetensors"

    def publish(self, weights: WeightSource, version: int) -> Path:
        """Write `weights` (name -> tensor, HF names) as version `version`; return the file path.

        Tensors are saved as given (dtype kept; the engine casts to its dtype), made contiguous
        on CPU. Raises ValueError if `version` does not advance or there are no tensors, TypeError
        for a non-tensor value.
        """
        if self.latest_version is not None and version <= self.latest_version:
            raise ValueError(
                f"weight version {version} does not advance past {self.latest_version}: publish "
                "versions in increasing order"
            )
        items = weights.items() if isinstance(weights, Mapping) else weights
        tensors: dict[str, torch.Tensor] = {}
        for name, t in items:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"weight {name!r} is a {type(t).__name__}, not a torch.Tensor")
            tensors[name] = t.detach().to("cpu").contiguous()
        if not tensors:
            raise ValueError("no tensors to publish: pass HF-named weights (name -> tensor)")
        path = self.slot_path(version)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".safetensors")
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata={"policy_version": str(version)})
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        (path.parent / "version.json").write_text(json.dumps({"policy_version": version}))
        self.latest_version, self.latest_path = version, path
        return path


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
