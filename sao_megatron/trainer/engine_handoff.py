"""The trainer's side of the rollout engines: when they start and which weights they serve.

Rank 0 owns the job's `EngineFleet` (`sao_megatron.rollout.engines`); `EngineHandOff` decides
when it is built and hands it the policy: started early so engine start-up overlaps SFT
(`start_early`), then given the weights RL starts from through the fleet's one hand-off
(`serving`). The other ranks take part in the collectives (the HF export and the weight
gather) and hold no fleet.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch.distributed as dist

from sao_megatron.parallel.collectives import broadcast_from_rank0
from sao_megatron.rollout import serve as remote
from sao_megatron.rollout.engines import EngineFleet
from sao_megatron.trainer.context import JobContext
from sao_megatron.weight_sync import export_hf, gather_hf_weights

log = logging.getLogger("sao_megatron.trainer")


class EngineHandOff:
    """Rank 0's engine fleet over a job's stages (construct on every rank).

    needs_engines: False when RL replays recorded batches (``rl.replay_batches``) and evaluates
    nothing: no engine is started at all. fleet: rank 0's fleet once started or requested.
    """

    def __init__(self, ctx: JobContext) -> None:
        self.ctx = ctx
        job = ctx.job
        self.needs_engines = job.rl.replay_batches is None or job.tasks.num_eval_tasks > 0
        self.fleet: EngineFleet | None = None

    def start_early(self, policy_chunks) -> None:
        """Start the engines now, so their start-up overlaps SFT (collective: the export).

        They load the initial policy (exported to run_dir/rollout/hf_init): rank 0's
        `EngineFleet.start_early` spawns the local engines, or asks the engine step for remote
        ones (``rollout.engine_urls_file``). `serving` loads the SFT weights into them before
        any episode is sampled. Nothing is started when no later stage needs the engines or
        `rollout.engine_urls` lists them.
        """
        ctx, job = self.ctx, self.ctx.job
        later = {"value_pretrain", "rl"} & set(job.stages)
        if not later or job.rollout.engine_urls or not self.needs_engines:
            return
        init_dir = ctx.run_dir / "rollout" / "hf_init"
        export_hf(policy_chunks, ctx.spec, ctx.hf_config, ctx.tokenizer, ctx.parallel, init_dir)
        if ctx.rank0:
            self.fleet = self.new_fleet(init_dir)
            self.fleet.start_early()

    def new_fleet(self, model_path: Path, initial_version: int = 0) -> EngineFleet:
        """Rank 0's engine fleet (not started): slots and logs under run_dir/rollout, an
        absolute path (remote engines read the slots by path, in another working directory)."""
        cfg = self.ctx.job.rollout
        run_dir = self.ctx.run_dir
        urls_file = remote.resolve_urls_file(cfg, run_dir) if cfg.engine_urls_file else None
        return EngineFleet(
            cfg,
            run_dir=(run_dir / "rollout").resolve(),
            model_path=model_path,
            initial_version=initial_version,
            urls_file=urls_file,
        )

    def serving(self, policy_chunks, hf_dir: Path, version: int) -> EngineFleet | None:
        """Rank 0's fleet, its engines serving `policy_chunks` as `version` (collective over the
        policy ranks). Engines started early and remote engines get the weights now through
        the fleet's one hand-off (`EngineFleet.load`: gathered to rank 0, one slot file, every
        engine synced; a failure raises); local engines not started yet start from `hf_dir`,
        the same weights. A restarted local engine starts from `hf_dir`. None on other ranks
        (and on rank 0 without `needs_engines`)."""
        if not self.needs_engines:
            return None
        ctx = self.ctx
        early = bool(self._broadcast_to_policy_ranks(self.fleet is not None))
        if not early and ctx.job.rollout.launches_engines:
            self.fleet = self.new_fleet(hf_dir, version) if ctx.rank0 else None
            return self.fleet
        weights = gather_hf_weights(policy_chunks, ctx.spec, ctx.train_parallel)
        if weights is None:  # not rank 0: it took part in the gather
            return None
        fleet = self.fleet or self.new_fleet(hf_dir, version)
        self.fleet = fleet
        fleet.load(weights, version, strict=True)
        fleet.restart_from(hf_dir)
        kind = "local" if ctx.job.rollout.launches_engines else "remote"
        log.info("%s engines %s serve policy version %d", kind, " ".join(fleet.urls), version)
        return fleet

    def stop(self) -> None:
        """Stop rank 0's engines (started or requested; idempotent)."""
        if self.fleet is not None:
            self.fleet.stop()

    def _broadcast_to_policy_ranks(self, obj):
        """Rank 0's `obj` on every rank that holds the RL policy (the world, or the policy ranks
        of a role split; the value ranks do not call it)."""
        if self.ctx.roles is None:
            return broadcast_from_rank0(obj)
        group = self.ctx.train_parallel.model_group
        if dist.get_world_size(group) == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]
