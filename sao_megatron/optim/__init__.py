"""Megatron DDP + optimiser (Adam, clipping, LR schedule, distributed optimiser) and precision."""

from sao_megatron.optim.builder import TrainState, build_optimizer
from sao_megatron.optim.config import OptimizerConfig, PrecisionConfig

__all__ = ["OptimizerConfig", "PrecisionConfig", "TrainState", "build_optimizer"]
