"""The algorithm registry: RL algorithms registered by name, looked up by `algorithm.name`.

An algorithm is a class derived from `sao_megatron.algorithm.base.Algorithm`, decorated with
``@register``; the built-ins (sao, grpo, grpo_dis) are imported by the package ``__init__``, so
they are registered before any config is read. An algorithm in a file of its own outside the
package (a plug-in, e.g. examples/algorithms/rebn.py) registers when that module is imported:
``sao-train --import MODULE`` or the config's ``plugins: [MODULE]`` (`sao_megatron.plugins`);
its own settings go in ``algorithm.options``, validated by the class's ``options_class``.
Nothing outside this module and the algorithm files tests an algorithm's name: callers ask the
object (`needs_value_model`, `schedule`, ...).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from .base import Algorithm
    from .config import AlgorithmConfig

_REGISTRY: dict[str, type[Algorithm]] = {}
A = TypeVar("A", bound="type[Algorithm]")


def register(cls: A) -> A:
    """Class decorator: make `cls` available as ``algorithm.name: <cls.name>``.

    Raises ValueError if the name is empty or already taken by another class.
    """
    name = getattr(cls, "name", "")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{cls.__qualname__}.name must be a non-empty string to register it")
    if _REGISTRY.get(name, cls) is not cls:
        raise ValueError(
            f"algorithm name {name!r} is already registered by {_REGISTRY[name].__qualname__}"
        )
    _REGISTRY[name] = cls
    return cls


def names() -> list[str]:
    """The registered algorithm names, sorted."""
    return sorted(_REGISTRY)


def get(name: str) -> type[Algorithm]:
    """The algorithm class registered as `name`.

    Raises ValueError naming ``algorithm.name`` and every registered name when it is unknown.
    """
    if name not in _REGISTRY:
        raise ValueError(
            f"algorithm.name={name!r}: not a registered algorithm; use one of {', '.join(names())}"
            " (a plug-in registers when its module is imported: `sao-train --import MODULE` or "
            "plugins: [MODULE] in the config)"
        )
    return _REGISTRY[name]


def build(config: AlgorithmConfig) -> Algorithm:
    """The algorithm object of `config` (``algorithm.name`` picks the class)."""
    return get(config.name)(config)
