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
