"""ParallelConfig: the TP/PP/EP/expert-TP/SP/virtual-PP layout of the trainer world."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(kw_only=True)
class ParallelConfig:
    """Parallel layout; the data-parallel size is derived from the world size.

    Megatron orders ranks ``tp-cp-ep-dp-pp`` (TP innermost). Attention/dense layers use
    ``tp x dp x pp`` ranks; expert layers use ``expert_tp x ep x expert_dp x pp``.
    """

    #: fields __post_init__ fills from others when left None (see sao_megatron.configs)
    DERIVED_FIELDS: ClassVar[tuple[str, ...]] = ("expert_tp",)

    tp: int = 1
    """Tensor-model-parallel size (Megatron ``tensor_model_parallel_size``)."""
    pp: int = 1
    """Pipeline-model-parallel size (number of pipeline stages)."""
    ep: int = 1
    """Expert-model-parallel size (experts are split across this many ranks)."""
    expert_tp: int | None = None
    """Tensor-parallel size inside each expert (Megatron ``expert_tensor_parallel_size``);
    None = tp (Megatron's default). expert_tp=1 keeps experts whole (usual for fine-grained
    MoE) but needs ep > 1 when tp > 1: with ep=1 Megatron-Core 0.16 treats expert weights as
    dense params and never reduces their gradients over the TP ranks that share them."""
    sequence_parallel: bool = False
    """Shard activations along the sequence in TP regions. Required for MoE with tp > 1."""
    virtual_pp: int | None = None
    """Virtual pipeline stages per rank (interleaved schedule); None = not interleaved."""
    seed: int = 1234
    """Base seed for Megatron's model-parallel RNG tracker and torch (the model's random
    init). In a job, 1234 + the job's ``seed`` unless set (`sao_megatron.trainer.derived`)."""

    def __post_init__(self) -> None:
        if self.expert_tp is None:
            self.expert_tp = self.tp
        for name in ("tp", "pp", "ep", "expert_tp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"parallel.{name}={value!r}: must be an integer >= 1")
        if self.ep == 1 and self.expert_tp != self.tp:
            raise ValueError(
                f"parallel.expert_tp={self.expert_tp} differs from parallel.tp={self.tp} with "
                "parallel.ep=1: Megatron-Core would not reduce expert gradients across the TP "
                "ranks; set expert_tp=tp (or None) or use ep > 1"
            )
        if self.sequence_parallel and self.tp == 1:
            raise ValueError(
                "parallel.sequence_parallel=True needs parallel.tp > 1; set it to False for tp=1"
            )
        if self.virtual_pp is not None:
            if self.virtual_pp < 1:
                raise ValueError(f"parallel.virtual_pp={self.virtual_pp}: must be >= 1 or None")
            if self.pp == 1 and self.virtual_pp > 1:
                raise ValueError(
                    f"parallel.virtual_pp={self.virtual_pp} needs parallel.pp > 1 (got pp=1)"
                )

    def data_parallel_size(self, world_size: int) -> int:
        """DP size for ``world_size`` ranks.

        Raises:
            ValueError: if ``world_size`` is not divisible by ``tp*pp`` or by
                ``expert_tp*ep*pp``.
        """
        mp = self.tp * self.pp
        if world_size % mp:
            raise ValueError(
                f"world size {world_size} is not divisible by tp*pp={mp} "
                f"(parallel.tp={self.tp}, parallel.pp={self.pp}); change tp/pp or the "
                "number of ranks"
            )
        emp = self.expert_tp * self.ep * self.pp
        if world_size % emp:
            raise ValueError(
                f"world size {world_size} is not divisible by expert_tp*ep*pp={emp} "
                f"(parallel.expert_tp={self.expert_tp}, parallel.ep={self.ep}, "
                f"parallel.pp={self.pp}); change ep/expert_tp or the number of ranks"
            )
        return world_size // mp
