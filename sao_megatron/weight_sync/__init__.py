"""Weight sync from the trainer to the rollout engines: gather, publish, reload.

- `gather_hf_weights`: HF-named full tensors onto global rank 0 (TP/EP gathers inside each
  pipeline stage, then one point-to-point send per stage owner).
- `WeightPublisher`: versioned, double-buffered safetensors slots.
- `sync_engine` / `sync_engines`: the engine reload call sequence.
- `publish_policy` / `export_hf`: what the trainer calls (every rank, one line).

See docs/WEIGHT_SYNC.md.
"""

from sao_megatron.weight_sync.engines import EngineSyncReport, sync_engine, sync_engines
from sao_megatron.weight_sync.gather import gather_hf_weights
from sao_megatron.weight_sync.publish import export_hf, publish_policy
from sao_megatron.weight_sync.publisher import WeightPublisher, WeightSource

__all__ = [
    "EngineSyncReport",
    "WeightPublisher",
    "WeightSource",
    "export_hf",
    "gather_hf_weights",
    "publish_policy",
    "sync_engine",
    "sync_engines",
]
