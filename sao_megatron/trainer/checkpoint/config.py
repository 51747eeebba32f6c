"""`CheckpointConfig`: where and how often checkpoints are written and from where a run resumes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(kw_only=True)
class CheckpointConfig:
    """The ``checkpoint:`` section of a job config.

    Fields:
        save_dir: folder holding ``step_*/`` and ``latest`` (shared storage on clusters).
        save_interval: save every this many train steps (step % interval == 0); 0 = never
            periodically (the controller may still save at the end).
        keep_last_k: keep this many newest complete checkpoints (>= 1), or 0 to keep all.
            Pruning deletes only steps older than the one just written, never newer ones.
        resume: "auto" (resume from ``latest`` in load_dir if there is one, else from the newest
            complete step folder with a warning, else start fresh), "none" (always start fresh),
            or a path to a step folder or a folder with ``latest`` (must exist).
        load_dir: folder searched by resume="auto"; None means save_dir.
        hash_max_bytes: files up to this size (bytes) get a sha256 in the manifest (checked on
            load); larger files are checked by size only. 0 disables hashing.

    Saving is synchronous (the former ``async_save`` field could only be False and was removed;
    `MOVED_FIELDS` makes the old key a clear error).
    """

    MOVED_FIELDS: ClassVar[dict[str, str]] = {
        "async_save": "was removed: saving is synchronous (asynchronous saving was never "
        "implemented); delete the key",
    }

    save_dir: str = "checkpoints"
    save_interval: int = 0
    keep_last_k: int = 3
    resume: str = "auto"
    load_dir: str | None = None
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
        if self.hash_max_bytes < 0:
            raise ValueError(f"checkpoint.hash_max_bytes={self.hash_max_bytes}: must be >= 0")
