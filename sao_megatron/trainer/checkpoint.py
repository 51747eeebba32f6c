"""Atomic, validated training checkpoints: Megatron dist_checkpointing parts plus common state.

One training step is one directory ``step_{N:08d}/`` under ``CheckpointConfig.save_dir``::

    step_00000012/
      policy/              Megatron dist_checkpointing (torch_dist) save of one sharded state dict
      value/               ... one folder per named part passed to `CheckpointManager.save`
      policy_optimizer/
      common/state.pt      train_step, policy_version, data cursor, buffer state, extra (rank 0)
      rng/rank_00000.pt    python/numpy/torch/CUDA/Megatron-tracker RNG state, one file per rank
      config.yaml          the run config (optional)
      tokenizer/           tokenizer files copied verbatim (optional)
      manifest.json        written LAST: every file with its size (+ sha256 for small files)
    latest                 text file naming the newest complete step directory

Save protocol (all ranks): write into ``step_N.tmp-<uuid>/``; barrier; rank 0 fsyncs every file,
writes ``manifest.json`` (temp file + ``os.replace``), renames the folder to ``step_N/``, replaces
``latest`` atomically (temp file + ``os.replace``) and only then prunes to ``keep_last_k``;
barrier. A crash at any point leaves ``latest`` on the previous complete step.

Load protocol: resolve ``latest`` or a path; validate the manifest (missing folder, missing
manifest = partial save, size/sha256 mismatch = corrupted) and check every requested sharded key
and global shape against the checkpoint metadata of every part, all BEFORE the first tensor is
read. Only then does dist_checkpointing read the tensors (resharding model weights to the current
TP/PP/EP layout). Which layout changes keep the optimiser state: docs/CHECKPOINTS.md.

Files hold pickles (``torch.load(weights_only=False)``): load only checkpoints you trust.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
import uuid
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest"
FORMAT_NAME = "sao_megatron.checkpoint"
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d{8})$")
_TMP_RE = re.compile(r"^step_\d{8}\.tmp-[0-9a-f]+$")
_PART_RE = re.compile(r"^[A-Za-z0-9_]+$")
_RESERVED_PARTS = {"common", "rng", "tokenizer"}


class CheckpointError(RuntimeError):
    """A checkpoint is missing, partial, corrupted or incompatible; the message names the path
    and the fix. Raised before any model or optimiser tensor is modified."""


@dataclass(kw_only=True)
class CheckpointConfig:
    """Where and how often checkpoints are written and from where a run resumes.

    Fields:
        save_dir: folder holding ``step_*/`` and ``latest`` (shared storage on clusters).
        save_interval: save every this many train steps (step % interval == 0); 0 = never
            periodically (the controller may still save at the end).
        keep_last_k: keep this many newest complete checkpoints (>= 1), or 0 to keep all.
        resume: "auto" (resume from ``latest`` in load_dir if there is one, else start fresh),
            "none" (always start fresh), or a path to a step folder or a folder with ``latest``
            (must exist).
        load_dir: folder searched by resume="auto"; None means save_dir.
        async_save: asynchronous saving is not implemented; must stay False.
        hash_max_bytes: files up to this size get a sha256 in the manifest (checked on load);
            larger files are checked by size only. 0 disables hashing.
    """

    save_dir: str = "checkpoints"
    save_interval: int = 0
    keep_last_k: int = 3
    resume: str = "auto"
    load_dir: str | None = None
    async_save: bool = False
    hash_max_bytes: int = 256 * 1024 * 1024

    def __post_init__(self) -> None:
        if not isinstance(self.save_dir, str) or not self.save_dir:
            raise ValueError(f"checkpoint.save_dir={self.save_dir!r}: must be a non-empty path")
        if self.save_interval < 0:
            raise ValueError(
                f"checkpoint.save_interval={self.save_interval}: must be >= 0 (0 = no periodic "
                "saves)"
            )
        if self.keep_last_k < 0:
            raise ValueError(
                f"checkpoint.keep_last_k={self.keep_last_k}: must be >= 1, or 0 to keep all"
            )
        if not isinstance(self.resume, str) or not self.resume:
            raise ValueError(
                f"checkpoint.resume={self.resume!r}: use 'auto', 'none' or a checkpoint path"
            )
        if self.async_save:
            raise ValueError(
                "checkpoint.async_save=True: asynchronous saving is not implemented; set "
                "checkpoint.async_save=false"
            )
        if self.hash_max_bytes < 0:
            raise ValueError(f"checkpoint.hash_max_bytes={self.hash_max_bytes}: must be >= 0")


@dataclass(kw_only=True)
class CommonState:
    """Non-tensor training state saved by rank 0 (RNG is saved per rank, separately).

    Fields:
        train_step: number of completed train steps.
        policy_version: weight version last published to the rollout engine.
        data_cursor: task/data iterator position (e.g. {"epoch": 1, "index": 40, "seed": 3}).
        buffer_state: trajectory buffer contents/counters (any picklable object).
        extra: free-form picklable dict (stage name, best metric, ...).
    """

    train_step: int
    policy_version: int = 0
    data_cursor: dict[str, Any] = field(default_factory=dict)
    buffer_state: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class LoadResult:
    """What `CheckpointManager.load` read.

    Fields:
        path: the step folder that was loaded.
        state_dicts: part name -> state dict returned by ``dist_checkpointing.load`` (tensors are
            already copied into the ShardedTensors' ``data``, i.e. into the model parameters for a
            model's ``sharded_state_dict()``; optimisers still need ``load_state_dict``).
        skipped_parts: optional parts not loaded because the checkpoint does not hold the
            requested keys/shapes (layout change), with the reason; the caller restarts them.
        common: the common state.
        manifest: the parsed manifest.json.
        rng_restored: True when this rank's RNG state was restored.
    """

    path: Path
    state_dicts: dict[str, Any]
    skipped_parts: dict[str, str]
    common: CommonState
    manifest: dict[str, Any]
    rng_restored: bool


# ---------------------------------------------------------------- RNG -----------------------------
def _megatron_rng_tracker():
    """Megatron's model-parallel RNG tracker (dropout etc. in TP regions) if initialised."""
    try:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    except ImportError:
        return None
    tracker = get_cuda_rng_tracker()
    return tracker if tracker.is_initialized() else None


def capture_rng_state() -> dict[str, Any]:
    """This process's python, numpy, torch CPU, CUDA (if initialised) and Megatron
    model-parallel tracker (if initialised) RNG states."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    tracker = _megatron_rng_tracker()
    if tracker is not None:
        state["megatron_tracker"] = {k: v.clone() for k, v in tracker.get_states().items()}
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Restore states made by `capture_rng_state` (CUDA and the Megatron tracker only when both
    sides have them)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["torch_cuda"])
    tracker = _megatron_rng_tracker()
    if "megatron_tracker" in state and tracker is not None:
        tracker.set_states({k: v.clone() for k, v in state["megatron_tracker"].items()})


# ---------------------------------------------------------------- dist helpers --------------------
def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _barrier() -> None:
    if _world() > 1:
        dist.barrier()


def _from_rank0(obj: Any) -> Any:
    """Broadcast a picklable object from rank 0 (identity on one process)."""
    if _world() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _require_dist(what: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{what} needs torch.distributed initialised (Megatron dist_checkpointing); call "
            "torch.distributed.init_process_group first (a 1-rank gloo group is enough)"
        )


# ---------------------------------------------------------------- file helpers --------------------
def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    _fsync_file(path)  # directories can be opened read-only and fsynced on POSIX


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_and_list(root: Path) -> dict[str, int]:
    """fsync every file under root; return {relative posix path: size}."""
    out = {}
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        _fsync_file(f)
        out[f.relative_to(root).as_posix()] = f.stat().st_size
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _summary(problems: list[str], limit: int = 5) -> str:
    more = f"; ... {len(problems) - limit} more" if len(problems) > limit else ""
    return "; ".join(problems[:limit]) + more


def _config_to_yaml(config: Any) -> str:
    from omegaconf import OmegaConf

    if isinstance(config, str):
        return config
    if is_dataclass(config) and not isinstance(config, type):
        return OmegaConf.to_yaml(OmegaConf.structured(config))
    return OmegaConf.to_yaml(OmegaConf.create(config))


def step_dir_name(train_step: int) -> str:
    """``step_{N:08d}``: the folder name of train step N."""
    return f"step_{train_step:08d}"


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete-looking step folders (name matches ``step_NNNNNNNN``) under root, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_RE.match(p.name))]
    return sorted(found)


def stale_tmp_dirs(root: str | os.PathLike) -> list[Path]:
    """Leftover ``step_N.tmp-<uuid>`` folders of interrupted saves (never loaded)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _TMP_RE.match(p.name))


