"""Engine process lifecycle without vLLM (a stand-in command), and reply parsing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest

from sao_megatron.net import free_port
from sao_megatron.rollout.config import RolloutConfig
from sao_megatron.rollout.engine import (
    EngineClient,
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
    assert wait_for(lambda: len(group_members(p.proc.pid)) == 3)  # supervisor, server, child
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


# A server that, like vLLM during start-up, ignores SIGTERM (the parent-death signal it used to
# get) and has a child of its own.
STUBBORN = (
    "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)']); time.sleep(300)"
)


class StubbornProcess(EngineProcess):
    stop_grace_s = 1.0

    def command(self) -> list[str]:
        return [sys.executable, "-c", STUBBORN]


def _launcher_script(tmp_path, cls: str, then: str) -> str:
    root = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    return textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {root!r})
        from pathlib import Path
        from tests.rollout.test_engine_process import {cls}, make_cfg, group_members
        t = Path({str(tmp_path)!r})
        p = {cls}(make_cfg(t), 0, t, t / "run")
        p.start()
        deadline = time.monotonic() + 300
        while len(group_members(p.proc.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)  # supervisor, server and the server's child are up
        print(p.proc.pid, flush=True)
        {then}
    """)


@pytest.mark.parametrize("how", ["atexit", "crash"])
def test_engine_dies_with_the_process_that_started_it(tmp_path, how):
    """Normal exit without stop(): atexit stops the group. Hard crash (os._exit, no atexit):
    the supervisor sees its parent die and stops the whole group, children included."""
    then = "os._exit(9)" if how == "crash" else "time.sleep(0.2)"
    script = _launcher_script(tmp_path, "SleeperProcess", then)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    pgid = int(out.stdout.split()[0])
    assert wait_for(lambda: group_members(pgid) == [], timeout=30)


def test_launcher_killed_during_start_up_leaves_no_engine_process(tmp_path):
    """Issue 19.6: the launcher is SIGKILLed while its engine is starting, and the engine
    ignores SIGTERM: the supervisor escalates to SIGKILL and the whole group is gone (it used to
    live on under PID 1)."""
    script = _launcher_script(tmp_path, "StubbornProcess", "time.sleep(300)")
    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pgid = int(launcher.stdout.readline())
        assert len(group_members(pgid)) == 3
        launcher.kill()  # SIGKILL: no atexit, no cleanup of any kind
        launcher.wait()
        gone = wait_for(lambda: group_members(pgid) == [], timeout=30)
    finally:
        launcher.kill()
        with contextlib.suppress(ProcessLookupError, NameError):
            os.killpg(pgid, signal.SIGKILL)  # leave nothing behind if the test fails
    assert gone
    assert (
        "parent died: stopping the engine group"
        in (tmp_path / "run/engines/engine0.log").read_text()
    )


def test_stop_escalates_to_sigkill_for_an_engine_ignoring_sigterm(tmp_path):
    p = StubbornProcess(make_cfg(tmp_path), 0, tmp_path, tmp_path / "run")
    p.start()
    assert wait_for(lambda: len(group_members(p.proc.pid)) == 3)
    t0 = time.monotonic()
    p.stop()
    assert group_members(p.proc.pid) == []  # the group ignoring SIGTERM was SIGKILLed
    assert time.monotonic() - t0 < 300  # (without escalation stop() would never return)


def test_supervisor_returns_the_server_exit_code_and_kills_its_leftovers(tmp_path):
    """A server that exits (crash in start-up) leaves no child behind, and its exit code and
    output reach wait_ready's error (through the supervisor)."""
    p = SleeperProcess(make_cfg(tmp_path), 0, tmp_path, tmp_path / "run")
    p.command = lambda: [
        sys.executable,
        "-c",
        "import subprocess, sys; subprocess.Popen([sys.executable, '-c', "
        "'import time; time.sleep(120)']); print('boom'); raise SystemExit(3)",
    ]
    p.start()
    assert p.proc.wait(30) == 3
    assert wait_for(lambda: group_members(p.proc.pid) == [])
    p.stop()


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


def test_free_port_is_bindable_on_loopback():
    import socket

    from sao_megatron.net import free_port
    from sao_megatron.rollout.engine import free_port as engine_free_port

    assert engine_free_port is free_port  # one implementation
    port = free_port()
    assert 1024 <= port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


