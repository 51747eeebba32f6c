"""`JobContext`: what every stage of a job shares on this rank, built once by the controller.

The trained config (vocabulary fitted to the tokenizer), the parallel layout the RL models
train in (a role's, with ``value.placement: separate``), the tokenizer and episode format, the
HF config and conversion spec the engines' weights follow, the algorithm; and the three
factories each stage needs: its checkpoint manager, its metrics logger, and the packing of
trajectories into this rank's train batch.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from sao_megatron.algorithm.base import Algorithm
from sao_megatron.convert.spec import ConversionSpec
from sao_megatron.data.batch import TrainBatch, pack_trajectories
from sao_megatron.parallel.roles import RoleLayout
from sao_megatron.parallel.state import ParallelState
from sao_megatron.trainer.checkpoint import CheckpointManager
from sao_megatron.trainer.job import JobConfig
from sao_megatron.trainer.metrics import MetricsLogger


@dataclasses.dataclass(kw_only=True)
class JobContext:
    """The job on this rank (fields are set once, by `Controller.prepare`).

    job: the config the run trains with (run_dir/config.yaml); parallel: the world's layout;
    train_parallel: the layout the RL stage's models train in (the role's when the critic is
    separate); roles: the role split or None; algorithm: the registered algorithm; tokenizer,
    formatter: the trained tokenizer and the episode format; hf_config, spec: the HF config and
    conversion spec of the policy the engines serve.
    """

    job: JobConfig
    parallel: ParallelState
    train_parallel: ParallelState
    roles: RoleLayout | None
    algorithm: Algorithm
    tokenizer: Any
    formatter: Any
    hf_config: dict
    spec: ConversionSpec

    @property
    def rank0(self) -> bool:
        return self.parallel.rank == 0

    @property
    def value_rank(self) -> bool:
        """A value rank of ``value.placement: separate`` (holds the critic only in RL)."""
        return self.roles is not None and not self.roles.is_policy

    @property
    def run_dir(self) -> Path:
        return Path(self.job.run_dir)

    def checkpoints(self, stage: str) -> CheckpointManager:
        """The checkpoint manager of `stage` ("sft", "rl"): checkpoint.save_dir/<stage>, the
        save_dir relative to run_dir unless absolute."""
        root = Path(self.job.checkpoint.save_dir)
        root = root if root.is_absolute() else self.run_dir / root
        return CheckpointManager(
            dataclasses.replace(self.job.checkpoint, save_dir=str(root / stage))
        )

    def logger(self, stage: str, total: int, initial: int) -> MetricsLogger:
        """`stage`'s metrics logger (run_dir/<stage>; rank 0 writes), at step `initial`."""
        return MetricsLogger(
            self.job.logging,
            self.run_dir / stage,
            is_logging_rank=self.rank0,
            total_steps=total,
            initial_step=initial,
            stage=stage,
        )

    def layout(self) -> dict[str, int]:
        """The parallel sizes a checkpoint's manifest records."""
        c = self.parallel.cfg
        return {"tp": c.tp, "pp": c.pp, "ep": c.ep, "dp": self.parallel.dp}

    def pack(self, trajectories: list) -> TrainBatch:
        """`trajectories` as one padded batch (`pack_trajectories`; padded to a multiple of TP
        with sequence parallelism, cut to model.max_position_embeddings)."""
        tp = self.parallel.cfg.tp if self.parallel.cfg.sequence_parallel else 1
        return pack_trajectories(
            trajectories,
            pad_token_id=self.tokenizer.pad_id,
            max_seq_len=self.job.model.max_position_embeddings,
            pad_to_multiple_of=tp,
        )
