"""`EngineProcess.wait_ready` under load: the deadline follows log progress, one restart, and a
short error naming the log file (fake servers: python one-liners, no vLLM)."""

from __future__ import annotations

import sys

import pytest

from sao_megatron.rollout.config import RolloutConfig
from sao_megatron.rollout.engine import EngineError, EngineProcess

SLOW_SERVER = """
import http.server, sys, time
for i in range(12):  # 12 s of start-up, a log line every second
    print('loading', i, flush=True)
    time.sleep(1.0)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()
"""


#: seconds without log progress before a start counts as stalled: far above the 1 s between the
#: slow server's lines and a loaded machine's interpreter start-up, far below its 12 s start
STALL_S = 8.0


def _cfg() -> RolloutConfig:
    return RolloutConfig(vllm_python=sys.executable, startup_timeout_s=STALL_S)


def test_slow_start_that_keeps_logging_is_not_killed(tmp_path):
    class Slow(EngineProcess):
        def command(self):
            return [sys.executable, "-c", SLOW_SERVER, str(self.port)]

    p = Slow(_cfg(), 0, tmp_path, tmp_path / "run")
    p.start()
    try:
        waited = p.wait_ready()  # 12 s > startup_timeout_s=8, but the log grows
    finally:
        p.stop()
    assert waited > 11
    assert p.num_starts == 1


def test_silent_engine_is_restarted_once_then_named_by_its_log(tmp_path):
    class Silent(EngineProcess):
        def command(self):
            return [
                sys.executable,
                "-c",
                "print('hung here', flush=True); import time; time.sleep(60)",
            ]

    p = Silent(_cfg(), 2, tmp_path, tmp_path / "run")
    p.start()
    with pytest.raises(EngineError) as err:
        p.wait_ready()
    p.stop()
    msg = str(err.value)
    assert p.num_starts == 2  # one restart
    assert str(p.log_path) in msg and "silent for 8 s" in msg
    # The message quotes the log's last line: the engine's own, or (when the SIGTERM reaches the
    # supervisor before it has seen the engine die, as on a loaded machine) the supervisor's.
    log_text = p.log_path.read_text()
    lines = log_text.strip().splitlines()
    assert lines.count("hung here") == 2  # both starts ran and wrote to the same log
    assert repr(lines[-1]) in msg
    assert msg.count("\n") == 0  # one line, not the whole log
