"""Decide the execution platform: CUDA + NCCL + Transformer Engine, or CPU + gloo + local specs."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from sao_megatron.platform.cpu_compat import enable_cpu_compat


@dataclass(frozen=True)
class Platform:
    """Where Megatron runs in this process.

    Attributes:
        device: ``torch.device("cuda", local_rank)`` or ``torch.device("cpu")``.
        backend: torch.distributed backend, ``"nccl"`` on CUDA, ``"gloo"`` on CPU.
        use_te: build layers from Transformer Engine specs (CUDA and TE importable); otherwise
            Megatron-Core's local specs.
    """

    device: torch.device
    backend: str
    use_te: bool

    @property
    def is_cuda(self) -> bool:
        """True on a CUDA machine."""
        return self.device.type == "cuda"


def transformer_engine_available() -> bool:
    """True if ``transformer_engine`` can be imported (only checked on CUDA machines)."""
    return importlib.util.find_spec("transformer_engine") is not None


#: /proc/cpuinfo flags of x86 instructions that compute in bf16 (without them PyTorch's CPU bf16
#: matmuls convert element by element: 1.0 GFLOP/s against 51 for fp32 on a 2-core AVX2 EPYC)
NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool | None:
    """Whether this CPU has bf16 instructions (`NATIVE_BF16_CPU_FLAGS` in the "flags" lines of
    /proc/cpuinfo, or of `cpuinfo` when given); None when that cannot be read (not Linux x86)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return None
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
    if not flags:
        return None
    return any(f in flags for f in NATIVE_BF16_CPU_FLAGS)


def slow_bf16_warning(platform: Platform, params_dtype: str, cpuinfo: str | None = None):
    """A warning (str) when ``params_dtype`` is bf16 on a CPU without bf16 instructions, where
    every matmul runs tens of times slower than in fp32; None otherwise."""
    if platform.is_cuda or params_dtype != "bf16" or cpu_has_native_bf16(cpuinfo) is not False:
        return None
    return (
        "precision.params_dtype=bf16 on a CPU without bf16 instructions (none of "
        f"{', '.join(NATIVE_BF16_CPU_FLAGS)} in /proc/cpuinfo): PyTorch's bf16 matmuls run "
        "tens of times slower than fp32 here. Set precision.params_dtype=fp32 on this machine."
    )


def auto_params_dtype(cpuinfo: str | None = None) -> tuple[str, str]:
    """What ``precision.params_dtype: auto`` means on this machine, and why.

    Returns:
        ``("bf16", reason)`` on a CUDA GPU that supports bf16 (``torch.cuda.is_bf16_supported``)
        or a CPU with bf16 instructions (`cpu_has_native_bf16`, from `cpuinfo` when given);
        ``("fp32", reason)`` otherwise, including a CPU whose flags cannot be read.
    """
    if torch.cuda.is_available():
        if torch.cuda.is_bf16_supported():
            return "bf16", f"CUDA device {torch.cuda.get_device_name()} supports bf16"
        return "fp32", f"CUDA device {torch.cuda.get_device_name()} has no bf16 support"
    native = cpu_has_native_bf16(cpuinfo)
    if native:
        return "bf16", "CPU with bf16 instructions"
    if native is None:
        return "fp32", "CPU whose bf16 support cannot be read from /proc/cpuinfo"
    return "fp32", f"CPU without bf16 instructions (none of {', '.join(NATIVE_BF16_CPU_FLAGS)})"


def detect_platform(local_rank: int = 0) -> Platform:
    """Pick the platform from ``torch.cuda.is_available()`` (and TE importability on CUDA).

    Args:
        local_rank: this process's rank on its node; selects the CUDA device.
    """
    if torch.cuda.is_available():
        return Platform(
            device=torch.device("cuda", local_rank),
            backend="nccl",
            use_te=transformer_engine_available(),
        )
    return Platform(device=torch.device("cpu"), backend="gloo", use_te=False)


def setup_platform(local_rank: int = 0) -> Platform:
    """Detect the platform and prepare the process for Megatron-Core.

    On CUDA: sets the CUDA device. On CPU: installs ``enable_cpu_compat()`` (see
    ``sao_megatron.platform.cpu_compat``). Safe to call more than once.
    """
    platform = detect_platform(local_rank)
    if platform.is_cuda:
        torch.cuda.set_device(platform.device)
    else:
        enable_cpu_compat()
    return platform
