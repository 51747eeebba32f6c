"""The names of the former ``engine`` module, kept importable: the engine process
(`sao_megatron.rollout.engine_process`) and the HTTP client (`sao_megatron.rollout.engine_client`)
are separate modules now; new code imports from them."""

from __future__ import annotations

from sao_megatron.rollout.engine_client import (
    CLIENT_KEEP_ALIVE_S,
    SERVED_MODEL_NAME,
    EngineClient,
    EngineError,
    Generation,
    MalformedReplyError,
    PauseClock,
    parse_generation,
    wait_excluding_pauses,
)
from sao_megatron.rollout.engine_process import (
    REPO_ROOT,
    SERVER_KEEP_ALIVE_S,
    WORKER_EXTENSION,
    EngineProcess,
    free_port,
    group_members,
    python_is_vllm_venv,
    start_engines,
)

__all__ = [
    "CLIENT_KEEP_ALIVE_S",
    "EngineClient",
    "EngineError",
    "EngineProcess",
    "Generation",
    "MalformedReplyError",
    "PauseClock",
    "REPO_ROOT",
    "SERVED_MODEL_NAME",
    "SERVER_KEEP_ALIVE_S",
    "WORKER_EXTENSION",
    "free_port",
    "group_members",
    "parse_generation",
    "python_is_vllm_venv",
    "start_engines",
    "wait_excluding_pauses",
]
