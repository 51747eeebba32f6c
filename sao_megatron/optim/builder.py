"""Wrap model chunks in Megatron DDP and build Megatron's optimiser and LR scheduler."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from sao_megatron.optim.config import OptimizerConfig, PrecisionConfig
from sao_megatron.parallel.state import ParallelState

logger = logging.getLogger(__name__)

#: the schedule's shape: the keys of Megatron's state dict that `OptimizerConfig` sets
SCHEDULE_FIELDS = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style")


class LRScheduler(OptimizerParamScheduler):
    """Megatron's ``OptimizerParamScheduler`` that, on loading, keeps the schedule this job was
    configured with and takes only the position in it (the number of updates) from the saved one.

    Two departures from Megatron's ``load_state_dict``:

    - **The count is set, not added.** Megatron's calls ``self.step(increment=saved num_steps)``,
      which assumes a scheduler at step 0. `build_optimizer` steps the schedule once at
      construction while warm-up is active (so update k uses lr*k/warmup), so the added count put
      every resumed run one step ahead (warm-up 10, peak 1e-3: lr 5e-4 instead of 4e-4 at update
      4 after resuming at 3). The saved count is read as updates done (less the construction
      step when the saved schedule had a warm-up), and this schedule is placed after as many.
    - **The configured shape wins.** With Megatron's defaults the saved warm-up, decay and style
      replaced the configured ones, while the peak and floor lr came from the optimiser's param
      groups, i.e. from the config: a job resumed with a changed ``warmup_steps`` silently kept
      the old warm-up while a changed ``lr`` took effect. Here every field of the shape
      (`SCHEDULE_FIELDS`) comes from the config, and each that differs from the checkpoint's is
      logged at WARNING (``resumed LR schedule: lr_warmup_steps 0 in the checkpoint -> 20 from
      the config``), so a resumed job says which schedule it uses.
    """

    def load_state_dict(self, state_dict: dict) -> None:
        """Resume this schedule after the saved number of updates (see the class docstring).

        Args:
            state_dict: what ``state_dict()`` returned (Megatron's keys: ``max_lr``,
                ``lr_warmup_steps``, ``num_steps``, ...).
        """
        changed = [
            f"{key} {state_dict[key]} in the checkpoint -> {getattr(self, key)} from the config"
            for key in SCHEDULE_FIELDS
            if key in state_dict and state_dict[key] != getattr(self, key)
        ]
        if changed:
            logger.warning("resumed LR schedule: %s", "; ".join(changed))
        updates = state_dict["num_steps"] - (1 if state_dict.get("lr_warmup_steps", 0) > 0 else 0)
        self.num_steps = 0
        self.override_opt_param_scheduler = True  # Megatron's switch: the configured values win
        super().load_state_dict(
            {**state_dict, "num_steps": updates + (1 if self.lr_warmup_steps > 0 else 0)}
        )


@dataclass
class TrainState:
    """What ``build_optimizer`` returns.

    Attributes:
        model: DDP-wrapped chunks (pass these to ``forward_backward``); ``unwrapped`` the
            original modules (for state dicts/freezing reports).
        optimizer: Megatron ``MegatronOptimizer`` (``ChainedOptimizer`` over dense/expert
            params); ``step() -> (update_successful, grad_norm, num_zeros)``.
        scheduler: `LRScheduler` (Megatron ``OptimizerParamScheduler``); ``step()`` calls
            ``scheduler.step(1)`` after each successful update. Stateful: its ``state_dict()``
            / ``load_state_dict()`` round-trip the schedule exactly (checkpoint it by name); a
            changed schedule in the config wins on loading and is logged.
    """

    model: list[DistributedDataParallel]
    unwrapped: list[torch.nn.Module]
    optimizer: object
    scheduler: LRScheduler

    def zero_grad(self) -> None:
        """Zero the DDP grad buffers and the optimiser's grads (before each forward_backward)."""
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> tuple[bool, float | None]:
        """Optimiser step (clip, unscale, update) then LR step if the update happened.

        Returns:
            (update_successful, grad_norm); an fp16 overflow gives (False, None) and halves
            the loss scale (after ``hysteresis`` overflows).
        """
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=1)
        return ok, grad_norm


