"""The episode status taxonomy: classification of exceptions, trainability, dispositions and the
per-status metrics."""

import pytest

from sao_megatron.rollout.engine import EngineError, MalformedReplyError
from sao_megatron.rollout.runner import EpisodeError
from sao_megatron.rollout.status import (
    DEFAULT_REQUEUE,
    AgentError,
    EngineEpisodeError,
    EnvStepError,
    EpisodeStatus,
    EpisodeTimeout,
    StaleEpisodeError,
    StaleEpisodeFailure,
    StatusCounters,
    classify_exception,
    disposition,
    failure_for,
    is_trainable,
    parse_statuses,
)


def _chained(outer, cause):
    try:
        raise outer from cause
    except type(outer) as e:
        return e


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (EngineError("engine0: connection refused"), "engine_error"),
        (MalformedReplyError("garbled"), "engine_error"),
        # the runner wraps a malformed reply in EpisodeError: the cause decides
        (_chained(EpisodeError("t: garbled"), MalformedReplyError("x")), "engine_error"),
        (EpisodeError("t: env.step raised KeyError"), "env_error"),
        (StaleEpisodeError("too old"), "aborted_stale"),
        (TimeoutError(), "timeout"),
        (EnvStepError("tool"), "env_error"),
        (AgentError("x"), "agent_error"),
        (EpisodeTimeout("x"), "timeout"),
        (EngineEpisodeError("x"), "engine_error"),
        (StaleEpisodeFailure("x"), "aborted_stale"),
        (KeyError("agent bug"), "agent_error"),
    ],
)
def test_classify_exception(exc, status):
    assert classify_exception(exc) == EpisodeStatus(status)


def test_classify_default_and_failure_bases():
    assert classify_exception(ValueError(), default=EpisodeStatus.ENV_ERROR) == "env_error"
    # the classes keep the bases the manager already handles (requeue vs drop)
    assert isinstance(failure_for("engine_error", "m"), EngineError)
    assert isinstance(failure_for("aborted_stale", "m"), StaleEpisodeError)
    for s in ("env_error", "agent_error", "timeout"):
        e = failure_for(s, "m")
        assert isinstance(e, EpisodeError) and e.status == s and classify_exception(e) == s
    with pytest.raises(ValueError, match="trainable"):
        failure_for("completed", "m")


def test_only_completed_and_truncated_are_trainable():
    assert {s.value for s in EpisodeStatus if is_trainable(s)} == {"completed", "truncated"}
    assert [s.value for s in EpisodeStatus] == [
        "completed",
        "truncated",
        "env_error",
        "agent_error",
        "engine_error",
        "timeout",
        "aborted_stale",
    ]
    assert str(EpisodeStatus.TIMEOUT) == "timeout" and f"{EpisodeStatus.ENV_ERROR}" == "env_error"


def test_disposition_and_config_parsing():
    assert disposition("completed") == disposition("truncated") == "train"
    assert disposition("engine_error") == disposition("aborted_stale") == "requeue"
    assert {disposition(s) for s in ("env_error", "agent_error", "timeout")} == {"drop"}
    requeue = parse_statuses(["timeout", "engine_error"])
    assert requeue == {EpisodeStatus.TIMEOUT, EpisodeStatus.ENGINE_ERROR}
    assert disposition("timeout", requeue) == "requeue"
    assert disposition("aborted_stale", requeue) == "drop"
    assert DEFAULT_REQUEUE == parse_statuses(["engine_error", "aborted_stale"])
    with pytest.raises(ValueError, match=r"rollout.requeue_statuses: 'oops' is not"):
        parse_statuses(["oops"])
    with pytest.raises(ValueError, match="'completed' is trained"):
        parse_statuses(["completed"])


def test_status_counters_metrics_and_state():
    c = StatusCounters()
    assert c.metrics()["episodes/trainable_fraction"] == 1.0
    for s in ["completed"] * 3 + ["truncated", "engine_error", "env_error", "timeout", "timeout"]:
        c.record(s)
    m = c.metrics()
    assert m == {
        "episodes/completed": 3,
        "episodes/truncated": 1,
        "episodes/env_error": 1,
        "episodes/agent_error": 0,
        "episodes/engine_error": 1,
        "episodes/timeout": 2,
        "episodes/aborted_stale": 0,
        "episodes/trainable_fraction": 0.5,
    }
    d = StatusCounters()
    d.load_state_dict(c.state_dict())
    assert d.metrics() == m
