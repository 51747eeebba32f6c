"""Weight sync from the trainer to the rollout engines: gather, publish, reload.

- `gather_hf_weights`: HF-named full tensors onto global rank 0 (TP/EP gathers inside each
  pipeline stage, then one point-to-point send per stage owner).
- `WeightPublisher`: versioned, double-buffered safetensors slots.
- `sync_engine` / `sync_engines`: the engine reload call sequence.
- `publish_policy` / `export_hf`: what the trainer calls (every rank, one line).

Exports are lazy: the rollout side (publisher, engine protocol) imports without Megatron-Core
and the conversion code. See docs/WEIGHT_SYNC.md.
"""

from __future__ import annotations

from sao_megatron.lazy import lazy_exports

_MODULES = {
    "engines": ("EngineSyncReport", "sync_engine", "sync_engines"),
    "gather": ("gather_hf_weights",),
    "publish": ("export_hf", "publish_policy"),
    "publisher": ("WeightPublisher", "WeightSource"),
}
__getattr__, __all__ = lazy_exports(__name__, _MODULES)
