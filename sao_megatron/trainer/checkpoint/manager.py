"""`CheckpointManager`: the save, resume and load protocols over step folders (package docstring).

Every rank of the default process group calls `save` and `load` together (they contain
collectives); torch.distributed must be initialised (a 1-rank gloo group is enough).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from sao_megatron.trainer.checkpoint import collectives as coll
from sao_megatron.trainer.checkpoint import io
from sao_megatron.trainer.checkpoint.config import CheckpointConfig
from sao_megatron.trainer.checkpoint.errors import CheckpointError
from sao_megatron.trainer.checkpoint.manifest import (
    LATEST_NAME,
    MANIFEST_NAME,
    STEP_RE,
    UNSTEPPED,
    build_manifest,
    check_part_compatible,
    find_resume_point,
    list_checkpoints,
    stale_tmp_dirs,
    step_dir_name,
    summary,
    tmp_dir_step,
    validate_checkpoint,
)
from sao_megatron.trainer.checkpoint.rng import capture_rng_state, restore_rng_state
from sao_megatron.trainer.checkpoint.state import CommonState, Stateful

# a child of the job's logger (sao_megatron.trainer): what resuming decides is in the job log,
# also under PYTHONWARNINGS=ignore (warnings.warn is not)
logger = logging.getLogger(__name__)

_PART_RE = re.compile(r"^[A-Za-z0-9_]+$")
_RESERVED_PARTS = {"common", "rng", "tokenizer"}
_VISIBLE_TIMEOUT_S = 60.0  # shared file systems may show other nodes' files late


@dataclass(kw_only=True)
class LoadResult:
    """What `CheckpointManager.load` read.

    Fields:
        path: the step folder that was loaded.
        state_dicts: part name -> state dict returned by ``dist_checkpointing.load`` (tensors are
            already copied into the ShardedTensors' ``data``, i.e. into the model parameters for a
            model's ``sharded_state_dict()``; optimisers still need ``load_state_dict``).
        skipped_parts: optional parts (or Stateful names) not loaded, with the reason: the
            checkpoint does not hold the requested keys/shapes (layout change) or the name.
        common: the common state.
        states: every Stateful name saved in the checkpoint -> its saved state dict (the objects
            passed to `load` already had ``load_state_dict`` called with theirs).
        manifest: the parsed manifest.json.
        rng_restored: True when this rank's RNG state was restored.
    """

    path: Path
    state_dicts: dict[str, Any]
    skipped_parts: dict[str, str]
    common: CommonState
    states: dict[str, Any] = field(default_factory=dict)
    manifest: dict[str, Any]
    rng_restored: bool


class CheckpointManager:
    """Saves and loads training steps per `CheckpointConfig` (see the package docstring)."""

    def __init__(self, config: CheckpointConfig) -> None:
        self.config = config
        self.save_dir = Path(config.save_dir)
        self._warned_newer: set[Path] = set()

    # ---- save ---------------------------------------------------------------------------------
    def should_save(self, train_step: int) -> bool:
        """True when ``save_interval > 0`` and train_step is a positive multiple of it."""
        interval = self.config.save_interval
        return interval > 0 and train_step > 0 and train_step % interval == 0

    def save(
        self,
        sharded_state_dicts: Mapping[str, Any],
        common: CommonState | None = None,
        *,
        train_step: int | None = None,
        states: Mapping[str, Stateful] | None = None,
        layout: Mapping[str, int] | None = None,
        run_config: Any = None,
        tokenizer_files: Sequence[str | os.PathLike] = (),
    ) -> Path:
        """Write one train step atomically; return the final step folder.

        Args:
            sharded_state_dicts: part name ([A-Za-z0-9_]+) -> Megatron sharded state dict, e.g.
                {"policy": model.sharded_state_dict(),
                 "policy_optimizer": optimizer.sharded_state_dict(model_sd)}. Consumed: Megatron
                builds its factories in place, so pass freshly made dicts.
            common: step, policy_version, cursor and extra state (rank 0's is saved); or None
                with ``train_step`` given.
            train_step: the step (names the folder) when ``common`` is None; must equal
                ``common.train_step`` if both are given.
            states: name -> object with ``state_dict()`` (run state, task stream, LR
                schedulers, ...); rank 0's ``state_dict()`` is saved in ``common/state.pt``.
            layout: parallel sizes recorded in the manifest, e.g. {"tp": 2, "pp": 1, "ep": 1,
                "dp": 1}.
            run_config: dataclass, dict, OmegaConf object or YAML text -> ``config.yaml``.
            tokenizer_files: files copied into ``tokenizer/`` (rank 0).

        Raises:
            ValueError: bad part name, or no/contradicting train step. RuntimeError:
                torch.distributed not initialised. CheckpointError: finalising failed on rank 0
                (raised on every rank).
        """
        coll.require_initialized("CheckpointManager.save")
        from megatron.core import dist_checkpointing

        common = self._common_for_save(common, train_step)
        for name in sharded_state_dicts:
            if not _PART_RE.match(name) or name in _RESERVED_PARTS:
                raise ValueError(
                    f"checkpoint part name {name!r}: use letters, digits and '_' only, not one "
                    f"of {sorted(_RESERVED_PARTS)}"
                )
        saved_states = {name: obj.state_dict() for name, obj in (states or {}).items()}
        step = int(common.train_step)
        final = self.save_dir / step_dir_name(step)
        rank0 = coll.rank() == 0
        tmp_name = f"{final.name}.tmp-{uuid.uuid4().hex}" if rank0 else None
        tmp = self.save_dir / coll.broadcast_from_rank0(tmp_name)
        t0 = time.perf_counter()
        if rank0:
            tmp.mkdir(parents=True)
            (tmp / "rng").mkdir()
            for name in sharded_state_dicts:
                (tmp / name).mkdir()
        coll.barrier()
        for name, sharded in sharded_state_dicts.items():
            dist_checkpointing.save(sharded, str(tmp / name), sharded_strategy=("torch_dist", 1))
        torch.save(capture_rng_state(), tmp / "rng" / f"rank_{coll.rank():05d}.pt")
        if rank0:
            (tmp / "common").mkdir()
            torch.save(asdict(common) | {"states": saved_states}, tmp / "common" / "state.pt")
            if run_config is not None:
                (tmp / "config.yaml").write_text(io.config_to_yaml(run_config))
            if tokenizer_files:
                (tmp / "tokenizer").mkdir()
                for f in tokenizer_files:
                    shutil.copy2(f, tmp / "tokenizer" / Path(f).name)
        coll.barrier()
        gathered = coll.all_gather_object(io.fsync_and_list(tmp))  # each rank flushes its view
        error = None
        if rank0:
            try:
                expected = {rel: size for g in gathered for rel, size in g.items()}
                self._finalize(tmp, final, step, list(sharded_state_dicts), layout, expected)
            except Exception as exc:  # every rank must learn about it, not hang in the barrier
                error = f"{type(exc).__name__}: {exc}"
        error = coll.broadcast_from_rank0(error)
        if error is not None:
            raise CheckpointError(
                f"saving {final} failed on rank 0: {error}; the previous checkpoint in "
                f"{self.save_dir} is intact (check free space and permissions, then rerun)"
            )
        logger.info("saved %s in %.2f s", final, time.perf_counter() - t0)
        return final

    @staticmethod
    def _common_for_save(common: CommonState | None, train_step: int | None) -> CommonState:
        if common is None:
            if train_step is None:
                raise ValueError("CheckpointManager.save: give `common` or `train_step`")
            return CommonState(train_step=int(train_step))
        if train_step is not None and int(train_step) != common.train_step:
            raise ValueError(
                f"CheckpointManager.save: train_step={train_step} != "
                f"common.train_step={common.train_step}; give one of them"
            )
        return common

    def _finalize(
        self,
        tmp: Path,
        final: Path,
        step: int,
        parts: list[str],
        layout: Mapping[str, int] | None,
        expected: Mapping[str, int],
    ) -> None:
        """Rank 0: wait until every file any rank wrote is visible, manifest, rename,
        ``latest``, prune (in that order)."""
        deadline = time.monotonic() + _VISIBLE_TIMEOUT_S
        while True:
            mine = io.fsync_and_list(tmp)
            missing = [r for r, size in expected.items() if mine.get(r) != size]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        if missing:
            raise CheckpointError(
                f"files written by other ranks are not visible from rank 0 after "
                f"{_VISIBLE_TIMEOUT_S:.0f} s: {summary(missing)}; is {self.save_dir} on storage "
                "shared by all nodes?"
            )
        manifest = build_manifest(
            tmp,
            mine,
            train_step=step,
            parts=parts,
            world_size=coll.world_size(),
            layout=layout,
            hash_max_bytes=self.config.hash_max_bytes,
        )
        for d in [tmp, *(p for p in tmp.rglob("*") if p.is_dir())]:
            io.fsync_dir(d)
        io.atomic_write_text(tmp / MANIFEST_NAME, json.dumps(manifest, indent=1))
        old = None
        if final.exists():  # re-saving a step (e.g. after a rollback): swap, then delete the old
            old = final.with_name(f"{final.name}.old-{uuid.uuid4().hex}")
            os.rename(final, old)
        os.rename(tmp, final)
        io.fsync_dir(self.save_dir)
        io.atomic_write_text(self.save_dir / LATEST_NAME, final.name + "\n")
        if old is not None:
            shutil.rmtree(old)
        self._prune(step)

    def _prune(self, step: int) -> None:
        """Delete what is older than the step just written: leftover tmp folders of interrupted
        saves up to this step, and all but the newest ``keep_last_k - 1`` older steps.

        Steps newer than ``step`` (another run's, or this run's before it was rolled back) are
        never deleted: a run that started fresh by mistake cannot remove trained checkpoints.
        """
        for stale in stale_tmp_dirs(self.save_dir):
            if tmp_dir_step(stale) <= step:
                logger.warning("removing %s left by an interrupted save", stale)
                shutil.rmtree(stale, ignore_errors=True)
        k = self.config.keep_last_k
        if k == 0:
            return
        found = list_checkpoints(self.save_dir)
        newer = [p for s, p in found if s > step and p not in self._warned_newer]
        if newer:
            self._warned_newer.update(newer)
            logger.warning(
                "keeping %s: newer than step %d just written to %s; checkpoint.keep_last_k "
                "prunes only older steps (delete them by hand if they are not wanted)",
                ", ".join(p.name for p in newer),
                step,
                self.save_dir,
            )
        older = [p for s, p in found if s < step]
        for path in older[: max(len(older) - (k - 1), 0)]:
            shutil.rmtree(path)

    # ---- load ---------------------------------------------------------------------------------
    def resolve_resume(self) -> Path | None:
        """The step folder to resume from per ``config.resume``, or None to start fresh.

        Decided on rank 0 and sent to every rank. ``auto`` follows ``latest`` in load_dir (or
        save_dir); without a usable ``latest`` it takes the newest complete step folder with a
        warning (see `find_resume_point`); finding nothing, it starts fresh (logged at INFO).
        Rank 0 logs these through the job's logger (``sao_megatron.trainer.checkpoint.manager``,
        a child of ``sao_megatron.trainer``).

        Raises:
            CheckpointError: resume is a path that holds no checkpoint, or ``latest`` is
                unusable and the step folders leave the choice ambiguous.
        """
        result: tuple[Path | None, str | None, str | None] = (None, None, None)
        if coll.rank() == 0:
            try:
                result = (*self._resolve_here(), None)
            except CheckpointError as exc:
                result = (None, None, str(exc))
        path, warning, error = coll.broadcast_from_rank0(result)
        if error is not None:
            raise CheckpointError(error)
        if coll.rank() == 0:
            resume = self.config.resume
            if warning is not None:
                logger.warning("checkpoint.resume=%s: %s", resume, warning)
            elif path is None and resume == "auto":
                logger.info(
                    "checkpoint.resume=auto: no checkpoint in %s; start fresh", self._resume_root()
                )
        return path

    def _resume_root(self) -> Path:
        return Path(self.config.load_dir or self.config.save_dir)

    def _resolve_here(self) -> tuple[Path | None, str | None]:
        resume = self.config.resume
        if resume == "none":
            return None, None
        if resume == "auto":
            root = self._resume_root()
            for stale in stale_tmp_dirs(root):
                logger.warning(
                    "checkpoint.resume=auto: ignoring %s: left by an interrupted save", stale
                )
            return find_resume_point(root)
        path = Path(resume)
        if path.is_dir() and STEP_RE.match(path.name):
            return path, None
        found, warning = find_resume_point(path) if path.is_dir() else (None, None)
        if found is None:
            raise CheckpointError(
                f"checkpoint.resume={resume}: not a step_NNNNNNNN folder nor a folder with a "
                "'latest' file or step folders; give an existing checkpoint path, 'auto' or "
                "'none'"
            )
        return found, warning

    def load(
        self,
        path: str | os.PathLike,
        sharded_state_dicts: Mapping[str, Any],
        *,
        states: Mapping[str, Stateful] | None = None,
        optional_parts: Sequence[str] = (),
        restore_rng: bool = True,
    ) -> LoadResult:
        """Validate, then load the named parts of a step folder into the given sharded dicts.

        Order: manifest validation on rank 0 (broadcast); the common state and the requested
        Stateful names; every part's keys and global shapes against its checkpoint metadata on
        every rank (gathered); then - only when all of that passed - dist_checkpointing reads the
        tensors, and each object in ``states`` gets ``load_state_dict``. Names in
        ``optional_parts`` that do not match (e.g. an optimiser after an EP change, a Stateful
        the checkpoint lacks) are skipped and reported in ``LoadResult.skipped_parts`` with a
        warning; any other mismatch raises. An optimiser part saved before its first step (no
        Adam moments) is skipped for every caller and reported at INFO: a fresh optimiser is
        the state it was saved in.

        Args:
            path: a step folder (use `resolve_resume` to pick it).
            sharded_state_dicts: part name -> sharded state dict of the *current* layout (for a
                Megatron optimiser: ``optimizer.sharded_state_dict(model_sd, is_loading=True)``).
            states: name -> object with ``load_state_dict`` (the names given to `save`).
            optional_parts: parts or Stateful names that may be skipped when incompatible.
            restore_rng: restore this rank's RNG state when the world size is unchanged.

        Raises:
            CheckpointError: missing/partial/corrupted checkpoint, a part or Stateful name not in
                it, or keys and shapes that do not match a required part - before any tensor or
                object is modified.
        """
        coll.require_initialized("CheckpointManager.load")
        from megatron.core import dist_checkpointing

        path = Path(path)
        states = dict(states or {})
        manifest, error = None, None
        if coll.rank() == 0:
            try:
                manifest = validate_checkpoint(path)
            except CheckpointError as exc:
                error = str(exc)
        manifest, error = coll.broadcast_from_rank0((manifest, error))
        if error is not None:
            raise CheckpointError(error)
        missing = [p for p in sharded_state_dicts if p not in manifest["parts"]]
        if missing:
            raise CheckpointError(
                f"checkpoint {path} has no part(s) {missing} (it holds {manifest['parts']}); "
                "load only the parts it has or start that part fresh"
            )
        saved = torch.load(path / "common" / "state.pt", weights_only=False)
        saved_states = saved.get("states", {})
        skipped: dict[str, str] = {}
        for name in states:
            if name in saved_states:
                continue
            reason = f"Stateful '{name}' not in checkpoint (it holds {sorted(saved_states)})"
            if name not in optional_parts:
                raise CheckpointError(
                    f"checkpoint {path}: {reason}. Nothing was loaded. Load only the names it "
                    "has, or list the name in optional_parts to start it fresh"
                )
            skipped[name] = reason
        local = {n: check_part_compatible(sd, path / n) for n, sd in sharded_state_dicts.items()}
        gathered = coll.all_gather_object(local)
        unstepped: list[str] = []
        for name in sharded_state_dicts:
            problems = [f"rank {r}: {p}" for r, g in enumerate(gathered) for p in g[name]]
            if not problems:
                continue
            if all(p.startswith(UNSTEPPED) for g in gathered for p in g[name]):
                unstepped.append(name)
                skipped[name] = (
                    f"{UNSTEPPED} (no moment estimates in it); it starts fresh, which is "
                    "exactly the state it was saved in"
                )
                continue
            reason = (
                f"layout {manifest.get('layout')} (world {manifest.get('world_size')}) -> "
                f"current does not match: {summary(problems)}"
            )
            if name not in optional_parts:
                raise CheckpointError(
                    f"checkpoint {path}, part '{name}': {reason}. Nothing was loaded. Use the "
                    "saved layout, or list the part in optional_parts to restart it (see "
                    "docs/CHECKPOINTS.md)"
                )
            skipped[name] = reason
        if coll.rank() == 0:
            for name, reason in skipped.items():
                log = logger.info if name in unstepped else logger.warning
                log("not loading part '%s' of %s: %s", name, path, reason)
        state_dicts = {
            name: dist_checkpointing.load(sd, str(path / name))
            for name, sd in sharded_state_dicts.items()
            if name not in skipped
        }
        for name, obj in states.items():
            if name not in skipped:
                obj.load_state_dict(saved_states[name])
        rng_restored = self._restore_rng(path, manifest) if restore_rng else False
        return LoadResult(
            path=path,
            state_dicts=state_dicts,
            skipped_parts=skipped,
            common=CommonState.from_saved(saved),
            states=saved_states,
            manifest=manifest,
            rng_restored=rng_restored,
        )

    @staticmethod
    def _restore_rng(path: Path, manifest: Mapping[str, Any]) -> bool:
        """Restore this rank's RNG file when the world size is unchanged, else warn."""
        rng_file = path / "rng" / f"rank_{coll.rank():05d}.pt"
        if manifest["world_size"] == coll.world_size() and rng_file.is_file():
            restore_rng_state(torch.load(rng_file, weights_only=False))
            return True
        if coll.rank() == 0:
            logger.warning(
                "RNG states not restored: saved with world size %s, now %d; random draws will "
                "differ from the uninterrupted run",
                manifest["world_size"],
                coll.world_size(),
            )
        return False
