"""RolloutManager: runs episodes on the engines in the background and hands batches to the trainer.

The trainer's whole view of the rollout (all methods are called from the trainer's thread)::

    with RolloutManager(config, formatter, tasks, run_dir=..., model_path=...) as rollout:
        for step in range(num_steps):
            batch = rollout.get_batch(train_version=step)            # list[Trajectory]
            ...train on batch...
            report = rollout.publish_weights(hf_named_tensors, version=step + 1)

Inside, an asyncio event loop on a background thread keeps up to ``max_concurrent_episodes``
episode groups in flight (one trajectory per task for SAO, ``group_size`` for GRPO), admits
new ones while the engines are within the staleness bound and the AReaL capacity rule holds
(`StalenessBuffer.can_start`), routes every request through the `Router`, and streams each
finished group into the `StalenessBuffer` at once. Episodes in flight are never aborted for
staleness (docs/ROLLOUT.md, "Bounded staleness").

Faults: a request that fails with `EngineError` (connection refused, dropped twice, HTTP 5xx,
timeout after ``request_timeout_s`` not counting weight-update pauses, aborted) marks its engine
unhealthy and fails the whole group, whose task is requeued (front of the queue, same task_id and
seed, a new attempt; nothing of the failed attempt reaches the buffer, so no task is lost or counted
twice). A recovery task then restarts a dead local engine (up to ``max_engine_restarts``; it reloads
the latest published weights and version) or waits for a remote one to answer /health, or drops it.
`EpisodeError` (environment exception, malformed reply) drops that group with a logged error; the
run goes on — unless `MAX_CONSECUTIVE_FAILURES` groups in a row fail with no trajectory admitted in
between: then the rollout stops and `get_batch` raises at once with the first error of that streak
(a broken environment, tokenizer or model fails every episode; retrying forever only floods the
log).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from sao_megatron.algorithm.deviation_controller import (
    DeviationController,
    DeviationControllerConfig,
)
from sao_megatron.data.episode import EpisodeFormatter
from sao_megatron.data.trajectory import Trajectory
from sao_megatron.rollout.buffer import Group, StalenessBuffer
from sao_megatron.rollout.config import RolloutConfig
from sao_megatron.rollout.engine import (
    EngineClient,
    EngineError,
    EngineProcess,
    Generation,
    start_engines,
    wait_excluding_pauses,
)
from sao_megatron.rollout.gateway import close_shared_gateway
from sao_megatron.rollout.router import Router
from sao_megatron.rollout.runner import EpisodeError, run_episode, sample_action, stop_token_ids
from sao_megatron.rollout.status import (
    EpisodeStatus,
    StatusCounters,
    classify_exception,
    disposition,
    parse_statuses,
)
from sao_megatron.weight_sync.engines import EngineSyncReport, sync_engine
from sao_megatron.weight_sync.publisher import WeightPublisher, WeightSource

log = logging.getLogger("sao_megatron.rollout")

#: Groups failing in a row (dropped: environment/reply errors, or engine faults past
#: rollout.max_episode_attempts) with no trajectory admitted in between before the rollout
#: gives up. 16 is above any plausible run of independent bad luck (a healthy run fails a few
#: percent of episodes at most, interleaved with successes) and small enough to stop within
#: the first wave of episodes (max_concurrent_episodes defaults to 16).
MAX_CONSECUTIVE_FAILURES = 16


@dataclass
class Task:
    """One task: build a fresh environment with `make_env()` and reset it with `seed`.

    task_id must be unique per task (GRPO groups by it; the fault tests count it).
    """

    task_id: str
    make_env: Callable[[], object]
    seed: int


@dataclass
class SyncResult:
    """Outcome of `publish_weights`: the file written and each engine's report or error."""

    version: int
    path: str
    write_s: float
    reports: list[EngineSyncReport]
    failed_engines: list[str]

    @property
    def max_pause_s(self) -> float:
        return max((r.pause_s for r in self.reports), default=0.0)


ClientFactory = Callable[[str, str, float], EngineClient]


