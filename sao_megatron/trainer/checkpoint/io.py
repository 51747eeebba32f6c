"""Durable file writes for checkpoints: fsync of files and folders, atomic text replace, sha256."""

from __future__ import annotations

import hashlib
import os
import uuid
from dataclasses import is_dataclass
from pathlib import Path
from typing import Any


def fsync_file(path: Path) -> None:
    """Flush one file's data to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (renames, new files) to stable storage (POSIX)."""
    fsync_file(path)  # directories can be opened read-only and fsynced on POSIX


def atomic_write_text(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` all at once: temp file, fsync, ``os.replace``, fsync folder."""
    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_and_list(root: Path) -> dict[str, int]:
    """fsync every file under root; return {relative posix path: size in bytes}."""
    out = {}
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        fsync_file(f)
        out[f.relative_to(root).as_posix()] = f.stat().st_size
    return out


def sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes (read in 1 MiB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def config_to_yaml(config: Any) -> str:
    """YAML text of a run config: a dataclass, a dict, an OmegaConf object, or YAML text."""
    from omegaconf import OmegaConf

    if isinstance(config, str):
        return config
    if is_dataclass(config) and not isinstance(config, type):
        return OmegaConf.to_yaml(OmegaConf.structured(config))
    return OmegaConf.to_yaml(OmegaConf.create(config))
