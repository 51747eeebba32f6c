"""OptimizerConfig (Adam, clipping, LR schedule, distributed optimiser) and PrecisionConfig."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")


@dataclass(kw_only=True)
class PrecisionConfig:
    """Parameter/compute precision. bf16/fp16 keep fp32 master weights in the optimiser;
    fp16 adds dynamic loss scaling (Micikevicius et al. 2018, "Mixed Precision Training")."""

    params_dtype: str = "fp32"
    """Model parameter dtype: "fp32", "bf16", "fp16", or "auto": bf16 where the hardware
    computes in bf16 (a CUDA GPU with bf16 support, a CPU with avx512_bf16/amx_bf16), fp32
    elsewhere (`sao_megatron.platform.auto_params_dtype`). "auto" is resolved when the config is
    built, so the saved config and every later read see the dtype that ran."""
    fp8: bool = False
    """FP8 GEMMs through Transformer Engine (hybrid E4M3/E5M2, delayed scaling). CUDA + TE only."""
    initial_loss_scale: float = 2.0**16
    """fp16 only: starting dynamic loss scale."""
    min_loss_scale: float = 1.0
    """fp16 only: the dynamic loss scale never goes below this."""
    loss_scale_window: int = 1000
    """fp16 only: steps without overflow before the loss scale is doubled."""
    hysteresis: int = 2
    """fp16 only: overflows tolerated before the loss scale is halved."""
    loss_scale: float | None = None
    """fp16 only: a static loss scale instead of dynamic scaling (None = dynamic)."""

    def __post_init__(self) -> None:
        self.auto_reason: str | None = None
        """Why "auto" became ``params_dtype`` (None when the dtype was given); not a field."""
        if self.params_dtype == "auto":
            from sao_megatron.platform.platform import auto_params_dtype

            self.params_dtype, self.auto_reason = auto_params_dtype()
        if self.params_dtype not in _DTYPES:
            raise ValueError(
                f"precision.params_dtype={self.params_dtype!r}: must be one of "
                f"{sorted(_DTYPES) + ['auto']}"
            )
        if self.initial_loss_scale <= 0 or self.min_loss_scale <= 0:
            raise ValueError("precision.initial_loss_scale and min_loss_scale must be > 0")
        if self.loss_scale_window < 1 or self.hysteresis < 1:
            raise ValueError("precision.loss_scale_window and hysteresis must be >= 1")
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise ValueError(f"precision.loss_scale={self.loss_scale}: must be > 0 or None")

    @property
    def torch_dtype(self) -> torch.dtype:
        """``params_dtype`` as a ``torch.dtype``."""
        return _DTYPES[self.params_dtype]

    def check_platform(self, is_cuda: bool, use_te: bool) -> None:
        """Raise if the precision cannot run on this platform.

        Raises:
            ValueError: ``fp8=True`` without CUDA or without Transformer Engine.
        """
        if self.fp8 and not (is_cuda and use_te):
            where = "a CPU-only machine" if not is_cuda else "a machine without Transformer Engine"
            raise ValueError(
                f"precision.fp8=True needs CUDA and Transformer Engine (Hopper or newer); this is "
                f"{where}. Set precision.fp8=False (use params_dtype='bf16' instead)."
            )


@dataclass(kw_only=True)
class OptimizerConfig:
    """Adam (Loshchilov & Hutter 2019, decoupled weight decay) with global-norm gradient
    clipping and a warmup + decay learning-rate schedule (Megatron ``OptimizerParamScheduler``).

    Used by several job sections (``policy_optim``, ``value_optim``, ``sft.optim``): its errors
    name fields as ``optimizer.<field>`` and ``sao_megatron.configs.load_config`` replaces that
    prefix (`CONFIG_SECTION`) by the section that failed, e.g. ``value_optim.lr``.
    """

    CONFIG_SECTION: ClassVar[str] = "optimizer"

    lr: float = 1e-6
    """Peak learning rate (reached at the end of warmup)."""
    min_lr: float = 0.0
    """Final learning rate of the decay."""
    weight_decay: float = 0.0
    """Decoupled weight decay (not applied to biases and norm weights, Megatron's default)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Max global L2 norm of the gradients (0 disables clipping)."""
    warmup_steps: int = 0
    """Linear warmup steps from 0 to ``lr``."""
    decay_steps: int | None = None
    """Steps over which the LR decays after warmup (None = constant after warmup)."""
    decay_style: str = "constant"
    """"constant", "linear", "cosine" or "inverse-square-root"."""
    distributed_optimizer: bool = False
    """Shard optimiser state across data-parallel ranks (ZeRO-1, Megatron distrib optimizer)."""
    overlap_grad_reduce: bool = False
    """Overlap DP gradient reduce-scatter/all-reduce with backward (GPU; no gain on gloo)."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"optimizer.lr={self.lr}: must be > 0")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"optimizer.min_lr={self.min_lr}: must be in [0, lr={self.lr}]")
        if self.weight_decay < 0:
            raise ValueError(f"optimizer.weight_decay={self.weight_decay}: must be >= 0")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"optimizer.{name}={getattr(self, name)}: must be in [0, 1)")
        if self.adam_eps <= 0:
            raise ValueError(f"optimizer.adam_eps={self.adam_eps}: must be > 0")
        if self.clip_grad < 0:
            raise ValueError(f"optimizer.clip_grad={self.clip_grad}: must be >= 0 (0 = off)")
        if self.warmup_steps < 0:
            raise ValueError(f"optimizer.warmup_steps={self.warmup_steps}: must be >= 0")
        if self.decay_style not in _DECAY_STYLES:
            raise ValueError(
                f"optimizer.decay_style={self.decay_style!r}: must be one of {_DECAY_STYLES}"
            )
        if self.decay_style != "constant" and not self.decay_steps:
            raise ValueError(
                f"optimizer.decay_style={self.decay_style!r} needs optimizer.decay_steps > 0"
            )
