"""Engine process lifecycle without vLLM (a stand-in command), and reply parsing."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import pytest

from sao_megatron.rollout.config import RolloutConfig
from sao_megatron.rollout.engine import (
    EngineError,
    EngineProcess,
    MalformedReplyError,
    group_members,
    parse_generation,
)

SLEEPER = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); time.sleep(120)"  # noqa: E501


class SleeperProcess(EngineProcess):
    """An EngineProcess whose server is a python that sleeps and has a child of its own."""

    def command(self) -> list[str]:
        return [sys.executable, "-c", SLEEPER]


def wait_for(cond, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def make_cfg(tmp_path) -> RolloutConfig:
    return RolloutConfig(
        vllm_python=sys.executable,
        startup_timeout_s=2.0,
    )


def test_stop_kills_the_whole_process_group(tmp_path):
    p = SleeperProcess(make_cfg(tmp_path), 0, tmp_path, tmp_path / "run")
    p.start()
    assert wait_for(lambda: len(group_members(p.proc.pid)) == 2)  # server + its child
    p.stop()
    assert group_members(p.proc.pid) == []
    assert "=== start 0" in p.log_path.read_text()


def test_wait_ready_reports_an_engine_that_exits(tmp_path):
    class Crashing(EngineProcess):
        def command(self):
            return [sys.executable, "-c", "print('boom: bad flag'); raise SystemExit(3)"]

    p = Crashing(make_cfg(tmp_path), 1, tmp_path, tmp_path / "run")
    p.start()
    with pytest.raises(EngineError, match="exited during start-up(.|\n)*boom: bad flag"):
        p.wait_ready()
    p.stop()


@pytest.mark.parametrize("how", ["atexit", "crash"])
def test_engine_dies_with_the_process_that_started_it(tmp_path, how):
    """Normal exit without stop(): atexit stops the group. Hard crash (os._exit, no atexit):
    the parent-death signal stops the server."""
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(__import__("pathlib").Path(__file__).resolve().parents[2])!r})
        from tests.rollout.test_engine_process import SleeperProcess, make_cfg
        from pathlib import Path
        p = SleeperProcess(make_cfg(Path({str(tmp_path)!r})), 0, Path({str(tmp_path)!r}),
                           Path({str(tmp_path)!r}) / "run")
        p.start()
        print(p.proc.pid, flush=True)
        import time; time.sleep(0.5)
        if {how!r} == "crash":
            os._exit(9)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    pgid = int(out.stdout.split()[0])
    if how == "atexit":
        assert wait_for(lambda: group_members(pgid) == [])
    else:  # the server got SIGTERM; its own child is its business (vLLM's server reaps its)
        assert wait_for(lambda: pgid not in group_members(pgid))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)  # the stand-in's orphaned child


def reply(body) -> httpx.Response:
    return httpx.Response(200, content=json.dumps(body).encode())


def good_choice(**over):
    c = {
        "token_ids": [5, 6, 7],
        "finish_reason": "stop",
        "logprobs": {"content": [{"token_id": t, "logprob": -0.5} for t in (5, 6, 7)]},
        "weight_versions": [
            {"version": "3", "start": 0, "end": 1},
            {"version": "4", "start": 1, "end": 3},
        ],
    }
    c.update(over)
    return {"choices": [c]}


def test_parse_generation_versions_per_token_and_malformed_replies():
    g = parse_generation(reply(good_choice()), "e0")
    assert g.token_ids == [5, 6, 7] and g.policy_versions == [3, 4, 4]
    assert g.logprobs == [-0.5] * 3 and g.finish_reason == "stop"
    g = parse_generation(
        reply(good_choice(weight_versions=[{"version": "default", "start": 0, "end": 3}])), "e0"
    )
    assert g.policy_versions == [0, 0, 0]
    bad = [
        {"choices": []},
        good_choice(logprobs=None),
        good_choice(logprobs={"content": [{"token_id": 5, "logprob": -1.0}]}),  # too few
        good_choice(weight_versions=[{"version": "1", "start": 0, "end": 2}]),  # uncovered
        good_choice(weight_versions=[{"version": "x", "start": 0, "end": 3}]),
    ]
    for body in bad:
        with pytest.raises(MalformedReplyError, match="malformed generate reply"):
            parse_generation(reply(body), "e0")
    with pytest.raises(MalformedReplyError):
        parse_generation(httpx.Response(200, content=b"<html>"), "e0")
