"""The environment protocol every task implements, and the registry that builds them by name."""

from __future__ import annotations

import dataclasses
import difflib
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


@runtime_checkable
class SupportsGoldAction(Protocol):
    """An environment that can name a gold (expert) action from its *current* state.

    Demonstrations (`sao_megatron.data.demonstrations`) and the `show` CLI drive any environment
    that implements this. `gold_action()` is only valid between `reset` and the end of the
    episode; it raises RuntimeError otherwise.
    """

    def gold_action(self) -> str: ...


@dataclass(kw_only=True)
class EnvSpec:
    """Which environment to build and with which options (a job config holds a list of these).

    Fields:
        name: a registered environment name (see `registered_envs()`), e.g. "hanoi"; checked
            when the spec is built (so a misspelt name fails when the config loads, with the
            closest registered names suggested). Register your own before loading the config.
        options: keyword options for that environment's config dataclass, e.g. {"horizon": 200}.
        weight: relative sampling weight when a job mixes several environments (> 0).
    """

    name: str
    options: dict[str, Any] = field(default_factory=dict)
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"EnvSpec.name={self.name!r}: give a registered environment name")
        check_env_name(
            self.name,
            where="EnvSpec.name (an entry of tasks.train, tasks.eval or demonstrations.envs)",
        )
        if not (self.weight > 0):
            raise ValueError(f"EnvSpec.weight={self.weight}: must be > 0")

    def build(self) -> Environment:
        """Build the environment through the registry (`make_env(name, **options)`)."""
        return make_env(self.name, **dict(self.options))


def config_from_options(config_cls: type, options: dict[str, Any], where: str) -> Any:
    """Build the config dataclass `config_cls(**options)`, naming unknown fields in the error.

    Raises ValueError("<where>: unknown option 'x'; valid options: [...]") instead of the bare
    TypeError a dataclass raises, so a typo in YAML says what the choices were.
    """
    names = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise ValueError(f"{where}: unknown option(s) {unknown}; valid options: {sorted(names)}")
    return config_cls(**options)


def task_id(env_name: str, seed: int) -> str:
    """The task id of an episode, ``f"{env_name}:{seed}"`` (GRPO groups samples by it)."""
    return f"{env_name}:{seed}"


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


#: optional built-ins, registered only when their package is installed: name -> pip package
OPTIONAL_ENVS = {"babyai": "minigrid"}


def check_env_name(name: str, where: str = "environment name") -> None:
    """Raise ValueError if `name` is not registered, suggesting the closest registered names
    (difflib) and how to register or install one.

    where: what to call the value in the message (e.g. "EnvSpec.name"; the job config's
    ``tasks.train``, ``tasks.eval`` and ``demonstrations.envs`` entries are EnvSpecs).
    """
    if name in _REGISTRY:
        return
    if name in OPTIONAL_ENVS:
        raise ValueError(
            f"{where}={name!r}: this environment needs the optional package "
            f"{OPTIONAL_ENVS[name]!r}: pip install {OPTIONAL_ENVS[name]}"
        )
    close = difflib.get_close_matches(name, sorted(_REGISTRY), n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    raise ValueError(
        f"{where}={name!r} is not a registered environment; {hint}registered: "
        f"{sorted(_REGISTRY)}. Register your own with "
        "@sao_megatron.envs.base.register_env('name') (import its module before loading the "
        "config)"
    )


def make_env(name: str, **options: Any) -> Environment:
    """Build a registered environment. Raises ValueError naming the closest known names."""
    check_env_name(name)
    return _REGISTRY[name](**options)


def registered_envs() -> list[str]:
    """Names accepted by `make_env`, sorted."""
    return sorted(_REGISTRY)
