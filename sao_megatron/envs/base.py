"""The environment protocol every task implements, and the registry that builds them by name.

Where a name comes from: `register_env` in a module that was imported (the built-ins of
`sao_megatron.envs`, a plug-in given by import path: ``plugins:`` / ``--import``), else, on
first use of the name, the module that registers it is imported from its import path: a
built-in of a higher layer (`LAZY_ENVS`: ``agent``, which the rollout gateway registers) or an
installed package's entry point in group `ENTRY_POINT_GROUP` (docs/ENVIRONMENTS.md).
Evaluation asks the environment for its own metrics (`episode_metrics`), never by its name.
"""

from __future__ import annotations

import importlib.metadata
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

from sao_megatron.envs.options import (  # noqa: F401  (config_from_options: re-exported)
    config_from_options,
    did_you_mean,
)
from sao_megatron.plugins import import_plugin


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
        options: keyword options of that environment, e.g. {"horizon": 200}; checked when the
            spec is built against the environment's options dataclass (`options_schema`):
            unknown keys (with the closest option names), types, ranges and allowed values.
        weight: relative sampling weight when a job mixes several environments (> 0).

    Messages name the fields ``EnvSpec.name`` and ``EnvSpec.options.<key>``; the job config
    reports them at the entry's path (``tasks.train[0].options.horizn``; `CONFIG_SECTION`).
    """

    CONFIG_SECTION: ClassVar[str] = "EnvSpec"

    name: str
    options: dict[str, Any] = field(default_factory=dict)
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"EnvSpec.name={self.name!r}: give a registered environment name")
        check_env_name(self.name, where="EnvSpec.name")
        if not (self.weight > 0):
            raise ValueError(f"EnvSpec.weight={self.weight}: must be > 0")
        options_config(self.name, self.options, where="EnvSpec.options")

    def build(self) -> Environment:
        """Build the environment through the registry (`make_env(name, **options)`)."""
        return make_env(self.name, **dict(self.options))


def task_id(env: str, seed: int, *, split: str = "train", draw: int | None = None) -> str:
    """The id of a task: every task id the package builds has this one format.

    ``<env>:<seed>`` for a task of the train split (``hanoi:7``), ``<split>/<env>:<seed>`` for
    any other split (``eval/hanoi:7``), and ``:<draw>`` appended for the draw-th task of a seeded
    stream (`sao_megatron.trainer.run_state.TaskStream`: ``hanoi:1234:5``, the sixth task drawn).

    GRPO groups samples by it (equal ids: one group), the rollout derives each request's
    sampling seed from it, and the trainer reads the draw back as its last ':' field
    (`sao_megatron.trainer.run_state.task_index`). `env` is the environment's name or its metric
    label and may itself hold ':' (an eval label ``gem:game_X``); the fields after it are
    integers. Raises ValueError for an empty `split` or one holding '/' or ':', or a negative
    `draw`.
    """
    if not split or "/" in split or ":" in split:
        raise ValueError(f"task_id(split={split!r}): a non-empty name without '/' or ':'")
    if draw is not None and draw < 0:
        raise ValueError(f"task_id(draw={draw}): the draw index of a stream is >= 0")
    prefix = "" if split == "train" else f"{split}/"
    return f"{prefix}{env}:{int(seed)}" + ("" if draw is None else f":{int(draw)}")


EnvFactory = Callable[..., Environment]
#: ``(final step infos of finished episodes, the environment's options) -> {metric: value}``
EpisodeMetrics = Callable[[Sequence[Mapping[str, Any]], Mapping[str, Any]], Mapping[str, float]]
_REGISTRY: dict[str, EnvFactory] = {}
_SCHEMAS: dict[str, tuple[type, dict[str, Any]]] = {}  # name -> (options dataclass, fixed)
_METRICS: dict[str, EpisodeMetrics] = {}  # name -> hook (`register_episode_metrics`)

#: built-in environments registered by a module of a higher layer, imported when the name is
#: first used: name -> import path (the rollout gateway registers ``agent`` itself)
LAZY_ENVS = {"agent": "sao_megatron.rollout.gateway.environment"}
#: entry-point group of installed plug-in environments: the entry point's name is the
#: environment's, its value the module that registers it (in a package's pyproject.toml,
#: ``[project.entry-points."sao_megatron.envs"]`` ``my_env = "my_pkg.envs"``)
ENTRY_POINT_GROUP = "sao_megatron.envs"


def register_env(
    name: str, options: type | None = None, fixed: Mapping[str, Any] | None = None
) -> Callable[[EnvFactory], EnvFactory]:
    """Decorator: register a factory (class or function taking keyword options) under `name`.

    Args:
        name: the name configs use (``tasks.train: [{name: ...}]``).
        options: the environment's options dataclass (``@dataclass(kw_only=True)``, each field
            documented in a ``Fields:`` docstring section and checked in ``__post_init__``,
            whose messages start with its ``CONFIG_SECTION`` prefix). An EnvSpec's options are
            checked against it when the job config loads; the factory builds its config with
            `options_config(name, options)`, the same check. Without it, option names are
            checked against the factory's keyword parameters (unless it takes ``**kwargs``).
        fixed: fields of `options` the environment sets itself (``{"dataset": "chain_sum"}``);
            giving one is an error.
    """

    def deco(factory: EnvFactory) -> EnvFactory:
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise ValueError(f"environment {name!r} is already registered")
        _REGISTRY[name] = factory
        if options is not None:
            _SCHEMAS[name] = (options, dict(fixed or {}))
        return factory

    return deco


def register_episode_metrics(name: str, metrics: EpisodeMetrics) -> None:
    """Declare how environment `name` summarises its evaluation episodes (`episode_metrics`),
    for an environment whose factory cannot carry an ``episode_metrics`` attribute itself.

    metrics: ``(infos, options) -> {metric: value}``, with ``infos`` the final step info of each
    finished episode and ``options`` the environment's options (a wrapper delegates with them).
    """
    if not callable(metrics):
        raise ValueError(
            f"register_episode_metrics({name!r}, {metrics!r}): give a function "
            "(infos, options) -> {metric: value}"
        )
    _METRICS[name] = metrics


def episode_metrics(spec: EnvSpec, infos: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The environment's own evaluation metrics of its finished episodes (``{}``: none).

    The hook is the one given to `register_episode_metrics`, else the factory's
    ``episode_metrics`` attribute (a staticmethod or classmethod of an environment class,
    ``episode_metrics(infos, options)``); it gets each episode's final step info and
    ``spec.options``. Evaluation reports the result as ``eval/<label>/<metric>``.
    """
    check_env_name(spec.name, where="EnvSpec.name")
    hook = _METRICS.get(spec.name) or getattr(_REGISTRY[spec.name], "episode_metrics", None)
    if hook is None:
        return {}
    return {str(k): float(v) for k, v in hook(list(infos), dict(spec.options)).items()}


