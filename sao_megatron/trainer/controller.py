"""The job controller: SFT warm-up -> value pre-training -> RL (SAO or GRPO), top to bottom.

Rank 0 owns the rollout (vLLM engines, episode loop, trajectory buffer) and hands each batch to
every trainer rank; all ranks train together through Megatron. Per RL step: pull a batch of
finished trajectories -> value, value, policy updates (`RLStep`) -> publish policy version k+1
to the engines -> log -> checkpoint. Rollout keeps sampling during training, bounded by
algorithm.max_staleness (0 = synchronous).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

from sao_megatron.configs import to_yaml
from sao_megatron.convert.spec import ConversionSpec
from sao_megatron.data.batch import pack_trajectories
from sao_megatron.data.demonstrations import demonstration_sequences
from sao_megatron.data.episode import EpisodeFormatter
from sao_megatron.models import build_policy
from sao_megatron.parallel.state import ParallelState
from sao_megatron.rollout.manager import RolloutManager, Task
from sao_megatron.trainer import runtime, signals
from sao_megatron.trainer.checkpoint import CheckpointManager, CommonState, step_dir_name
from sao_megatron.trainer.evaluate import evaluate
from sao_megatron.trainer.job import JobConfig
from sao_megatron.trainer.metrics import (
    MetricsLogger,
    Timer,
    peak_memory_gib,
    reset_peak_memory,
)
from sao_megatron.trainer.rl_step import RLStep, StepConfig
from sao_megatron.trainer.sft import SequenceSampler, sft_step

log = logging.getLogger("sao_megatron.trainer")


class TaskStream:
    """The endless, seeded stream of RL tasks.

    The checkpointed cursor is `consumed`, the number of tasks the trainer has trained on.
    Resuming with ``start=k`` skips the first k tasks: in synchronous mode (max_staleness=0) the
    trained tasks are exactly the first k drawn, so a resumed run sees the same tasks as an
    uninterrupted one; asynchronously, tasks that were in flight at the checkpoint are run again.
    """

    def __init__(self, job: JobConfig, start: int = 0) -> None:
        self._rng = random.Random(f"tasks:{job.tasks.train_seed}")
        self._specs = job.tasks.train
        self._weights = [e.weight for e in job.tasks.train]
        self.drawn = 0
        self.consumed = start
        while self.drawn < start:
            self._draw()

    def _draw(self) -> Task:
        spec = self._rng.choices(self._specs, self._weights)[0]
        seed = self._rng.randrange(2**31)
        self.drawn += 1
        return Task(task_id=f"{spec.name}:{seed}:{self.drawn - 1}", make_env=spec.build, seed=seed)

    def __iter__(self) -> Iterator[Task]:
        return self

    def __next__(self) -> Task:
        return self._draw()


class Controller:
    """Runs the stages of `job` on this rank (construct on every rank, call `run()`)."""

    def __init__(self, job: JobConfig, parallel: ParallelState) -> None:
        self.job, self.parallel = job, parallel
        self.rank0 = parallel.rank == 0
        self.run_dir = Path(job.run_dir)
        self.summary: dict[str, float] = {}

    # ------------------------------------------------------------------ helpers
    def _ckpt(self, stage: str) -> CheckpointManager:
        root = Path(self.job.checkpoint.save_dir)
        root = root if root.is_absolute() else self.run_dir / root
        return CheckpointManager(
            dataclasses.replace(self.job.checkpoint, save_dir=str(root / stage))
        )

    def _logger(self, stage: str, total: int, initial: int) -> MetricsLogger:
        cfg = dataclasses.replace(self.job.logging, run_dir=str(self.run_dir / stage))
        return MetricsLogger(
            cfg, is_logging_rank=self.rank0, total_steps=total, initial_step=initial
        )

    def _layout(self) -> dict[str, int]:
        c = self.parallel.cfg
        return {"tp": c.tp, "pp": c.pp, "ep": c.ep, "dp": self.parallel.dp}

    @staticmethod
    def _sharded_parts(states: dict, loading: bool = False) -> dict:
        """Fresh Megatron sharded state dicts of each model and its optimiser (consumed by
        dist_checkpointing, so built anew for every save/load)."""
        parts = {}
        for name, st in states.items():
            chunk = st.unwrapped[0]
            parts[name] = chunk.sharded_state_dict()
            parts[f"{name}_optimizer"] = st.optimizer.sharded_state_dict(
                chunk.sharded_state_dict(), is_loading=loading
            )
        return parts

    def _save(self, mgr, states: dict, common: CommonState) -> None:
        common.extra["schedulers"] = {n: st.scheduler.state_dict() for n, st in states.items()}
        mgr.save(
            self._sharded_parts(states),
            common,
            layout=self._layout(),
            run_config=to_yaml(self.job),
            tokenizer_files=sorted((self.run_dir / "tokenizer").glob("*")),
        )

    def _load(self, mgr, path, states: dict):
        optional = [f"{name}_optimizer" for name in states]
        res = mgr.load(path, self._sharded_parts(states, loading=True), optional_parts=optional)
        schedulers = res.common.extra.get("schedulers", {})
        for name, st in states.items():
            if f"{name}_optimizer" in res.state_dicts:
                st.optimizer.load_state_dict(res.state_dicts[f"{name}_optimizer"])
                if name in schedulers:
                    st.scheduler.load_state_dict(schedulers[name])
        return res

    # ------------------------------------------------------------------ stages
    def run(self) -> dict[str, float]:
        job = self.job
        self.tokenizer = runtime.prepare_tokenizer(job, self.parallel.rank)
        runtime.fit_vocab_to_tokenizer(job, self.tokenizer, self.parallel.cfg.tp)
        self.formatter = EpisodeFormatter(self.tokenizer, job.episode)
        self.hf_config = runtime.hf_config_for(
            job.model, self.tokenizer, job.precision.params_dtype
        )
        self.spec = ConversionSpec.from_hf_config(self.hf_config)
        rl_resume = self._ckpt("rl").resolve_resume() if "rl" in job.stages else None
        policy = None
        if "sft" in job.stages and rl_resume is None:
            policy = self.sft_stage()
        if {"value_pretrain", "rl"} & set(job.stages):
            self.rl_stage(policy, rl_resume)
        return self.summary

    def sft_stage(self):
        job, p = self.job, self.parallel
        state = runtime.build_policy_state(job, p, job.sft.optim)
        seqs = demonstration_sequences(job.demonstrations, self.formatter)
        sampler = SequenceSampler(len(seqs), seed=job.seed)
        mgr, step = self._ckpt("sft"), 0
        if (path := mgr.resolve_resume()) is not None:
            res = self._load(mgr, path, {"policy": state})
            step, cursor = res.common.train_step, res.common.data_cursor
            sampler.epoch, sampler.index = cursor["epoch"], cursor["index"]
        m: dict[str, float] = {}
        with self._logger("sft", job.sft.steps, step) as logger:
            while step < job.sft.steps:
                batch = [seqs[i] for i in sampler.next(job.sft.batch_size)]
                m = sft_step(
                    state,
                    p,
                    batch,
                    pad_token_id=self.tokenizer.pad_id,
                    micro_batch_size=job.sft.micro_batch_size,
                )
                step += 1
                logger.log(step, m)
                stop = signals.stop_requested()  # [signals] any rank got SIGTERM/SIGUSR1
                if stop or mgr.should_save(step) or step == job.sft.steps:
                    self._save(
                        mgr,
                        {"policy": state},
                        CommonState(train_step=step, data_cursor=sampler.state()),
                    )
                if stop:  # [signals] saved at this step: exit 0, a restart resumes here
                    raise signals.StoppedBySignal(step, mgr.save_dir / step_dir_name(step))
        if m:  # nothing ran when resuming a finished SFT stage
            self.summary["sft/final_loss"] = m["sft/loss"]
        return state.unwrapped

    def rl_stage(self, policy_chunks, resume_path) -> None:
        job, p = self.job, self.parallel
        if policy_chunks is None and resume_path is None and "sft" not in job.stages:
            sft = self._ckpt("sft").resolve_resume()  # start from a finished SFT stage if any
            if sft is not None:  # its weights only: RL has its own optimiser and LR schedule
                policy_chunks = build_policy(job.model, p, job.precision)
                self._ckpt("sft").load(sft, {"policy": policy_chunks[0].sharded_state_dict()})
        policy = runtime.build_policy_state(job, p, job.policy_optim, init_from=policy_chunks)
        value = None
        if job.algorithm.name == "sao":
            value = runtime.build_value_state(job, p, policy.unwrapped)
        step_fn = RLStep(
            job.algorithm, p, policy, value, StepConfig(micro_batch_size=job.rl.micro_batch_size)
        )
        states = {"policy": policy} | ({"value": value} if value else {})
        mgr, step, version, pretrain_done, task_start = self._ckpt("rl"), 0, 0, 0, 0
        if resume_path is not None:
            res = self._load(mgr, resume_path, states)
            step, version = res.common.train_step, res.common.policy_version
            pretrain_done = res.common.extra.get("value_pretrain_steps", 0)
            task_start = res.common.data_cursor.get("tasks_consumed", 0)
        hf_dir = self.run_dir / "hf_policy"
        runtime.export_policy_hf(
            policy.unwrapped, self.spec, self.hf_config, self.tokenizer, p, hf_dir
        )
        rollout = None
        self.tasks = TaskStream(job, task_start)
        if self.rank0:
            rcfg = dataclasses.replace(
                job.rollout, model_path=str(hf_dir), run_dir=str(self.run_dir / "rollout")
            )
            rollout = RolloutManager(
                rcfg, self.formatter, self.tasks, initial_version=version
            ).start()  # a resumed run's engines serve the checkpoint's weights as `version`
        try:
            self._rl_loop(step_fn, policy, states, mgr, rollout, step, version, pretrain_done)
        finally:
            if rollout is not None:
                rollout.stop()

    def _rl_loop(self, step_fn, policy, states, mgr, rollout, step, version, pretrain_done):
        job = self.job
        timer = Timer()
        if "rl" in job.stages and step == 0:
            self.summary |= {f"before/{k}": v for k, v in self._evaluate(rollout).items()}
        start = time.perf_counter()  # rl.time_budget_s counts value pre-training and RL
        with self._logger("value_pretrain", job.value_pretrain.steps, pretrain_done) as logger:
            while "value_pretrain" in job.stages and pretrain_done < job.value_pretrain.steps:
                batch = self._next_batch(rollout, version)
                pretrain_done += 1
                m = self._from_last_stage(step_fn.value_step(batch))
                logger.log(pretrain_done, m | _episode_metrics(batch))
        self.summary["rl/value_pretrain_s"] = time.perf_counter() - start
        if "rl" not in job.stages:
            return
        m: dict[str, float] = {}
        out_of_time = False
        with self._logger("rl", job.rl.steps, step) as logger:
            while step < job.rl.steps and not out_of_time:
                with timer.phase("rollout"):
                    batch = self._next_batch(rollout, version)
                reset_peak_memory()  # memory/peak_* below = this update's peak
                with timer.phase("train"):
                    m = self._from_last_stage(step_fn.train_step(batch, train_version=version))
                mem = peak_memory_gib()
                version, step = version + 1, step + 1
                with timer.phase("sync"):
                    m |= self._publish(rollout, policy, version)
                if job.rl.eval_interval and step % job.rl.eval_interval == 0:
                    m |= self._evaluate(rollout)
                stop = signals.stop_requested()  # [signals] any rank got SIGTERM/SIGUSR1
                if stop or mgr.should_save(step) or step == job.rl.steps:
                    with timer.phase("checkpoint"):
                        self._save_rl(mgr, states, step, version, pretrain_done)
                times = timer.summary()
                elapsed = time.perf_counter() - start
                if job.rl.time_budget_s:  # rank 0's clock decides for every rank
                    out_of_time = bool(_from_rank0(elapsed >= job.rl.time_budget_s))
                m |= _episode_metrics(batch) | times | mem
                m["time/rl_elapsed_s"] = elapsed
                m["batch/num_trajectories"] = float(batch.num_trajectories)
                m["throughput/train_tokens_per_s"] = int(batch.loss_mask.sum()) / max(
                    times.get("time/train", 0.0), 1e-9
                )
                m |= _rollout_metrics(rollout.stats()) if rollout else {}
                logger.log(step, m)
                if stop:  # [signals] saved at this step; rl_stage's finally stops the engines
                    raise signals.StoppedBySignal(step, mgr.save_dir / step_dir_name(step))
        if out_of_time and not (mgr.should_save(step) or step == job.rl.steps):  # budget ended it
            self._save_rl(mgr, states, step, version, pretrain_done)
        runtime.export_policy_hf(
            policy.unwrapped,
            self.spec,
            self.hf_config,
            self.tokenizer,
            self.parallel,
            self.run_dir / "hf_policy_final",
        )
        self.summary |= {f"after/{k}": v for k, v in self._evaluate(rollout).items()}
        self.summary |= {k: v for k, v in m.items() if k.startswith(("deviation/", "throughput/"))}
        self.summary["rl/steps_done"] = float(step)
        self.summary["rl/wall_s"] = time.perf_counter() - start

    def _save_rl(self, mgr, states, step: int, version: int, pretrain_done: int) -> None:
        cursor = _from_rank0({"tasks_consumed": self.tasks.consumed})
        common = CommonState(
            train_step=step,
            policy_version=version,
            data_cursor=cursor,
            extra={"value_pretrain_steps": pretrain_done},
        )
        self._save(mgr, states, common)

    def _publish(self, rollout, policy, version: int) -> dict[str, float]:
        """Send the policy's weights as `version` to the engines (collective; rank 0 writes)."""
        weights = runtime.policy_hf_weights(policy.unwrapped, self.spec, self.parallel)
        if rollout is None:
            for _ in weights:  # take part in the gathers
                pass
            return {}
        sync = rollout.publish_weights(weights, version)
        return {
            "sync/max_pause_s": sync.max_pause_s,
            "sync/write_s": sync.write_s,
            "sync/failed_engines": float(len(sync.failed_engines)),
        }

    def _from_last_stage(self, metrics: dict) -> dict:
        """Loss metrics live on the last pipeline stage; give them to the logging rank."""
        p = self.parallel
        if p.cfg.pp == 1:
            return metrics
        box = [metrics]
        src = dist.get_global_rank(p.pg_collection.pp, p.cfg.pp - 1)
        dist.broadcast_object_list(box, src=src, group=p.pg_collection.pp)
        return box[0]

    def _next_batch(self, rollout, version):
        """The next training batch on every rank (rank 0 pulls it from the rollout)."""
        trajs = None
        if rollout is not None:
            trajs = rollout.get_batch(version, timeout=self.job.rl.batch_timeout_s)
            # completion order is timing-dependent; a fixed order makes runs reproducible
            trajs.sort(key=lambda t: (_task_index(t.task_id), t.group_index))
            self.tasks.consumed += len({t.task_id for t in trajs})
        trajs = _from_rank0(trajs)
        tp = self.parallel.cfg.tp if self.parallel.cfg.sequence_parallel else 1
        return pack_trajectories(
            trajs,
            pad_token_id=self.tokenizer.pad_id,
            max_seq_len=self.job.model.max_position_embeddings,
            pad_to_multiple_of=tp,
        )

    def _evaluate(self, rollout) -> dict[str, float]:
        job = self.job
        out = None
        if rollout is not None and job.tasks.num_eval_tasks:
            out = evaluate(
                rollout.urls,
                job.tasks.eval_envs,
                num_tasks=job.tasks.num_eval_tasks,
                base_seed=job.tasks.eval_seed,
                formatter=self.formatter,
                rollout=job.rollout,
            )
        return _from_rank0(out) or {}


