"""What becomes of a finished episode group (admit, requeue, drop) and when failures stop a rollout.

The `RolloutManager` runs a task's group (one trajectory for SAO, ``group_size`` for GRPO) and
hands its results here, one per episode: a `Trajectory` or the exception that ended it.

* No exception: the group is admitted to the buffer, and the failure streak ends.
* Otherwise the whole group is dropped from the buffer (its finished members too). Its task is
  requeued (front of the queue, same task_id and seed, a new attempt) when an error's status is
  one of ``rollout.requeue_statuses`` (`disposition`; by default an engine fault) and the task
  has attempts left (``rollout.max_episode_attempts``); nothing of the failed attempt reaches
  the buffer, so no task is lost or counted twice.
* Else the group is dropped for good with a logged error (`EpisodeError`: environment
  exception, malformed reply) and the run goes on — unless `MAX_CONSECUTIVE_FAILURES` groups in
  a row are dropped with no group admitted in between: then the rollout stops and
  `RolloutManager.get_batch` raises at once with the first error of that streak (a broken
  environment, tokenizer or model fails every episode; retrying forever only floods the log).
  An exception of any other type than `EPISODE_FAILURES` is a bug and stops the rollout at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from sao_megatron.rollout.engine_client import EngineError
from sao_megatron.rollout.episode_status import EpisodeStatus
from sao_megatron.rollout.status import EpisodeError, classify_exception, disposition

#: Groups failing in a row (dropped: environment/reply errors, or engine faults past
#: rollout.max_episode_attempts) with no trajectory admitted in between before the rollout
#: gives up. 16 is above any plausible run of independent bad luck (a healthy run fails a few
#: percent of episodes at most, interleaved with successes) and small enough to stop within
#: the first wave of episodes (max_concurrent_episodes defaults to 16).
MAX_CONSECUTIVE_FAILURES = 16

#: The exceptions that end an episode in a running rollout; any other type is a bug.
EPISODE_FAILURES = (EpisodeError, EngineError, TimeoutError)


@dataclass(frozen=True)
class GroupOutcome:
    """What to do with a finished group.

    Attributes:
        action: ``"admit"`` its trajectories, ``"requeue"`` its task (a new attempt) or
            ``"drop"`` it.
        error: requeue: the first error whose status asks for a retry; drop: the error to
            report (one not of `EpisodeError` first: an engine fault, a timeout or a bug).
        kind: requeue: the status without ``_error`` (``engine``, ``timeout``, ...), the
            suffix of the ``requeued_<kind>`` counter.
    """

    action: Literal["admit", "requeue", "drop"]
    error: BaseException | None = None
    kind: str = ""


def settle_group(
    results: Sequence[object],
    attempt: int,
    requeue: Iterable[EpisodeStatus],
    max_attempts: int,
) -> GroupOutcome:
    """The outcome of a group from its per-episode `results` (a `Trajectory` or an exception
    each), its 0-based `attempt`, the statuses to requeue and ``rollout.max_episode_attempts``."""
    errors = [r for r in results if isinstance(r, BaseException)]
    if not errors:
        return GroupOutcome("admit")
    retry = [
        e
        for e in errors
        if isinstance(e, EPISODE_FAILURES)
        and disposition(classify_exception(e), requeue) == "requeue"
    ]
    if retry and attempt + 1 < max_attempts:
        kind = classify_exception(retry[0]).value.removesuffix("_error")
        return GroupOutcome("requeue", retry[0], kind)
    bad = [e for e in errors if not isinstance(e, EpisodeError)] or errors
    return GroupOutcome("drop", bad[0])


class FailureStreak:
    """The errors of the groups dropped since the last admitted one."""

    def __init__(self, limit: int = MAX_CONSECUTIVE_FAILURES) -> None:
        self.limit = limit
        self.errors: list[BaseException] = []

    def clear(self) -> None:
        """A group was admitted: the streak ends."""
        self.errors.clear()

    def add(self, error: BaseException) -> RuntimeError | None:
        """Count a dropped group; at the `limit`-th in a row, return the error that stops the
        rollout (its cause: the streak's first error), else None."""
        self.errors.append(error)
        if len(self.errors) != self.limit:
            return None
        first = self.errors[0]
        fatal = RuntimeError(
            f"{len(self.errors)} episode groups in a row failed with no "
            f"trajectory admitted in between; the first error: "
            f"{type(first).__name__}: {first}"
        )
        fatal.__cause__ = first
        return fatal