def options_schema(name: str) -> type | None:
    """The options dataclass registered for environment `name` (None: none declared)."""
    check_env_name(name)
    found = _SCHEMAS.get(name)
    return found[0] if found else None


def fixed_options(name: str) -> dict[str, Any]:
    """The options environment `name` sets itself (not settable in its options)."""
    found = _SCHEMAS.get(name)
    return dict(found[1]) if found else {}


def options_config(name: str, options: Mapping[str, Any], where: str | None = None) -> Any:
    """Check `options` of environment `name` against its schema and return the built options
    dataclass (None for an environment without one, after checking its keyword parameters).

    where: the field-path prefix of the options in messages (default `name`: ``hanoi.horizn``;
    an EnvSpec passes ``EnvSpec.options``). Raises ValueError (see
    `sao_megatron.envs.options.config_from_options`).
    """
    where = where or name
    check_env_name(name)
    if name not in _SCHEMAS:
        _check_parameters(name, _REGISTRY[name], options, where)
        return None
    config_cls, fixed = _SCHEMAS[name]
    hints = getattr(config_cls, "FIXED_HINTS", {})
    for key, value in fixed.items():
        if isinstance(options, Mapping) and key in options:
            raise ValueError(
                f"{where}.{key}: {key!r} is fixed to {value!r} by environment {name!r}; "
                f"{hints.get(key, 'remove it')}"
            )
    merged = {**options, **fixed} if isinstance(options, Mapping) else options
    return config_from_options(config_cls, merged, where, env=name)


