"""Megatron DDP + optimiser (Adam, clipping, LR schedule, distributed optimiser) and precision."""

from sao_megatron.optim.builder import LRScheduler, TrainState, build_optimizer
from sao_megatron.optim.config import OptimizerConfig, PrecisionConfig

__all__ = ["LRScheduler", "OptimizerConfig", "PrecisionConfig", "TrainState", "build_optimizer"]
