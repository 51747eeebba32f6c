"""The job controller: SFT warm-up -> value pre-training -> RL, top to bottom.

Rank 0 owns the rollout (vLLM engines, episode loop, trajectory buffer) and hands each batch to
every trainer rank; all ranks train together through Megatron. Per RL step (`RLLoop.run`):
pull a batch of finished trajectories -> the algorithm's update schedule (SAO: value targets,
value update x K, advantages with the updated critic, policy update; `algorithm.schedule`) ->
publish policy version k+1 to the engines -> log -> checkpoint. Rollout keeps sampling during
training, bounded by rollout.max_staleness (0 = synchronous).

Who owns what (docs/ARCHITECTURE.md): the stages share a `JobContext`; `EngineHandOff` starts
the engines and hands them the policy; `build_rl` builds the RL stage's parts, each a
`Stateful` of its checkpoint (`checkpoint.train_states`); `BatchSource` gives each step its
batch (rollout, or a recorded run); `RLLoop` runs the steps.

The job config is read, never rewritten: run-time paths (run_dir/<stage>, run_dir/rollout,
run_dir/hf_policy) are constructor arguments of the components; the one resolved value (the
model's vocabulary, fitted to a trained tokenizer) makes a new config, which is what
run_dir/config.yaml and every checkpoint record.
"""

from __future__ import annotations

import logging
from pathlib import Path

from sao_megatron.algorithm import registry
from sao_megatron.configs import to_yaml
from sao_megatron.convert.spec import ConversionSpec
from sao_megatron.data.chat_format import build_formatter
from sao_megatron.data.demonstrations import demonstration_sequences
from sao_megatron.parallel.collectives import broadcast_from_last_stage, broadcast_from_rank0
from sao_megatron.parallel.roles import RoleLayout, split_roles
from sao_megatron.parallel.state import ParallelState
from sao_megatron.trainer import report, runtime, signals
from sao_megatron.trainer.batch_source import BatchSource
from sao_megatron.trainer.checkpoint import CommonState, step_dir_name
from sao_megatron.trainer.checkpoint.train_states import Schedulers, load_train_states
from sao_megatron.trainer.context import JobContext
from sao_megatron.trainer.critic_placement import check_separate_job
from sao_megatron.trainer.engine_handoff import EngineHandOff
from sao_megatron.trainer.job import JobConfig, ValuePretrainConfig
from sao_megatron.trainer.rl_loop import RLLoop, evaluate_heldout, log_eval
from sao_megatron.trainer.rl_parts import RLParts, build_rl, save_rl, save_stage
from sao_megatron.trainer.sft import SequenceSampler, sft_step
from sao_megatron.trainer.value_pretrain import ValuePretrain
from sao_megatron.weight_sync import export_hf

log = logging.getLogger("sao_megatron.trainer")


