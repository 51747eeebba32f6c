"""The on-disk layout of checkpoints: step folders, ``latest``, ``manifest.json`` (write and
validate), finding the step to resume from, and checking a sharded state dict against a part.

Reads no tensor: everything here looks at names, sizes, hashes and dist_checkpointing metadata.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from sao_megatron.trainer.checkpoint import io
from sao_megatron.trainer.checkpoint.errors import CheckpointError

MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest"
FORMAT_NAME = "sao_megatron.checkpoint"
FORMAT_VERSION = 1
STEP_RE = re.compile(r"^step_(\d{8})$")
TMP_RE = re.compile(r"^step_(\d{8})\.tmp-[0-9a-f]+$")
_FIX = "resume from an older step (checkpoint.resume=<path>) or start fresh (resume=none)"


def step_dir_name(train_step: int) -> str:
    """``step_{N:08d}``: the folder name of train step N."""
    return f"step_{train_step:08d}"


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, folder) of every folder named ``step_NNNNNNNN`` under root, oldest first (a name
    match only: see `is_complete` and `validate_checkpoint`)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_RE.match(p.name))]
    return sorted(found)


def stale_tmp_dirs(root: str | os.PathLike) -> list[Path]:
    """Leftover ``step_N.tmp-<uuid>`` folders of interrupted saves (never loaded)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and TMP_RE.match(p.name))


def tmp_dir_step(path: Path) -> int:
    """The train step of a ``step_N.tmp-<uuid>`` folder."""
    m = TMP_RE.match(path.name)
    assert m is not None, path
    return int(m.group(1))


def find_latest(root: str | os.PathLike) -> Path | None:
    """The step folder named by ``root/latest``, or None when there is no ``latest`` file.

    Raises:
        CheckpointError: ``latest`` exists but does not name a step folder that is there.
    """
    pointer = Path(root) / LATEST_NAME
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    path = Path(root) / name
    if not STEP_RE.match(name) or not path.is_dir():
        raise CheckpointError(
            f"{pointer} names '{name}', which is not a step folder under {root}; point it at a "
            f"complete step_NNNNNNNN folder (ls {root}) or set checkpoint.resume=none"
        )
    return path


def is_complete(path: Path) -> bool:
    """True when ``path`` holds a parseable manifest of this format (cheap: hashes are checked
    by `validate_checkpoint` when loading)."""
    try:
        manifest = json.loads((path / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(manifest, dict)
        and manifest.get("format") == FORMAT_NAME
        and manifest.get("format_version") == FORMAT_VERSION
        and "files" in manifest
    )


def find_resume_point(root: str | os.PathLike) -> tuple[Path | None, str | None]:
    """The step folder a run in ``root`` resumes from, and a warning to show (or None).

    ``latest`` decides when it names a step folder. When it is missing or garbled (it does not
    name an existing step folder) but step folders exist, the newest one is used if it is
    complete, with a warning; if the newest step folder is not complete, which one to resume
    from is ambiguous and this raises. No step folder and no ``latest``: (None, None), a fresh
    start.

    Raises:
        CheckpointError: ``latest`` garbled and no step folder; or no usable ``latest`` and the
            newest step folder is not complete (the message lists the candidates and the fix).
    """
    root = Path(root)
    steps = [p for _, p in list_checkpoints(root)]
    try:
        latest = find_latest(root)
    except CheckpointError:
        if not steps:
            raise
        name = (root / LATEST_NAME).read_text().strip()
        problem = f"{root / LATEST_NAME} names '{name}', which is not a step folder"
    else:
        if latest is not None:
            return latest, None
        if not steps:
            return None, None
        problem = f"{root / LATEST_NAME} is missing"
    complete = [p for p in steps if is_complete(p)]
    if complete and complete[-1] == steps[-1]:
        return complete[-1], (
            f"{problem}; resuming from the newest complete step folder {complete[-1]} (set "
            f"checkpoint.resume=<path> to choose another, or checkpoint.resume=none)"
        )
    older = f"; the newest complete one is {complete[-1].name}" if complete else ""
    raise CheckpointError(
        f"{problem}, and the newest step folder {steps[-1]} has no valid {MANIFEST_NAME} (not "
        f"a complete save){older}: set checkpoint.resume=<step folder> to choose one, or "
        "checkpoint.resume=none to start fresh"
    )


def build_manifest(
    root: Path,
    sizes: Mapping[str, int],
    *,
    train_step: int,
    parts: list[str],
    world_size: int,
    layout: Mapping[str, int] | None,
    hash_max_bytes: int,
) -> dict[str, Any]:
    """The manifest of the files under ``root``: each file's size, plus sha256 for files up to
    ``hash_max_bytes``; format, step, parts, world size, layout and library versions."""
    import megatron.core

    files = {}
    for rel, size in sorted(sizes.items()):
        digest = io.sha256(root / rel) if size <= hash_max_bytes else None
        files[rel] = {"size": size, "sha256": digest}
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "train_step": train_step,
        "parts": parts,
        "world_size": world_size,
        "layout": dict(layout or {}),
        "megatron_core_version": megatron.core.__version__,
        "torch_version": torch.__version__,
        "created_unix": time.time(),
        "files": files,
    }


