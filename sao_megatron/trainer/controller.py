"""The job controller: SFT warm-up -> value pre-training -> RL, top to bottom.

Rank 0 owns the rollout (vLLM engines, episode loop, trajectory buffer) and hands each batch to
every trainer rank; all ranks train together through Megatron. Per RL step (`Controller._rl_loop`):
pull a batch of finished trajectories -> the algorithm's update schedule (SAO: value targets,
value update x K, advantages with the updated critic, policy update; `algorithm.schedule`) ->
publish policy version k+1 to the engines -> log -> checkpoint. Rollout keeps sampling during
training, bounded by rollout.max_staleness (0 = synchronous).

The job config is read, never rewritten: run-time paths (run_dir/<stage>, run_dir/rollout,
run_dir/hf_policy) are constructor arguments of the components; the one resolved value (the
model's vocabulary, fitted to a trained tokenizer) makes a new config, which is what
run_dir/config.yaml and every checkpoint record.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from sao_megatron.algorithm import registry
from sao_megatron.configs import to_yaml
from sao_megatron.convert.hf_io import read_hf_config
from sao_megatron.convert.spec import ConversionSpec
from sao_megatron.data.batch import pack_trajectories
from sao_megatron.data.chat_format import build_formatter
from sao_megatron.data.demonstrations import demonstration_sequences
from sao_megatron.models import build_policy
from sao_megatron.parallel.collectives import broadcast_from_last_stage, broadcast_from_rank0
from sao_megatron.parallel.roles import RoleLayout, split_roles
from sao_megatron.parallel.state import ParallelState
from sao_megatron.rollout import serve as remote
from sao_megatron.rollout.engines import EngineFleet
from sao_megatron.rollout.manager import RolloutManager
from sao_megatron.trainer import report, runtime, signals
from sao_megatron.trainer.batch_record import (
    BATCHES_DIR,
    BatchRecorder,
    BatchReplay,
    MissingBatch,
)
from sao_megatron.trainer.checkpoint import (
    CheckpointManager,
    CommonState,
    clear_optimizer_state,
    step_dir_name,
)
from sao_megatron.trainer.checkpoint.role_parts import merge_from_value_ranks, role_split_parts
from sao_megatron.trainer.critic_placement import SeparateCriticStep, check_separate_job
from sao_megatron.trainer.evaluate import evaluate
from sao_megatron.trainer.job import JobConfig, ValuePretrainConfig
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
from sao_megatron.trainer.rl_step import RLStep, StepConfig
from sao_megatron.trainer.run_state import RLRunState, TaskStream, task_index
from sao_megatron.trainer.sft import SequenceSampler, sft_step
from sao_megatron.trainer.value_pretrain import ValuePretrain
from sao_megatron.weight_sync import export_hf, gather_hf_weights, publish_policy

log = logging.getLogger("sao_megatron.trainer")

#: CommonState.extra key of the rollout's per-status episode counts (`StatusCounters`)
EPISODE_STATUS_KEY = "episode_status_counts"


@dataclasses.dataclass(kw_only=True)
class RLParts:
    """What the RL stage runs with (built by `Controller.build_rl`).

    step_fn: the RL step (its ``policy`` is the policy TrainState; a `SeparateCriticStep`
    with ``value.placement: separate``, whose ``policy`` is None on the value ranks); states:
    name -> TrainState of every model this rank holds and checkpoints; checkpoints: the RL
    stage's CheckpointManager; run: the run state; rollout: the rollout (rank 0 only, else
    None), not started.
    """

    step_fn: RLStep | SeparateCriticStep
    states: dict[str, Any]
    checkpoints: CheckpointManager
    run: RLRunState
    rollout: RolloutManager | None


class Controller:
    """Runs the stages of `job` on this rank (construct on every rank, call `run()`).

    `job` is not modified; `self.job` is the config the run trains with (see the module
    docstring), written to run_dir/config.yaml by rank 0.

    ``value.placement: separate`` (docs/TRAINING.md "Critic placement"): constructing splits the
    world into policy ranks [0, P) and value ranks [P, 2P) (`split_roles`, a collective). SFT
    trains the policy on every rank (there is no critic yet); value pre-training and RL train
    the policy on the policy ranks and the critic on the value ranks (`SeparateCriticStep`).
    Raises ValueError for what that placement does not support (`check_separate_job`).
    """

    def __init__(self, job: JobConfig, parallel: ParallelState) -> None:
        self.roles: RoleLayout | None = None
        if job.value.placement == "separate":
            check_separate_job(job, parallel)
            self.roles = split_roles(parallel)
        self.job, self.parallel = job, parallel
        #: the parallel state the RL stage's models train with (the role's when separate)
        self.train_parallel = self.roles.parallel if self.roles is not None else parallel
        #: a value rank of ``value.placement: separate`` (holds the critic only in RL)
        self.value_rank = self.roles is not None and not self.roles.is_policy
        self.algorithm = registry.build(job.algorithm)
        self.rank0 = parallel.rank == 0
        self.run_dir = Path(job.run_dir)
        self.summary: dict[str, float] = {}
        self._fleet: EngineFleet | None = None  # rank 0's engines, once started or requested
        # rl.replay_batches without held-out evaluation: RL needs no engine at all
        self.needs_engines = job.rl.replay_batches is None or job.tasks.num_eval_tasks > 0

    # ------------------------------------------------------------------ helpers
    def _ckpt(self, stage: str) -> CheckpointManager:
        root = Path(self.job.checkpoint.save_dir)
        root = root if root.is_absolute() else self.run_dir / root
        return CheckpointManager(
            dataclasses.replace(self.job.checkpoint, save_dir=str(root / stage))
        )

    def _logger(self, stage: str, total: int, initial: int) -> MetricsLogger:
        return MetricsLogger(
            self.job.logging,
            self.run_dir / stage,
            is_logging_rank=self.rank0,
            total_steps=total,
            initial_step=initial,
            stage=stage,
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

    def _save(self, mgr, states: dict, common: CommonState, split: bool = False) -> None:
        """Save `states` (every rank holds them, or, `split`, each role its own)."""
        schedulers = {n: st.scheduler.state_dict() for n, st in states.items()}
        if split:  # rank 0 saves the common state: the critic's schedule from the value ranks
            schedulers = merge_from_value_ranks(schedulers, self.roles, self.parallel.rank)
        common.extra["schedulers"] = schedulers
        parts = self._sharded_parts(states)
        mgr.save(
            role_split_parts(parts, self.roles, self.parallel.rank) if split else parts,
            common,
            layout=self._layout(),
            run_config=to_yaml(self.job),
            tokenizer_files=sorted((self.run_dir / "tokenizer").glob("*")),
        )

    def _load(self, mgr, path, states: dict, split: bool = False):
        """Load `states` from `path` (`split`: each role its own parts, `role_split_parts`)."""
        optional = [f"{name}_optimizer" for name in states]
        parts = self._sharded_parts(states, loading=True)
        if split:
            parts = role_split_parts(parts, self.roles, self.parallel.rank, loading=True)
        res = mgr.load(path, parts, optional_parts=optional)
        schedulers = res.common.extra.get("schedulers", {})
        for name, st in states.items():
            if f"{name}_optimizer" in res.state_dicts:
                st.optimizer.load_state_dict(res.state_dicts[f"{name}_optimizer"])
                if name in schedulers:
                    st.scheduler.load_state_dict(schedulers[name])
            else:  # not in the checkpoint (never stepped) or another layout: start fresh
                clear_optimizer_state(st.optimizer)
        return res

    # ------------------------------------------------------------------ stages
    def prepare(self) -> None:
        """Tokenizer, the trained config (vocabulary fitted; written to config.yaml), formats."""
        self.tokenizer = runtime.prepare_tokenizer(self.job, self.parallel.rank)
        self.job = runtime.fit_vocab_to_tokenizer(self.job, self.tokenizer, self.parallel.cfg.tp)
        if self.rank0:  # the config this run trains with, next to its outputs
            (self.run_dir / "config.yaml").write_text(to_yaml(self.job))
        self.formatter = build_formatter(self.tokenizer, self.job.episode)
        self.hf_config = runtime.job_hf_config(self.job, self.tokenizer)
        self.spec = ConversionSpec.from_hf_config(self.hf_config)

    def run(self) -> dict[str, float]:
        self.prepare()
        job = self.job
        # a resumed or re-run job keeps what earlier runs measured (before-RL figures)
        self.summary = broadcast_from_rank0(
            report.read_summary(self.run_dir) if self.rank0 else None
        )
        rl_resume = self._ckpt("rl").resolve_resume() if "rl" in job.stages else None
        if self._finished(rl_resume):
            return self.summary
        policy = None
        try:
            if "sft" in job.stages and rl_resume is None:
                policy = self.sft_stage()
            if {"value_pretrain", "rl"} & set(job.stages):
                self.rl_stage(policy, rl_resume)
        finally:  # also when the rollout never started: engines started or requested early
            if self._fleet is not None:
                self._fleet.stop()
        return self.summary

    def _start_engines_early(self, policy_chunks) -> None:
        """Start the engines now, so their start-up overlaps SFT (collective: the export).

        They load the initial policy (exported to run_dir/rollout/hf_init): rank 0's
        `EngineFleet.start_early` spawns the local engines, or asks the engine step for remote
        ones (``rollout.engine_urls_file``). `_fleet_serving` loads the SFT weights into them
        before any episode is sampled. Nothing is started when no later stage needs the
        engines or `rollout.engine_urls` lists them.
        """
        job = self.job
        later = {"value_pretrain", "rl"} & set(job.stages)
        if not later or job.rollout.engine_urls or not self.needs_engines:
            return
        init_dir = self.run_dir / "rollout" / "hf_init"
        export_hf(policy_chunks, self.spec, self.hf_config, self.tokenizer, self.parallel, init_dir)
        if self.rank0:
            self._fleet = self._new_fleet(init_dir)
            self._fleet.start_early()

    def _new_fleet(self, model_path: Path, initial_version: int = 0) -> EngineFleet:
        """Rank 0's engine fleet (not started): slots and logs under run_dir/rollout, an
        absolute path (remote engines read the slots by path, in another working directory)."""
        cfg = self.job.rollout
        urls_file = remote.resolve_urls_file(cfg, self.run_dir) if cfg.engine_urls_file else None
        return EngineFleet(
            cfg,
            run_dir=(self.run_dir / "rollout").resolve(),
            model_path=model_path,
            initial_version=initial_version,
            urls_file=urls_file,
        )

    def _fleet_serving(self, policy_chunks, hf_dir: Path, version: int) -> EngineFleet | None:
        """Rank 0's fleet, its engines serving `policy_chunks` as `version` (collective over the
        policy ranks). Engines started early and remote engines get the weights now through
        the fleet's one hand-off (`EngineFleet.load`: gathered to rank 0, one slot file, every
        engine synced; a failure raises); local engines not started yet start from `hf_dir`,
        the same weights. A restarted local engine starts from `hf_dir`. None on other ranks."""
        early = bool(self._broadcast_to_policy_ranks(self._fleet is not None))
        if not early and self.job.rollout.launches_engines:
            return self._new_fleet(hf_dir, version) if self.rank0 else None
        weights = gather_hf_weights(policy_chunks, self.spec, self.train_parallel)
        if weights is None:  # not rank 0: it took part in the gather
            return None
        fleet = self._fleet or self._new_fleet(hf_dir, version)
        self._fleet = fleet
        fleet.load(weights, version, strict=True)
        fleet.restart_from(hf_dir)
        kind = "local" if self.job.rollout.launches_engines else "remote"
        log.info("%s engines %s serve policy version %d", kind, " ".join(fleet.urls), version)
        return fleet

    def _broadcast_to_policy_ranks(self, obj):
        """Rank 0's `obj` on every rank that holds the RL policy (the world, or the policy ranks
        of a role split; the value ranks do not call it)."""
        if self.roles is None:
            return broadcast_from_rank0(obj)
        group = self.train_parallel.model_group
        if dist.get_world_size(group) == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]

    def _finished(self, rl_resume: Path | None) -> bool:
        """True (and says so) when the RL stage already ended at its latest checkpoint: its
        final export, evaluation and summary were written (``summary.json``'s ``rl/steps_done``
        is that checkpoint's step, and the step is ``rl.steps`` or a time budget ended it).
        Re-running such a job starts no engine and evaluates nothing."""
        if rl_resume is None:
            return False
        step = _step_of(rl_resume)
        done = self.summary.get("rl/steps_done")
        ended = step >= self.job.rl.steps or self.job.rl.time_budget_s > 0
        if done is None or int(done) != step or not ended:
            return False
        if self.rank0:
            log.info(
                "nothing to do: the RL stage finished at step %d (checkpoint %s); final policy "
                "%s, summary %s. Use a new run_dir (or raise rl.steps) to train more.",
                step,
                rl_resume,
                self.run_dir / "hf_policy_final",
                self.run_dir / report.SUMMARY_FILE,
            )
        return True

    def _log_eval(self, step: int, metrics: dict[str, float]) -> None:
        """Held-out evaluation figures into run_dir/rl/eval.jsonl (one record per evaluation;
        metrics.jsonl keeps one record per train step) and TensorBoard, at `step` (the policy
        version evaluated: 0 before RL, the last step after it, every rl.eval_interval)."""
        if not metrics:
            return
        if self.rank0:
            log.info("held-out evaluation at step %d: %s", step, eval_summary(metrics))
        cfg = dataclasses.replace(self.job.logging, console=False)
        rl_dir = self.run_dir / "rl"
        with MetricsLogger(cfg, rl_dir, is_logging_rank=self.rank0, metrics_file=EVAL_FILE) as lg:
            lg.log(step, metrics, force=True)

    def sft_stage(self):
        job, p = self.job, self.parallel
        state = runtime.build_policy_state(job, p, job.sft.optim)
        runtime.mask_vocab_padding(state.unwrapped, self.hf_config["vocab_size"], p)
        seqs = demonstration_sequences(job.demonstrations, self.formatter)
        sampler = SequenceSampler(len(seqs), seed=job.seed)
        mgr, step = self._ckpt("sft"), 0
        if (path := mgr.resolve_resume()) is not None:
            res = self._load(mgr, path, {"policy": state})
            step, cursor = res.common.train_step, res.common.data_cursor
            sampler.epoch, sampler.index = cursor["epoch"], cursor["index"]
            if self.rank0:
                log.info("SFT: resumed from checkpoint %s at step %d/%d", path, step, job.sft.steps)
        if step < job.sft.steps:
            self._start_engines_early(state.unwrapped)
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

    def build_rl(self, policy_chunks, resume_path) -> RLParts:
        """Models, optimisers, the RL step, run state and (on rank 0) the rollout, not started;
        restored from `resume_path` when given. Exports the policy the engines will serve.

        With a role split (``value.placement: separate``) the policy ranks build the policy,
        the value ranks the critic, from the same initial policy (`policy_chunks`, the SFT
        checkpoint, the HF model or the seeded random init: `_value_trunk`); only the policy
        ranks export and talk to the engines."""
        job, p, rp = self.job, self.parallel, self.train_parallel
        if policy_chunks is None and resume_path is None and "sft" not in job.stages:
            sft = self._ckpt("sft").resolve_resume()  # start from a finished SFT stage if any
            if sft is not None:  # its weights only: RL has its own optimiser and LR schedule
                policy_chunks = build_policy(job.model, p, job.precision)
                self._ckpt("sft").load(sft, {"policy": policy_chunks[0].sharded_state_dict()})
        policy = value = None
        if not self.value_rank:
            policy = runtime.build_policy_state(job, rp, job.policy_optim, init_from=policy_chunks)
            # padding rows past the served vocabulary stay out of the trainer's softmax
            runtime.mask_vocab_padding(policy.unwrapped, self.hf_config["vocab_size"], rp)
        if self.algorithm.needs_value_model and (self.roles is None or self.value_rank):
            trunk = policy.unwrapped if policy is not None else self._value_trunk(policy_chunks)
            value = runtime.build_value_state(job, rp, trunk)
        step_cfg = StepConfig(
            micro_batch_size=job.rl.micro_batch_size,
            max_staleness=job.rollout.max_staleness,
            routing_replay=job.rollout.routing_replay,
        )
        if self.roles is not None:
            step_fn = SeparateCriticStep(
                self.algorithm, self.roles, policy=policy, value=value, step_cfg=step_cfg
            )
        else:
            step_fn = RLStep(self.algorithm, p, policy, value, step_cfg)
        states = ({"policy": policy} if policy else {}) | ({"value": value} if value else {})
        mgr, run, self.tasks = self._ckpt("rl"), RLRunState(), TaskStream(job.tasks)
        status_counts = None  # the rollout's episodes/<status> counts at the checkpoint
        if resume_path is not None:
            common = self._load(mgr, resume_path, states, split=self.roles is not None).common
            run.load_state_dict(common.extra["rl_run_state"])
            status_counts = common.extra.get(EPISODE_STATUS_KEY)  # absent in older checkpoints
            self.tasks.load_state_dict(common.data_cursor)
            if self.rank0:
                log.info(
                    "RL: resumed from checkpoint %s at step %d/%d (policy version %d, %d value "
                    "pre-training steps done, %d tasks consumed)",
                    resume_path,
                    run.step,
                    job.rl.steps,
                    run.policy_version,
                    run.value_pretrain_steps,
                    self.tasks.consumed,
                )
        hf_dir = self.run_dir / "hf_policy"
        fleet = None
        if policy is not None:  # the value ranks of a role split never own engine weights
            export_hf(policy.unwrapped, self.spec, self.hf_config, self.tokenizer, rp, hf_dir)
            if self.needs_engines:
                fleet = self._fleet_serving(policy.unwrapped, hf_dir, run.policy_version)
        rollout = None
        if self.rank0 and self.needs_engines:  # a resumed run's engines serve its version
            self._fleet = fleet or self._new_fleet(hf_dir, run.policy_version)
            rollout = RolloutManager(
                job.rollout,
                self.formatter,
                self.tasks,
                fleet=self._fleet,
                initial_version=run.policy_version,
                group_size=self.algorithm.group_size,
            )
            if status_counts is not None:  # counts continue across the resume
                rollout.status_counters.load_state_dict(status_counts)
        return RLParts(step_fn=step_fn, states=states, checkpoints=mgr, run=run, rollout=rollout)

    def _value_trunk(self, init_from) -> list:
        """The initial policy chunks a value rank initialises the critic's trunk from: built and
        filled exactly as `runtime.build_policy_state` does on a policy rank (the same random
        draws, so a seeded init and the critic's head match the colocated run's), without its
        optimiser."""
        job = self.job
        chunks = build_policy(job.model, self.train_parallel, job.precision)
        if init_from is not None:
            for new, old in zip(chunks, init_from, strict=True):
                new.load_state_dict(old.state_dict())
        elif job.init_from_hf is not None:
            spec = ConversionSpec.from_hf_config(read_hf_config(job.init_from_hf))
            runtime.init_policy_from_hf(chunks, job.init_from_hf, spec)
        return chunks

    def rl_stage(self, policy_chunks, resume_path) -> None:
        rl = self.build_rl(policy_chunks, resume_path)
        if rl.rollout is not None:
            rl.rollout.start()
        try:
            if "rl" in self.job.stages and rl.run.step == 0:
                before = self._evaluate(rl.rollout)
                self.summary |= {f"before/{k}": v for k, v in before.items()}
                if self.rank0:  # saved now: a crash or a resume must not lose them
                    report.update_summary(self.run_dir, self.summary)
                self._log_eval(0, before)
            self._clock = time.perf_counter()  # rl.time_budget_s counts value pre-training and RL
            self._eval_s = self._last_eval_s = 0.0  # evaluations during RL: off the clock
            self._value_pretrain(rl)
            if "rl" in self.job.stages:
                self._finish_rl(rl, self._rl_loop(rl))
            elif rl.run.value_pretrain_steps:  # stages without rl keep the pre-trained critic:
                self._save_rl(rl)  # a later `stages: [rl]` job in this run_dir resumes from it
        finally:
            if rl.rollout is not None:
                rl.rollout.stop()

    def _value_pretrain(self, rl: RLParts) -> None:
        """Cold-start the critic (`sao_megatron.trainer.value_pretrain`)."""
        job = self.job
        stage = ValuePretrain(
            job.value_pretrain if "value_pretrain" in job.stages else ValuePretrainConfig(),
            rl.step_fn,
            rl.run,
            next_trajectories=lambda version: self._pretrain_trajectories(rl.rollout, version),
            pack=self._pack,
            gather_metrics=lambda m: broadcast_from_last_stage(m, self.train_parallel),
            logger=lambda total, initial: self._logger("value_pretrain", total, initial),
            group_size=self.algorithm.group_size,
        )
        self.summary |= stage.run()
        self.summary["rl/value_pretrain_s"] = time.perf_counter() - self._clock

    def _rl_loop(self, rl: RLParts) -> dict[str, float]:
        """Per step: batch -> the algorithm's update schedule -> publish -> log -> checkpoint.

        With a role split (`_separate_update`) the value ranks take part in every step's
        collectives (batch hand-off, evaluation, stop and time-budget decisions, checkpoint) but
        not in the weight sync. A stop signal or the time budget that arrives while the critic
        has already trained on the next batch ends the stage one step later, after the policy
        trained on it too, so a checkpoint always holds both models after the same step.

        Returns the last step's metrics.
        """
        job, run, step_fn, timer, m = self.job, rl.run, rl.step_fn, Timer(), {}
        out_of_time = stop = False
        ahead = None  # role split: (batch, bound) the critic trained on while the policy trained
        self._open_batch_record()
        saved = run.step  # the last step a checkpoint holds
        with self._logger("rl", job.rl.steps, run.step) as logger:
            while run.step < job.rl.steps and not (out_of_time and ahead is None):
                value_done = ahead is not None  # this batch's value work ran ahead
                with timer.phase("rollout"):
                    pulled = ahead if value_done else self._pull(rl, run.step + 1)
                if pulled is None:  # rl.replay_batches: the recorded run ends before this step
                    break
                batch, bound = pulled
                reset_peak_memory()  # memory/peak_* below = this update's peak
                if self.roles is None:
                    with timer.phase("train"):
                        update = step_fn.start(batch, run.policy_version, max_staleness=bound)
                        # SAO: value targets, value update x K, advantages, policy update
                        for phase in self.algorithm.schedule:
                            step_fn.run(phase, update)
                        m = broadcast_from_last_stage(step_fn.finish(update), self.parallel)
                else:
                    pull = not (stop or out_of_time) and self._pulls_ahead(rl)
                    m, ahead = self._separate_update(rl, timer, batch, bound, value_done, pull)
                    m["placement/value_ahead"] = float(value_done)
                if bound is not None:
                    m["deviation/token_bound"] = float(bound)  # this batch's per-token bound
                if rl.rollout is not None:  # the deviation controller (rollout.deviation_target)
                    m |= rl.rollout.observe_step(m)
                mem = peak_memory_gib()
                run.step, run.policy_version = run.step + 1, run.policy_version + 1
                if not self.value_rank and self.needs_engines:
                    with timer.phase("sync"):
                        m |= publish_policy(
                            step_fn.policy.unwrapped,
                            self.spec,
                            self.train_parallel,
                            rl.rollout,
                            run.policy_version,
                        )
                elapsed = time.perf_counter() - self._clock - self._eval_s
                by_step = job.rl.eval_interval and run.step % job.rl.eval_interval == 0
                # rank 0's clock decides for all (evaluation is collective)
                by_time = bool(job.rl.eval_interval_s) and broadcast_from_rank0(
                    elapsed - self._last_eval_s >= job.rl.eval_interval_s
                )
                if by_step or by_time:
                    t_eval = time.perf_counter()
                    metrics = self._evaluate(rl.rollout)
                    self._log_eval(run.step, metrics | {"time/rl_elapsed_s": elapsed})
                    self._eval_s += time.perf_counter() - t_eval  # not on the stage's clock
                    self._last_eval_s = elapsed
                if job.rl.time_budget_s and not out_of_time:  # rank 0's clock decides for all
                    out_of_time = bool(broadcast_from_rank0(elapsed >= job.rl.time_budget_s))
                m |= episode_metrics(batch) | mem | {"time/rl_elapsed_s": elapsed}
                m |= self._step_metrics(batch, timer.summary(), rl.rollout)
                logger.log(run.step, m)
                # any rank got SIGTERM/SIGUSR1 (or the stop file); sticky until the stop
                stop = signals.stop_requested() or stop
                ending = (stop or out_of_time) and ahead is None
                if ending or rl.checkpoints.should_save(run.step) or (run.step == job.rl.steps):
                    with timer.phase("checkpoint"):  # logged with the next step
                        self._save_rl(rl)
                        saved = run.step
                if stop and ahead is None:  # saved at this step; rl_stage's finally stops engines
                    ckpt = rl.checkpoints.save_dir / step_dir_name(run.step)
                    raise signals.StoppedBySignal(run.step, ckpt)
        if self.roles is not None:
            step_fn.flush()
        if saved != run.step:  # a replay that ran out of recorded steps: keep what it trained
            self._save_rl(rl)
        return m

    def _open_batch_record(self) -> None:
        """The recorder (``rl.record_batches``, rank 0) and the replayed folder
        (``rl.replay_batches``, read by rank 0) of this RL stage, or None."""
        cfg = self.job.rl
        self._recorder = self._replay = None
        if cfg.record_batches and self.rank0:
            self._recorder = BatchRecorder(self.run_dir / BATCHES_DIR)
        if cfg.replay_batches is not None and self.rank0:
            self._replay = BatchReplay(cfg.replay_batches, self.job.model.max_position_embeddings)

    def _pull(self, rl: RLParts, step: int) -> tuple | None:
        """Train step `step`'s batch and its per-token bound on every rank: rank 0 pulls them
        from the rollout (`_next_trajectories`, `_trained_bound`) and records them with
        ``rl.record_batches``, or reads them from ``rl.replay_batches``; the world receives.
        None (on every rank) when the replayed run has no record of `step`."""
        version = rl.run.policy_version + step - rl.run.step - 1  # the version trained at step
        if self.job.rl.replay_batches is None:
            trajs = self._next_trajectories(rl.rollout, version)
            bound = self._trained_bound(rl.rollout)
            if self._recorder is not None:
                self._recorder.record(step, version, trajs, bound)
            return self._pack(trajs), bound
        got = None
        if self.rank0:
            try:
                trajs, recorded, bound = self._replay.load(step)
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
        return None if got is None else (self._pack(got[0]), got[1])

    def _pretrain_trajectories(self, rollout, version) -> list:
        """Value pre-training's next trajectories (`_next_trajectories`); none are recorded.

        Raises:
            ValueError: with ``rl.replay_batches`` (value pre-training is not replayed).
        """
        if self.job.rl.replay_batches is not None:
            raise ValueError(
                "rl.replay_batches replays RL steps only, but this run still has value "
                "pre-training to do: resume from a checkpoint after value pre-training (the "
                "recorded run's checkpoints/rl/step_*) or set value_pretrain.steps=0"
            )
        return self._next_trajectories(rollout, version)

    def _pulls_ahead(self, rl: RLParts) -> bool:
        """Role split: whether this step hands out the next batch before the policy trains on
        this one, so the critic trains on it meanwhile (the same decision on every rank).

        Only asynchronously (rollout.max_staleness >= 1: the next batch is then sampled by the
        policy before this update, within the bound of the version it is trained at), when a
        next step exists and no checkpoint follows this step (a checkpoint holds both models
        after the same step)."""
        job, nxt = self.job, rl.run.step + 1
        return (
            job.rollout.max_staleness >= 1
            and nxt < job.rl.steps
            and not rl.checkpoints.should_save(nxt)
        )

    def _separate_update(self, rl, timer, batch, bound, value_done: bool, pull: bool):
        """One update of a role split (`SeparateCriticStep`), the SAO order kept: the critic's
        updates and advantages of `batch` (unless `value_done`), then, with `pull`, the next
        batch handed to every rank and the critic's work on it while the policy ranks update
        on `batch` with the advantages received. Returns (metrics of this rank for `batch`:
        on the policy ranks the colocated step's keys, next (batch, bound) or None)."""
        step_fn, version = rl.step_fn, rl.run.policy_version
        m: dict[str, float] = {}
        if self.value_rank and not value_done:
            with timer.phase("train"):
                m = step_fn.train_step(batch, version, max_staleness=bound)
        ahead = None
        if pull:
            with timer.phase("rollout"):
                ahead = self._pull(rl, rl.run.step + 2)
        with timer.phase("train"):
            if self.value_rank and ahead is not None:
                m = step_fn.train_step(ahead[0], version + 1, max_staleness=ahead[1])
            elif not self.value_rank:
                m = step_fn.train_step(batch, version, max_staleness=bound)
        return m, ahead

    def _trained_bound(self, rollout) -> int | None:
        """The deviation controller's bound for the trained tokens of this batch (the buffer's
        hand-off bound, broadcast from rank 0), or None without a controller."""
        r = self.job.rollout
        if r.deviation_target is None or not r.deviation_bound_trained:
            return None
        bound = rollout.buffer.hand_off_staleness if rollout is not None else None
        return broadcast_from_rank0(bound)

    def _finish_rl(self, rl: RLParts, m: dict[str, float]) -> None:
        """Export the final policy (policy ranks), evaluate it and fill the summary."""
        if not self.value_rank:
            export_hf(
                rl.step_fn.policy.unwrapped,
                self.spec,
                self.hf_config,
                self.tokenizer,
                self.train_parallel,
                self.run_dir / "hf_policy_final",
            )
        after = self._evaluate(rl.rollout)
        self._log_eval(rl.run.step, after)
        self.summary |= {f"after/{k}": v for k, v in after.items()}
        self.summary |= {k: v for k, v in m.items() if k.startswith(("deviation/", "throughput/"))}
        self.summary["rl/steps_done"] = float(rl.run.step)
        self.summary["rl/wall_s"] = time.perf_counter() - self._clock - self._eval_s
        self.summary["rl/eval_during_s"] = self._eval_s

    def _step_metrics(self, batch, times: dict[str, float], rollout) -> dict[str, float]:
        out = dict(times)
        out["batch/num_trajectories"] = float(batch.num_trajectories)
        out["throughput/train_tokens_per_s"] = int(batch.loss_mask.sum()) / max(
            times.get("time/train", 0.0), 1e-9
        )
        return out | (rollout_metrics(rollout.stats()) if rollout else {})

    def _save_rl(self, rl: RLParts) -> None:
        """The RL checkpoint (collective; with a role split each role saves its own model and
        optimiser into the same step folder, `role_split_parts`)."""
        if self.roles is not None:
            rl.step_fn.flush()  # the critic's sends of this step are received
        common = CommonState(
            train_step=rl.run.step,
            policy_version=rl.run.policy_version,
            data_cursor=broadcast_from_rank0(self.tasks.state_dict()),  # rank 0 pulls batches
            extra={
                "rl_run_state": rl.run.state_dict(),
                # the rollout's episodes/<status> counts (rank 0 runs the rollout)
                EPISODE_STATUS_KEY: broadcast_from_rank0(
                    rl.rollout.status_counters.state_dict() if rl.rollout is not None else None
                ),
            },
        )
        self._save(rl.checkpoints, rl.states, common, split=self.roles is not None)

    def _next_trajectories(self, rollout, version) -> list:
        """The next batch's trajectories on every rank (rank 0 pulls them from the rollout)."""
        trajs = None
        if rollout is not None:
            trajs = rollout.get_batch(version, timeout=self.job.rl.batch_timeout_s)
            # completion order is timing-dependent; a fixed order makes runs reproducible
            trajs.sort(key=lambda t: (task_index(t.task_id), t.group_index))
            self.tasks.consume(len({t.task_id for t in trajs}))
        return broadcast_from_rank0(trajs)

    def _pack(self, trajs):
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
        return broadcast_from_rank0(out) or {}


def _step_of(checkpoint: Path) -> int:
    """The train step of a checkpoint folder named ``step_NNNNNNNN`` (`step_dir_name`)."""
    return int(checkpoint.name.rsplit("_", 1)[1])