class RolloutManager:
    """Owns the engines, the router, the buffer and the background episode loop.

    Args:
        config: the rollout config.
        formatter: episode format (tokenizer, prompt layout, stop tokens).
        tasks: an iterable of `Task` (usually endless); drawn lazily, requeued tasks first.
        client_factory: builds the client of one engine from (url, name, timeout); tests pass
            an in-process fake here (default `EngineClient`).
        processes: already running local engines to adopt instead of starting new ones (they
            are restarted on failure like our own, but `stop()` leaves them running).
        run_dir: folder for engine logs and the weight-sync slots (a job: run_dir/rollout).
        model_path: Hugging Face checkpoint folder local engines load, version 0 (required when
            starting engines; a job passes the exported policy).
        group_size: trajectories per task, the algorithm's (`Algorithm.group_size`); 1 = SAO.
        initial_version: the policy version of the weights the engines start with (a resumed
            run serves its checkpoint's weights as that version, so nothing sampled before the
            first sync is mislabelled or stale).
    """

    def __init__(
        self,
        config: RolloutConfig,
        formatter: EpisodeFormatter,
        tasks: Iterable[Task],
        *,
        client_factory: ClientFactory = EngineClient,
        processes: list[EngineProcess] | None = None,
        initial_version: int = 0,
        run_dir: str | Path,
        model_path: str = "",
        group_size: int = 1,
    ) -> None:
        if group_size < 1 or config.trajectories_per_batch % group_size:
            raise ValueError(
                f"rollout.trajectories_per_batch={config.trajectories_per_batch} must be a "
                f"multiple of the group size {group_size} (algorithm.grpo.group_size)"
            )
        self.config = config
        self.run_dir, self.model_path, self.group_size = Path(run_dir), model_path, group_size
        self.formatter = formatter
        self.stop_token_ids = stop_token_ids(formatter, config)
        self._tasks: Iterator[Task] = iter(tasks)
        self._requeued: collections.deque[tuple[Task, int]] = collections.deque()
        self._client_factory = client_factory
        self.buffer = StalenessBuffer(
            trajectories_per_batch=config.trajectories_per_batch,
            group_size=group_size,
            max_staleness=config.max_staleness,
            on_stale=self._on_stale_group,
        )
        self.publisher = WeightPublisher(self.run_dir / "weights")
        self.processes: list[EngineProcess | None] = list(processes or [])
        self._owns_processes = processes is None
        self.urls: list[str] = []
        self.clients: list[EngineClient] = []
        self.engine_versions: list[int] = []
        self.router: Router | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._wake: asyncio.Event | None = None
        self._recovering: set[int] = set()
        self._restarts: list[int] = []
        self._inflight = 0
        self._closing = False
        self._fatal: BaseException | None = None
        self._drained_since: float | None = None  # task source exhausted, nothing in flight
        self._failure_streak: list[BaseException] = []  # failed groups since the last success
        self._t0 = time.monotonic()
        self.counters = collections.Counter()
        self.status_counters = StatusCounters()  # episodes/<status> in stats()
        self._requeue = parse_statuses(config.requeue_statuses)
        self.attempts: collections.Counter = collections.Counter()  # task_id -> attempts started
        self._task_by_id: dict[str, Task] = {}  # tasks started and not yet handed to the trainer
        self.sync_history: list[SyncResult] = []
        self.initial_version = initial_version
        self.buffer.set_train_version(initial_version)
        self.max_inflight = config.max_concurrent_episodes  # lowered by the controller
        self.controller: DeviationController | None = None
        if config.deviation_target is not None:
            self.controller = DeviationController(
                DeviationControllerConfig(
                    target=config.deviation_target,
                    max_staleness=config.max_staleness,
                    max_inflight=max(config.max_concurrent_episodes, group_size),
                    min_inflight=group_size,
                    immediate_cut=config.deviation_bound_trained,
                )
            )
        self._busy_mark: tuple[float, float] | None = None  # (wall, busy engine-seconds)

    # ================================================================ lifecycle (trainer thread)
    def start(self) -> RolloutManager:
        """Start local engines (or attach to `engine_urls`), then the episode loop. Blocks until
        every engine is healthy. Raises EngineError if one fails to start."""
        c = self.config
        if self.processes:
            self.urls = [p.url for p in self.processes]
        elif c.launches_engines:
            procs = [
                EngineProcess(c, i, self.model_path, self.run_dir) for i in range(c.num_engines)
            ]
            self.processes = list(procs)
            try:
                start_engines(procs)
            except BaseException:
                self.stop()
                raise
            self.urls = [p.url for p in procs]
        else:
            self.processes = [None] * len(c.engine_urls)
            self.urls = list(c.engine_urls)
        self._restarts = [0] * len(self.urls)
        self.engine_versions = [self.initial_version] * len(self.urls)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="rollout-loop", daemon=True
        )
        self._thread.start()
        self._call(self._setup())
        self._main_future = asyncio.run_coroutine_threadsafe(self._schedule(), self._loop)
        return self

    def __enter__(self) -> RolloutManager:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop the loop, close clients and stop local engines (idempotent)."""
        self._closing = True
        if self._loop is not None and self._loop.is_running():
            try:
                self._call(self._shutdown(), timeout=30)
            except Exception as e:  # noqa: BLE001 - best effort on the way out
                log.warning("rollout shutdown: %s", e)
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(timeout=10)
        if self._owns_processes:
            for p in self.processes:
                if p is not None:
                    p.stop()

    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # ================================================================ trainer API
    def get_batch(self, train_version: int, timeout: float | None = None) -> list[Trajectory]:
        """Block until `trajectories_per_batch` trajectories are ready whose newest token is
        within max_staleness of `train_version`; return them (GRPO groups contiguous). Their
        older tokens are the trainer's to mask (`sao_megatron.rollout.staleness`).

        Raises TimeoutError after `timeout` s (the message gives the time waited and the
        rollout's counts); RuntimeError if the rollout failed (no engine left, every episode
        failing) or a finite task source ran out before the batch was full.
        """
        t0 = time.monotonic()
        deadline = None if timeout is None else t0 + timeout
        while True:
            if self._fatal is not None:
                raise RuntimeError(f"rollout failed: {self._fatal}") from self._fatal
            left = None if deadline is None else deadline - time.monotonic()
            step = 1.0 if left is None else max(0.0, min(1.0, left))
            try:
                batch = self.buffer.get_batch(train_version, timeout=step)
            except TimeoutError:
                drained = self._drained_since
                if drained is not None and time.monotonic() - drained > 2.0:
                    raise RuntimeError(
                        f"the task source is exhausted: {self.buffer.num_ready()} trajectories "
                        f"left, fewer than rollout.trajectories_per_batch="
                        f"{self.config.trajectories_per_batch}"
                    ) from None
                if left is not None and left <= step:
                    raise TimeoutError(
                        f"no batch of {self.config.trajectories_per_batch} trajectories at "
                        f"train_version={train_version} after {time.monotonic() - t0:.1f} s: "
                        f"{self._progress()}"
                    ) from None
                continue
            for t in batch:
                self._task_by_id.pop(t.task_id, None)
            self.counters["consumed_tokens"] += _action_tokens(batch)
            self._poke()
            return batch

    def _progress(self) -> str:
        """One line of rollout counts for error messages."""
        c = self.counters
        healthy = len(self.router.healthy_indices()) if self.router else 0
        return (
            f"{self.buffer.num_ready()} admissible ready, {self._inflight} episodes in flight, "
            f"{c['trajectories']} trajectories finished, {c['failed_groups']} groups failed, "
            f"{c['requeued_engine']} requeued after engine faults, {c['requeued_stale']} "
            f"requeued as stale, {c['engine_failures']} engine failures, {healthy}/"
            f"{len(self.urls)} engines healthy, engine version {self._engine_version()}"
        )

    def publish_weights(self, weights: WeightSource, version: int) -> SyncResult:
        """Publish HF-named `weights` as `version` and sync every healthy engine to it.

        Writes the double-buffered slot file, then pauses/reloads/versions/resumes each engine
        (concurrently). Engines that fail are handed to recovery (restart loads this version).
        Returns the per-engine pause times (logged too).
        """
        t0 = time.perf_counter()
        path = self.publisher.publish(weights, version)
        write_s = time.perf_counter() - t0
        result = self._call(self._sync_all(str(path), version, write_s))
        self.sync_history.append(result)
        self.buffer.set_train_version(version)
        self._poke()
        log.info(
            "weights v%d: write %.3f s, engine pause max %.3f s, failed %s",
            version,
            write_s,
            result.max_pause_s,
            result.failed_engines,
        )
        return result

    def observe_step(self, metrics: dict[str, float]) -> dict[str, float]:
        """Measure the engines' busy fraction of the step (``rollout/busy_fraction``: the mean
        over engines of the share of wall time since the previous call with a request
        outstanding; absent before `start`) and, with ``rollout.deviation_target``, feed the
        step's metrics to the deviation controller and apply its admission bounds (its state,
        ``controller/*``, is returned too).

        Reads ``deviation/abs_one_minus_ratio_mean`` and ``deviation/lag0/abs_one_minus_ratio_mean``
        (`sao_megatron.trainer.rl_step`).
        """
        out = {} if self.router is None else {"rollout/busy_fraction": self._busy_fraction()}
        if self.controller is None:
            return out
        self.controller.update(
            deviation=float(metrics.get("deviation/abs_one_minus_ratio_mean", float("nan"))),
            deviation_lag0=float(
                metrics.get("deviation/lag0/abs_one_minus_ratio_mean", float("nan"))
            ),
            busy_fraction=out.get("rollout/busy_fraction", 0.0),
        )
        self.buffer.set_admission_staleness(
            self.controller.max_staleness, hand_off=self.config.deviation_bound_trained
        )
        self.max_inflight = self.controller.max_inflight
        self._poke()
        return self.controller.metrics() | out

    def _busy_fraction(self) -> float:
        """Mean over engines of the share of wall time with a request outstanding, since the
        last call (since start the first time)."""
        if self.router is None or not self.router.loads:
            return 0.0
        now = time.monotonic()
        busy = sum(ld.busy_seconds(now) for ld in self.router.loads) / len(self.router.loads)
        t0, b0 = self._busy_mark or (self.router._t0, 0.0)
        self._busy_mark = (now, busy)
        return float(min(max((busy - b0) / max(now - t0, 1e-9), 0.0), 1.0))

    def stats(self) -> dict:
        """Counters, buffer stats, per-engine utilisation and throughput since start."""
        wall = time.monotonic() - self._t0
        out = {f"rollout/{k}": v for k, v in self.counters.items()}
        out.update({f"buffer/{k}": v for k, v in self.buffer.stats.items()})
        out.update(self.status_counters.metrics())
        c = self.counters
        out["rollout/pending_tokens"] = (  # sampled, neither handed over nor dropped yet
            c["generated_tokens"]
            - c["consumed_tokens"]
            - c["discarded_tokens"]
            - c["stale_dropped_tokens"]
        )
        out["rollout/retried_requests"] = sum(  # dropped connections sent once more
            getattr(c, "num_retried_requests", 0) for c in self.clients
        )
        out["rollout/wall_s"] = wall
        out["rollout/trajectories_per_s"] = self.counters["trajectories"] / max(wall, 1e-9)
        out["rollout/tokens_per_s"] = self.counters["generated_tokens"] / max(wall, 1e-9)
        if self.router is not None:
            for name, u in self.router.utilisation().items():
                out.update({f"engine/{name}/{k}": v for k, v in u.items()})
        return out

    # ================================================================ event loop internals
    def _poke(self) -> None:
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def _setup(self) -> None:
        self._wake = asyncio.Event()
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

    async def _shutdown(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in self.clients:
            await c.aclose()
        await close_shared_gateway()

    def _engine_version(self) -> int:
        healthy = self.router.healthy_indices() if self.router else []
        return min((self.engine_versions[i] for i in healthy), default=0)

    def _next_task(self) -> tuple[Task, int] | None:
        if self._requeued:
            return self._requeued.popleft()
        try:
            return next(self._tasks), 0
        except StopIteration:
            return None

    async def _schedule(self) -> None:
        """Start groups while the capacity rule and the concurrency limit allow."""
        g = self.group_size
        exhausted = False
        while not self._closing:
            self._wake.clear()
            while (
                self._fatal is None
                and self._inflight + g <= max(self.max_inflight, g)
                and self.buffer.can_start(self._engine_version(), base_version=self.initial_version)
            ):
                item = self._next_task()
                if item is None:
                    exhausted = True
                    break
                self.buffer.mark_started()
                self._inflight += g
                asyncio.get_running_loop().create_task(self._run_group(*item))
            self._check_processes()
            drained = exhausted and self._inflight == 0 and not self._requeued
            if not drained:
                self._drained_since = None
            elif self._drained_since is None:
                self._drained_since = time.monotonic()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=0.5)
            except TimeoutError:
                pass

    async def _run_group(self, task: Task, attempt: int) -> None:
        g = self.group_size
        self.attempts[task.task_id] += 1
        self._task_by_id[task.task_id] = task
        self.counters["episodes_started"] += g
        sampled = [0]  # tokens the engines returned to this attempt's episodes, all members
        results = await asyncio.gather(
            *(self._run_one(task, i, attempt, sampled) for i in range(g)), return_exceptions=True
        )
        self._inflight -= g
        errors = [r for r in results if isinstance(r, BaseException)]
        for r in results:  # every episode ends with a status (rollout/status.py)
            if isinstance(r, Trajectory):
                self.status_counters.record(r.status)
            elif isinstance(r, EpisodeError | EngineError | TimeoutError):
                self.status_counters.record(classify_exception(r))
        try:
            if not errors:
                self.buffer.put_group(list(results))
                self.counters["trajectories"] += g
                self._failure_streak.clear()
                return
            self.buffer.mark_discarded()
            # the whole group is dropped, its finished members included (GRPO: one failed
            # member costs the G episodes' tokens)
            self.counters["discarded_tokens"] += sampled[0]
            retry = [
                e
                for e in errors
                if isinstance(e, EpisodeError | EngineError | TimeoutError)
                and disposition(classify_exception(e), self._requeue) == "requeue"
            ]
            if retry and attempt + 1 < self.config.max_episode_attempts:
                kind = classify_exception(retry[0]).value.removesuffix("_error")
                self.counters[f"requeued_{kind}"] += 1  # requeued_engine, requeued_timeout, ...
                log.warning(
                    "task %s attempt %d requeued (%s): %s", task.task_id, attempt, kind, retry[0]
                )
                self._requeued.appendleft((task, attempt + 1))
            else:
                self.counters["failed_groups"] += 1
                bad = [e for e in errors if not isinstance(e, EpisodeError)] or errors
                log.error(
                    "task %s dropped after attempt %d: %s: %s",
                    task.task_id,
                    attempt,
                    type(bad[0]).__name__,
                    bad[0],
                )
                if not isinstance(bad[0], EpisodeError | EngineError | TimeoutError):
                    raise bad[0]
                self._failure_streak.append(bad[0])
                if len(self._failure_streak) == MAX_CONSECUTIVE_FAILURES:
                    first = self._failure_streak[0]
                    self._fatal = RuntimeError(
                        f"{len(self._failure_streak)} episode groups in a row failed with no "
                        f"trajectory admitted in between; the first error: "
                        f"{type(first).__name__}: {first}"
                    )
                    self._fatal.__cause__ = first
                    log.error("rollout stopped: %s", self._fatal)
        except Exception as e:  # a bug: stop the run loudly rather than hang the trainer
            self._fatal = e
            log.exception("rollout loop failed")
        finally:
            self._wake.set()

    async def _run_one(
        self, task: Task, group_index: int, attempt: int, sampled: list[int]
    ) -> Trajectory:
        """One episode of a group; `sampled[0]` (shared by the group) accumulates the tokens its
        requests returned."""
        episode_id = f"{task.task_id}#{group_index}@{attempt}"
        try:
            env = task.make_env()
        except Exception as e:
            raise EpisodeError(f"{task.task_id}: make_env raised {type(e).__name__}: {e}") from e

        async def generate(
            eid: str,
            prompt: list[int],
            max_tokens: int,
            seed: int | None,
            routing_start: int | None = None,
        ) -> Generation:
            gen = await self._generate(eid, prompt, max_tokens, seed, routing_start)
            sampled[0] += len(gen.token_ids)
            return gen

        kw = {
            "seed": task.seed,
            "task_id": task.task_id,
            "formatter": self.formatter,
            "generate": generate,
            "config": self.config,
            "group_index": group_index,
            "episode_id": episode_id,
        }
        try:
            agent_run = getattr(env, "run_episode", None)  # an AgentEnvironment (rollout/gateway/)
            if agent_run is not None:  # enforces rollout.episode_timeout_s itself
                traj = await agent_run(**kw)
            else:
                traj = await asyncio.wait_for(
                    run_episode(env=env, **kw), timeout=self.config.episode_timeout_s
                )
        finally:
            if self.router is not None:
                self.router.forget(episode_id)
        traj.info["attempt"] = attempt
        return traj

    async def _generate(
        self,
        episode_id: str,
        prompt: list[int],
        max_tokens: int,
        seed: int | None,
        routing_start: int | None = None,
    ) -> Generation:
        cost = len(prompt) + max_tokens
        deadline = time.monotonic() + self.config.request_timeout_s
        while not self.router.healthy_indices():  # all engines recovering: wait a little
            if self._fatal is not None or time.monotonic() > deadline:
                raise EngineError("no healthy engine")
            await asyncio.sleep(0.2)
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
                    stop_ids=self.stop_token_ids,
                    routing_start=routing_start,
                ),
                self.config.request_timeout_s,
                client.pause_clock,
            )
        except (EngineError, TimeoutError) as e:
            self._on_engine_failure(i, e)
            raise EngineError(f"{client.name}: {type(e).__name__}: {e}") from e
        finally:
            self.router.end(i, cost, len(gen.token_ids) if gen else 0)
        self.counters["generated_tokens"] += len(gen.token_ids)
        self.counters["requests"] += 1
        if routing_start is not None and gen.routed_experts is None:
            self.counters["routing_incomplete_requests"] += 1
        return gen

    # ---------------------------------------------------------------- faults
    def _check_processes(self) -> None:
        """Watchdog of the local engines, run by the scheduler at least every 0.5 s: a process
        that has exited is recovered now, not when a request next fails on it (an idle engine
        that dies, or one whose requests all ended before it died, would otherwise stay down
        unnoticed and the router would keep it as healthy)."""
        for i, p in enumerate(self.processes):
            if p is None or i in self._recovering or p.is_alive():
                continue
            if self.router is not None and i in self.router.healthy_indices():
                self._on_engine_failure(
                    i,
                    EngineError(
                        f"engine{i} process exited with status {p.exit_code} (log {p.log_path})"
                    ),
                )

    def _on_engine_failure(self, i: int, error: BaseException) -> None:
        if i in self._recovering or self._closing:
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
                self._fatal = EngineError("every engine failed and could not be restarted")
        self._wake.set()

    async def _try_recover(self, i: int) -> bool:
        proc = self.processes[i]
        client = self.clients[i]
        if await client.healthy() and (proc is None or proc.is_alive()):
            return True  # a slow request, not a dead engine
        if proc is None:  # remote engine: give it the start-up time to come back
            deadline = time.monotonic() + self.config.startup_timeout_s
            while time.monotonic() < deadline and not self._closing:
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

    def _on_stale_group(self, group: Group) -> None:
        """Buffer callback (any thread): requeue the task of a group with no token left within
        the staleness bound (a fresh attempt, so the task mix stays unbiased)."""
        t = group[0]
        self.counters["requeued_stale"] += 1
        self.counters["stale_dropped_tokens"] += _action_tokens(group)
        self.status_counters.record(EpisodeStatus.ABORTED_STALE, len(group))
        task = self._task_by_id[t.task_id]
        self._loop.call_soon_threadsafe(
            self._requeued.appendleft, (task, int(t.info.get("attempt", 0)) + 1)
        )
        self._poke()

    async def _sync_all(self, path: str, version: int, write_s: float) -> SyncResult:
        healthy = [i for i in self.router.healthy_indices() if i not in self._recovering]
        results = await asyncio.gather(
            *(sync_engine(self.clients[i], path, version) for i in healthy), return_exceptions=True
        )
        reports, failed = [], []
        for i, r in zip(healthy, results, strict=True):
            if isinstance(r, BaseException):
                failed.append(self.clients[i].name)
                self._on_engine_failure(i, r)
            else:
                reports.append(r)
                self.engine_versions[i] = version
        return SyncResult(version, path, write_s, reports, failed)


def _action_tokens(trajectories: Iterable[Trajectory]) -> int:
    """Sampled (action) tokens of `trajectories`: what the engines generated for them."""
    return sum(len(n.action_token_ids) for t in trajectories for n in t.nodes)


def round_robin_tasks(
    make_envs: dict[str, Callable[[], object]],
    start_seed: int = 0,
) -> Iterator[Task]:
    """Endless tasks cycling over named environment factories, seeds start_seed, +1, ...

    task_id = "<name>/<seed>".
    """
    for seed in itertools.count(start_seed):
        for name, make in make_envs.items():
            yield Task(task_id=f"{name}/{seed}", make_env=make, seed=seed)


def agent_tasks(name: str, make_env: Callable[[], object], start_seed: int = 0) -> Iterator[Task]:
    """Endless manager tasks ``<name>/<seed>`` of one agent environment (seeds start_seed, ...)."""
    seed = start_seed
    while True:
        yield Task(task_id=f"{name}/{seed}", make_env=make_env, seed=seed)
        seed += 1
