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
unhealthy and fails the whole group. The `EngineFleet` (`sao_megatron.rollout.engines`, the owner
of the engines, their clients and their weights) then restarts a dead local engine (up to
``max_engine_restarts``; it reloads the latest published weights and version) or waits for a
remote one to answer /health, or drops it. What becomes of a failed group (its task requeued, or
dropped; the rollout stopped after `MAX_CONSECUTIVE_FAILURES` in a row) is
`sao_megatron.rollout.group_outcome`'s.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from sao_megatron.data.episode import EpisodeFormatter
from sao_megatron.data.trajectory import Trajectory
from sao_megatron.rollout.admission import AdmissionBounds
from sao_megatron.rollout.buffer import Group, StalenessBuffer
from sao_megatron.rollout.config import RolloutConfig
from sao_megatron.rollout.engine_client import EngineClient, EngineError, Generation
from sao_megatron.rollout.engine_process import EngineProcess
from sao_megatron.rollout.engines import ClientFactory, EngineFleet, SyncResult
from sao_megatron.rollout.gateway import close_shared_gateway
from sao_megatron.rollout.group_outcome import (
    EPISODE_FAILURES,
    MAX_CONSECUTIVE_FAILURES,
    FailureStreak,
    settle_group,
)
from sao_megatron.rollout.runner import stop_token_ids
from sao_megatron.rollout.status import (
    EpisodeStatus,
    StatusCounters,
    classify_exception,
    parse_statuses,
)
from sao_megatron.rollout.tasks import Task, agent_tasks, round_robin_tasks, run_task_episode
from sao_megatron.weight_sync.publisher import WeightSource

log = logging.getLogger("sao_megatron.rollout")


