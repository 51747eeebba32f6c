"""Agent environments and tasks: the protocol, a registry, and the built-in environments.

Importing this package registers the built-ins: "hanoi", "chain_sum", "basic_arithmetic",
"reasoning_gym" (and "babyai" when minigrid is installed). Build one with
``make_env(name, **options)`` or ``EnvSpec(name=..., options={...}).build()``.
"""

from sao_megatron.envs import hanoi, reasoning_gym_tasks  # noqa: F401  (registers built-ins)
from sao_megatron.envs.base import (
    Environment,
    EnvSpec,
    StepResult,
    SupportsGoldAction,
    make_env,
    register_env,
    registered_envs,
)

__all__ = [
    "EnvSpec",
    "Environment",
    "StepResult",
    "SupportsGoldAction",
    "make_env",
    "register_env",
    "registered_envs",
]