class DroppingServer:
    """A loopback HTTP/1.1 server that reads each request in full and, for its first
    `num_drops` requests, closes (``how="close"``) or resets (``how="reset"``: SO_LINGER 0, an
    RST) the connection with no reply -- what a vLLM server closing an idle keep-alive
    connection does to a request that just went out on it (issue 31.6). Later requests get
    `body` as JSON, after `delay_s`."""

    def __init__(self, num_drops: int, how: str, body: dict, delay_s: float = 0.0) -> None:
        self.num_drops, self.how, self.delay_s = num_drops, how, delay_s
        self.body = json.dumps(body).encode()
        self.num_requests = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, buf = buf.split(b"\r\n\r\n", 1)
                length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
                while len(buf) < length:
                    buf += conn.recv(65536)
                buf = buf[length:]
                with self._lock:
                    self.num_requests += 1
                    drop = self.num_requests <= self.num_drops
                if drop:
                    if self.how == "reset":
                        conn.setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                        )
                    return
                time.sleep(self.delay_s)
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    + f"content-length: {len(self.body)}\r\n\r\n".encode()
                    + self.body
                )

    def close(self) -> None:
        self.sock.close()


def _generate(url: str, request_timeout_s: float = 120.0, pause_s: float | None = None):
    """(Generation or the exception raised, the client's retry count) of one request; with
    `pause_s`, the client pauses its engine's clock for that long while the request waits."""

    async def go():
        client = EngineClient(url, "e0", request_timeout_s)
        if pause_s is not None:  # what /pause ... /resume do to the clock (no server round trip)
            loop = asyncio.get_running_loop()
            loop.call_later(0.2, client.pause_clock.start)
            loop.call_later(0.2 + pause_s, client.pause_clock.stop)
        try:
            gen = await client.generate(
                [1, 2, 3], max_tokens=3, temperature=1.0, top_p=1.0, stop_token_ids=[]
            )
        except EngineError as e:
            gen = e
        finally:
            await client.aclose()
        return gen, client.num_retried_requests

    return asyncio.run(go())


@pytest.mark.parametrize("how", ["close", "reset"])
def test_a_request_whose_connection_drops_is_sent_once_more_to_the_same_engine(how):
    """Issue 31.6: before, the first drop (``ReadError`` on a reset, ``RemoteProtocolError`` on
    a close) was an EngineError and the engine was declared failed."""
    srv = DroppingServer(num_drops=1, how=how, body=good_choice())
    try:
        gen, retried = _generate(srv.url)
    finally:
        srv.close()
    assert not isinstance(gen, BaseException), gen
    assert gen.token_ids == [5, 6, 7] and gen.policy_versions == [3, 4, 4]
    assert retried == 1 and srv.num_requests == 2


def test_a_second_drop_or_a_refused_connection_is_an_engine_error():
    srv = DroppingServer(num_drops=2, how="reset", body=good_choice())
    try:
        err, retried = _generate(srv.url)
    finally:
        srv.close()
    assert isinstance(err, EngineError) and "on the retry after a ReadError" in str(err), err
    assert retried == 1 and srv.num_requests == 2  # once more, not forever
    # a dead engine (nothing listens on the port) fails at once, without a retry
    err, retried = _generate(f"http://127.0.0.1:{free_port()}")
    assert isinstance(err, EngineError) and "ConnectError" in str(err), err
    assert retried == 0


def test_the_client_drops_idle_connections_before_the_server_does(tmp_path):
    """The client's keep-alive is below vLLM's default (5 s) and ours, with a margin of seconds
    (a loaded server's event loop fires its timer late, not early). The real server keeps its
    side open that long: tests/rollout/test_weight_swap.py."""
    from sao_megatron.rollout.engine import CLIENT_KEEP_ALIVE_S, SERVER_KEEP_ALIVE_S

    env = SleeperProcess(make_cfg(tmp_path), 0, tmp_path, tmp_path / "run").environment()
    assert int(env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"]) == SERVER_KEEP_ALIVE_S
    assert CLIENT_KEEP_ALIVE_S + 2.0 <= min(5, SERVER_KEEP_ALIVE_S)


def test_a_weight_update_pause_does_not_count_against_the_request_timeout():
    """A reply 6 s late with ``request_timeout_s=3``: a timeout, unless the engine was paused
    for 5 s of it (a reload longer than the timeout), when the request waits for it (~1 s of
    unpaused waiting: 2 s of margin for a loaded machine)."""
    srv = DroppingServer(num_drops=0, how="close", body=good_choice(), delay_s=6.0)
    try:
        err, _ = _generate(srv.url, request_timeout_s=3.0)
        gen, _ = _generate(srv.url, request_timeout_s=3.0, pause_s=5.0)
    finally:
        srv.close()
    assert isinstance(err, EngineError) and "no reply within 3 s" in str(err), err
    assert not isinstance(gen, BaseException), gen
    assert gen.policy_versions == [3, 4, 4]
