"""Asynchronous rollout: vLLM engines, router, episode runner, trajectory buffer, weight sync.

Exports are lazy: the vLLM server imports `sao_megatron.rollout.vllm_worker_ext` (and so this
package) inside the vLLM virtualenv, which must not pull in the trainer's modules. See
docs/ROLLOUT.md for the trainer API.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "RolloutConfig": "config",
    "RolloutManager": "manager",
    "Task": "manager",
    "SyncResult": "manager",
    "round_robin_tasks": "manager",
    "StalenessBuffer": "buffer",
    "Router": "router",
    "EngineProcess": "engine",
    "EngineClient": "engine",
    "EngineError": "engine",
    "Generation": "engine",
    "run_episode": "runner",
    "AgentEnvironment": "gateway",
    "ChatGateway": "gateway",
    "run_agent_episode": "gateway",
    "EpisodeStatus": "status",
    "StatusCounters": "status",
    "stale_token_mask": "staleness",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'sao_megatron.rollout' has no attribute {name!r}")
    return getattr(importlib.import_module(f"sao_megatron.rollout.{_EXPORTS[name]}"), name)
