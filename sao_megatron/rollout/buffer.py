"""Trajectory buffer with bounded staleness and a double-buffered hand-off to the trainer.

Off-policy control (docs/ARCHITECTURE.md, docs/ROLLOUT.md "Bounded staleness") is bounded at
admission and per token; episodes are never aborted for staleness mid-flight (a long episode
would then never finish: issue 19). The buffer does admission and the hand-off check:

1. **Admission of new episodes.** A group starts only while the engines' weight version v is
   within the bound of the trainer's (``train_version - v <= max_staleness``) and AReaL's
   capacity rule holds (Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement
   Learning System for Language Reasoning", section 5.1): ``N_started <= (v + eta + 1) * B``,
   N_started counting trajectories started and not discarded, eta = ``max_staleness``, B =
   ``trajectories_per_batch``. The rule keeps the rollout from running arbitrarily far ahead of
   a slow trainer; with one batch per version it also bounds the lag of every trajectory's
   *newest* token by eta (a trajectory that finishes at version v is among the first
   (v + eta + 1) * B started, so it is consumed by batch v + eta at the latest).
   (`StalenessBuffer.can_start`.)
2. **Hand-off.** Tokens older than the bound inside an admitted trajectory are dropped from the
   policy loss by the trainer (`sao_megatron.rollout.staleness.stale_token_mask`). A group whose
   tokens are *all* older than the bound (``train_version - max(policy_version) > eta`` for
   every trajectory; possible only when the trainer consumed more batches than versions, an
   engine fell behind, or an episode's last environment step, after its newest token, outlasted
   the bound) has nothing to train: `get_batch` drops it, counts it
   (``num_stale_dropped``) and hands it to ``on_stale`` (the manager requeues the task: a fresh
   episode, never a duplicate).

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

import torch

from sao_megatron.data.trajectory import Trajectory
from sao_megatron.rollout.staleness import stale_token_mask

Group = list[Trajectory]


class StalenessBuffer:
    """Bounded-staleness buffer of trajectory groups.

    Args:
        trajectories_per_batch: B, trajectories per training batch (multiple of group_size).
        group_size: G, trajectories per group (1 for SAO).
        max_staleness: eta >= 0, the bound on train_version - policy_version of a trained token.
        on_stale: called (outside the lock) with each group dropped because all its tokens are
            older than the bound.
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
        # the bound admission uses (<= max_staleness; lowered by the deviation controller,
        # sao_megatron.algorithm.deviation_controller) and the hand-off's (max_staleness unless
        # the controller's bound applies to admitted data too, rollout.deviation_bound_trained)
        self.admission_staleness = max_staleness
        self.hand_off_staleness = max_staleness
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
            "last_stale_token_fraction": 0.0,
        }

    # ----------------------------------------------------------------- admission (AReaL rule)
    def can_start(self, engine_version: int, base_version: int = 0) -> bool:
        """True if one more group may start at engine weight version `engine_version`.

        The engines must be within the bound of the trainer (``train_version - engine_version
        <= eta``, eta = `admission_staleness`, max_staleness unless a deviation controller
        lowered it) and AReaL's capacity rule must hold (with the same eta), counting versions from
        `base_version` (the version this run started at: a resumed run starts at its
        checkpoint's version with nothing started).
        """
        with self._cond:
            eta = self.admission_staleness
            if self.train_version - engine_version > eta:
                return False
            cap = (engine_version - base_version + eta + 1) * self.batch_size
            cap += self._extra_capacity
            return self._num_started + self.group_size <= cap

    def set_admission_staleness(self, eta: int, hand_off: bool = False) -> None:
        """Admit new groups under bound `eta` (clamped to [0, max_staleness]) from now on.
        With `hand_off` the same bound applies to the groups already admitted (those whose
        newest token it leaves behind are dropped, `is_stale`); else they keep max_staleness."""
        with self._cond:
            self.admission_staleness = max(0, min(int(eta), self.max_staleness))
            self.hand_off_staleness = self.admission_staleness if hand_off else self.max_staleness
            self._cond.notify_all()

    def mark_started(self) -> None:
        """Count one group as started (call right after `can_start` said yes)."""
        with self._cond:
            self._num_started += self.group_size

    def mark_discarded(self) -> None:
        """A started group will never be put (engine fault, episode failure): free its capacity."""
        with self._cond:
            self._num_started -= self.group_size
            self._cond.notify_all()

    def is_stale(self, max_policy_version: int) -> bool:
        """True if a token of version `max_policy_version` (and every older one) is beyond the
        bound at the current train version: data whose newest token is this old has nothing
        left to train."""
        return self.train_version - max_policy_version > self.hand_off_staleness

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
        def fresh(g: Group) -> bool:  # at least one token within the bound
            return not self.is_stale(max(t.max_policy_version for t in g))

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
                with; every returned group has a token with train_version - version <= eta
                (older tokens are the trainer's to mask: `stale_token_mask`).
            timeout: seconds to wait (None: forever). Raises TimeoutError when exceeded.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        stale: list[Group] = []
        try:
            with self._cond:
                self.train_version = max(self.train_version, train_version)
                if self._last_batch_version == train_version:
                    # the last batch was consumed without a version change: free its capacity
                    # now, before waiting (after the wait, eta = 0 would deadlock: the batch
                    # asked for could never be started)
                    self._extra_capacity += self.batch_size
                    self._last_batch_version = None  # credited once
                    self._cond.notify_all()
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
                self._last_batch_version = train_version
                lags = [self.train_version - t.min_policy_version for t in trajs]
                self.stats["num_consumed"] += len(trajs)
                self.stats["num_batches"] += 1
                self.stats["last_lag_mean"] = sum(lags) / len(lags)
                self.stats["last_lag_max"] = max(lags)
                self.stats["last_stale_token_fraction"] = _stale_fraction(
                    trajs, self.train_version, self.hand_off_staleness
                )
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


def _stale_fraction(trajs: list[Trajectory], train_version: int, max_staleness: int) -> float:
    """Fraction of the action tokens of `trajs` older than the bound (what the trainer masks)."""
    versions = torch.tensor([v for t in trajs for n in t.nodes for v in n.policy_versions])
    if versions.numel() == 0:
        return 0.0
    return float(stale_token_mask(versions, train_version, max_staleness).double().mean())
