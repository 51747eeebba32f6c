"""What the RL loop carries between steps and checkpoints: its counters (`RLRunState`, with
value pre-training's held-out set) and the seeded stream of training tasks (`TaskStream`)."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from typing import Any, ClassVar

from sao_megatron.data.trajectory import ActionNode, Trajectory
from sao_megatron.envs.base import task_id
from sao_megatron.rollout.manager import Task
from sao_megatron.trainer.job import TasksConfig


@dataclasses.dataclass(kw_only=True)
class RLRunState:
    """The RL stage's counters: what the loop carries and the checkpoint saves.

    Fields:
        step: completed policy updates (train steps).
        policy_version: version of the policy weights the engines serve (k after k updates).
        value_pretrain_steps: completed value pre-training steps.
        value_pretrain_stop_reason: why value pre-training ended ("target_reached",
            "step_cap", "fixed_steps"; `sao_megatron.trainer.value_pretrain`), "" while it has
            not (or never ran).
        value_pretrain_heldout: the held-out trajectories value pre-training evaluates the
            critic on (drawn once, with a target set; None before that or without a target):
            a resumed run evaluates on the same ones.
    The task cursor is the `TaskStream`'s own state (saved next to this one).
    """

    #: the counters every checkpoint holds; the other fields are absent from older ones
    REQUIRED: ClassVar[tuple[str, ...]] = ("step", "policy_version", "value_pretrain_steps")

    step: int = 0
    policy_version: int = 0
    value_pretrain_steps: int = 0
    value_pretrain_stop_reason: str = ""
    value_pretrain_heldout: list[Trajectory] | None = None

    def state_dict(self) -> dict[str, Any]:
        """The fields by name; the held-out trajectories as plain dicts (`dataclasses.asdict`,
        which the checkpoint's common state goes through anyway), rebuilt on load."""
        state = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.value_pretrain_heldout is not None:
            state["value_pretrain_heldout"] = [
                dataclasses.asdict(t) for t in self.value_pretrain_heldout
            ]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict()` (or an older checkpoint's, without the value
        pre-training stop reason and held-out set: they keep their defaults); raises ValueError
        on a missing counter or an unknown key."""
        names = {f.name for f in dataclasses.fields(self)}
        if not set(self.REQUIRED) <= set(state) <= names:
            raise ValueError(
                f"RLRunState: checkpoint holds {sorted(state)}, want {sorted(self.REQUIRED)} "
                f"and optionally {sorted(names - set(self.REQUIRED))}"
            )
        for name in self.REQUIRED:
            setattr(self, name, int(state[name]))
        self.value_pretrain_stop_reason = str(state.get("value_pretrain_stop_reason", ""))
        heldout = state.get("value_pretrain_heldout")
        self.value_pretrain_heldout = None if heldout is None else [_trajectory(t) for t in heldout]


def _trajectory(d: dict[str, Any]) -> Trajectory:
    """A `Trajectory` from its `dataclasses.asdict` form."""
    return Trajectory(**(d | {"nodes": [ActionNode(**n) for n in d["nodes"]]}))


class TaskStream:
    """The endless, seeded stream of RL tasks (a `Task` per draw).

    The checkpointed cursor is `consumed`, the number of tasks the trainer has trained on
    (`consume`). Restoring it (`load_state_dict`) skips the first `consumed` tasks: in
    synchronous mode (rollout.max_staleness=0) the trained tasks are exactly the first ones
    drawn, so a resumed run sees the same tasks as an uninterrupted one; asynchronously, tasks
    that were in flight at the checkpoint are run again.

    Args:
        tasks: the ``tasks`` section (train environments, weights, train_seed).
    """

    def __init__(self, tasks: TasksConfig) -> None:
        self._seed = f"tasks:{tasks.train_seed}"
        self._specs = tasks.train
        self._weights = [e.weight for e in tasks.train]
        self._rng = random.Random(self._seed)
        self.drawn = 0
        self.consumed = 0

    def _draw(self) -> Task:
        spec = self._rng.choices(self._specs, self._weights)[0]
        seed = self._rng.randrange(2**31)
        self.drawn += 1
        tid = task_id(spec.name, seed, draw=self.drawn - 1)
        return Task(task_id=tid, make_env=spec.build, seed=seed)

    def __iter__(self) -> Iterator[Task]:
        return self

    def __next__(self) -> Task:
        return self._draw()

    def consume(self, num_tasks: int) -> None:
        """Count `num_tasks` more tasks as trained on."""
        self.consumed += num_tasks

    def state_dict(self) -> dict[str, int]:
        return {"tasks_consumed": self.consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after the first ``state["tasks_consumed"]`` tasks of the seeded stream.

        Raises ValueError once tasks were drawn (load before the rollout starts drawing).
        """
        if self.drawn:
            raise ValueError("TaskStream.load_state_dict after tasks were drawn: load it first")
        self._rng = random.Random(self._seed)
        self.consumed = int(state["tasks_consumed"])
        while self.drawn < self.consumed:
            self._draw()


def task_index(task_id: str) -> int:
    """Position of a task in the `TaskStream`: the draw of its id
    (`sao_megatron.envs.base.task_id`, the last ':' field)."""
    return int(task_id.rsplit(":", 1)[1])
