"""Episode statuses: how an episode ended, and which statuses are trained (no project imports, so
`rollout.config` can validate `requeue_statuses` with it). The exceptions and counters that use
them live in `sao_megatron.rollout.status`."""

from __future__ import annotations

import enum
from collections.abc import Iterable


class EpisodeStatus(str, enum.Enum):  # noqa: UP042 - StrEnum needs 3.11; we support 3.10
    """How an episode ended (the value is the metric suffix: ``episodes/<value>``)."""

    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ENV_ERROR = "env_error"
    AGENT_ERROR = "agent_error"
    ENGINE_ERROR = "engine_error"
    TIMEOUT = "timeout"
    ABORTED_STALE = "aborted_stale"

    @property
    def trainable(self) -> bool:
        return self in TRAINABLE

    def __str__(self) -> str:  # f"{status}" -> "completed"
        return self.value


TRAINABLE = frozenset({EpisodeStatus.COMPLETED, EpisodeStatus.TRUNCATED})
#: default of the proposed ``rollout.requeue_statuses``: retried with a fresh attempt
DEFAULT_REQUEUE = frozenset({EpisodeStatus.ENGINE_ERROR, EpisodeStatus.ABORTED_STALE})


def is_trainable(status: EpisodeStatus | str) -> bool:
    """True only for ``completed`` and ``truncated``."""
    return EpisodeStatus(status) in TRAINABLE


def parse_statuses(names: Iterable[str], field: str = "rollout.requeue_statuses") -> frozenset:
    """Statuses from config strings; ValueError naming `field` for an unknown or trainable one."""
    out = set()
    for name in names:
        try:
            s = EpisodeStatus(name)
        except ValueError:
            raise ValueError(
                f"{field}: {name!r} is not an episode status; use some of "
                f"{[s.value for s in EpisodeStatus if not s.trainable]}"
            ) from None
        if s.trainable:
            raise ValueError(f"{field}: {name!r} is trained, not requeued; remove it")
        out.add(s)
    return frozenset(out)
