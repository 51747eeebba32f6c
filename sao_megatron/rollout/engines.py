"""EngineFleet: the one owner of a run's rollout engines and of the weight hand-off to them.

Rank 0 builds one fleet per run. It owns

* the engines: local vLLM processes it starts (`start_early` overlaps their start-up with SFT;
  `start` waits for them), processes it adopts (started by someone else: never stopped here), or
  remote engines it attaches to (``rollout.engine_urls``, or the URLs the engine step,
  ``sao-serve`` (`sao_megatron.rollout.serve`), publishes through ``rollout.engine_urls_file``);
* one `EngineClient` per engine, the `Router` over them and the asyncio event loop they live in
  (a background thread; the `RolloutManager` runs its episodes on the same loop);
* the weights they serve: `load(weights, version)` is the only hand-off, start weights included
  (one double-buffered `WeightPublisher` slot, then `sync_engine` on every healthy engine);
* their faults: a failed engine is restarted (local, up to ``rollout.max_engine_restarts``) or
  waited for (remote), then resynced to the latest loaded weights, or dropped; a watchdog
  notices local processes that exited between requests.

The per-engine update sequence (`sync_engine`): ``/pause?mode=keep`` (requests in flight freeze
at a step boundary, nothing is aborted) -> ``/collective_rpc sao_reload_weights(path)`` (in-place
reload plus the CPU MoE repack, see `sao_megatron.rollout.vllm_worker_ext`) ->
``/update_weight_version`` -> ``/reset_prefix_cache`` (cached KV of the old weights must not be
reused) -> ``/resume``; then ``/weight_info`` must report the new version (engines that silently
keep old weights are caught here). Requests in flight wait through the pause: the client's
`pause_clock` leaves it out of ``request_timeout_s``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sao_megatron.rollout import serve as remote
from sao_megatron.rollout.config import RolloutConfig
from sao_megatron.rollout.engine_client import (
    EngineClient,
    EngineError,
    Generation,
    wait_excluding_pauses,
)
from sao_megatron.rollout.engine_process import EngineProcess, start_engines
from sao_megatron.rollout.router import Router
from sao_megatron.rollout.runner import sample_action
from sao_megatron.weight_sync.publisher import WeightPublisher, WeightSource

log = logging.getLogger("sao_megatron.rollout")

ClientFactory = Callable[[str, str, float], EngineClient]
#: Seconds between two looks of the watchdog at the local engine processes.
WATCHDOG_S = 0.5


@dataclass
class EngineSyncReport:
    """What one engine did for one update. Times in seconds."""

    engine: str
    version: int
    pause_s: float
    reload_s: float
    num_tensors: int
    num_repacked_layers: int


@dataclass
class SyncResult:
    """Outcome of `EngineFleet.load`: the file written and each engine's report or error."""

    version: int
    path: str
    write_s: float
    reports: list[EngineSyncReport]
    failed_engines: list[str]

    @property
    def max_pause_s(self) -> float:
        return max((r.pause_s for r in self.reports), default=0.0)


async def sync_engine(client: EngineClient, path: str | Path, version: int) -> EngineSyncReport:
    """Pause `client`'s engine, reload `path`, set `version`, reset its prefix cache, resume.

    Raises EngineError if a step fails or the engine does not report `version` afterwards (the
    engine is then left for the caller to restart; resume is attempted in any case).
    """
    t0 = time.perf_counter()
    await client.pause()
    try:
        report = await client.reload_weights(str(path))
        await client.set_weight_version(version)
        await client.reset_prefix_cache()
    finally:
        try:
            await client.resume()
        except EngineError:
            pass
    pause_s = time.perf_counter() - t0
    seen = await client.weight_version()
    if seen != version:
        raise EngineError(f"{client.name} reports weight version {seen} after sync to {version}")
    return EngineSyncReport(
        engine=client.name,
        version=version,
        pause_s=pause_s,
        reload_s=float(report.get("seconds", float("nan"))),
        num_tensors=int(report.get("num_tensors", -1)),
        num_repacked_layers=int(report.get("num_repacked_layers", -1)),
    )


