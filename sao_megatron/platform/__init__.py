"""Platform selection (CUDA/NCCL/TE vs CPU/gloo/local) and the CPU compatibility layer."""

from sao_megatron.platform.cpu_compat import (
    WORKAROUNDS,
    active_workarounds,
    disable_cpu_compat,
    enable_cpu_compat,
)
from sao_megatron.platform.platform import (
    Platform,
    detect_platform,
    setup_platform,
    transformer_engine_available,
)

__all__ = [
    "WORKAROUNDS",
    "Platform",
    "active_workarounds",
    "detect_platform",
    "disable_cpu_compat",
    "enable_cpu_compat",
    "setup_platform",
    "transformer_engine_available",
]