def _check_parameters(name: str, factory: EnvFactory, options: Any, where: str) -> None:
    """Options of an environment without a schema: keys must be the factory's parameters."""
    if not isinstance(options, Mapping):
        raise ValueError(f"{where}={options!r}: give a mapping of options of {name!r}")
    try:
        params = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check against
        return
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in options:
        if key not in names:
            qualname = getattr(factory, "__qualname__", repr(factory))
            raise ValueError(
                f"{where}.{key}: unknown option of environment {name!r} (not a parameter of "
                f"{qualname}); {did_you_mean(key, names)}allowed options: {sorted(names)}"
            )


#: optional built-ins, registered only when their package is installed: name -> pip package
OPTIONAL_ENVS = {"babyai": "minigrid"}


def check_env_name(name: str, where: str = "environment name") -> None:
    """Raise ValueError if `name` is not registered, suggesting the closest registered names
    (difflib) and how to register or install one.

    where: what to call the value in the message (e.g. "EnvSpec.name", which the job config
    reports as ``tasks.train[0].name``).
    """
    if name in _REGISTRY or _import_provider(name):
        return
    if name in OPTIONAL_ENVS:
        raise ValueError(
            f"{where}={name!r}: this environment needs the optional package "
            f"{OPTIONAL_ENVS[name]!r}: pip install {OPTIONAL_ENVS[name]}"
        )
    known = registered_envs()
    hint = did_you_mean(name, known)
    raise ValueError(
        f"{where}={name!r} is not a registered environment; {hint}registered: {known}. "
        "Register your own with @sao_megatron.envs.base.register_env('name') in a module the "
        "config's plugins: list (or --import) names, or an installed package's entry point in "
        f"group {ENTRY_POINT_GROUP!r}"
    )


def _providers() -> dict[str, tuple[str, str]]:
    """Names not registered yet that importing a module registers: name -> (import path, where
    it was declared); the built-ins of `LAZY_ENVS` first, then installed entry points."""
    out = {name: (path, "sao_megatron.envs.base.LAZY_ENVS") for name, path in LAZY_ENVS.items()}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep.dist, "name", None) or "an installed package"
        out.setdefault(ep.name, (ep.module, f"entry point {ep.name} = {ep.value} of {dist}"))
    return {name: v for name, v in out.items() if name not in _REGISTRY}


def _import_provider(name: str) -> bool:
    """Import the module that registers `name` (`_providers`); False when none declares it.

    Raises ValueError (a `PluginError` when the import fails) when the module does not
    register `name`.
    """
    found = _providers().get(name)
    if found is None:
        return False
    path, origin = found
    import_plugin(path, origin=origin)
    if name not in _REGISTRY:
        raise ValueError(
            f"environment {name!r}: {origin} imported {path!r}, which registered no environment "
            f"{name!r}; register it there with @register_env({name!r})"
        )
    return True


def make_env(name: str, **options: Any) -> Environment:
    """Build a registered environment. Raises ValueError naming the closest known names."""
    check_env_name(name)
    return _REGISTRY[name](**options)


def registered_envs() -> list[str]:
    """Names accepted by `make_env`, sorted: the registered ones and those whose module is
    imported on first use (`LAZY_ENVS`, entry points in `ENTRY_POINT_GROUP`)."""
    return sorted({*_REGISTRY, *_providers()})
