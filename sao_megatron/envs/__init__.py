"""Agent environments and tasks: the protocol, a registry, and the built-in environments.

Importing this package registers the built-ins: "hanoi", "chain_sum", "basic_arithmetic",
"reasoning_gym", "gem" (any GEM environment id, gem-llm), "latency" (a wrapper that adds a
heavy-tailed delay to each step of another environment) and "babyai" when minigrid is
installed. "agent" (an OpenAI-SDK agent run through the gateway) is registered by the rollout
gateway, imported by its import path when the name is first used (`base.LAZY_ENVS`), as are
installed plug-ins' entry points (`base.ENTRY_POINT_GROUP`). Build one with
``make_env(name, **options)`` or ``EnvSpec(name=..., options={...}).build()``; each declares
its options as a dataclass (`options_schema(name)`), checked when an EnvSpec is built, i.e. when
a job config loads.
"""

import importlib.util

from sao_megatron.envs import gem, hanoi, latency, reasoning_gym_tasks  # noqa: F401  (registers)
from sao_megatron.envs.base import (
    Environment,
    EnvSpec,
    StepResult,
    SupportsGoldAction,
    episode_metrics,
    make_env,
    options_config,
    options_schema,
    register_env,
    register_episode_metrics,
    registered_envs,
    task_id,
)

latency.register()

if importlib.util.find_spec("minigrid") is not None:  # optional dependency
    from sao_megatron.envs import babyai  # noqa: F401


__all__ = [
    "EnvSpec",
    "Environment",
    "StepResult",
    "SupportsGoldAction",
    "episode_metrics",
    "make_env",
    "options_config",
    "options_schema",
    "register_env",
    "register_episode_metrics",
    "registered_envs",
    "task_id",
]
