"""The RL stage's step loop: batch -> the algorithm's update schedule -> publish -> log ->
evaluate -> checkpoint, and its clock (`RLLoop`).

The clock (``rl.time_budget_s``, ``time/rl_elapsed_s``) counts value pre-training and RL, not
held-out evaluations during RL. Held-out evaluation runs on rank 0 against the engines and its
figures go to run_dir/rl/eval.jsonl (`evaluate_heldout`, `log_eval`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from sao_megatron.parallel.collectives import broadcast_from_last_stage, broadcast_from_rank0
from sao_megatron.trainer import signals
from sao_megatron.trainer.batch_source import BatchSource
from sao_megatron.trainer.checkpoint import step_dir_name
from sao_megatron.trainer.context import JobContext
from sao_megatron.trainer.evaluate import evaluate
from sao_megatron.trainer.metrics import (
    EVAL_FILE,
    MetricsLogger,
    Timer,
    episode_metrics,
    eval_summary,
    peak_memory_gib,
    reset_peak_memory,
    rollout_metrics,
)
from sao_megatron.trainer.rl_parts import RLParts
from sao_megatron.weight_sync import publish_policy

log = logging.getLogger("sao_megatron.trainer")
EVAL_EPISODES_DIR = "eval_episodes"  # under run_dir/rl: one JSON-lines file per evaluation


def evaluate_heldout(ctx: JobContext, rollout, step: int) -> dict[str, float]:
    """Held-out evaluation of the engines' current policy (rank 0 runs it, every rank gets
    the figures; {} without a rollout or with ``tasks.num_eval_tasks: 0``). With
    ``logging.eval_episodes`` (default on) rank 0 also writes every episode to
    run_dir/rl/eval_episodes/step_<step, 8 digits>.jsonl (`evaluate.episode_record`)."""
    job, out = ctx.job, None
    if rollout is not None and job.tasks.num_eval_tasks:
        episodes = (
            ctx.run_dir / "rl" / EVAL_EPISODES_DIR / f"step_{step:08d}.jsonl"
            if ctx.rank0 and job.logging.eval_episodes
            else None
        )
        out = evaluate(
            rollout.urls,
            job.tasks.eval_envs,
            num_tasks=job.tasks.num_eval_tasks,
            base_seed=job.tasks.eval_seed,
            formatter=ctx.formatter,
            rollout=job.rollout,
            episodes_path=episodes,
        )
    return broadcast_from_rank0(out) or {}


def log_eval(ctx: JobContext, step: int, metrics: dict[str, float]) -> None:
    """Held-out evaluation figures into run_dir/rl/eval.jsonl (one record per evaluation;
    metrics.jsonl keeps one record per train step) and TensorBoard, at `step` (the policy
    version evaluated: 0 before RL, the last step after it, every rl.eval_interval)."""
    if not metrics:
        return
    if ctx.rank0:
        log.info("held-out evaluation at step %d: %s", step, eval_summary(metrics))
    cfg = dataclasses.replace(ctx.job.logging, console=False)
    with MetricsLogger(
        cfg, ctx.run_dir / "rl", is_logging_rank=ctx.rank0, metrics_file=EVAL_FILE
    ) as lg:
        lg.log(step, metrics, force=True)


class RLLoop:
    """The RL stage's loop over `rl` (construct on every rank; `start_clock`, then `run`).

    save: writes the RL checkpoint of `rl` at its current step (collective); needs_engines:
    the policy is published to engines after every update (`EngineHandOff.needs_engines`).
    """

    def __init__(
        self,
        ctx: JobContext,
        rl: RLParts,
        batches: BatchSource,
        save: Callable[[], object],
        *,
        needs_engines: bool,
    ) -> None:
        self.ctx, self.rl, self.batches, self.save = ctx, rl, batches, save
        self.needs_engines = needs_engines
        self.start_clock()

    def start_clock(self) -> None:
        self.clock = time.perf_counter()
        self.eval_s = self.last_eval_s = 0.0  # evaluations during RL: off the clock

    def elapsed(self) -> float:
        """Seconds on the stage's clock (evaluations during RL excluded)."""
        return time.perf_counter() - self.clock - self.eval_s

    def run(self) -> dict[str, float]:
        """Per step: batch -> the algorithm's update schedule -> publish -> log -> checkpoint.

        With a role split (`_separate_update`) the value ranks take part in every step's
        collectives (batch hand-off, evaluation, stop and time-budget decisions, checkpoint)
        but not in the weight sync. A stop signal or the time budget that arrives while the
        critic has already trained on the next batch ends the stage one step later, after the
        policy trained on it too, so a checkpoint always holds both models after the same step.

        Returns the last step's metrics. Raises `signals.StoppedBySignal` after the checkpoint
        of the step a stop signal ended.
        """
        ctx, rl = self.ctx, self.rl
        job, run, step_fn, timer, m = ctx.job, rl.run, rl.step_fn, Timer(), {}
        out_of_time = stop = False
        ahead = None  # role split: (batch, bound) the critic trained on while the policy trained
        saved = run.step  # the last step a checkpoint holds
        with ctx.logger("rl", job.rl.steps, run.step) as logger:
            while run.step < job.rl.steps and not (out_of_time and ahead is None):
                value_done = ahead is not None  # this batch's value work ran ahead
                with timer.phase("rollout"):
                    pulled = ahead if value_done else self._pull(run.step + 1)
                if pulled is None:  # rl.replay_batches: the recorded run ends before this step
                    break
                batch, bound = pulled
                reset_peak_memory()  # memory/peak_* below = this update's peak
                if ctx.roles is None:
                    with timer.phase("train"):
                        update = step_fn.start(batch, run.policy_version, max_staleness=bound)
                        # SAO: value targets, value update x K, advantages, policy update
                        for phase in ctx.algorithm.schedule:
                            step_fn.run(phase, update)
                        m = broadcast_from_last_stage(step_fn.finish(update), ctx.parallel)
                else:
                    pull = not (stop or out_of_time) and self._pulls_ahead()
                    m, ahead = self._separate_update(timer, batch, bound, value_done, pull)
                    m["placement/value_ahead"] = float(value_done)
                if bound is not None:
                    m["deviation/token_bound"] = float(bound)  # this batch's per-token bound
                if rl.rollout is not None:  # the deviation controller (rollout.deviation_target)
                    m |= rl.rollout.observe_step(m)
                mem = peak_memory_gib()
                run.step, run.policy_version = run.step + 1, run.policy_version + 1
                if not ctx.value_rank and self.needs_engines:
                    with timer.phase("sync"):
                        m |= publish_policy(
                            step_fn.policy.unwrapped,
                            ctx.spec,
                            ctx.train_parallel,
                            rl.rollout,
                            run.policy_version,
                        )
                elapsed = self._maybe_evaluate(run.step)
                if job.rl.time_budget_s and not out_of_time:  # rank 0's clock decides for all
                    out_of_time = bool(broadcast_from_rank0(elapsed >= job.rl.time_budget_s))
                m |= episode_metrics(batch) | mem | {"time/rl_elapsed_s": elapsed}
                m |= self._step_metrics(batch, timer.summary())
                logger.log(run.step, m)
                # any rank got SIGTERM/SIGUSR1 (or the stop file); sticky until the stop
                stop = signals.stop_requested() or stop
                ending = (stop or out_of_time) and ahead is None
                if ending or rl.checkpoints.should_save(run.step) or (run.step == job.rl.steps):
                    with timer.phase("checkpoint"):  # logged with the next step
                        self.save()
                        saved = run.step
                if stop and ahead is None:  # saved at this step; the stage stops the engines
                    ckpt = rl.checkpoints.save_dir / step_dir_name(run.step)
                    raise signals.StoppedBySignal(run.step, ckpt)
        if ctx.roles is not None:
            step_fn.flush()
        if saved != run.step:  # a replay that ran out of recorded steps: keep what it trained
            self.save()
        return m

    def _maybe_evaluate(self, step: int) -> float:
        """Held-out evaluation after `step` when rl.eval_interval or rl.eval_interval_s asks
        for one (off the clock); returns the clock's elapsed seconds."""
        job = self.ctx.job
        elapsed = self.elapsed()
        by_step = job.rl.eval_interval and step % job.rl.eval_interval == 0
        # rank 0's clock decides for all (evaluation is collective)
        by_time = bool(job.rl.eval_interval_s) and broadcast_from_rank0(
            elapsed - self.last_eval_s >= job.rl.eval_interval_s
        )
        if by_step or by_time:
            t_eval = time.perf_counter()
            metrics = evaluate_heldout(self.ctx, self.rl.rollout, step)
            log_eval(self.ctx, step, metrics | {"time/rl_elapsed_s": elapsed})
            self.eval_s += time.perf_counter() - t_eval  # not on the stage's clock
            self.last_eval_s = elapsed
        return elapsed

    def _pull(self, step: int) -> tuple | None:
        run = self.rl.run
        version = run.policy_version + step - run.step - 1  # the version trained at step
        return self.batches.pull(step, version)

    def _pulls_ahead(self) -> bool:
        """Role split: whether this step hands out the next batch before the policy trains on
        this one, so the critic trains on it meanwhile (the same decision on every rank).

        Only asynchronously (rollout.max_staleness >= 1: the next batch is then sampled by the
        policy before this update, within the bound of the version it is trained at), when a
        next step exists and no checkpoint follows this step (a checkpoint holds both models
        after the same step)."""
        job, nxt = self.ctx.job, self.rl.run.step + 1
        return (
            job.rollout.max_staleness >= 1
            and nxt < job.rl.steps
            and not self.rl.checkpoints.should_save(nxt)
        )

    def _separate_update(self, timer, batch, bound, value_done: bool, pull: bool):
        """One update of a role split (`SeparateCriticStep`), the SAO order kept: the critic's
        updates and advantages of `batch` (unless `value_done`), then, with `pull`, the next
        batch handed to every rank and the critic's work on it while the policy ranks update
        on `batch` with the advantages received. Returns (metrics of this rank for `batch`:
        on the policy ranks the colocated step's keys, next (batch, bound) or None)."""
        step_fn, version = self.rl.step_fn, self.rl.run.policy_version
        value_rank = self.ctx.value_rank
        m: dict[str, float] = {}
        if value_rank and not value_done:
            with timer.phase("train"):
                m = step_fn.train_step(batch, version, max_staleness=bound)
        ahead = None
        if pull:
            with timer.phase("rollout"):
                ahead = self._pull(self.rl.run.step + 2)
        with timer.phase("train"):
            if value_rank and ahead is not None:
                m = step_fn.train_step(ahead[0], version + 1, max_staleness=ahead[1])
            elif not value_rank:
                m = step_fn.train_step(batch, version, max_staleness=bound)
        return m, ahead

    def _step_metrics(self, batch, times: dict[str, float]) -> dict[str, float]:
        out = dict(times)
        out["batch/num_trajectories"] = float(batch.num_trajectories)
        out["throughput/train_tokens_per_s"] = int(batch.loss_mask.sum()) / max(
            times.get("time/train", 0.0), 1e-9
        )
        rollout = self.rl.rollout
        return out | (rollout_metrics(rollout.stats()) if rollout else {})
