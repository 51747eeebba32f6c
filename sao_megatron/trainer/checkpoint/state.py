"""The non-tensor state a checkpoint holds: `Stateful` objects and the `CommonState` record.

Checkpointed objects follow torchtitan's habit: anything with ``state_dict()`` /
``load_state_dict(sd)`` (the run state, the task stream, Megatron's LR schedulers) is passed to
`CheckpointManager.save` / `load` by name, so the manager needs no knowledge of what they are.

The rollout buffer is deliberately not checkpointed: its in-flight and ready trajectories are
regenerated after a resume from the task cursor (tasks the trainer had not trained on are drawn
again), which keeps a checkpoint independent of the rollout engines and of timing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Stateful(Protocol):
    """An object whose non-tensor state round-trips through a picklable dict."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@dataclass(kw_only=True)
class CommonState:
    """Non-tensor training state saved by rank 0 (RNG is saved per rank, separately).

    Fields:
        train_step: number of completed train steps (names the step folder).
        policy_version: weight version last published to the rollout engine.
        data_cursor: task/data iterator position (e.g. {"epoch": 1, "index": 40} or
            {"tasks_consumed": 64}); trajectories are regenerated from it after a resume.
        extra: free-form picklable dict (stage name, counters, ...).
    """

    train_step: int
    policy_version: int = 0
    data_cursor: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_saved(cls, saved: dict[str, Any]) -> CommonState:
        """Rebuild from the dict in ``common/state.pt`` (without its ``states`` entry).

        ``buffer_state`` (always None in checkpoints written before it was removed) is dropped.
        """
        fields = {k: v for k, v in saved.items() if k not in ("states", "buffer_state")}
        return cls(**fields)


def clear_optimizer_state(optimizer) -> None:
    """Empty the torch optimisers' per-parameter state under a Megatron optimiser (or a chain).

    Building a sharded state dict for loading (``is_loading=True``) fills the Adam state with
    zero moments but no ``step`` (Megatron keeps it in the param groups until a load puts it
    back); when that optimiser part is then not loaded, torch's Adam fails on its first step
    with ``KeyError: 'step'``. An empty state is what a fresh optimiser has."""
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        opt.optimizer.state.clear()
