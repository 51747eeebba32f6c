"""The file hand-off between the trainer and engines in their own job step
(`sao_megatron.rollout.serve`), with fake engines: no vLLM. The real thing runs in
tests/launch/test_slurm.py (two SLURM job steps)."""

from __future__ import annotations

import http.server
import threading
from pathlib import Path

import pytest

from sao_megatron.rollout import serve
from sao_megatron.rollout.config import RolloutConfig
from sao_megatron.rollout.engine import EngineError


@pytest.fixture
def health_server():
    """A server answering 200 on /health: the URL of a 'healthy engine'."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_config_takes_urls_or_urls_file_not_both():
    cfg = RolloutConfig(engine_urls_file="rollout/engine_urls.json")
    assert not cfg.launches_engines
    with pytest.raises(ValueError, match="rollout.engine_urls_file"):
        RolloutConfig(engine_urls=["http://a:1"], engine_urls_file="x.json")
    assert serve.resolve_urls_file(cfg, "/runs/a") == Path("/runs/a/rollout/engine_urls.json")
    with pytest.raises(ValueError, match="rollout.engine_urls_file is not set"):
        serve.resolve_urls_file(RolloutConfig(), "/runs/a")


def test_node_engine_listens_on_the_node_address(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    py = tmp_path / "python"
    py.touch()
    e = serve.NodeEngine(RolloutConfig(vllm_python=str(py)), 1, model, tmp_path / "n", "node7")
    e.port = 8123
    cmd = e.command()
    assert cmd[cmd.index("--host") + 1] == "node7" and "127.0.0.1" not in cmd
    assert cmd[cmd.index("--port") + 1] == "8123"
    assert e.url == "http://node7:8123"
    assert e.log_path == tmp_path / "n" / "engines" / "engine1.log"


def test_trainer_ignores_a_previous_runs_urls_and_reads_its_own(tmp_path, health_server):
    urls_file = tmp_path / "rollout" / "engine_urls.json"
    serve.write_json(urls_file, {"nonce": "old", "urls": ["http://dead:1"]})
    nonce = serve.request_engines(urls_file, tmp_path / "hf")
    assert not urls_file.exists()  # the old run's file is gone
    req = serve.read_json(serve.request_path(urls_file))
    assert req == {"nonce": nonce, "model_path": str((tmp_path / "hf").resolve())}
    serve.write_json(urls_file, {"nonce": "other", "urls": ["http://dead:1"]})

    def publish():
        serve.write_json(urls_file, {"nonce": nonce, "urls": [health_server], "logs": []})

    timer = threading.Timer(1.5, publish)
    timer.start()
    assert serve.wait_for_engine_urls(urls_file, nonce, stall_s=30, poll_s=0.1) == [health_server]
    timer.join()


def test_trainer_wait_fails_on_a_task_error_and_on_silence(tmp_path):
    urls_file = tmp_path / "engine_urls.json"
    nonce = serve.request_engines(urls_file, tmp_path)
    serve.write_json(serve.part_path(urls_file, 1), {"nonce": nonce, "host": "n2", "error": "boom"})
    with pytest.raises(EngineError, match="failed on n2: boom"):
        serve.wait_for_engine_urls(urls_file, nonce, stall_s=30, poll_s=0.1)
    serve.part_path(urls_file, 1).unlink()
    with pytest.raises(EngineError, match=r"no engine URLs in .*engine_urls.json"):
        serve.wait_for_engine_urls(urls_file, nonce, stall_s=0.5, poll_s=0.1)


class FakeEngine:
    """Stands in for `NodeEngine`: 'healthy' at the fake server's URL."""

    instances: list[FakeEngine] = []
    url_of: str = ""

    def __init__(self, config, index, model_path, run_dir, host):
        self.index, self.model_path, self.host = index, model_path, host
        self.url = f"{FakeEngine.url_of}"
        self.log_path = Path(run_dir) / "engines" / f"engine{index}.log"
        self.started = self.stopped = False
        FakeEngine.instances.append(self)

    def start(self):
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.write_text("starting\n")
        self.started = True

    def wait_ready(self):
        return 0.0

    def is_alive(self):
        return not self.stopped

    def stop(self):
        self.stopped = True


def test_serve_publishes_urls_and_exits_when_released(tmp_path, health_server, monkeypatch):
    """serve() in the main thread (it installs signal handlers), the 'trainer' in a thread:
    request -> URLs of both engines -> a new request restarts them -> release -> exit 0."""
    FakeEngine.instances, FakeEngine.url_of = [], health_server
    monkeypatch.setattr(serve, "NodeEngine", FakeEngine)

    async def versions(urls):
        return [3] * len(urls)

    monkeypatch.setattr(serve, "_weight_versions", versions)
    urls_file = tmp_path / "rollout" / "engine_urls.json"
    seen: dict = {}

    def trainer():
        try:
            first = serve.request_engines(urls_file, tmp_path / "hf_init")
            seen["first"] = serve.wait_for_engine_urls(urls_file, first, stall_s=60, poll_s=0.1)
            second = serve.request_engines(urls_file, tmp_path / "hf_policy")  # a new trainer
            seen["second"] = serve.wait_for_engine_urls(urls_file, second, stall_s=60, poll_s=0.1)
            serve.release_engines(urls_file, second)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            seen["error"] = e
            serve.release_engines(urls_file, "")

    t = threading.Thread(target=trainer)
    t.start()
    code = serve.serve(
        RolloutConfig(num_engines=2), urls_file, host="nodeA", task=0, num_tasks=1, poll_s=0.1
    )
    t.join(60)
    assert "error" not in seen, seen.get("error")
    assert code == 0
    assert seen["first"] == seen["second"] == [health_server, health_server]
    assert [e.model_path for e in FakeEngine.instances] == [
        str((tmp_path / "hf_init").resolve())
    ] * 2 + [str((tmp_path / "hf_policy").resolve())] * 2
    assert all(e.started and e.stopped for e in FakeEngine.instances)
    assert FakeEngine.instances[0].log_path == (
        urls_file.parent / "remote" / "nodeA" / "engines" / "engine0.log"
    )
    assert not urls_file.exists() and not serve.part_path(urls_file, 0).exists()
