"""A stage's checkpoint from its parts: the models with their optimisers, and `Stateful` objects.

A stage names what it checkpoints and packs nothing by hand:

* ``models``: name -> `TrainState` of every model this rank trains (``policy``, ``value``); each
  gives two tensor parts, ``<name>`` (the model chunk's sharded state dict) and
  ``<name>_optimizer`` (optional: a never-stepped optimiser is not saved, one of another layout
  is not loaded; either starts fresh);
* ``stateful``: name -> object with ``state_dict()`` / ``load_state_dict()`` (the run state,
  the task stream or the SFT sampler, the LR schedulers (`Schedulers`), the rollout's counters
  and deviation controller, the algorithm's state across steps); rank 0's ``state_dict()`` is
  saved in ``common/state.pt`` and every rank loads it (`CheckpointManager`).

With a role split (``value.placement: separate``) each role writes its own model parts
(`role_split_parts`) and `Schedulers` brings the value ranks' schedules to rank 0.

Checkpoints written before the parts were Stateful kept them in ``CommonState.extra`` and
``data_cursor``; `load_train_states` reads those for a name the checkpoint lacks (`LEGACY`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sao_megatron.trainer.checkpoint.manager import CheckpointManager, LoadResult
from sao_megatron.trainer.checkpoint.role_parts import merge_from_value_ranks, role_split_parts
from sao_megatron.trainer.checkpoint.state import CommonState, Stateful, clear_optimizer_state

log = logging.getLogger(__name__)

#: where a checkpoint written before Stateful parts kept each one: name -> reader of its common
#: state (None when that checkpoint does not hold it)
LEGACY: dict[str, Callable[[CommonState], Any]] = {
    "run": lambda c: c.extra.get("rl_run_state"),
    "tasks": lambda c: c.data_cursor if "tasks_consumed" in c.data_cursor else None,
    "sampler": lambda c: c.data_cursor if "index" in c.data_cursor else None,
    "schedulers": lambda c: c.extra.get("schedulers"),
    "rollout": lambda c: (
        {"status_counts": c.extra["episode_status_counts"]}
        if c.extra.get("episode_status_counts") is not None
        else None
    ),
}


class Schedulers:
    """The LR schedulers of `models` as one Stateful (name -> the scheduler's state dict).

    With `roles` (a role split) ``state_dict()`` is a collective: rank 0, which saves the
    common state, also gets the first value rank's schedules (`merge_from_value_ranks`).
    ``load_state_dict`` loads the schedules of the models this rank holds."""

    def __init__(self, models: Mapping[str, Any], roles=None, rank: int = 0) -> None:
        self.models, self.roles, self.rank = models, roles, rank

    def state_dict(self) -> dict[str, Any]:
        out = {name: st.scheduler.state_dict() for name, st in self.models.items()}
        if self.roles is not None:
            out = merge_from_value_ranks(out, self.roles, self.rank)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, st in self.models.items():
            if name in state:
                st.scheduler.load_state_dict(state[name])


class Kept:
    """A Stateful for a part this rank does not run (the rollout on ranks > 0, or before it is
    built): it keeps what it loaded and saves it back unchanged; ``state`` is None until then."""

    def __init__(self) -> None:
        self.state: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any] | None:
        return self.state

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.state = state


def _tensor_parts(models: Mapping[str, Any], loading: bool = False) -> dict[str, Any]:
    """Fresh Megatron sharded state dicts of each model and its optimiser (dist_checkpointing
    consumes them, so they are built anew for every save and load)."""
    parts = {}
    for name, st in models.items():
        chunk = st.unwrapped[0]
        parts[name] = chunk.sharded_state_dict()
        parts[f"{name}_optimizer"] = st.optimizer.sharded_state_dict(
            chunk.sharded_state_dict(), is_loading=loading
        )
    return parts


def save_train_states(
    mgr: CheckpointManager,
    common: CommonState,
    models: Mapping[str, Any],
    stateful: Mapping[str, Stateful],
    *,
    roles=None,
    rank: int = 0,
    **save_kwargs: Any,
) -> Path:
    """Save one step of a stage (collective over the world); returns the step folder.

    common: the step and policy version (names the folder); models: name -> TrainState this
    rank holds (with `roles`, each role its own); stateful: name -> Stateful (rank 0's saved);
    save_kwargs: `CheckpointManager.save`'s layout, run_config, tokenizer_files.
    """
    parts = _tensor_parts(models)
    if roles is not None:
        parts = role_split_parts(parts, roles, rank)
    return mgr.save(parts, common, states=stateful, **save_kwargs)


def load_train_states(
    mgr: CheckpointManager,
    path: Path,
    models: Mapping[str, Any],
    stateful: Mapping[str, Stateful],
    *,
    roles=None,
    rank: int = 0,
) -> LoadResult:
    """Load a step saved by `save_train_states` (or an older checkpoint, `LEGACY`) into
    `models` and `stateful` (collective over the world).

    A Stateful the checkpoint does not hold (and no legacy key gives) is left as it is (logged);
    an optimiser part that is absent or of another layout is cleared (a fresh optimiser).

    Raises:
        CheckpointError: the step folder is invalid, or a model part does not match.
    """
    parts = _tensor_parts(models, loading=True)
    if roles is not None:
        parts = role_split_parts(parts, roles, rank, loading=True)
    optional = [f"{name}_optimizer" for name in models]
    res = mgr.load(path, parts, optional_parts=optional)
    for name, st in models.items():  # optimisers first: a scheduler's load sets their lr
        if f"{name}_optimizer" in res.state_dicts:
            st.optimizer.load_state_dict(res.state_dicts[f"{name}_optimizer"])
        else:  # not in the checkpoint (never stepped) or another layout: start fresh
            clear_optimizer_state(st.optimizer)
    for name, obj in stateful.items():
        if name in res.states:
            obj.load_state_dict(res.states[name])
        elif (saved := LEGACY[name](res.common) if name in LEGACY else None) is not None:
            obj.load_state_dict(saved)
        elif rank == 0:
            log.info("%s holds no %r state (an older checkpoint): it starts fresh", path, name)
    return res