def build_optimizer(
    model: Sequence[torch.nn.Module],
    parallel: ParallelState,
    optimizer: OptimizerConfig,
    precision: PrecisionConfig,
) -> TrainState:
    """Megatron DDP + Megatron Adam (fp32 master weights for bf16/fp16, dynamic loss scaling for
    fp16, global-norm clipping, optional distributed optimiser) + warmup/decay LR schedule.

    Same code path on CPU and GPU. Parameters with ``requires_grad=False`` (see
    ``apply_freeze``) are excluded from the DDP buffers and the optimiser, so call
    ``apply_freeze`` first.

    Raises:
        ValueError: no trainable parameter; precision not matching the model's params dtype.
    """
    chunks = list(model)
    trainable = sum(p.numel() for c in chunks for p in c.parameters() if p.requires_grad)
    if trainable == 0:
        raise ValueError("build_optimizer: the model has no trainable parameter (all frozen?)")
    dtype = precision.torch_dtype
    wrong = {p.dtype for c in chunks for p in c.parameters()} - {dtype}
    if wrong:
        raise ValueError(
            f"precision.params_dtype={precision.params_dtype} but model params are {wrong}; "
            "build the model with the same PrecisionConfig"
        )
    config = chunks[0].config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=optimizer.overlap_grad_reduce,
        use_distributed_optimizer=optimizer.distributed_optimizer,
    )
    wrapped = [
        DistributedDataParallel(
            config=config,
            ddp_config=ddp_config,
            module=chunk,
            disable_bucketing=i > 0,
            pg_collection=parallel.pg_collection,
        )
        for i, chunk in enumerate(chunks)
    ]
    # Hooks the pipeline schedules call (same as Megatron-LM's training loop).
    config.no_sync_func = [m.no_sync for m in wrapped]
    if len(wrapped) == 1:
        config.no_sync_func = config.no_sync_func[0]
    config.finalize_model_grads_func = finalize_model_grads

    mcfg = MegatronOptimizerConfig(
        optimizer="adam",
        lr=optimizer.lr,
        min_lr=optimizer.min_lr,
        weight_decay=optimizer.weight_decay,
        adam_beta1=optimizer.adam_beta1,
        adam_beta2=optimizer.adam_beta2,
        adam_eps=optimizer.adam_eps,
        clip_grad=optimizer.clip_grad,
        use_distributed_optimizer=optimizer.distributed_optimizer,
        params_dtype=dtype,
        bf16=precision.params_dtype == "bf16",
        fp16=precision.params_dtype == "fp16",
        loss_scale=precision.loss_scale,
        initial_loss_scale=precision.initial_loss_scale,
        min_loss_scale=precision.min_loss_scale,
        loss_scale_window=precision.loss_scale_window,
        hysteresis=precision.hysteresis,
    )
    opt = get_megatron_optimizer(
        mcfg, wrapped, use_gloo_process_groups=False, pg_collection=parallel.pg_collection
    )
    config.grad_scale_func = opt.scale_loss  # loss scale (1 unless fp16), as Megatron-LM
    warmup = optimizer.warmup_steps
    decay = optimizer.decay_steps if optimizer.decay_style != "constant" else 1
    scheduler = LRScheduler(
        opt,
        init_lr=0.0,
        max_lr=optimizer.lr,
        min_lr=optimizer.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=warmup + decay,
        lr_decay_style=optimizer.decay_style,
        start_wd=optimizer.weight_decay,
        end_wd=optimizer.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
    if warmup:
        # Megatron's scheduler gives lr=0 at step 0; start at lr/warmup so update k (1-based)
        # uses lr*k/warmup.
        scheduler.step(increment=1)
    return TrainState(model=wrapped, unwrapped=chunks, optimizer=opt, scheduler=scheduler)
