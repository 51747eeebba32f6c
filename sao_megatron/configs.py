"""Load job configs: YAML files fill component dataclasses (OmegaConf structured configs).

Every component owns a small ``@dataclass(kw_only=True)`` validated in ``__post_init__``; a job
config only composes them. This module turns ``CONFIG.yaml`` plus dotted CLI overrides
(``algorithm.value_updates_per_policy_update=2``) into that typed object, and turns OmegaConf's
errors into messages that name the field and the fix: an unknown key gets the closest field
names (difflib), a moved or removed key (a class's ``MOVED_FIELDS``) says where it went, and a
value a reused component rejects is reported under the section it sits in (``sft.optim.lr``, not the
component's generic ``optimizer.lr``; see ``CONFIG_SECTION``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from sao_megatron.plugins import import_plugins

T = TypeVar("T")

# The dotted keys the YAML file and the overrides of the config being built set (leaves only),
# for a component's __post_init__ that must tell a value the user wrote from the dataclass
# default it equals (`explicit_fields`); None outside `load_config`.
_EXPLICIT_KEYS: contextvars.ContextVar[frozenset[str] | None] = contextvars.ContextVar(
    "sao_config_explicit_keys", default=None
)


def explicit_fields(section: str) -> set[str] | None:
    """The fields of ``section`` (e.g. ``"model"``) that the YAML file or an override of the
    config being loaded sets, whatever their value (a value equal to the dataclass default
    counts); None when the config is not being built by `load_config` (a dataclass made in
    Python: the caller cannot tell and must fall back on its own rule)."""
    keys = _EXPLICIT_KEYS.get()
    if keys is None:
        return None
    prefix = section + "."
    return {k[len(prefix) :].split(".")[0] for k in keys if k.startswith(prefix)}


def _leaf_keys(node: Any, path: str = "") -> Iterator[str]:
    """Dotted paths of the leaves of a parsed YAML/dotlist layer (a mapping value that is a
    list or scalar is a leaf)."""
    if isinstance(node, DictConfig):
        for k in node:
            child = node._get_node(k)
            sub = f"{path}.{k}" if path else str(k)
            if isinstance(child, DictConfig):
                yield from _leaf_keys(child, sub)
            else:
                yield sub


@contextlib.contextmanager
def _explicit_keys(layers: list[DictConfig]) -> Iterator[None]:
    token = _EXPLICIT_KEYS.set(frozenset(k for layer in layers for k in _leaf_keys(layer)))
    try:
        yield
    finally:
        _EXPLICIT_KEYS.reset(token)


def load_config(schema: type[T], path: str | Path | None, overrides: list[str] = ()) -> T:
    """Build ``schema`` from a YAML file and ``key.sub=value`` overrides.

    Args:
        schema: a dataclass type (the job config).
        path: YAML file, or None to start from the dataclass defaults.
        overrides: dotted overrides applied after the file, in order.

    Raises:
        FileNotFoundError: the YAML file does not exist.
        ValueError: unknown key, wrong type, or a value a component's ``__post_init__`` rejects;
            the message names the dotted field. A ``plugins`` list (a top-level field of the
            schema) is imported before the sections are validated
            (`sao_megatron.plugins.PluginError` when one cannot be).
    """
    base = OmegaConf.structured(schema)
    _reset_derived_fields(base)
    layers = []
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"config file {p} does not exist")
        layers.append(OmegaConf.load(p))
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ValueError(f"overrides must look like section.field=value, got {bad}")
    layers.append(OmegaConf.from_dotlist(list(overrides)))
    try:
        merged = OmegaConf.merge(base, *layers)
    except ConfigKeyError as e:
        raise ValueError(_unknown_key_message(e.object_type, e.key, e.full_key)) from None
    except ValidationError as e:
        raise ValueError(f"config field {e.full_key!r}: {e.msg.splitlines()[0]}") from None
    except OmegaConfBaseException as e:  # pragma: no cover - other OmegaConf failures
        raise ValueError(f"config error: {e}") from None
    if "plugins" in merged:  # registers the algorithms/environments the sections name
        import_plugins(merged.plugins)
    try:
        with _explicit_keys(layers):
            return OmegaConf.to_object(merged)  # runs each dataclass's __post_init__
    except ValueError as e:
        raise ValueError(_in_section(merged, str(e))) from None


def _unknown_key_message(owner: Any, key: Any, full_key: str) -> str:
    """'unknown config key 'rl.stpes': did you mean 'rl.steps'?' (difflib over the owner's
    fields), or the migration of a key the owner lists in ``MOVED_FIELDS`` (old field -> "moved to
    <new.key>" or "was removed: <why>")."""
    name = getattr(owner, "__name__", "the config dataclass")
    moved = getattr(owner, "MOVED_FIELDS", {})
    if key in moved:
        return f"config key {full_key!r} {moved[key]}"
    prefix = full_key[: -len(str(key))] if full_key.endswith(str(key)) else ""
    fields = [f.name for f in dataclasses.fields(owner)] if dataclasses.is_dataclass(owner) else []
    close = difflib.get_close_matches(str(key), fields, n=3, cutoff=0.6)
    hint = (
        "did you mean " + " or ".join(repr(prefix + c) for c in close) + "?"
        if close
        else "check the spelling against `sao-train --help`"
    )
    return f"unknown config key {full_key!r}: not a field of {name}; {hint}"


def _in_section(merged: DictConfig, message: str) -> str:
    """Rename a reused component's generic section in a validation message to where it sits.

    A class used in several sections (``OptimizerConfig`` in ``policy_optim``, ``value_optim``
    and ``sft.optim``) names its fields with a generic prefix, its ``CONFIG_SECTION``
    ("optimizer"). The failing section is the deepest node whose ``__post_init__`` raises; its
    dotted path replaces the generic prefix.
    """
    found = _failing_node(merged, "")
    if found is None:
        return message
    path, cls = found
    generic = getattr(cls, "CONFIG_SECTION", None)
    if not generic or not path or path == generic:
        return message
    return message.replace(f"{generic}.", f"{path}.")


def _failing_node(node: Any, path: str) -> tuple[str, type] | None:
    """(dotted path, dataclass) of the deepest dataclass node below ``node`` whose
    instantiation raises ValueError, or None if ``node`` instantiates."""
    try:
        OmegaConf.to_object(node)
        return None
    except ValueError:
        pass
    if isinstance(node, DictConfig):
        children = [(str(k), f"{path}.{k}" if path else str(k)) for k in node]
    elif isinstance(node, ListConfig):
        children = [(i, f"{path}[{i}]") for i in range(len(node))]
    else:
        children = []
    for key, child_path in children:
        child = node._get_node(key) if isinstance(node, DictConfig) else node[key]
        if isinstance(child, DictConfig | ListConfig) and not OmegaConf.is_missing(node, key):
            found = _failing_node(child, child_path)
            if found is not None:
                return found
    cls = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
    return (path, cls) if cls is not None and dataclasses.is_dataclass(cls) else None


def _reset_derived_fields(node: Any) -> None:
    """Put fields that ``__post_init__`` derives back to their unset default in the base.

    A config class lists such fields in a ``DERIVED_FIELDS`` class attribute (e.g.
    ``ParallelConfig.expert_tp``, derived from ``tp`` when None). Building the structured base
    runs ``__post_init__`` on the default instances, which would freeze the derived value
    (expert_tp=1) before a YAML file or override changes what it derives from (tp=2). Resetting
    them lets ``to_object`` derive them again from the final values.
    """
    if not isinstance(node, DictConfig):
        return
    cls = OmegaConf.get_type(node)
    if cls is not None and dataclasses.is_dataclass(cls):
        by_name = {f.name: f for f in dataclasses.fields(cls)}
        for name in getattr(cls, "DERIVED_FIELDS", ()):
            f = by_name[name]
            node[name] = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    for key in node:
        if OmegaConf.is_missing(node, key):
            continue
        _reset_derived_fields(node._get_node(key))


def to_yaml(config: Any) -> str:
    """Serialise a (nested) config dataclass to YAML, e.g. for checkpoints and run dirs."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def describe(schema: type) -> list[tuple[str, str]]:
    """(dotted field, default) for every leaf field of a config dataclass, for ``--help``.

    Defaults are those of the job (nested factories included), not of each section's class.
    A field the schema derives from others when the config leaves it out (its
    ``DERIVED_DEFAULTS``: dotted field -> rule, e.g. ``JobConfig``'s ``"parallel.seed": "1234 +
    seed"``) shows its rule instead: ``"1234 + seed (derived unless set)"``.
    """
    base = OmegaConf.structured(schema)
    _reset_derived_fields(base)
    rows: list[tuple[str, str]] = []

    def walk(node: Any, prefix: str) -> None:
        for key in node:
            value = node._get_node(key)
            name = f"{prefix}{key}"
            if isinstance(value, DictConfig) and OmegaConf.get_type(value) not in (dict, None):
                walk(value, name + ".")
            else:
                rows.append(
                    (
                        name,
                        repr(
                            OmegaConf.to_container(value)
                            if OmegaConf.is_config(value)
                            else value._value()
                        ),
                    )
                )

    walk(base, "")
    derived = getattr(schema, "DERIVED_DEFAULTS", {})
    return [(n, f"{derived[n]} (derived unless set)" if n in derived else d) for n, d in rows]
