"""How an episode ended: the failure taxonomy, what is trainable, and the per-status counters.

Every episode ends with exactly one `EpisodeStatus`:

=================  ===========================================================  ==========
status             meaning                                                      trained
=================  ===========================================================  ==========
``completed``      the environment terminated / the agent returned its reward   yes
``truncated``      a budget ran out (turns, ``max_model_len``); GAE bootstraps   yes
``env_error``      the environment (or an agent's tool sandbox) raised          no
``agent_error``    the agent's own code raised, returned no valid reward, or    no
                   rewrote the conversation history
``engine_error``   the inference engine failed (down, hung, 5xx, garbled reply)  no
``timeout``        a step exceeded its time limit or the episode its wall clock no
``aborted_stale``  the episode's oldest token became too old to train           no
=================  ===========================================================  ==========

Only ``completed`` and ``truncated`` episodes are trained: an infrastructure failure must never
enter the loss as reward 0 (the failure mode behind rLLM issue #710, where 76 of 178 episodes of a
run were infrastructure failures trained as zero reward). What happens to the others is a policy
(`disposition`): by default ``engine_error`` and ``aborted_stale`` are requeued (the task is
retried, as the manager already does), the rest are dropped and counted.

The pure helpers here (`classify_exception`, `disposition`, `StatusCounters`) carry no rollout
state, so the runner, the manager and the gateway share them.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
from collections.abc import Iterable
from typing import Any

from sao_megatron.rollout.engine import EngineError, MalformedReplyError
from sao_megatron.rollout.episode_status import (
    DEFAULT_REQUEUE,
    TRAINABLE,
    EpisodeStatus,
    is_trainable,
    parse_statuses,
)


class EpisodeError(RuntimeError):
    """The episode cannot continue (environment exception, malformed engine reply)."""


class StaleEpisodeError(RuntimeError):
    """The episode's tokens are too old to train (status ``aborted_stale``)."""


def disposition(
    status: EpisodeStatus | str, requeue: Iterable[EpisodeStatus] = DEFAULT_REQUEUE
) -> str:
    """What the rollout does with a finished episode: ``"train"``, ``"requeue"`` or ``"drop"``."""
    s = EpisodeStatus(status)
    if s in TRAINABLE:
        return "train"
    return "requeue" if s in set(requeue) else "drop"


# ------------------------------------------------------------------ exceptions with a status
class EpisodeFailure(RuntimeError):
    """An episode ended without a trainable trajectory; ``status`` says why."""

    status: EpisodeStatus = EpisodeStatus.AGENT_ERROR

    def __init__(self, message: str, status: EpisodeStatus | None = None) -> None:
        super().__init__(message)
        if status is not None:
            self.status = EpisodeStatus(status)


class EnvStepError(EpisodeFailure, EpisodeError):
    """The environment (or a tool an agent runs) raised. Raise it from a tool to mark the
    episode ``env_error`` rather than ``agent_error``. An `EpisodeError`: the manager drops it."""

    status = EpisodeStatus.ENV_ERROR


class AgentError(EpisodeFailure, EpisodeError):
    """The agent failed: its code raised, it returned no finite reward, or it rewrote history."""

    status = EpisodeStatus.AGENT_ERROR


class EpisodeTimeout(EpisodeFailure, EpisodeError):
    """A step exceeded ``step_timeout_s`` or the episode ``episode_timeout_s``."""

    status = EpisodeStatus.TIMEOUT


class EngineEpisodeError(EpisodeFailure, EngineError):
    """The engine failed during the episode. An `EngineError`: the manager requeues the task."""

    status = EpisodeStatus.ENGINE_ERROR


class StaleEpisodeFailure(EpisodeFailure, StaleEpisodeError, EpisodeError):
    """The episode's oldest token exceeds ``rollout.max_staleness``. An `EpisodeError` too, so
    the manager's episode handling counts it and requeues or drops it by its status (requeued
    by default, `DEFAULT_REQUEUE`) instead of treating it as a rollout bug."""

    status = EpisodeStatus.ABORTED_STALE


