"""What the RL stage runs with, built in one place: `build_rl` (what tools use too), `save_rl`.

`build_rl` builds the models and optimisers this rank trains, the RL step, the run state and
task stream, and (rank 0) the rollout, not started; restores them from a checkpoint when given
one; exports the policy the engines will serve and hands it to them (`EngineHandOff`). Every
part a checkpoint keeps is a `Stateful` in `RLParts.stateful` (`train_states`).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from sao_megatron.configs import to_yaml
from sao_megatron.convert.hf_io import read_hf_config
from sao_megatron.convert.spec import ConversionSpec
from sao_megatron.models import build_policy
from sao_megatron.rollout.manager import RolloutManager
from sao_megatron.trainer import runtime
from sao_megatron.trainer.checkpoint import CheckpointManager, CommonState
from sao_megatron.trainer.checkpoint.train_states import (
    Kept,
    Schedulers,
    load_train_states,
    save_train_states,
)
from sao_megatron.trainer.context import JobContext
from sao_megatron.trainer.critic_placement import SeparateCriticStep
from sao_megatron.trainer.engine_handoff import EngineHandOff
from sao_megatron.trainer.rl_step import RLStep, StepConfig
from sao_megatron.trainer.run_state import RLRunState, TaskStream
from sao_megatron.weight_sync import export_hf

log = logging.getLogger("sao_megatron.trainer")


@dataclasses.dataclass(kw_only=True)
class RLParts:
    """What the RL stage runs with (built by `build_rl`).

    step_fn: the RL step (its ``policy`` is the policy TrainState; a `SeparateCriticStep`
    with ``value.placement: separate``, whose ``policy`` is None on the value ranks); states:
    name -> TrainState of every model this rank holds and checkpoints; stateful: name ->
    every other part a checkpoint keeps (run, tasks, schedulers, rollout, algorithm);
    checkpoints: the RL stage's CheckpointManager; run: the run state; tasks: the task
    stream; rollout: the rollout (rank 0 only, else None), not started.
    """

    step_fn: RLStep | SeparateCriticStep
    states: dict[str, Any]
    stateful: dict[str, Any]
    checkpoints: CheckpointManager
    run: RLRunState
    tasks: TaskStream
    rollout: RolloutManager | None


def build_rl(
    ctx: JobContext, engines: EngineHandOff, policy_chunks=None, resume_path: Path | None = None
) -> RLParts:
    """The RL stage's parts on this rank (collective), restored from `resume_path` if given.

    policy_chunks: the policy to start from (the SFT stage's), else a finished SFT stage's
    checkpoint in this run_dir, ``init_from_hf`` or the seeded random init. With a role split
    the policy ranks build the policy, the value ranks the critic from the same initial policy
    (`value_trunk`); only the policy ranks export and talk to the engines.
    """
    job, p, rp = ctx.job, ctx.parallel, ctx.train_parallel
    if policy_chunks is None and resume_path is None and "sft" not in job.stages:
        sft = ctx.checkpoints("sft").resolve_resume()  # start from a finished SFT stage if any
        if sft is not None:  # its weights only: RL has its own optimiser and LR schedule
            policy_chunks = build_policy(job.model, p, job.precision)
            ctx.checkpoints("sft").load(sft, {"policy": policy_chunks[0].sharded_state_dict()})
    policy = value = None
    if not ctx.value_rank:
        policy = runtime.build_policy_state(job, rp, job.policy_optim, init_from=policy_chunks)
        # padding rows past the served vocabulary stay out of the trainer's softmax
        runtime.mask_vocab_padding(policy.unwrapped, ctx.hf_config["vocab_size"], rp)
    if ctx.algorithm.needs_value_model and (ctx.roles is None or ctx.value_rank):
        trunk = policy.unwrapped if policy is not None else value_trunk(ctx, policy_chunks)
        value = runtime.build_value_state(job, rp, trunk)
    step_cfg = StepConfig(
        micro_batch_size=job.rl.micro_batch_size,
        max_staleness=job.rollout.max_staleness,
        routing_replay=job.rollout.routing_replay,
    )
    if ctx.roles is not None:
        step_fn = SeparateCriticStep(
            ctx.algorithm, ctx.roles, policy=policy, value=value, step_cfg=step_cfg
        )
    else:
        step_fn = RLStep(ctx.algorithm, p, policy, value, step_cfg)
    states = ({"policy": policy} if policy else {}) | ({"value": value} if value else {})
    run, tasks, kept = RLRunState(), TaskStream(job.tasks), Kept()
    stateful = {
        "run": run,
        "tasks": tasks,
        "schedulers": Schedulers(states, ctx.roles, p.rank),
        "rollout": kept,  # the rollout's own once built (rank 0)
        "algorithm": ctx.algorithm,
    }
    mgr = ctx.checkpoints("rl")
    if resume_path is not None:
        load_train_states(mgr, resume_path, states, stateful, roles=ctx.roles, rank=p.rank)
        if ctx.rank0:
            log.info(
                "RL: resumed from checkpoint %s at step %d/%d (policy version %d, %d value "
                "pre-training steps done, %d tasks consumed)",
                resume_path,
                run.step,
                job.rl.steps,
                run.policy_version,
                run.value_pretrain_steps,
                tasks.consumed,
            )
    hf_dir = ctx.run_dir / "hf_policy"
    if policy is not None:  # the value ranks of a role split never own engine weights
        export_hf(policy.unwrapped, ctx.spec, ctx.hf_config, ctx.tokenizer, rp, hf_dir)
        engines.serving(policy.unwrapped, hf_dir, run.policy_version)
    rollout = None
    if ctx.rank0 and engines.needs_engines:  # a resumed run's engines serve its version
        engines.fleet = engines.fleet or engines.new_fleet(hf_dir, run.policy_version)
        rollout = RolloutManager(
            job.rollout,
            ctx.formatter,
            tasks,
            fleet=engines.fleet,
            initial_version=run.policy_version,
            group_size=ctx.algorithm.group_size,
        )
        if kept.state is not None:  # counts and the deviation controller continue
            rollout.load_state_dict(kept.state)
        stateful["rollout"] = rollout
    return RLParts(
        step_fn=step_fn,
        states=states,
        stateful=stateful,
        checkpoints=mgr,
        run=run,
        tasks=tasks,
        rollout=rollout,
    )


def value_trunk(ctx: JobContext, init_from) -> list:
    """The initial policy chunks a value rank initialises the critic's trunk from: built and
    filled exactly as `runtime.build_policy_state` does on a policy rank (the same random
    draws, so a seeded init and the critic's head match the colocated run's), without its
    optimiser."""
    job = ctx.job
    chunks = build_policy(job.model, ctx.train_parallel, job.precision)
    if init_from is not None:
        for new, old in zip(chunks, init_from, strict=True):
            new.load_state_dict(old.state_dict())
    elif job.init_from_hf is not None:
        spec = ConversionSpec.from_hf_config(read_hf_config(job.init_from_hf))
        runtime.init_policy_from_hf(chunks, job.init_from_hf, spec)
    return chunks


def save_rl(ctx: JobContext, rl: RLParts) -> Path:
    """The RL checkpoint of `rl` at its run state's step (collective; with a role split each
    role saves its own model and optimiser into the same step folder)."""
    if ctx.roles is not None:
        rl.step_fn.flush()  # the critic's sends of this step are received
    common = CommonState(train_step=rl.run.step, policy_version=rl.run.policy_version)
    split = ctx.roles is not None
    return save_stage(ctx, rl.checkpoints, common, rl.states, rl.stateful, split=split)


def save_stage(
    ctx: JobContext, mgr, common: CommonState, models, stateful, *, split: bool = False
) -> Path:
    """One checkpoint of a stage with this job's layout, config and tokenizer files (`split`:
    each role of a role split saves its own models, `role_split_parts`)."""
    return save_train_states(
        mgr,
        common,
        models,
        stateful,
        roles=ctx.roles if split else None,
        rank=ctx.parallel.rank,
        layout=ctx.layout(),
        run_config=to_yaml(ctx.job),
        tokenizer_files=sorted((ctx.run_dir / "tokenizer").glob("*")),
    )
