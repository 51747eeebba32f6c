"""Plug-in modules: user code that registers algorithms or environments, imported by name or path.

A plug-in is an ordinary Python module whose import registers something (``@register`` of
`sao_megatron.algorithm.registry`, ``@register_env`` of `sao_megatron.envs`). A job names its
plug-ins in the top-level ``plugins:`` list of its config and with ``sao-train --import MODULE``
(both add up); each entry is

* a dotted module name importable from ``sys.path`` (``mypkg.my_algorithm``), or
* a path to a ``.py`` file (``examples/algorithms/rebn.py``), relative to the working
  directory, else to the repository (as agent files are).

They are imported before the config is resolved (`sao_megatron.configs.load_config` imports the
config's list, the CLI its ``--import`` flags), in every process that resolves it: each trainer
rank gets the same command line from torchrun/srun, the engine nodes' ``sao-serve`` the
trainer's arguments, and ``run_dir/config.yaml`` records the list. Importing a module twice (by
path and by name, or once per config load) runs it once. A module that cannot be imported is
a `PluginError` naming it and the exception, in one line.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import traceback
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parents[1]


class PluginError(ValueError):
    """A plug-in module that cannot be imported (the message is one line)."""


def is_path(entry: str) -> bool:
    """True when `entry` names a file (ends with .py or contains a path separator)."""
    return entry.endswith(".py") or "/" in entry or "\\" in entry


def _file_of(entry: str) -> Path:
    path = Path(entry).expanduser()
    if not path.is_absolute() and not path.exists() and (REPO_ROOT / path).exists():
        path = REPO_ROOT / path
    return path.resolve()


def _loaded_from(path: Path) -> ModuleType | None:
    """A module already imported from `path` (under any name), or None."""
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if isinstance(file, str) and file.endswith(path.name) and Path(file).resolve() == path:
            return module
    return None


def _where(exc: BaseException) -> str:
    """' (at file:line)' of the innermost frame of `exc` outside importlib, or ''."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "importlib" not in f.filename]
    if isinstance(exc, SyntaxError) or not frames or frames[-1].filename == __file__:
        return ""
    return f" (at {frames[-1].filename}:{frames[-1].lineno})"


def _import_file(path: Path) -> ModuleType:
    name = f"sao_plugin_{path.stem}"
    n = 1
    while name in sys.modules:  # another file of the same stem is loaded
        name, n = f"sao_plugin_{path.stem}_{n}", n + 1
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before exec: dataclasses and typing look the module up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def import_plugin(entry: str, origin: str = "plugins") -> ModuleType:
    """Import one plug-in (a dotted module name or a .py path) and return its module.

    `origin` names where the entry came from in the error (``plugins``, ``--import``).
    Raises PluginError naming the entry and the exception (type, message and the line of the
    plug-in that raised it).
    """
    if not isinstance(entry, str) or not entry.strip():
        raise PluginError(f"{origin}: {entry!r} is not a module name or a .py path")
    try:
        if is_path(entry):
            path = _file_of(entry)
            if not path.is_file():
                raise PluginError(
                    f"{origin}: cannot import {entry!r}: no such file {path} (give a .py file "
                    "relative to the working directory, or a dotted module name)"
                )
            return _loaded_from(path) or _import_file(path)
        if entry in sys.modules:
            return sys.modules[entry]
        spec = importlib.util.find_spec(entry)
        origin_file = getattr(spec, "origin", None)
        if origin_file and (same := _loaded_from(Path(origin_file).resolve())) is not None:
            sys.modules[entry] = same  # imported by path before: do not run it twice
            return same
        return importlib.import_module(entry)
    except PluginError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of user code is reported the same way
        hint = ""
        if isinstance(e, ModuleNotFoundError) and e.name and entry.startswith(e.name):
            hint = "; add its folder to PYTHONPATH or give the path to its .py file"
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise PluginError(
            f"{origin}: cannot import {entry!r}: {type(e).__name__}: {first}{_where(e)}{hint}"
        ) from e


def import_plugins(entries: Iterable[str], origin: str = "plugins") -> list[ModuleType]:
    """`import_plugin` each entry, in order; raises PluginError at the first that fails."""
    return [import_plugin(str(e), origin) for e in entries]


def add_import_argument(parser: argparse.ArgumentParser, help: str) -> None:
    """Add the repeatable ``--import MODULE`` flag (into ``args.imports``, a list) to `parser`:
    the one spelling shared by ``sao-train``, ``sao-plan`` and ``sao-serve``."""
    parser.add_argument(
        "--import", dest="imports", action="append", default=[], metavar="MODULE", help=help
    )
