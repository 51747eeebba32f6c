"""Atomic, validated training checkpoints: Megatron dist_checkpointing parts plus common state.

One training step is one directory ``step_{N:08d}/`` under ``CheckpointConfig.save_dir``::

    step_00000012/
      policy/              Megatron dist_checkpointing (torch_dist) save of one sharded state dict
      value/               ... one folder per named part passed to `CheckpointManager.save`
      policy_optimizer/
      common/state.pt      train_step, policy_version, data cursor, extra, and the state dicts
                           of the Stateful objects passed by name (rank 0)
      rng/rank_00000.pt    python/numpy/torch/CUDA/Megatron-tracker RNG state, one file per rank
      config.yaml          the run config (optional)
      tokenizer/           tokenizer files copied verbatim (optional)
      manifest.json        written LAST: every file with its size (+ sha256 for small files)
    latest                 text file naming the newest complete step directory

Save protocol (all ranks): write into ``step_N.tmp-<uuid>/``; barrier; rank 0 fsyncs every file,
writes ``manifest.json`` (temp file + ``os.replace``), renames the folder to ``step_N/``, replaces
``latest`` atomically (temp file + ``os.replace``) and only then prunes steps older than N to
``keep_last_k`` (never newer ones); barrier. A crash at any point leaves ``latest`` on the
previous complete step.

Resume: ``latest``, or, when it is missing or garbled, the newest complete step folder (with a
warning; an error when the newest step folder is incomplete).

Load protocol: resolve ``latest`` or a path; validate the manifest (missing folder, missing
manifest = partial save, size/sha256 mismatch = corrupted) and check every requested sharded key
and global shape against the checkpoint metadata of every part, all BEFORE the first tensor is
read. Only then does dist_checkpointing read the tensors (resharding model weights to the current
TP/PP/EP layout). Which layout changes keep the optimiser state: docs/CHECKPOINTS.md.

The rollout buffer is not saved: trajectories are regenerated from the task cursor (`state`).

Modules: `config` (CheckpointConfig), `errors`, `state` (Stateful, CommonState,
clear_optimizer_state), `rng`, `io` (fsync, atomic writes, sha256), `manifest` (layout on
disk, validation, compatibility), `collectives` (rank-0 broadcast/gather/barrier), `manager`
(CheckpointManager), `role_parts` (the parts of a world split into policy and value ranks,
``value.placement: separate``).

Files hold pickles (``torch.load(weights_only=False)``): load only checkpoints you trust.
"""

from __future__ import annotations

from sao_megatron.lazy import lazy_exports

# Lazy exports: a submodule importing a sibling does not re-enter this package's __init__.
_MODULES = {
    "config": ("CheckpointConfig",),
    "errors": ("CheckpointError",),
    "manager": ("CheckpointManager", "LoadResult"),
    "manifest": (
        "FORMAT_NAME",
        "FORMAT_VERSION",
        "LATEST_NAME",
        "MANIFEST_NAME",
        "check_part_compatible",
        "find_latest",
        "find_resume_point",
        "is_complete",
        "list_checkpoints",
        "stale_tmp_dirs",
        "step_dir_name",
        "validate_checkpoint",
    ),
    "rng": ("capture_rng_state", "restore_rng_state"),
    "role_parts": (
        "ROLE_OF_PART",
        "merge_from_value_ranks",
        "role_split_parts",
        "set_replica_ids",
        "with_other_roles_parts",
    ),
    "state": ("CommonState", "Stateful", "clear_optimizer_state"),
}
__getattr__, __all__ = lazy_exports(__name__, _MODULES)
