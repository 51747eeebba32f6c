"""Compatibility names for the rollout manager: the publisher slots and the engine reload
protocol live in `sao_megatron.weight_sync` (see docs/WEIGHT_SYNC.md)."""

from sao_megatron.weight_sync.engines import EngineSyncReport, sync_engine, sync_engines
from sao_megatron.weight_sync.publisher import WeightPublisher, WeightSource

__all__ = ["EngineSyncReport", "WeightPublisher", "WeightSource", "sync_engine", "sync_engines"]