class Controller:
    """Runs the stages of `job` on this rank (construct on every rank, call `run()`).

    `job` is not modified; `self.job` is the config the run trains with (see the module
    docstring), written to run_dir/config.yaml by rank 0 (`prepare`).

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
        self.algorithm = registry.build(job.algorithm)
        self.rank0 = parallel.rank == 0
        self.run_dir = Path(job.run_dir)
        self.summary: dict[str, float] = {}

    def prepare(self) -> JobContext:
        """Tokenizer, the trained config (vocabulary fitted; written to config.yaml), formats:
        the `JobContext` every stage shares (``self.ctx``) and the engine hand-off."""
        self.tokenizer = runtime.prepare_tokenizer(self.job, self.parallel.rank)
        self.job = runtime.fit_vocab_to_tokenizer(self.job, self.tokenizer, self.parallel.cfg.tp)
        if self.rank0:  # the config this run trains with, next to its outputs
            (self.run_dir / "config.yaml").write_text(to_yaml(self.job))
        self.formatter = build_formatter(self.tokenizer, self.job.episode)
        self.hf_config = runtime.job_hf_config(self.job, self.tokenizer)
        self.spec = ConversionSpec.from_hf_config(self.hf_config)
        self.ctx = JobContext(
            job=self.job,
            parallel=self.parallel,
            train_parallel=self.roles.parallel if self.roles is not None else self.parallel,
            roles=self.roles,
            algorithm=self.algorithm,
            tokenizer=self.tokenizer,
            formatter=self.formatter,
            hf_config=self.hf_config,
            spec=self.spec,
        )
        self.engines = EngineHandOff(self.ctx)
        return self.ctx

    def run(self) -> dict[str, float]:
        self.prepare()
        job = self.job
        # a resumed or re-run job keeps what earlier runs measured (before-RL figures)
        self.summary = broadcast_from_rank0(
            report.read_summary(self.run_dir) if self.rank0 else None
        )
        rl_resume = self.ctx.checkpoints("rl").resolve_resume() if "rl" in job.stages else None
        if self._finished(rl_resume):
            return self.summary
        policy = None
        try:
            if "sft" in job.stages and rl_resume is None:
                policy = self.sft_stage()
            if {"value_pretrain", "rl"} & set(job.stages):
                self.rl_stage(policy, rl_resume)
        finally:  # also when the rollout never started: engines started or requested early
            self.engines.stop()
        return self.summary

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

    def sft_stage(self):
        """SFT on the demonstrations (every rank trains the policy); returns its chunks."""
        ctx, job, p = self.ctx, self.job, self.parallel
        state = runtime.build_policy_state(job, p, job.sft.optim)
        runtime.mask_vocab_padding(state.unwrapped, self.hf_config["vocab_size"], p)
        seqs = demonstration_sequences(job.demonstrations, self.formatter)
        sampler = SequenceSampler(len(seqs), seed=job.seed)
        models = {"policy": state}
        stateful = {"sampler": sampler, "schedulers": Schedulers(models)}
        mgr, step = ctx.checkpoints("sft"), 0
        if (path := mgr.resolve_resume()) is not None:
            step = load_train_states(mgr, path, models, stateful).common.train_step
            if self.rank0:
                log.info("SFT: resumed from checkpoint %s at step %d/%d", path, step, job.sft.steps)
        if step < job.sft.steps:
            self.engines.start_early(state.unwrapped)
        m: dict[str, float] = {}
        with ctx.logger("sft", job.sft.steps, step) as logger:
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
                    save_stage(ctx, mgr, CommonState(train_step=step), models, stateful)
                if stop:  # [signals] saved at this step: exit 0, a restart resumes here
                    raise signals.StoppedBySignal(step, mgr.save_dir / step_dir_name(step))
        if m:  # nothing ran when resuming a finished SFT stage
            self.summary["sft/final_loss"] = m["sft/loss"]
        return state.unwrapped

    def build_rl(self, policy_chunks=None, resume_path: Path | None = None) -> RLParts:
        """The RL stage's parts on this rank (`rl_parts.build_rl`; call `prepare` first)."""
        return build_rl(self.ctx, self.engines, policy_chunks, resume_path)

    def rl_stage(self, policy_chunks, resume_path) -> None:
        """Value pre-training and RL (as `job.stages` lists them), then the final policy."""
        ctx, rl = self.ctx, self.build_rl(policy_chunks, resume_path)
        batches = BatchSource(ctx, rl.tasks, rl.rollout)
        loop = RLLoop(
            ctx,
            rl,
            batches,
            lambda: save_rl(ctx, rl),
            needs_engines=self.engines.needs_engines,
        )
        if rl.rollout is not None:
            rl.rollout.start()
        try:
            if "rl" in self.job.stages and rl.run.step == 0:
                before = evaluate_heldout(ctx, rl.rollout, 0)
                self.summary |= {f"before/{k}": v for k, v in before.items()}
                if self.rank0:  # saved now: a crash or a resume must not lose them
                    report.update_summary(self.run_dir, self.summary)
                log_eval(ctx, 0, before)
            loop.start_clock()  # rl.time_budget_s counts value pre-training and RL
            self._value_pretrain(rl, batches)
            self.summary["rl/value_pretrain_s"] = loop.elapsed()
            if "rl" in self.job.stages:
                self._finish_rl(rl, loop, loop.run())
            elif rl.run.value_pretrain_steps:  # stages without rl keep the pre-trained critic:
                save_rl(ctx, rl)  # a later `stages: [rl]` job in this run_dir resumes from it
        finally:
            if rl.rollout is not None:
                rl.rollout.stop()

    def _value_pretrain(self, rl: RLParts, batches: BatchSource) -> None:
        """Cold-start the critic (`sao_megatron.trainer.value_pretrain`)."""
        job, ctx = self.job, self.ctx
        stage = ValuePretrain(
            job.value_pretrain if "value_pretrain" in job.stages else ValuePretrainConfig(),
            rl.step_fn,
            rl.run,
            next_trajectories=batches.pretrain_trajectories,
            pack=ctx.pack,
            gather_metrics=lambda m: broadcast_from_last_stage(m, ctx.train_parallel),
            logger=lambda total, initial: ctx.logger("value_pretrain", total, initial),
            group_size=self.algorithm.group_size,
        )
        self.summary |= stage.run()

    def _finish_rl(self, rl: RLParts, loop: RLLoop, m: dict[str, float]) -> None:
        """Export the final policy (policy ranks), evaluate it and fill the summary."""
        ctx = self.ctx
        if not ctx.value_rank:
            export_hf(
                rl.step_fn.policy.unwrapped,
                self.spec,
                self.hf_config,
                self.tokenizer,
                ctx.train_parallel,
                self.run_dir / "hf_policy_final",
            )
        after = evaluate_heldout(ctx, rl.rollout, rl.run.step)
        log_eval(ctx, rl.run.step, after)
        self.summary |= {f"after/{k}": v for k, v in after.items()}
        self.summary |= {k: v for k, v in m.items() if k.startswith(("deviation/", "throughput/"))}
        self.summary["rl/steps_done"] = float(rl.run.step)
        self.summary["rl/wall_s"] = loop.elapsed()
        self.summary["rl/eval_during_s"] = loop.eval_s


def _step_of(checkpoint: Path) -> int:
    """The train step of a checkpoint folder named ``step_NNNNNNNN`` (`step_dir_name`)."""
    return int(checkpoint.name.rsplit("_", 1)[1])