class EngineFleet:
    """The engines of one run (rank 0), their clients, their weights and their recovery.

    Args:
        config: the rollout config.
        run_dir: the rollout folder (a job: run_dir/rollout, absolute: remote engines read the
            weight slots by path): engine logs under ``engines/``, slots under ``weights/``.
        model_path: Hugging Face folder local engines start from (version `initial_version`).
        client_factory: builds the client of one engine from (url, name, timeout); tests pass
            an in-process fake (default `EngineClient`).
        processes: running local engines to adopt; restarted on failure like our own, but
            `stop` leaves them running.
        initial_version: the version the engines serve before the first `load`.
        urls_file: resolved ``rollout.engine_urls_file`` (remote engines found through files).

    Callbacks, called in the event loop: `on_change()` after an engine was recovered or
    dropped, `on_fatal(error)` when no engine is left.
    """

    def __init__(
        self,
        config: RolloutConfig,
        *,
        run_dir: str | Path,
        model_path: str | Path = "",
        client_factory: ClientFactory = EngineClient,
        processes: list[EngineProcess] | None = None,
        initial_version: int = 0,
        urls_file: Path | None = None,
    ) -> None:
        self.config = config
        self.run_dir, self.model_path = Path(run_dir), str(model_path)
        self.initial_version = initial_version
        self.urls_file = urls_file
        self.publisher = WeightPublisher(self.run_dir / "weights")
        self.processes: list[EngineProcess | None] = list(processes or [])
        self._owned: list[EngineProcess] = []  # started here: stopped by `stop`
        self._client_factory = client_factory
        self.urls: list[str] = []
        self.clients: list[EngineClient] = []
        self.engine_versions: list[int] = []
        self.router: Router | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.counters: collections.Counter = collections.Counter()
        self.on_change: Callable[[], None] = lambda: None
        self.on_fatal: Callable[[BaseException], None] = lambda error: None
        self._recovering: set[int] = set()
        self._restarts: list[int] = []
        self._remote_request: str | None = None  # nonce of our request to the engine step
        self.closing = False
        self._busy_mark: tuple[float, float] | None = None  # (wall, busy engine-seconds)

    # ================================================================ lifecycle (caller's thread)
    def start_early(self) -> None:
        """Begin starting the engines without waiting (their start-up overlaps the caller's
        work): spawn the local processes, or ask the engine step for remote engines on
        `model_path`. `start` waits for them. Nothing to do with ``rollout.engine_urls``."""
        c = self.config
        if c.launches_engines and not self.processes:
            self._owned = [
                EngineProcess(c, i, self.model_path, self.run_dir) for i in range(c.num_engines)
            ]
            self.processes = list(self._owned)
            for p in self._owned:
                p.start()
            log.info("starting %d vLLM engine(s) early", len(self._owned))
        elif c.engine_urls_file and self._remote_request is None:
            self._request_remote()

    def start(self) -> EngineFleet:
        """Engines ready and their clients connected (idempotent). Blocks until every engine
        answers /health; raises EngineError (after stopping what it started) if one does not."""
        if self.loop is not None:
            return self
        c = self.config
        try:
            if self._owned:  # started early
                for p in self._owned:
                    waited = p.wait_ready()
                    log.info("engine %d ready at %s (%.1f s later)", p.index, p.url, waited)
            elif not self.processes and c.launches_engines:
                self._owned = [
                    EngineProcess(c, i, self.model_path, self.run_dir) for i in range(c.num_engines)
                ]
                self.processes = list(self._owned)
                start_engines(self._owned)
            if self.processes:
                self.urls = [p.url for p in self.processes]
            else:
                self.urls = self._remote_urls()
                self.processes = [None] * len(self.urls)
        except BaseException:
            self.stop()
            raise
        self._restarts = [0] * len(self.urls)
        self.engine_versions = [self.initial_version] * len(self.urls)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="rollout-loop", daemon=True
        )
        self._thread.start()
        self.call(self._setup())
        return self

    def _request_remote(self) -> None:
        if self.urls_file is None:
            raise ValueError("rollout.engine_urls_file is set: pass its resolved path as urls_file")
        self._remote_request = remote.request_engines(self.urls_file, self.model_path)
        log.info(
            "asked the engine step for engines on %s (%s.request)", self.model_path, self.urls_file
        )

    def _remote_urls(self) -> list[str]:
        """``rollout.engine_urls``, or the URLs the engine step publishes for our request."""
        if self.config.engine_urls:
            return list(self.config.engine_urls)
        if self._remote_request is None:
            self._request_remote()
        return remote.wait_for_engine_urls(
            self.urls_file, self._remote_request, self.config.startup_timeout_s
        )

    def restart_from(self, model_path: str | Path) -> None:
        """The HF folder a restarted local engine starts from before its resync."""
        self.model_path = str(model_path)
        for p in self.processes:
            if p is not None:
                p.model_path = self.model_path

    def stop(self) -> None:
        """Close the clients, stop the loop and the engines this fleet started, release the
        remote engines (idempotent). Tasks still running in the loop are cancelled."""
        self.closing = True
        if self.loop is not None and self.loop.is_running():
            try:
                self.call(self._shutdown(), timeout=30)
            except Exception as e:  # noqa: BLE001 - best effort on the way out
                log.warning("engine fleet shutdown: %s", e)
            self.loop.call_soon_threadsafe(self.loop.stop)
            if self._thread is not None:
                self._thread.join(timeout=10)
        for p in self._owned:
            p.stop()
        if self._remote_request is not None:  # the engine step may exit now
            remote.release_engines(self.urls_file, self._remote_request)
            self._remote_request = None

    def call(self, coro, timeout: float | None = None):
        """Run `coro` in the fleet's event loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    # ================================================================ weights
    def load(self, weights: WeightSource, version: int, *, strict: bool = False) -> SyncResult:
        """Serve HF-named `weights` as `version` on every healthy engine (starts the fleet if
        needed): write the next double-buffered slot, then pause/reload/version/resume each
        engine concurrently. Engines that fail are handed to recovery (a restart loads this
        version); with `strict` (start weights) EngineError is raised for them instead."""
        self.start()
        t0 = time.perf_counter()
        path = self.publisher.publish(weights, version)
        write_s = time.perf_counter() - t0
        result = self.call(self._sync_all(str(path), version, write_s))
        log.info(
            "weights v%d: write %.3f s, engine pause max %.3f s, failed %s",
            version,
            write_s,
            result.max_pause_s,
            result.failed_engines,
        )
        if strict and result.failed_engines:
            raise EngineError(
                f"loading weights v{version} into {', '.join(result.failed_engines)} failed "
                "(see the log above)"
            )
        return result

    def busy_fraction(self) -> float:
        """Mean over engines of the share of wall time with a request outstanding, since the
        last call (since start the first time)."""
        if self.router is None or not self.router.loads:
            return 0.0
        now = time.monotonic()
        busy = sum(ld.busy_seconds(now) for ld in self.router.loads) / len(self.router.loads)
        t0, b0 = self._busy_mark or (self.router._t0, 0.0)
        self._busy_mark = (now, busy)
        return float(min(max((busy - b0) / max(now - t0, 1e-9), 0.0), 1.0))

    def stats(self) -> dict[str, float]:
        """``rollout/retried_requests`` (dropped connections sent once more) and each engine's
        utilisation (``engine/<name>/*``)."""
        out = {
            "rollout/retried_requests": sum(
                getattr(c, "num_retried_requests", 0) for c in self.clients
            )
        }
        if self.router is not None:
            for name, u in self.router.utilisation().items():
                out.update({f"engine/{name}/{k}": v for k, v in u.items()})
        return out

    def serving_version(self) -> int:
        """The oldest version a healthy engine serves (0 before `start`)."""
        healthy = self.router.healthy_indices() if self.router else []
        return min((self.engine_versions[i] for i in healthy), default=0)

    # ================================================================ event loop
    async def _setup(self) -> None:
        self.clients = [
            self._client_factory(u, f"engine{i}", self.config.request_timeout_s)
            for i, u in enumerate(self.urls)
        ]
        self.router = Router(
            self.clients, [c.name for c in self.clients], self.config.affinity_overload_factor
        )
        for c in self.clients:  # vLLM starts at version "default"; ours at initial_version
            await c.set_weight_version(self.initial_version)
            if self.config.records_routing:
                await c.enable_routing_capture()
        asyncio.get_running_loop().create_task(self._watchdog())

    async def _shutdown(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in self.clients:
            await c.aclose()

    async def generate(
        self,
        episode_id: str,
        prompt: list[int],
        max_tokens: int,
        seed: int | None,
        stop_ids: list[int],
        routing_start: int | None = None,
    ) -> Generation:
        """Sample one action on the engine the router picks for `episode_id` (at least one
        must be healthy). A failure (EngineError, or no reply within ``request_timeout_s`` not
        counting weight-update pauses) hands the engine to recovery and raises EngineError."""
        cost = len(prompt) + max_tokens
        i = self.router.choose(episode_id, cost)
        self.router.begin(i, episode_id, len(prompt), cost)
        client = self.clients[i]
        gen: Generation | None = None
        try:
            gen = await wait_excluding_pauses(  # a weight update's pause is not a hang
                sample_action(
                    client,
                    prompt,
                    max_tokens=max_tokens,
                    seed=seed,
                    config=self.config,
                    stop_ids=stop_ids,
                    routing_start=routing_start,
                ),
                self.config.request_timeout_s,
                client.pause_clock,
            )
        except (EngineError, TimeoutError) as e:
            self.on_engine_failure(i, e)
            raise EngineError(f"{client.name}: {type(e).__name__}: {e}") from e
        finally:
            self.router.end(i, cost, len(gen.token_ids) if gen else 0)
        return gen

    async def _sync_all(self, path: str, version: int, write_s: float) -> SyncResult:
        healthy = [i for i in self.router.healthy_indices() if i not in self._recovering]
        results = await asyncio.gather(
            *(sync_engine(self.clients[i], path, version) for i in healthy), return_exceptions=True
        )
        reports, failed = [], []
        for i, r in zip(healthy, results, strict=True):
            if isinstance(r, BaseException):
                failed.append(self.clients[i].name)
                self.on_engine_failure(i, r)
            else:
                reports.append(r)
                self.engine_versions[i] = version
        return SyncResult(version, path, write_s, reports, failed)

    # ---------------------------------------------------------------- faults (in the loop)
    async def _watchdog(self) -> None:
        """Every `WATCHDOG_S`: a local process that has exited is recovered now, not when a
        request next fails on it (an idle engine that dies, or one whose requests all ended
        before it died, would otherwise stay down unnoticed and the router would keep it as
        healthy)."""
        while not self.closing:
            for i, p in enumerate(self.processes):
                if p is None or i in self._recovering or p.is_alive():
                    continue
                if i in self.router.healthy_indices():
                    self.on_engine_failure(
                        i,
                        EngineError(
                            f"engine{i} process exited with status {p.exit_code} (log {p.log_path})"
                        ),
                    )
            await asyncio.sleep(WATCHDOG_S)

    def on_engine_failure(self, i: int, error: BaseException) -> None:
        """Engine `i` failed a request or an update: take it out of the router and recover it
        in the background (call in the loop)."""
        if i in self._recovering or self.closing:
            return
        log.warning("engine %d failed (%s: %s); recovering", i, type(error).__name__, error)
        self.counters["engine_failures"] += 1
        self._recovering.add(i)
        self.router.set_healthy(i, False)
        asyncio.get_running_loop().create_task(self._recover(i))

    async def _recover(self, i: int) -> None:
        try:
            ok = await self._try_recover(i)
        except Exception as e:  # noqa: BLE001 - recovery failing means "drop the engine"
            log.error("engine %d recovery failed: %s", i, e)
            ok = False
        self._recovering.discard(i)
        if ok:
            self.router.set_healthy(i, True)
            log.info("engine %d back at version %d", i, self.engine_versions[i])
        else:
            self.counters["engines_dropped"] += 1
            log.error("engine %d dropped", i)
            if not self.router.healthy_indices() and not self._recovering:
                self.on_fatal(EngineError("every engine failed and could not be restarted"))
        self.on_change()

    async def _try_recover(self, i: int) -> bool:
        proc = self.processes[i]
        client = self.clients[i]
        if await client.healthy() and (proc is None or proc.is_alive()):
            return True  # a slow request, not a dead engine
        if proc is None:  # remote engine: give it the start-up time to come back
            deadline = time.monotonic() + self.config.startup_timeout_s
            while time.monotonic() < deadline and not self.closing:
                if await client.healthy():
                    return await self._resync(i)
                await asyncio.sleep(2.0)
            return False
        if self._restarts[i] >= self.config.max_engine_restarts:
            return False
        self._restarts[i] += 1
        self.counters["engine_restarts"] += 1
        await asyncio.to_thread(proc.stop)
        await asyncio.to_thread(proc.start)
        await asyncio.to_thread(proc.wait_ready)
        await client.aclose()
        self.clients[i] = self._client_factory(proc.url, client.name, self.config.request_timeout_s)
        self.router.engines[i] = self.clients[i]
        return await self._resync(i)

    async def _resync(self, i: int) -> bool:
        c = self.clients[i]
        if self.config.records_routing:  # a restarted engine starts without the capture
            await c.enable_routing_capture()
        version = self.publisher.latest_version
        if version is None:  # a restarted engine loads the initial weights again
            await c.set_weight_version(self.initial_version)
            self.engine_versions[i] = self.initial_version
        else:
            await sync_engine(c, self.publisher.latest_path, version)
            self.engine_versions[i] = version
        return True
