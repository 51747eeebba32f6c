"""Lazy package exports (PEP 562): a package lists its public names per submodule and imports a
submodule only when one of its names is first used, so light parts of a package import without
the heavy dependencies of the others (Megatron-Core is absent in the vLLM virtualenv)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(
    package: str, modules: dict[str, tuple[str, ...]]
) -> tuple[Callable[[str], Any], list[str]]:
    """``(__getattr__, __all__)`` for ``package`` exporting ``modules[sub]`` from ``package.sub``.

    Use in a package ``__init__``: ``__getattr__, __all__ = lazy_exports(__name__, {...})``.
    """
    where = {name: sub for sub, names in modules.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{where[name]}"), name)

    return __getattr__, sorted(where)