def _from_rank0(obj):
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return obj


def _rollout_metrics(stats: dict) -> dict[str, float]:
    """The rollout's counters, with the throughput/utilisation figures under standard names."""
    out = dict(stats)
    out["throughput/rollout_trajectories_per_s"] = out.pop("rollout/trajectories_per_s", 0.0)
    out["throughput/rollout_tokens_per_s"] = out.pop("rollout/tokens_per_s", 0.0)
    util = [v for k, v in stats.items() if k.startswith("engine/") and k.endswith("/utilisation")]
    if util:
        out["rollout/worker_utilization"] = sum(util) / len(util)
    return out


def _task_index(task_id: str) -> int:
    """Position of a task in the `TaskStream` (its id ends with ':<index>')."""
    return int(task_id.rsplit(":", 1)[1])


def _episode_metrics(batch) -> dict[str, float]:
    """Reward, success and length statistics of the batch's trajectories."""
    totals = batch.node_rewards.sum(1)
    return {
        "reward/mean": float(totals.mean()),
        "reward/success_rate": float((totals >= 1.0 - 1e-6).float().mean()),
        "episode/length_mean": float(batch.num_nodes.float().mean()),
        "episode/truncated_fraction": float(batch.truncated.float().mean()),
        "episode/action_tokens_per_trajectory": batch.num_action_tokens / batch.num_trajectories,
    }