def failure_for(status: EpisodeStatus | str, message: str) -> EpisodeFailure:
    """The exception class of `status`. The manager handles it by its base class
    (`EngineError`, `EpisodeError`) and then requeues or drops it by its status
    (``rollout.requeue_statuses``)."""
    s = EpisodeStatus(status)
    cls = {
        EpisodeStatus.ENV_ERROR: EnvStepError,
        EpisodeStatus.AGENT_ERROR: AgentError,
        EpisodeStatus.TIMEOUT: EpisodeTimeout,
        EpisodeStatus.ENGINE_ERROR: EngineEpisodeError,
        EpisodeStatus.ABORTED_STALE: StaleEpisodeFailure,
    }.get(s)
    if cls is None:
        raise ValueError(f"{s} is a trainable status, not a failure")
    return cls(message)


def classify_exception(
    exc: BaseException, default: EpisodeStatus = EpisodeStatus.AGENT_ERROR
) -> EpisodeStatus:
    """The status of an episode that ended with `exc`.

    `EpisodeFailure` carries its own; `EngineError`/`MalformedReplyError` (also as the cause of
    the runner's `EpisodeError`) -> engine_error; `StaleEpisodeError` -> aborted_stale;
    `TimeoutError` -> timeout; the runner's other `EpisodeError`s (env.reset/env.step raised,
    undecodable ids) -> env_error; anything else -> `default` (the gateway: the agent's code
    raised -> agent_error).
    """
    if isinstance(exc, EpisodeFailure):
        return exc.status
    if isinstance(exc, EngineError | MalformedReplyError):
        return EpisodeStatus.ENGINE_ERROR
    if isinstance(exc, StaleEpisodeError):
        return EpisodeStatus.ABORTED_STALE
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return EpisodeStatus.TIMEOUT
    if isinstance(exc, EpisodeError):
        if isinstance(exc.__cause__, EngineError | MalformedReplyError):
            return EpisodeStatus.ENGINE_ERROR
        return EpisodeStatus.ENV_ERROR
    return EpisodeStatus(default)


class StatusCounters:
    """Per-status episode counts for metrics: ``episodes/<status>`` (all seven, zeros included),
    plus ``episodes/trainable_fraction`` (completed + truncated over all finished)."""

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()

    def record(self, status: EpisodeStatus | str, n: int = 1) -> None:
        self.counts[EpisodeStatus(status)] += n

    def metrics(self, prefix: str = "episodes/") -> dict[str, float]:
        out: dict[str, float] = {f"{prefix}{s.value}": self.counts[s] for s in EpisodeStatus}
        total = sum(self.counts.values())
        good = sum(self.counts[s] for s in TRAINABLE)
        out[f"{prefix}trainable_fraction"] = good / total if total else 1.0
        return out

    def state_dict(self) -> dict[str, int]:
        return {s.value: int(self.counts[s]) for s in EpisodeStatus}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.counts = collections.Counter({EpisodeStatus(k): int(v) for k, v in state.items()})


# ------------------------------------------------------------------ asynchronous steps
async def call_step(fn: Any, *args: Any, timeout_s: float | None = None, what: str = "step"):
    """Call an environment/tool function without blocking the event loop, under a time limit.

    ``fn(*args)`` may be a coroutine function (awaited) or a plain function (run in a worker
    thread with `asyncio.to_thread`, so a slow synchronous step never blocks other episodes).
    Raises `EpisodeTimeout` after `timeout_s` seconds (None: no limit; a thread that overruns
    cannot be killed and is left to finish on its own, its result discarded) and `EnvStepError`
    when the step raises.
    """
    if inspect.iscoroutinefunction(fn):
        aw = fn(*args)
    else:
        aw = asyncio.to_thread(fn, *args)
    try:
        return await asyncio.wait_for(aw, timeout=timeout_s)
    except TimeoutError as e:
        raise EpisodeTimeout(f"{what} took longer than {timeout_s} s (step_timeout_s)") from e
    except EpisodeFailure:
        raise
    except Exception as e:
        raise EnvStepError(f"{what} raised {type(e).__name__}: {e}") from e


__all__ = [
    "AgentError",
    "StaleEpisodeError",
    "DEFAULT_REQUEUE",
    "EngineEpisodeError",
    "EnvStepError",
    "EpisodeFailure",
    "EpisodeStatus",
    "EpisodeTimeout",
    "StaleEpisodeFailure",
    "StatusCounters",
    "TRAINABLE",
    "call_step",
    "classify_exception",
    "disposition",
    "failure_for",
    "is_trainable",
    "parse_statuses",
]
