"""Re-record tests/golden/golden_values.json: `python -m tests.golden.record` (from the repo root).

Only for an intended change of numerics; the commit that re-records must say why.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from tests.conftest import launch
from tests.golden import golden_worker

GOLDEN = Path(__file__).with_name("golden_values.json")


def collect() -> dict:
    """Every golden run: 1-rank ones in this process, 2-rank ones on 2 spawned gloo ranks."""
    out = {f"{a}/1rank/rank0": golden_worker.run(a, {}) for a in ("sao", "grpo")}
    with tempfile.TemporaryDirectory() as tmp:
        launch(golden_worker.worker, 2, tmp)
        ranks = [torch.load(f"{tmp}/rank{r}.pt") for r in range(2)]
    for r, results in enumerate(ranks):  # metrics of the local shard differ per rank
        out |= {f"{run}/rank{r}": res for run, res in results.items()}
    return out


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps(collect(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
