"""Versioned, double-buffered safetensors slots the engines reload from (file hand-off).

Version k+1 goes into the slot that does *not* hold version k (``<root>/slot{(k+1) % 2}/
model.safetensors``): first to a temporary file in the same folder, then ``os.replace`` --
readers never see a half-written file, and version k stays intact for an engine that restarts
while k+1 is being written.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

WeightSource = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


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
