"""The execution the phases of a train step share: sums over ranks, one model's update pass.

Loss denominators and logged figures are summed over the data-parallel group (`dp_sum`) so the
gradient is that of the *global* token-mean and every DP rank logs the same number; the same
sum, on tensors, is the algorithm's `BatchReducer` (`DataParallelSum`: whitening over the global
batch). A value update and a policy update run the same pass (`StepContext.forward_backward`,
then the model's optimiser step, then `update_metrics`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sao_megatron.data.micro_batches import RankBatch
from sao_megatron.models.forward import LossFn, forward_backward
from sao_megatron.optim.builder import TrainState
from sao_megatron.parallel.state import ParallelState


def _all_reduce_sum(x: torch.Tensor, group, device: torch.device) -> torch.Tensor:
    """float64 copy of `x` summed over `group`, reduced on `device` (the backend's: NCCL
    reduces CUDA tensors, gloo CPU ones), returned on the device of `x`."""
    t = x.detach().to(device=device, dtype=torch.float64, copy=True)
    dist.all_reduce(t, group=group)
    return t.to(x.device)


def _sum(values: list[float], group, device: torch.device, *, reduce: bool) -> list[float]:
    """float64 all-reduce (sum) of `values` over `group` when `reduce`, else `values`."""
    t = torch.tensor([float(x) for x in values], dtype=torch.float64)
    return (_all_reduce_sum(t, group, device) if reduce else t).tolist()


def _f(x) -> float:
    return float("nan") if x is None else float(x)


class DataParallelSum:
    """The step's `sao_megatron.algorithm.advantages.BatchReducer`: float64 tensors summed over
    this rank's data-parallel group, the identity at DP = 1.

    The DP group is exactly the set of ranks holding the other trajectories of the batch:
    `layout_micro_batches` deals trajectories by DP rank, and the tensor- and pipeline-parallel
    peers of a DP rank train on the same ones (expert parallelism splits experts across DP ranks,
    not data; with a separate critic, the role's own DP group, `sao_megatron.parallel.roles`).
    """

    def __init__(self, parallel: ParallelState) -> None:
        self.reduce = parallel.dp > 1
        self.group = parallel.pg_collection.dp if self.reduce else None
        self.device = parallel.platform.device

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """`x` summed elementwise over the DP ranks (float64, on the device of `x`)."""
        if not self.reduce:
            return x.to(torch.float64)
        return _all_reduce_sum(x, self.group, self.device)


class StepContext:
    """This rank's parallel state and the operations built on it.

    Args:
        parallel: this rank's parallel state (its DP group sums the step's counts).

    Attributes:
        batch_reducer: `DataParallelSum`, the sums over the DP group that `dp_sum` and the
            algorithm's batch statistics (`AdvantageInputs.reducer`) use.
    """

    def __init__(self, parallel: ParallelState) -> None:
        self.parallel = parallel
        self.batch_reducer = DataParallelSum(parallel)

    def dp_sum(self, x: float) -> float:
        """`x` summed over the data-parallel group (float64)."""
        return self.dp_sum_dict({"x": x})["x"]

    def dp_sum_dict(self, d: dict[str, float]) -> dict[str, float]:
        """`dp_sum` of every value, in one all-reduce."""
        t = torch.tensor([float(x) for x in d.values()], dtype=torch.float64)
        return dict(zip(d, self.batch_reducer.sum(t).tolist(), strict=True))

    def world_sum(self, *xs: float) -> list[float]:
        """`xs` summed over every rank training this model (float64): the default process
        group, or the role's ranks of a separate critic (`ParallelState.model_group`)."""
        group = self.parallel.model_group
        multi = dist.is_initialized() and dist.get_world_size(group) > 1
        return _sum(list(xs), group, self.parallel.platform.device, reduce=multi)

    def forward_backward(
        self,
        train: TrainState,
        rank: RankBatch,
        extras: dict[str, torch.Tensor],
        *,
        kind: str,
        loss_fn: LossFn,
        **sampling,
    ) -> list[dict[str, torch.Tensor]]:
        """Zero `train`'s gradients, then forward and backward `loss_fn` over the micro-batches
        of `rank` (`sao_megatron.models.forward.forward_backward`). Each micro-batch's loss
        reads its loss inputs and its rows of `extras` (the step's per-token inputs [R, T-1]:
        `MicroBatch.model_inputs`); `sampling`: temperature, top_p, top_k of a policy."""
        train.zero_grad()
        return forward_backward(
            train.model,
            self.parallel,
            rank.model_inputs(extras),
            kind=kind,
            loss_fn=loss_fn,
            **sampling,
        )

    def update_metrics(
        self, name: str, train: TrainState, recs: list[dict], ok: bool, grad_norm: float | None
    ) -> dict[str, float]:
        """The logged figures of one optimiser update of model `name` ("policy", "value"): the
        global loss (sum of the micro-batches' losses over DP ranks), the gradient norm (NaN
        when the step was skipped), whether it applied, the learning rate it used."""
        loss = self.dp_sum(sum(float(r["loss"]) for r in recs))
        lr = train.optimizer.param_groups[0]["lr"]
        return {
            f"loss/{name}": loss,
            f"grad_norm/{name}": _f(grad_norm),
            f"{name}/update_ok": float(ok),
            f"lr/{name}": float(lr),
        }