def find_latest(root: str | os.PathLike) -> Path | None:
    """The step folder named by ``root/latest``, or None when there is no ``latest`` file.

    Raises:
        CheckpointError: ``latest`` exists but names a folder that is not there.
    """
    pointer = Path(root) / LATEST_NAME
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    path = Path(root) / name
    if not _STEP_RE.match(name) or not path.is_dir():
        raise CheckpointError(
            f"{pointer} names '{name}', which is not a step folder under {root}; point it at a "
            f"complete step_NNNNNNNN folder (ls {root}) or set checkpoint.resume=none"
        )
    return path


def validate_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Check a step folder against its manifest; return the parsed manifest.

    Checks: the folder exists, ``manifest.json`` exists and parses (absent = partial save), every
    listed file exists with the recorded size and, where recorded, sha256 (else corrupted), and
    every part has its dist_checkpointing ``metadata.json``. Reads no tensor.

    Raises:
        CheckpointError: naming the path, what is wrong and the fix.
    """
    path = Path(path)
    fix = "resume from an older step (checkpoint.resume=<path>) or start fresh (resume=none)"
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist; {fix}")
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        raise CheckpointError(
            f"checkpoint {path} is partial: {MANIFEST_NAME} is missing (the save was interrupted "
            f"before it completed); {fix}"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        parts = manifest["parts"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"checkpoint {path} is corrupted: unreadable manifest ({exc}); {fix}"
        ) from exc
    if manifest.get("format") != FORMAT_NAME or manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path}: manifest format {manifest.get('format')!r} v"
            f"{manifest.get('format_version')} is not {FORMAT_NAME} v{FORMAT_VERSION}; {fix}"
        )
    problems = []
    for rel, info in files.items():
        f = path / rel
        if not f.is_file():
            problems.append(f"{rel}: missing")
        elif f.stat().st_size != info["size"]:
            problems.append(f"{rel}: size {f.stat().st_size} != {info['size']} in manifest")
        elif info.get("sha256") and _sha256(f) != info["sha256"]:
            problems.append(f"{rel}: sha256 differs from the manifest")
    for part in parts:
        if f"{part}/metadata.json" not in files:
            problems.append(f"{part}/metadata.json: not in manifest")
    if problems:
        raise CheckpointError(f"checkpoint {path} is corrupted: {_summary(problems)}; {fix}")
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
    problems = []
    for key, (shape, allow_mismatch) in _requested_shards(sharded_state_dict).items():
        if key not in saved:
            problems.append(f"'{key}' not in checkpoint")
        elif shape is not None and not allow_mismatch:
            saved_shape = tuple(saved[key].global_shape)
            if saved_shape != shape:
                problems.append(
                    f"'{key}' global shape {list(saved_shape)} != requested {list(shape)}"
                )
    return problems


# ---------------------------------------------------------------- manager -------------------------
class CheckpointManager:
    """Saves and loads training steps per `CheckpointConfig` (see the module docstring).

    Every rank of the default process group must call `save` and `load` together (they contain
    collectives); torch.distributed must be initialised (a 1-rank gloo group is enough).
    """

    def __init__(self, config: CheckpointConfig) -> None:
        self.config = config
        self.save_dir = Path(config.save_dir)

    # ---- save ---------------------------------------------------------------------------------
    def should_save(self, train_step: int) -> bool:
        """True when ``save_interval > 0`` and train_step is a positive multiple of it."""
        interval = self.config.save_interval
        return interval > 0 and train_step > 0 and train_step % interval == 0

    def save(
        self,
        sharded_state_dicts: Mapping[str, Any],
        common: CommonState,
        *,
        layout: Mapping[str, int] | None = None,
        run_config: Any = None,
        tokenizer_files: Sequence[str | os.PathLike] = (),
    ) -> Path:
        """Write train step ``common.train_step`` atomically; return the final step folder.

        Args:
            sharded_state_dicts: part name ([A-Za-z0-9_]+) -> Megatron sharded state dict, e.g.
                {"policy": model.sharded_state_dict(),
                 "policy_optimizer": optimizer.sharded_state_dict(model_sd)}. Consumed: Megatron
                builds its factories in place, so pass freshly made dicts.
            common: step, policy_version, cursor, buffer and extra state (rank 0's is saved).
            layout: parallel sizes recorded in the manifest, e.g. {"tp": 2, "pp": 1, "ep": 1,
                "dp": 1}.
            run_config: dataclass, dict, OmegaConf object or YAML text -> ``config.yaml``.
            tokenizer_files: files copied into ``tokenizer/`` (rank 0).

        Raises:
            ValueError: bad part name. RuntimeError: torch.distributed not initialised.
        """
        _require_dist("CheckpointManager.save")
        from megatron.core import dist_checkpointing

        for name in sharded_state_dicts:
            if not _PART_RE.match(name) or name in _RESERVED_PARTS:
                raise ValueError(
                    f"checkpoint part name {name!r}: use letters, digits and '_' only, not one "
                    f"of {sorted(_RESERVED_PARTS)}"
                )
        step = int(common.train_step)
        final = self.save_dir / step_dir_name(step)
        tmp_name = f"{final.name}.tmp-{uuid.uuid4().hex}" if _rank() == 0 else None
        tmp = self.save_dir / _from_rank0(tmp_name)
        t0 = time.perf_counter()
        if _rank() == 0:
            tmp.mkdir(parents=True)
            (tmp / "rng").mkdir()
            for name in sharded_state_dicts:
                (tmp / name).mkdir()
        _barrier()
        for name, sharded in sharded_state_dicts.items():
            dist_checkpointing.save(sharded, str(tmp / name), sharded_strategy=("torch_dist", 1))
        torch.save(capture_rng_state(), tmp / "rng" / f"rank_{_rank():05d}.pt")
        if _rank() == 0:
            (tmp / "common").mkdir()
            torch.save(asdict(common), tmp / "common" / "state.pt")
            if run_config is not None:
                (tmp / "config.yaml").write_text(_config_to_yaml(run_config))
            if tokenizer_files:
                (tmp / "tokenizer").mkdir()
                for f in tokenizer_files:
                    shutil.copy2(f, tmp / "tokenizer" / Path(f).name)
        _barrier()
        seen = _fsync_and_list(tmp)  # each rank flushes what it sees (its own files at least)
        gathered = [seen]
        if _world() > 1:
            gathered = [None] * _world()
            dist.all_gather_object(gathered, seen)
        error = None
        if _rank() == 0:
            try:
                expected = {rel: size for g in gathered for rel, size in g.items()}
                self._finalize(tmp, final, step, list(sharded_state_dicts), layout, expected)
            except Exception as exc:  # every rank must learn about it, not hang in the barrier
                error = f"{type(exc).__name__}: {exc}"
        error = _from_rank0(error)
        if error is not None:
            raise CheckpointError(f"saving {final} failed on rank 0: {error}")
        logger.info("saved %s in %.2f s", final, time.perf_counter() - t0)
        return final

    def _finalize(
        self,
        tmp: Path,
        final: Path,
        step: int,
        parts: list[str],
        layout: Mapping | None,
        expected: Mapping[str, int],
    ) -> None:
        """Rank 0: wait until every file any rank wrote is visible, manifest, rename,
        ``latest``, prune (in that order)."""
        import megatron.core

        deadline = time.monotonic() + 60.0  # shared file systems may show other nodes' files late
        while True:
            mine = _fsync_and_list(tmp)
            missing = [r for r, size in expected.items() if mine.get(r) != size]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        if missing:
            raise CheckpointError(
                f"files written by other ranks are not visible from rank 0 after 60 s: "
                f"{_summary(missing)}; is {self.save_dir} on storage shared by all nodes?"
            )
        files = {}
        for rel, size in sorted(mine.items()):
            digest = _sha256(tmp / rel) if size <= self.config.hash_max_bytes else None
            files[rel] = {"size": size, "sha256": digest}
        for d in [tmp, *(p for p in tmp.rglob("*") if p.is_dir())]:
            _fsync_dir(d)
        manifest = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "train_step": step,
            "parts": parts,
            "world_size": _world(),
            "layout": dict(layout or {}),
            "megatron_core_version": megatron.core.__version__,
            "torch_version": torch.__version__,
            "created_unix": time.time(),
            "files": files,
        }
        _atomic_write_text(tmp / MANIFEST_NAME, json.dumps(manifest, indent=1))
        old = None
        if final.exists():  # re-saving a step (e.g. after a rollback): swap, then delete the old
            old = final.with_name(f"{final.name}.old-{uuid.uuid4().hex}")
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(self.save_dir)
        _atomic_write_text(self.save_dir / LATEST_NAME, final.name + "\n")
        if old is not None:
            shutil.rmtree(old)
        self._prune(keep=final)

    def _prune(self, keep: Path) -> None:
        """Delete stale tmp folders and all but the newest keep_last_k steps (keep included)."""
        for stale in stale_tmp_dirs(self.save_dir):
            logger.warning("removing %s left by an interrupted save", stale)
            shutil.rmtree(stale, ignore_errors=True)
        k = self.config.keep_last_k
        if k == 0:
            return
        others = [p for _, p in list_checkpoints(self.save_dir) if p != keep]
        for path in others[: max(len(others) - (k - 1), 0)]:
            shutil.rmtree(path)

    # ---- load ---------------------------------------------------------------------------------
    def resolve_resume(self) -> Path | None:
        """The step folder to resume from per ``config.resume``, or None to start fresh.

        Raises:
            CheckpointError: resume is a path that does not exist or holds no ``latest``.
        """
        resume = self.config.resume
        if resume == "none":
            return None
        if resume == "auto":
            root = Path(self.config.load_dir or self.config.save_dir)
            for stale in stale_tmp_dirs(root):
                if _rank() == 0:
                    warnings.warn(f"ignoring {stale}: left by an interrupted save", stacklevel=2)
            return find_latest(root)
        path = Path(resume)
        if path.is_dir() and _STEP_RE.match(path.name):
            return path
        latest = find_latest(path) if path.is_dir() else None
        if latest is None:
            raise CheckpointError(
                f"checkpoint.resume={resume}: not a step_NNNNNNNN folder nor a folder with a "
                "'latest' file; give an existing checkpoint path, 'auto' or 'none'"
            )
        return latest

    def load(
        self,
        path: str | os.PathLike,
        sharded_state_dicts: Mapping[str, Any],
        *,
        optional_parts: Sequence[str] = (),
        restore_rng: bool = True,
    ) -> LoadResult:
        """Validate, then load the named parts of a step folder into the given sharded dicts.

        Order: manifest validation on rank 0 (broadcast), then every part's keys and global
        shapes against its checkpoint metadata on every rank (gathered), then - only when all of
        that passed - dist_checkpointing reads the tensors. Parts in ``optional_parts`` that do
        not match (e.g. an optimiser after an EP change) are skipped and reported in
        ``LoadResult.skipped_parts`` with a warning; any other mismatch raises.

        Args:
            path: a step folder (use `resolve_resume` to pick it).
            sharded_state_dicts: part name -> sharded state dict of the *current* layout (for a
                Megatron optimiser: ``optimizer.sharded_state_dict(model_sd, is_loading=True)``).
            optional_parts: parts that may be skipped when incompatible.
            restore_rng: restore this rank's RNG state when the world size is unchanged.

        Raises:
            CheckpointError: missing/partial/corrupted checkpoint, a part not in it, or keys and
                shapes that do not match a required part - before any tensor is modified.
        """
        _require_dist("CheckpointManager.load")
        from megatron.core import dist_checkpointing

        path = Path(path)
        manifest, error = None, None
        if _rank() == 0:
            try:
                manifest = validate_checkpoint(path)
            except CheckpointError as exc:
                error = str(exc)
        manifest, error = _from_rank0((manifest, error))
        if error is not None:
            raise CheckpointError(error)
        missing = [p for p in sharded_state_dicts if p not in manifest["parts"]]
        if missing:
            raise CheckpointError(
                f"checkpoint {path} has no part(s) {missing} (it holds {manifest['parts']}); "
                "load only the parts it has or start that part fresh"
            )
        local = {n: check_part_compatible(sd, path / n) for n, sd in sharded_state_dicts.items()}
        gathered = [local]
        if _world() > 1:
            gathered = [None] * _world()
            dist.all_gather_object(gathered, local)
        skipped: dict[str, str] = {}
        for name in sharded_state_dicts:
            problems = [f"rank {r}: {p}" for r, g in enumerate(gathered) for p in g[name]]
            if not problems:
                continue
            reason = (
                f"layout {manifest.get('layout')} (world {manifest.get('world_size')}) -> "
                f"current does not match: {_summary(problems)}"
            )
            if name not in optional_parts:
                raise CheckpointError(
                    f"checkpoint {path}, part '{name}': {reason}. Nothing was loaded. Use the "
                    "saved layout, or list the part in optional_parts to restart it (see "
                    "docs/CHECKPOINTS.md)"
                )
            skipped[name] = reason
            if _rank() == 0:
                warnings.warn(f"not loading part '{name}' of {path}: {reason}", stacklevel=2)
        state_dicts = {
            name: dist_checkpointing.load(sd, str(path / name))
            for name, sd in sharded_state_dicts.items()
            if name not in skipped
        }
        common = CommonState(**torch.load(path / "common" / "state.pt", weights_only=False))
        rng_file = path / "rng" / f"rank_{_rank():05d}.pt"
        rng_restored = False
        if restore_rng and manifest["world_size"] == _world() and rng_file.is_file():
            restore_rng_state(torch.load(rng_file, weights_only=False))
            rng_restored = True
        elif restore_rng and _rank() == 0:
            warnings.warn(
                f"RNG states not restored: saved with world size {manifest['world_size']}, "
                f"now {_world()}; random draws will differ from the uninterrupted run",
                stacklevel=2,
            )
        return LoadResult(
            path=path,
            state_dicts=state_dicts,
            skipped_parts=skipped,
            common=common,
            manifest=manifest,
            rng_restored=rng_restored,
        )
