"""Agent environments and tasks: the protocol, a registry, and the built-in environments.

Importing this package registers the built-ins: "hanoi", "chain_sum", "basic_arithmetic",
"reasoning_gym", "latency" (a wrapper that adds a heavy-tailed delay to each step of another
environment) and "babyai" when minigrid is installed. Build one with
``make_env(name, **options)`` or ``EnvSpec(name=..., options={...}).build()``.
"""

import importlib.util

from sao_megatron.envs import hanoi, latency, reasoning_gym_tasks  # noqa: F401  (registers built-ins)
from sao_megatron.envs.base import (
    Environment,
    EnvSpec,
    StepResult,
    SupportsGoldAction,
    make_env,
    register_env,
    registered_envs,
    task_id,
)

latency.register()

if importlib.util.find_spec("minigrid") is not None:  # optional dependency
    from sao_megatron.envs import babyai  # noqa: F401


@register_env("agent")
def _agent_env(**options):
    """An OpenAI-SDK agent function run through the chat gateway (docs/AGENTS.md)."""
    from sao_megatron.rollout.gateway import make_agent_environment

    return make_agent_environment(**options)


__all__ = [
    "EnvSpec",
    "Environment",
    "StepResult",
    "SupportsGoldAction",
    "make_env",
    "register_env",
    "registered_envs",
    "task_id",
]
