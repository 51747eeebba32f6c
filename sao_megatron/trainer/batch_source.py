"""Where each RL step's batch comes from: the rollout, or a recorded run (``rl.replay_batches``).

Rank 0 pulls the trajectories (from the rollout's buffer, or from the recorded folder), moves
the task cursor, records them with ``rl.record_batches``, and sends them to every rank; each
rank packs them into the train batch (`JobContext.pack`). Completion order is timing-dependent,
so a batch is sorted by task index and group index: runs are reproducible.
"""

from __future__ import annotations

import logging

from sao_megatron.parallel.collectives import broadcast_from_rank0
from sao_megatron.trainer.batch_record import BATCHES_DIR, BatchRecorder, BatchReplay, MissingBatch
from sao_megatron.trainer.context import JobContext
from sao_megatron.trainer.run_state import TaskStream, task_index

log = logging.getLogger("sao_megatron.trainer")


class BatchSource:
    """The RL stage's batches on this rank (construct on every rank).

    tasks: the seeded task stream (its cursor is checkpointed); rollout: rank 0's
    `RolloutManager`, None elsewhere (and with no engines).
    """

    def __init__(self, ctx: JobContext, tasks: TaskStream, rollout) -> None:
        self.ctx, self.tasks, self.rollout = ctx, tasks, rollout
        cfg = ctx.job.rl
        self.recorder = self.replay = None
        if cfg.record_batches and ctx.rank0:
            self.recorder = BatchRecorder(ctx.run_dir / BATCHES_DIR)
        if cfg.replay_batches is not None and ctx.rank0:
            self.replay = BatchReplay(cfg.replay_batches, ctx.job.model.max_position_embeddings)

    def pull(self, step: int, version: int) -> tuple | None:
        """Train step `step`'s (batch, per-token bound) on every rank, sampled by policy
        `version`: pulled from the rollout (and recorded with ``rl.record_batches``) or read
        from ``rl.replay_batches``. None (on every rank) when the replayed run has no record
        of `step`.

        Raises:
            ValueError: a replayed step was trained at another policy version.
        """
        if self.ctx.job.rl.replay_batches is None:
            trajs = self.next_trajectories(version)
            bound = self.trained_bound()
            if self.recorder is not None:
                self.recorder.record(step, version, trajs, bound)
            return self.ctx.pack(trajs), bound
        got = None
        if self.ctx.rank0:
            try:
                trajs, recorded, bound = self.replay.load(step)
            except MissingBatch as e:
                log.info("%s: the RL stage ends after step %d", e, step - 1)
            else:
                if recorded != version:
                    raise ValueError(
                        f"rl.replay_batches: step {step} was trained at policy version "
                        f"{recorded} in the recorded run, this run is at {version}: resume from "
                        "the recorded run's checkpoint of the step before the first replayed one"
                    )
                self.tasks.consume(len({t.task_id for t in trajs}))  # the cursor moves on too
                got = (trajs, bound)
        got = broadcast_from_rank0(got)
        return None if got is None else (self.ctx.pack(got[0]), got[1])

    def pretrain_trajectories(self, version: int) -> list:
        """Value pre-training's next trajectories (`next_trajectories`); none are recorded.

        Raises:
            ValueError: with ``rl.replay_batches`` (value pre-training is not replayed).
        """
        if self.ctx.job.rl.replay_batches is not None:
            raise ValueError(
                "rl.replay_batches replays RL steps only, but this run still has value "
                "pre-training to do: resume from a checkpoint after value pre-training (the "
                "recorded run's checkpoints/rl/step_*) or set value_pretrain.steps=0"
            )
        return self.next_trajectories(version)

    def next_trajectories(self, version: int) -> list:
        """The next batch's trajectories on every rank (rank 0 pulls them from the rollout,
        waiting up to rl.batch_timeout_s), in task order."""
        trajs = None
        if self.rollout is not None:
            trajs = self.rollout.get_batch(version, timeout=self.ctx.job.rl.batch_timeout_s)
            # completion order is timing-dependent; a fixed order makes runs reproducible
            trajs.sort(key=lambda t: (task_index(t.task_id), t.group_index))
            self.tasks.consume(len({t.task_id for t in trajs}))
        return broadcast_from_rank0(trajs)

    def trained_bound(self) -> int | None:
        """The deviation controller's bound for the trained tokens of this batch (the buffer's
        hand-off bound, broadcast from rank 0), or None without a controller."""
        r = self.ctx.job.rollout
        if r.deviation_target is None or not r.deviation_bound_trained:
            return None
        rollout = self.rollout
        bound = rollout.buffer.hand_off_staleness if rollout is not None else None
        return broadcast_from_rank0(bound)
