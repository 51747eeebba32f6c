"""`CheckpointError`: the one exception type of the checkpoint package."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint is missing, partial, corrupted or incompatible, or a save failed.

    The message is one line naming the path, what is wrong and what to do (``sao-train`` prints
    it as is and exits with code 2). Load errors are raised before any model or optimiser tensor
    is modified.
    """

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(part.strip() for part in message.splitlines() if part.strip()))