class RolloutManager:
    """Runs the episodes on a fleet of engines; owns the buffer and the episode scheduling.

    Args:
        config: the rollout config.
        formatter: episode format (tokenizer, prompt layout, stop tokens).
        tasks: an iterable of `Task` (usually endless); drawn lazily, requeued tasks first.
        fleet: the `EngineFleet` to run on (a job's, built by the controller, which may have
            started it and loaded its start weights already); `stop()` stops it.
        client_factory, processes, run_dir, model_path: without `fleet`, the manager's own
            fleet is built from these (`EngineFleet`: the client of each engine, e.g. an
            in-process fake; running engines to adopt; the folder of engine logs and weight
            slots; the Hugging Face folder local engines start from).
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
        fleet: EngineFleet | None = None,
        client_factory: ClientFactory = EngineClient,
        processes: list[EngineProcess] | None = None,
        initial_version: int = 0,
        run_dir: str | Path | None = None,
        model_path: str = "",
        group_size: int = 1,
    ) -> None:
        if group_size < 1 or config.trajectories_per_batch % group_size:
            raise ValueError(
                f"rollout.trajectories_per_batch={config.trajectories_per_batch} must be a "
                f"multiple of the group size {group_size} (algorithm.grpo.group_size)"
            )
        if fleet is None and run_dir is None:
            raise ValueError("RolloutManager: pass run_dir (or an EngineFleet as fleet)")
        self.config = config
        self.group_size = group_size
        self.fleet = fleet or EngineFleet(
            config,
            run_dir=run_dir,
            model_path=model_path,
            client_factory=client_factory,
            processes=processes,
        )
        self.fleet.on_change = self._poke  # an engine was recovered or dropped
        self.fleet.on_fatal = lambda error: setattr(self, "_fatal", error)  # no engine left
        self.formatter = formatter
        self.stop_token_ids = stop_token_ids(formatter, config)
        self._tasks: Iterator[Task] = iter(tasks)
        self._requeued: collections.deque[tuple[Task, int]] = collections.deque()
        self.buffer = StalenessBuffer(
            trajectories_per_batch=config.trajectories_per_batch,
            group_size=group_size,
            max_staleness=config.max_staleness,
            on_stale=self._on_stale_group,
        )
        self._wake: asyncio.Event | None = None
        self._inflight = 0
        self._closing = False
        self._fatal: BaseException | None = None
        self._drained_since: float | None = None  # task source exhausted, nothing in flight
        self._failure_streak = FailureStreak()  # failed groups since the last success
        self._t0 = time.monotonic()
        self.counters = self.fleet.counters  # one Counter: the fleet's engine_* counts too
        self.status_counters = StatusCounters()  # episodes/<status> in stats()
        self._requeue = parse_statuses(config.requeue_statuses)
        self.attempts: collections.Counter = collections.Counter()  # task_id -> attempts started
        self._task_by_id: dict[str, Task] = {}  # tasks started and not yet handed to the trainer
        self.sync_history: list[SyncResult] = []
        self.initial_version = initial_version
        self.buffer.set_train_version(initial_version)
        self.admission = AdmissionBounds(config, group_size, self.buffer)

    # ================================================================ lifecycle (trainer thread)
    def start(self) -> RolloutManager:
        """Start the fleet (`EngineFleet.start`: blocks until every engine is healthy, raises
        EngineError if one fails to start), then the episode loop."""
        try:
            self.fleet.start()
        except BaseException:
            self.stop()
            raise
        self._call(self._setup())
        self._main_future = asyncio.run_coroutine_threadsafe(self._schedule(), self._loop)
        return self

    # the fleet's, for the trainer's and the tests' view of the engines
    router = property(lambda self: self.fleet.router)
    clients = property(lambda self: self.fleet.clients)
    urls = property(lambda self: self.fleet.urls)
    engine_versions = property(lambda self: self.fleet.engine_versions)
    _loop = property(lambda self: self.fleet.loop)
    run_dir = property(lambda self: self.fleet.run_dir)
    model_path = property(lambda self: self.fleet.model_path)
    initial_version = property(  # the version served before the first update (the fleet's)
        lambda self: self.fleet.initial_version,
        lambda self, version: setattr(self.fleet, "initial_version", version),
    )
    # the admission bounds': the deviation controller (None without one), episodes in flight
    controller = property(lambda self: self.admission.controller)
    max_inflight = property(
        lambda self: self.admission.max_inflight,
        lambda self, n: setattr(self.admission, "max_inflight", n),
    )

    def __enter__(self) -> RolloutManager:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop the episode loop and the fleet (its clients, the engines it started;
        idempotent)."""
        self._closing = True
        if self._wake is not None and self._loop is not None and self._loop.is_running():
            try:
                self._call(self._shutdown(), timeout=30)
            except Exception as e:  # noqa: BLE001 - best effort on the way out
                log.warning("rollout shutdown: %s", e)
        self.fleet.stop()

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
            f"{len(self.urls)} engines healthy, engine version {self.fleet.serving_version()}"
        )

    def publish_weights(self, weights: WeightSource, version: int) -> SyncResult:
        """Publish HF-named `weights` as `version` and sync every healthy engine to it.

        `EngineFleet.load`: writes the double-buffered slot file, then pauses/reloads/versions/
        resumes each engine (concurrently). Engines that fail are handed to recovery (restart
        loads this version). Returns the per-engine pause times (logged too).
        """
        result = self.fleet.load(weights, version)
        self.sync_history.append(result)
        self.buffer.set_train_version(version)
        self._poke()
        return result

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the rollout (the Stateful ``rollout``): the cumulative
        ``episodes/<status>`` counts and the deviation controller's state (None without one).
        In-flight and buffered trajectories are not kept (`CommonState`)."""
        control = self.admission.state_dict()
        return {"status_counts": self.status_counters.state_dict(), "deviation": control}

    def load_state_dict(self, state: dict) -> None:
        """Continue the counts and, with a controller, its bounds (applied to admission now)."""
        if state.get("status_counts") is not None:
            self.status_counters.load_state_dict(state["status_counts"])
        self.admission.load_state_dict(state.get("deviation"))

    def observe_step(self, metrics: dict[str, float]) -> dict[str, float]:
        """Measure the engines' busy fraction of the step (``rollout/busy_fraction``: the mean
        over engines of the share of wall time since the previous call with a request
        outstanding; absent before `start`) and, with ``rollout.deviation_target``, feed the
        step's metrics to the deviation controller and apply its admission bounds (its state,
        ``controller/*``, is returned too; `AdmissionBounds.observe`).
        """
        out = {} if self.router is None else {"rollout/busy_fraction": self.fleet.busy_fraction()}
        if self.controller is None:
            return out
        control = self.admission.observe(metrics, out.get("rollout/busy_fraction", 0.0))
        self._poke()
        return control | out

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
        out["rollout/wall_s"] = wall
        out["rollout/trajectories_per_s"] = self.counters["trajectories"] / max(wall, 1e-9)
        out["rollout/tokens_per_s"] = self.counters["generated_tokens"] / max(wall, 1e-9)
        return out | self.fleet.stats()

    # ================================================================ event loop internals
    def _poke(self) -> None:
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def _setup(self) -> None:
        self._wake = asyncio.Event()

    async def _shutdown(self) -> None:  # cancel the episodes (the loop's tasks), close the gateway
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await close_shared_gateway()

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
                and self.buffer.can_start(
                    self.fleet.serving_version(), base_version=self.initial_version
                )
            ):
                item = self._next_task()
                if item is None:
                    exhausted = True
                    break
                self.buffer.mark_started()
                self._inflight += g
                asyncio.get_running_loop().create_task(self._run_group(*item))
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
        for r in results:  # every episode ends with a status (rollout/status.py)
            if isinstance(r, Trajectory):
                self.status_counters.record(r.status)
            elif isinstance(r, EPISODE_FAILURES):
                self.status_counters.record(classify_exception(r))
        try:
            out = settle_group(results, attempt, self._requeue, self.config.max_episode_attempts)
            if out.action == "admit":
                self.buffer.put_group(list(results))
                self.counters["trajectories"] += g
                self._failure_streak.clear()
                return
            self.buffer.mark_discarded()
            # the whole group is dropped, its finished members included (GRPO: one failed
            # member costs the G episodes' tokens)
            self.counters["discarded_tokens"] += sampled[0]
            if out.action == "requeue":
                self.counters[f"requeued_{out.kind}"] += 1  # requeued_engine, requeued_timeout..
                log.warning(
                    "task %s attempt %d requeued (%s): %s",
                    task.task_id,
                    attempt,
                    out.kind,
                    out.error,
                )
                self._requeued.appendleft((task, attempt + 1))
            else:
                self.counters["failed_groups"] += 1
                error = out.error
                log.error(
                    "task %s dropped after attempt %d: %s: %s",
                    task.task_id,
                    attempt,
                    type(error).__name__,
                    error,
                )
                if not isinstance(error, EPISODE_FAILURES):
                    raise error
                fatal = self._failure_streak.add(error)
                if fatal is not None:
                    self._fatal = fatal
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

        async def generate(eid, prompt, max_tokens, seed, routing_start=None) -> Generation:
            gen = await self._generate(eid, prompt, max_tokens, seed, routing_start)
            sampled[0] += len(gen.token_ids)
            return gen

        episode_id = f"{task.task_id}#{group_index}@{attempt}"
        try:
            return await run_task_episode(
                task, group_index, attempt, episode_id, self.formatter, self.config, generate
            )
        finally:
            if self.router is not None:
                self.router.forget(episode_id)

    async def _generate(
        self,
        episode_id: str,
        prompt: list[int],
        max_tokens: int,
        seed: int | None,
        routing_start: int | None = None,
    ) -> Generation:
        deadline = time.monotonic() + self.config.request_timeout_s
        while not self.router.healthy_indices():  # all engines recovering: wait a little
            if self._fatal is not None or time.monotonic() > deadline:
                raise EngineError("no healthy engine")
            await asyncio.sleep(0.2)
        gen = await self.fleet.generate(
            episode_id, prompt, max_tokens, seed, self.stop_token_ids, routing_start
        )
        self.counters["generated_tokens"] += len(gen.token_ids)
        self.counters["requests"] += 1
        if routing_start is not None and gen.routed_experts is None:
            self.counters["routing_incomplete_requests"] += 1
        return gen

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


def _action_tokens(trajectories: Iterable[Trajectory]) -> int:
    """Sampled (action) tokens of `trajectories`: what the engines generated for them."""
    return sum(len(n.action_token_ids) for t in trajectories for n in t.nodes)


__all__ = ["MAX_CONSECUTIVE_FAILURES", "RolloutManager", "Task", "agent_tasks", "round_robin_tasks"]
