"""The environment protocol every task implements, and the registry that builds them by name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(kw_only=True)
class StepResult:
    """What `Environment.step` returns.

    observation: text shown to the agent before its next action ("" when done).
    reward: scalar reward for the action just taken.
    done: the episode terminated (solved, failed, illegal action).
    truncated: the step budget ran out before termination (GAE bootstraps from V).
    info: free-form facts for metrics and debugging (e.g. {"success": True, "error": ...}).
    """

    observation: str
    reward: float
    done: bool
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """An agent environment. Single-turn tasks are 1-step episodes.

    `reset(seed)` must make the episode reproducible: the same seed gives the same task.
    `step(action)` never raises on bad actions: a malformed or illegal action returns a
    StepResult with done=True and the documented reward (and info["error"]).
    """

    name: str
    max_steps: int

    def reset(self, seed: int) -> str: ...

    def step(self, action: str) -> StepResult: ...


EnvFactory = Callable[..., Environment]
_REGISTRY: dict[str, EnvFactory] = {}


def register_env(name: str) -> Callable[[EnvFactory], EnvFactory]:
    """Decorator: register a factory (class or function taking keyword options) under `name`."""

    def deco(factory: EnvFactory) -> EnvFactory:
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise ValueError(f"environment {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory

    return deco


def make_env(name: str, **options: Any) -> Environment:
    """Build a registered environment. Raises ValueError listing the known names."""
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown environment {name!r}; registered: {sorted(_REGISTRY)}. "
            "Register your own with @sao_megatron.envs.base.register_env('name')"
        )
    return _REGISTRY[name](**options)


def registered_envs() -> list[str]:
    return sorted(_REGISTRY)
