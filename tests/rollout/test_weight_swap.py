"""Weight swaps under load: nothing in flight fails (issue 31.6).

The vLLM tests use the session's engines (conftest `engines`), only the first one. Before the fix
an idle quickstart declared its engine failed right after a weight update (``EngineError ...
/inference/v1/generate: ReadError``): the client reused a keep-alive connection for as long as
the server kept it (both 5 s), so a request sent as the server closed it was reset. And every
reload logged vLLM's "RotaryEmbedding: Failed to load weights". A fake-engine test checks that a
reload longer than ``request_timeout_s`` times out no request frozen by it.
"""

from __future__ import annotations

import asyncio
import itertools
import select
import socket
import time

import pytest
import torch
from safetensors.torch import load_file

from sao_megatron.rollout.engine import CLIENT_KEEP_ALIVE_S
from sao_megatron.rollout.manager import RolloutManager, Task
from tests.rollout.fakes import CountEnv, FakeEngine, FakeEngineClient, make_formatter
from tests.rollout.test_vllm import config

ROTARY_WARNING = "Failed to load weights"


class SlowReloadClient(FakeEngineClient):
    """A fake engine whose reload takes `reload_s` (a big model, a loaded machine)."""

    reload_s = 8.0

    async def reload_weights(self, path: str) -> dict:
        await asyncio.sleep(self.reload_s)
        return await super().reload_weights(path)


def test_a_reload_longer_than_the_request_timeout_times_out_no_request(one_fake_engine, tmp_path):
    """Requests frozen by an 8 s pause with ``request_timeout_s=4`` (healthy ones take ~0.3 s)
    wait for the resume: no engine failure, no requeue (before: TimeoutError, engine failed)."""
    engine = FakeEngine("engine0", token_latency_s=0.05)
    cfg = one_fake_engine(engine, max_concurrent_episodes=8, max_staleness=1, request_timeout_s=4.0)
    tasks = (Task(task_id=f"c{i}", make_env=CountEnv, seed=i) for i in itertools.count())
    with RolloutManager(
        cfg, make_formatter(), tasks, client_factory=SlowReloadClient, run_dir=tmp_path
    ) as m:
        m.get_batch(train_version=0, timeout=300)
        in_flight = m.router.loads[0].outstanding_requests
        res = m.publish_weights({"w": torch.zeros(2)}, version=1)
        m.get_batch(train_version=1, timeout=300)
        counters = dict(m.counters)
    assert in_flight > 0 and res.max_pause_s >= SlowReloadClient.reload_s
    assert not res.failed_engines
    for key in ("engine_failures", "requeued_engine", "requeued_timeout", "failed_groups"):
        assert counters.get(key, 0) == 0, (key, counters)


def _health_on(sock: socket.socket) -> bytes:
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: engine\r\n\r\n")
    reply = b""
    while b"\r\n\r\n" not in reply:
        data = sock.recv(4096)
        if not data:
            return reply
        reply += data
    return reply


@pytest.mark.vllm
def test_the_engine_keeps_an_idle_connection_open_past_the_client_keep_alive(engines):
    """The server must not close an idle connection the client may still reuse: it waits
    seconds longer than `CLIENT_KEEP_ALIVE_S` (before: 5 s on both sides)."""
    host, port = engines[0].url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        assert _health_on(sock).startswith(b"HTTP/1.1 200")
        time.sleep(CLIENT_KEEP_ALIVE_S + 4.0)
        readable, _, _ = select.select([sock], [], [], 0)
        closed = bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
        assert not closed, "the engine closed an idle connection the client could still reuse"
        assert _health_on(sock).startswith(b"HTTP/1.1 200")


@pytest.mark.vllm
def test_requests_in_flight_survive_weight_swaps_with_no_engine_failure(
    engines, tiny_models, tmp_path
):
    """Episodes and a stream of long requests run on one engine while its weights are swapped
    4 times, with a trainer that pauses ~5 s between a batch and the next sync (idle pooled
    connections, as in the quickstart): no engine failure, no requeue, no request error; every
    generation's versions step up only at a swap (per token, docs/ROLLOUT.md), and requests
    sent after a swap carry the new version. vLLM's rotary warning is logged 0 times."""
    cfg = config(
        tmp_path,
        engine_urls=[engines[0].url],
        trajectories_per_batch=4,
        max_concurrent_episodes=6,
        max_staleness=1,
        max_tokens_per_action=16,
    )
    weights = [load_file(m / "model.safetensors") for m in tiny_models]
    tasks = (Task(task_id=f"c{i}", make_env=CountEnv, seed=i) for i in itertools.count())
    gens: list[tuple[float, list[int]]] = []  # (start time, versions per token)
    errors: list[BaseException] = []
    log = engines[0].log_path
    with RolloutManager(cfg, make_formatter(), tasks, run_dir=tmp_path) as m:
        stop = asyncio.Event()

        async def stream(k: int) -> None:
            for n in itertools.count():
                if stop.is_set():
                    return
                start = time.monotonic()
                try:
                    g = await m.clients[0].generate(
                        [1, 5, 9, 11 + k],
                        max_tokens=160,
                        temperature=1.0,
                        top_p=1.0,
                        stop_token_ids=[],
                        seed=1000 * k + n,
                        ignore_eos=True,
                    )
                except Exception as e:  # noqa: BLE001 - counted and reported
                    errors.append(e)
                else:
                    gens.append((start, g.policy_versions))

        streams = [asyncio.run_coroutine_threadsafe(stream(k), m._loop) for k in range(2)]
        warnings_before = log.read_text(errors="replace").count(ROTARY_WARNING)
        synced_at, results = {0: 0.0}, []
        for version in range(1, 5):
            m.get_batch(train_version=version - 1, timeout=300)
            time.sleep(5.0)  # the trainer's step: the rollout idles at the staleness bound
            results.append(m.publish_weights(weights[version % 2], version=version))
            synced_at[version] = time.monotonic()
        final = m.get_batch(train_version=4, timeout=300)
        m._loop.call_soon_threadsafe(stop.set)
        for f in streams:
            f.result(timeout=300)
        warnings_after = log.read_text(errors="replace").count(ROTARY_WARNING)
        counters = dict(m.counters)
    assert not errors, errors
    assert all(not r.failed_engines and len(r.reports) == 1 for r in results)
    for key in ("engine_failures", "requeued_engine", "failed_groups", "engines_dropped"):
        assert counters.get(key, 0) == 0, (key, counters)
    assert all(t.max_policy_version >= 3 for t in final)  # within the staleness bound of 4
    assert len(gens) >= 8, len(gens)
    straddled = 0
    for start, versions in gens:
        assert versions == sorted(versions), versions  # a version changes only at a swap
        after = max(v for v, t in synced_at.items() if t <= start)
        assert min(versions) >= after, (start, versions, synced_at)  # sent after a swap: new
        straddled += len(set(versions)) > 1
    assert straddled >= 1  # some request was in flight across a swap and finished it
    assert warnings_after == warnings_before, (warnings_before, warnings_after, str(log))