def summary(problems: list[str], limit: int = 5) -> str:
    """The first ``limit`` problems joined by '; ' and how many more there are."""
    more = f"; ... {len(problems) - limit} more" if len(problems) > limit else ""
    return "; ".join(problems[:limit]) + more


def validate_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Check a step folder against its manifest; return the parsed manifest.

    Checks: the folder exists, ``manifest.json`` exists and parses (absent = partial save), every
    listed file exists with the recorded size and, where recorded, sha256 (else corrupted), and
    every part has its dist_checkpointing ``metadata.json``. Reads no tensor.

    Raises:
        CheckpointError: naming the path, what is wrong and the fix.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist; {_FIX}")
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        raise CheckpointError(
            f"checkpoint {path} is partial: {MANIFEST_NAME} is missing (the save was interrupted "
            f"before it completed); {_FIX}"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        parts = manifest["parts"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"checkpoint {path} is corrupted: unreadable manifest ({exc}); {_FIX}"
        ) from exc
    if manifest.get("format") != FORMAT_NAME or manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path}: manifest format {manifest.get('format')!r} v"
            f"{manifest.get('format_version')} is not {FORMAT_NAME} v{FORMAT_VERSION}; {_FIX}"
        )
    problems = []
    for rel, info in files.items():
        f = path / rel
        if not f.is_file():
            problems.append(f"{rel}: missing")
        elif f.stat().st_size != info["size"]:
            problems.append(f"{rel}: size {f.stat().st_size} != {info['size']} in manifest")
        elif info.get("sha256") and io.sha256(f) != info["sha256"]:
            problems.append(f"{rel}: sha256 differs from the manifest")
    for part in parts:
        if f"{part}/metadata.json" not in files:
            problems.append(f"{part}/metadata.json: not in manifest")
    if problems:
        raise CheckpointError(f"checkpoint {path} is corrupted: {summary(problems)}; {_FIX}")
    return manifest


def _requested_shards(sharded_state_dict: Any) -> dict[str, tuple[tuple[int, ...] | None, bool]]:
    """unique key -> (global shape or None for objects, allow_shape_mismatch), without side
    effects on the caller's dict (factories are built on a structural copy)."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_outplace, nested_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
    )

    copy = dict_list_map_outplace(lambda x: x, sharded_state_dict)
    for _ in range(4):  # factories may build factories; Megatron nests at most once
        if not any(isinstance(v, ShardedTensorFactory) for v in nested_values(copy)):
            break
        copy = dict_list_map_outplace(
            lambda x: x.build() if isinstance(x, ShardedTensorFactory) else x, copy
        )
    out: dict[str, tuple[tuple[int, ...] | None, bool]] = {}
    for v in nested_values(copy):
        if isinstance(v, ShardedTensor):
            out[v.key] = (tuple(v.global_shape), bool(v.allow_shape_mismatch))
        elif isinstance(v, ShardedObject):
            out[v.unique_key] = (None, False)
    return out


def check_part_compatible(sharded_state_dict: Any, part_dir: str | os.PathLike) -> list[str]:
    """Differences between what this rank asks for and what a saved part holds (reads metadata
    only). Empty list = loadable. Each entry names a key: missing, or global shape differs."""
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    saved = load_sharded_metadata(str(part_dir))
    problems, missing = [], []
    for key, (shape, allow_mismatch) in _requested_shards(sharded_state_dict).items():
        if key not in saved:
            missing.append(key)
            problems.append(f"'{key}' not in checkpoint")
        elif shape is not None and not allow_mismatch:
            saved_shape = tuple(saved[key].global_shape)
            if saved_shape != shape:
                problems.append(
                    f"'{key}' global shape {list(saved_shape)} != requested {list(shape)}"
                )
    if (
        missing
        and len(missing) == len(problems)
        and all(k.startswith(_MOMENTS) for k in missing)
        and not any(k.startswith(_MOMENTS) for k in saved)
    ):
        return [f"{UNSTEPPED}: it holds none of the {len(missing)} requested '{_MOMENTS}*' keys"]
    return problems


_MOMENTS = "optimizer.state."
UNSTEPPED = "saved before the optimiser's first step"
"""Prefix of `check_part_compatible`'s one problem for an optimiser part saved before any step
(Adam had no moment estimates yet): restarting it fresh restores it exactly, so a loader may
treat it as expected rather than as a layout change."""
