"""Process groups and Megatron parallel_state set-up (the only place that touches it)."""

from sao_megatron.parallel.config import ParallelConfig
from sao_megatron.parallel.state import (
    ParallelState,
    destroy_parallel,
    initialize_parallel,
    tensor_parallel_group,
)

__all__ = [
    "ParallelConfig",
    "ParallelState",
    "destroy_parallel",
    "initialize_parallel",
    "tensor_parallel_group",
]
