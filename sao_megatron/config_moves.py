"""Migration messages for config keys that moved or were removed.

A config dataclass lists its former fields in a ``MOVED_FIELDS`` class attribute (old field name
-> the fix, "moved to <new.dotted.key>" or "was removed: <why>"), next to the fields that replaced
them. `moved_key_message` finds the entry of a dotted key by walking the job schema, so that
`sao_megatron.configs.load_config` can answer an unknown key with its migration instead of
"unknown key".
"""

from __future__ import annotations

import dataclasses
import typing


def moved_key_message(schema: type, dotted_key: str) -> str | None:
    """The migration error text of `dotted_key` (e.g. "algorithm.eps_low") under `schema`, or
    None when the key never existed (a plain typo) or its section is not a dataclass."""
    *sections, leaf = dotted_key.split(".")
    cls = schema
    for name in sections:
        if not dataclasses.is_dataclass(cls):
            return None
        hints = typing.get_type_hints(cls)
        if name not in {f.name for f in dataclasses.fields(cls)}:
            return None
        cls = hints[name]
    fix = getattr(cls, "MOVED_FIELDS", {}).get(leaf) if dataclasses.is_dataclass(cls) else None
    return None if fix is None else f"config key {dotted_key!r} {fix}"
