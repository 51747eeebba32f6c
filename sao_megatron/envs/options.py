"""Environment option schemas: an options mapping checked against a config dataclass, and its table.

Each environment declares its options as a ``@dataclass(kw_only=True)`` (``HanoiConfig``,
``ReasoningGymConfig``, ...; `register_env(name, options=...)` records it). `config_from_options`
is the one check, used both when a job config loads (``EnvSpec`` entries of ``tasks.train``,
``tasks.eval`` and ``demonstrations.envs``) and when an environment is built at run time:

1. keys: every key must be a field (unknown ones get the closest field names, difflib) and every
   field without a default must be given;
2. types: each value must match its field's annotation (``int`` is not ``bool``, a ``float``
   field takes an int; a dataclass-typed field, e.g. latency's ``env``, is checked recursively);
3. values: the dataclass's ``__post_init__`` (ranges, allowed values, cross-field rules).

Messages name the value by its field path. ``where`` is that path's prefix (``"hanoi"`` at run
time, ``"EnvSpec.options"`` in an EnvSpec, renamed by the job config to
``tasks.train[0].options``); a schema's ``__post_init__`` writes its messages with its own
prefix, its ``CONFIG_SECTION`` (``"hanoi."``), which is replaced by ``where``.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import inspect
import re
import types
import typing
from collections.abc import Mapping
from typing import Any

_NUMBER_OF = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def rename_prefix(message: str, old: str | None, new: str) -> str:
    """Replace the field-path prefix ``old.`` by ``new.`` wherever a path starts with it (not
    inside a longer dotted name), e.g. ``hanoi.horizon=0`` -> ``tasks.train[0].options.horizon=0``.
    """
    if not old or old == new:
        return message
    return re.sub(rf"(?<![\w.\]\[]){re.escape(old)}\.", lambda _: f"{new}.", message)


def did_you_mean(word: str, choices: collections.abc.Iterable[str], prefix: str = "") -> str:
    """``"did you mean 'a' or 'b'? "`` for the close matches of `word` (difflib), else ``""``."""
    close = difflib.get_close_matches(str(word), sorted(choices), n=3, cutoff=0.6)
    return f"did you mean {' or '.join(repr(prefix + c) for c in close)}? " if close else ""


def describe_type(hint: Any) -> str:
    """A type annotation in words: ``int | None`` -> ``"an integer or null"``."""
    if hint is Any:
        return "any value"
    if hint is type(None):
        return "null"
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_type(a) for a in typing.get_args(hint))
    if hint in _NUMBER_OF:
        return _NUMBER_OF[hint]
    if hint is dict or origin is dict or origin is collections.abc.Mapping:
        return "a mapping"
    if hint is list or origin is list:
        return "a list"
    if origin is collections.abc.Callable or hint is collections.abc.Callable:
        return "a callable"
    if dataclasses.is_dataclass(hint):
        return f"a mapping of {hint.__name__} fields"
    return getattr(hint, "__name__", str(hint))


def _matches(value: Any, hint: Any) -> bool:
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in typing.get_args(hint))
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is dict or origin is dict or origin is collections.abc.Mapping:
        return isinstance(value, Mapping)
    if hint is list or origin is list:
        return isinstance(value, list | tuple)
    if origin is collections.abc.Callable or hint is collections.abc.Callable:
        return callable(value)
    if dataclasses.is_dataclass(hint):
        return isinstance(value, hint | Mapping)
    return isinstance(value, hint) if isinstance(hint, type) else True


def _dataclass_in(hint: Any) -> type | None:
    """The dataclass a (possibly optional) annotation names, if any."""
    if dataclasses.is_dataclass(hint):
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        found = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
        return found[0] if len(found) == 1 else None
    return None


def _coerce(value: Any, hint: Any, where: str, env: str) -> Any:
    """Check `value` against `hint`; a mapping given for a dataclass field is built into it."""
    if not _matches(value, hint):
        raise ValueError(
            f"{where}={value!r}: must be {describe_type(hint)} (got {type(value).__name__})"
        )
    cls = _dataclass_in(hint)
    if cls is not None and isinstance(value, Mapping):
        return config_from_options(cls, value, where, env=env)
    return value


def option_fields(config_cls: type) -> list[dataclasses.Field]:
    """The fields of an options dataclass that options may set (init fields), in order."""
    return [f for f in dataclasses.fields(config_cls) if f.init]


def config_from_options(
    config_cls: type, options: Mapping[str, Any], where: str, *, env: str | None = None
) -> Any:
    """Build ``config_cls(**options)`` after checking keys and types; errors name the field path.

    Args:
        config_cls: the options dataclass (the schema).
        options: the options mapping (an EnvSpec's ``options``, a factory's keyword options).
        where: the field-path prefix of the options (``"hanoi"``, ``"EnvSpec.options"``).
        env: the environment's registered name, for the messages (default: `where`).

    Raises:
        ValueError: ``"<where>.<key>: unknown option of environment 'hanoi' (not a field of
            HanoiConfig); did you mean 'horizon'? allowed options: [...]"``, a missing required
            option, ``"<where>.<key>=<value>: must be an integer (got str)"``, or what the
            dataclass's ``__post_init__`` rejects with its prefix replaced by `where`.
    """
    env = env or where
    if not isinstance(options, Mapping):
        raise ValueError(
            f"{where}={options!r}: give a mapping of {config_cls.__name__} fields "
            f"(options of environment {env!r})"
        )
    fields = option_fields(config_cls)
    names = [f.name for f in fields]
    for key in options:
        if key not in names:
            raise ValueError(
                f"{where}.{key}: unknown option of environment {env!r} (not a field of "
                f"{config_cls.__name__}); {did_you_mean(key, names)}allowed options: "
                f"{sorted(names)}"
            )
    for f in fields:
        if _is_required(f) and f.name not in options:
            raise ValueError(
                f"{where}.{f.name}: required option of environment {env!r} is missing "
                f"({config_cls.__name__} fields: {sorted(names)})"
            )
    hints = typing.get_type_hints(config_cls)
    values = {k: _coerce(v, hints[k], f"{where}.{k}", env) for k, v in options.items()}
    try:
        return config_cls(**values)
    except ValueError as e:
        raise ValueError(
            rename_prefix(str(e), getattr(config_cls, "CONFIG_SECTION", None), where)
        ) from None


def field_docs(config_cls: type) -> dict[str, str]:
    """Field name -> its description in the ``Fields:`` section of the class docstring, or of a
    base class's for inherited fields (a field line ``name: text`` indented one level,
    continuation lines deeper; a blank line ends the section)."""
    out: dict[str, str] = {}
    for cls in reversed(config_cls.__mro__):
        if dataclasses.is_dataclass(cls):
            out.update(_own_field_docs(cls))
    return out


def _own_field_docs(config_cls: type) -> dict[str, str]:
    out: dict[str, str] = {}
    current, in_fields = None, False
    for line in inspect.cleandoc(config_cls.__dict__.get("__doc__") or "").splitlines():
        if line.strip() == "Fields:":
            in_fields = True
            continue
        if not in_fields:
            continue
        if not line.strip():
            if out:
                break
            continue
        m = re.match(r"^ {4}(\w+): (.*)$", line)
        if m and m.group(1) in config_cls.__dataclass_fields__:
            current = m.group(1)
            out[current] = m.group(2).strip()
        elif current is not None and line.startswith(" " * 5):
            out[current] += " " + line.strip()
    return out


def _is_required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _default_text(f: dataclasses.Field) -> str:
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, str) else str(value)


def options_table(config_cls: type, fixed: Mapping[str, Any] = ()) -> str:
    """A markdown table of the options (name, type, default, meaning from the docstring);
    fields in `fixed` (set by the environment itself) are left out."""
    docs = field_docs(config_cls)
    hints = typing.get_type_hints(config_cls)
    rows = ["| option | type | default | meaning |", "|---|---|---|---|"]
    for f in option_fields(config_cls):
        if f.name in dict(fixed):
            continue
        meaning = docs.get(f.name, "").replace("|", "\\|")
        kind = describe_type(hints[f.name])
        default = "required" if _is_required(f) else f"`{_default_text(f)}`"
        rows.append(f"| `{f.name}` | {kind} | {default} | {meaning} |")
    return "\n".join(rows)
