"""Weight sync, the trainer side: gather the policy's weights, export them, hand them over.

- `gather_hf_weights`: HF-named full tensors onto global rank 0 (TP/EP gathers inside each
  pipeline stage, then one point-to-point send per stage owner).
- `WeightPublisher`: versioned, double-buffered safetensors slots (the file hand-off).
- `publish_policy` / `export_hf`: what the trainer calls (every rank, one line); `WeightSink`
  is what `publish_policy` needs of the receiving side.

The engine side (pause, reload, version, resume; restarts) is the rollout's
`sao_megatron.rollout.engines.EngineFleet`; this package imports nothing of `rollout`. Exports
are lazy: the publisher imports without Megatron-Core and the conversion code. See
docs/WEIGHT_SYNC.md.
"""

from __future__ import annotations

from sao_megatron.lazy import lazy_exports

_MODULES = {
    "gather": ("gather_hf_weights",),
    "publish": ("WeightSink", "export_hf", "publish_policy"),
    "publisher": ("WeightPublisher", "WeightSource"),
}
__getattr__, __all__ = lazy_exports(__name__, _MODULES)
