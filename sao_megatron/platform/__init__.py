"""Platform selection (CUDA/NCCL/TE vs CPU/gloo/local) and the CPU compatibility layer."""

from sao_megatron.platform.cpu_compat import (
    WORKAROUNDS,
    active_workarounds,
    disable_cpu_compat,
    enable_cpu_compat,
)
from sao_megatron.platform.platform import (
    NATIVE_BF16_CPU_FLAGS,
    Platform,
    auto_params_dtype,
    cpu_has_native_bf16,
    detect_platform,
    setup_platform,
    slow_bf16_warning,
    transformer_engine_available,
)

__all__ = [
    "NATIVE_BF16_CPU_FLAGS",
    "WORKAROUNDS",
    "Platform",
    "active_workarounds",
    "auto_params_dtype",
    "cpu_has_native_bf16",
    "detect_platform",
    "disable_cpu_compat",
    "enable_cpu_compat",
    "setup_platform",
    "slow_bf16_warning",
    "transformer_engine_available",
]
