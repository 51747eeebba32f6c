"""Trajectory buffer with bounded staleness and a double-buffered hand-off to the trainer.

Off-policy control (DESIGN.md section 3) has two parts, both here:

1. **Admission of new episodes (AReaL capacity rule).** AReaL (Fu et al. 2025, "AReaL: A
   Large-Scale Asynchronous Reinforcement Learning System for Language Reasoning", section 5.1)
   lets the rollout start a trajectory only while ``N_started <= (v + eta + 1) * B``: N_started
   counts trajectories started and not discarded, v is the engines' weight version, eta =
   ``max_staleness`` and B = ``trajectories_per_batch``. Batch j is trained at train_version j,
   so trajectories consumed in start order are never more than eta versions old, and the rollout
   cannot run arbitrarily far ahead of a slow trainer. (`StalenessBuffer.can_start`.)
2. **Filter at hand-off (guarantee).** Episodes finish out of order and a long multi-turn episode
   can outlive several updates, so the rule alone is not a guarantee. `get_batch(train_version)`
   drops every group with ``train_version - min(policy_version) > max_staleness`` and hands it
   to ``on_stale`` (the manager requeues the task: a fresh episode, never a duplicate). In-flight
   episodes that are already too old are aborted early by the manager (`is_stale`).

Double buffering: finished groups append to a *filling* list; as soon as B trajectories are there
and the *ready* slot is empty they are sealed into it. The trainer takes the ready batch
(`get_batch`, blocking) while the next one keeps filling. Groups (GRPO: G trajectories of one
task) enter and leave atomically. All methods are thread-safe; `put_group` never blocks, so the
rollout's event loop can call it directly.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from sao_megatron.data.trajectory import Trajectory

Group = list[Trajectory]


class StalenessBuffer:
    """Bounded-staleness buffer of trajectory groups.

    Args:
        trajectories_per_batch: B, trajectories per training batch (multiple of group_size).
        group_size: G, trajectories per group (1 for SAO).
        max_staleness: eta >= 0, the bound on train_version - min(policy_version).
        on_stale: called (outside the lock) with each group dropped as stale.
    Raises ValueError for inconsistent sizes.
    """

    def __init__(
        self,
        *,
        trajectories_per_batch: int,
        group_size: int = 1,
        max_staleness: int,
        on_stale: Callable[[Group], None] | None = None,
    ) -> None:
        if group_size < 1 or trajectories_per_batch < 1 or trajectories_per_batch % group_size:
            raise ValueError(
                f"trajectories_per_batch={trajectories_per_batch} must be a positive multiple of "
                f"group_size={group_size}"
            )
        if max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness}: must be >= 0")
        self.batch_size = trajectories_per_batch
        self.group_size = group_size
        self.max_staleness = max_staleness
        self.on_stale = on_stale
        self._cond = threading.Condition()
        self._filling: list[Group] = []
        self._ready: list[Group] | None = None
        self._num_started = 0  # trajectories started and not discarded (AReaL's N_started)
        # AReaL's rule assumes one batch per version; a batch consumed without a version change
        # (value pre-training, several batches per update) frees one batch of capacity.
        self._extra_capacity = 0
        self._last_batch_version: int | None = None
        self.train_version = 0  # version of the policy the trainer is training (latest known)
        self.stats = {
            "num_put": 0,
            "num_consumed": 0,
            "num_stale_dropped": 0,
            "num_batches": 0,
            "last_lag_mean": 0.0,
            "last_lag_max": 0,
        }

    # ----------------------------------------------------------------- admission (AReaL rule)
    def can_start(self, engine_version: int) -> bool:
        """True if one more group may start at engine weight version `engine_version`."""
        with self._cond:
            cap = (engine_version + self.max_staleness + 1) * self.batch_size
            cap += self._extra_capacity
            return self._num_started + self.group_size <= cap

    def mark_started(self) -> None:
        """Count one group as started (call right after `can_start` said yes)."""
        with self._cond:
            self._num_started += self.group_size

    def mark_discarded(self) -> None:
        """A started group will never be put (fault, failure, stale abort): free its capacity."""
        with self._cond:
            self._num_started -= self.group_size
            self._cond.notify_all()

    def is_stale(self, min_policy_version: int) -> bool:
        """True if data with this oldest version can no longer be trained (abort it early)."""
        return self.train_version - min_policy_version > self.max_staleness

    # ----------------------------------------------------------------- producer side
    def put_group(self, group: Group) -> None:
        """Add one finished group (validated); never blocks.

        Raises ValueError if the group has the wrong size or a trajectory is invalid.
        """
        if len(group) != self.group_size:
            raise ValueError(f"group of {len(group)} trajectories; expected {self.group_size}")
        for t in group:
            t.validate()
        with self._cond:
            self._filling.append(group)
            self.stats["num_put"] += len(group)
            self._seal()
            self._cond.notify_all()

    def _seal(self) -> None:  # holds the lock
        if self._ready is None and len(self._filling) * self.group_size >= self.batch_size:
            n = self.batch_size // self.group_size
            self._ready, self._filling = self._filling[:n], self._filling[n:]

    # ----------------------------------------------------------------- consumer side
    def set_train_version(self, version: int) -> list[Group]:
        """Record the trainer's version and drop groups it can no longer train; return them."""
        with self._cond:
            self.train_version = max(self.train_version, version)
            stale = self._drop_stale()
        self._report(stale)
        return stale

    def _drop_stale(self) -> list[Group]:  # holds the lock
        def fresh(g: Group) -> bool:
            return not self.is_stale(min(t.min_policy_version for t in g))

        stale = [g for g in (self._ready or []) + self._filling if not fresh(g)]
        if stale:
            ready = [g for g in (self._ready or []) if fresh(g)]
            self._filling = ready + [g for g in self._filling if fresh(g)]
            self._ready = None
            self._num_started -= len(stale) * self.group_size
            self.stats["num_stale_dropped"] += len(stale) * self.group_size
            self._seal()
        return stale

    def _report(self, stale: list[Group]) -> None:
        if self.on_stale is not None:
            for g in stale:
                self.on_stale(g)

    def get_batch(self, train_version: int, timeout: float | None = None) -> list[Trajectory]:
        """Block until B admissible trajectories are ready; return them (groups contiguous).

        Args:
            train_version: version of the weights the trainer will compute this batch's loss
                with; every returned trajectory has train_version - min(version) <= eta.
            timeout: seconds to wait (None: forever). Raises TimeoutError when exceeded.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        stale: list[Group] = []
        try:
            with self._cond:
                self.train_version = max(self.train_version, train_version)
                while True:
                    stale += self._drop_stale()
                    self._seal()
                    if self._ready is not None:
                        batch, self._ready = self._ready, None
                        self._seal()  # the next batch keeps filling from what is there
                        break
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        have = len(self._filling) * self.group_size
                        raise TimeoutError(
                            f"no batch of {self.batch_size} trajectories after {timeout} s "
                            f"({have} admissible ready)"
                        )
                    self._cond.wait(left if left is None else min(left, 1.0))
                trajs = [t for g in batch for t in g]
                if self._last_batch_version == train_version:
                    self._extra_capacity += self.batch_size
                self._last_batch_version = train_version
                lags = [self.train_version - t.min_policy_version for t in trajs]
                self.stats["num_consumed"] += len(trajs)
                self.stats["num_batches"] += 1
                self.stats["last_lag_mean"] = sum(lags) / len(lags)
                self.stats["last_lag_max"] = max(lags)
                return trajs
        finally:
            self._report(stale)

    def num_ready(self) -> int:
        """Admissible trajectories waiting (ready + filling)."""
        with self._cond:
            return (len(self._ready or []) + len(self._filling)) * self.group_size

    def num_started(self) -> int:
        with self._cond:
            return self._num_started
