"""The critic's part of a train step: VALUE_TARGETS, VALUE_UPDATE and the critic's fit.

The fit is measured on this DP rank's share (`fit`, `RLStep.value_fit`) or over the global
batch (`evaluate`, `RLStep.value_eval`: value pre-training's held-out explained variance).

SAO's value work is K + 1 value forwards and K backwards when the targets need no values
(`Algorithm.value_targets`, lam_value = 1): VALUE_TARGETS then runs no forward, the first
update's forward gives V_old (detached) and the bootstrap value V_last of truncated rows.
Otherwise (lam_value != 1, or a truncated trajectory whose rows span micro-batches) VALUE_TARGETS
runs a no-grad value forward first, K + 2 forwards in all (the last one, `after_updates`, is the
critic after its updates, for the ADVANTAGES phase).

Value loss (`sao_megatron.algorithm.losses.value_loss`, token-mean over the global value mask):
0.5 max((V - R)^2, (V_old + clip(V - V_old, -eps_v, eps_v) - R)^2), eps_v =
``algorithm.sao.value_clip``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sao_megatron.algorithm.config import AlgorithmConfig
from sao_megatron.algorithm.losses import value_loss
from sao_megatron.algorithm.metrics import explained_variance
from sao_megatron.data.micro_batches import RankBatch, values_at_predictions
from sao_megatron.models.forward import compute_values
from sao_megatron.optim.builder import TrainState
from sao_megatron.trainer.step_advantages import StepAdvantages
from sao_megatron.trainer.step_context import StepContext
from sao_megatron.trainer.step_state import PendingTargets, StepState


class ValuePhases:
    """The value-model phases of a train step.

    Args:
        ctx: the step's execution context (DP sums, the update pass).
        advantages: the algorithm's advantage math on the local batch (gives the targets).
        value: value-model `TrainState` (DDP model, optimiser, LR scheduler).
        config: the algorithm's config (``sao.value_clip``).
    """

    def __init__(
        self,
        ctx: StepContext,
        advantages: StepAdvantages,
        value: TrainState,
        config: AlgorithmConfig,
    ) -> None:
        self.ctx, self.advantages, self.value, self.config = ctx, advantages, value, config

    # ---------------------------------------------------------------------- phases
    def targets(self, state: StepState) -> None:
        """VALUE_TARGETS: the value targets with the critic before its updates.

        Without a value forward when the algorithm gives value-free targets and every row that
        bootstraps sits in the micro-batch of its trajectory's last action token (always for
        full-history rows); the first VALUE_UPDATE then supplies V_old and V_last. Otherwise a
        no-grad value forward gives V_old and the targets (the decision is taken over all DP
        ranks: expert-parallel forwards are collective)."""
        pending = self._pending_targets(state)
        if pending is None:
            state.values = self.values(state.batch)
            _, state.returns, state.value_mask = self.advantages.compute(state, state.values)
            self._explained_variance_before(state)
        state.pending_targets = pending
        state.num_value_tokens = self.ctx.dp_sum(int(state.value_mask.sum()))

    def update(self, state: StepState) -> None:
        """VALUE_UPDATE: one optimiser step of the clipped value loss on V_old / returns.

        With pending targets (no VALUE_TARGETS forward) this is the first update: V_old is its
        own forward's V (detached), so V - V_old = 0, the clip branch of the loss equals the
        unclipped one (value and gradient, bit for bit), and the returns take V_last from the
        same forward; afterwards V_old and the returns are kept for the next updates."""
        clip, n_value, rank = self.config.sao.value_clip, state.num_value_tokens, state.batch
        pending = state.pending_targets

        def loss_fn(outputs, mb):
            v, after = values_at_predictions(outputs["values"])
            e = mb.extras
            if pending is None:
                old, ret = e["old_values"], e["returns"]
            else:
                start = int(e["row"][0])
                old = v.detach()
                ret = pending.returns(after.cpu(), slice(start, start + len(v))).to(v.device)
            loss = value_loss(
                v, old, ret, e["value_mask"], clip=clip, mode="token_mean", num_tokens=n_value
            )
            return loss, {}

        extras = {"value_mask": state.value_mask}
        if pending is None:
            extras |= {"old_values": state.values[0], "returns": state.returns}
        else:
            extras["row"] = torch.arange(rank.num_rows)
        recs = self.ctx.forward_backward(self.value, rank, extras, kind="value", loss_fn=loss_fn)
        ok, grad_norm = self.value.step()
        if pending is not None:
            raw = self._pp_values(recs, rank.token_shape)
            self._resolve_targets(state, values_at_predictions(raw))
        m = self.ctx.update_metrics("value", self.value, recs, ok, grad_norm)
        # the standard names hold the last update's figures
        state.metrics |= m | {f"value/loss_{state.value_updates}": m["loss/value"]}
        state.value_updates += 1

    def after_updates(self, state: StepState) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh values after the value updates, and how well they fit the targets (targets
        still pending when no update ran, K = 0, take V_last from these values)."""
        values = self.values(state.batch)
        if state.pending_targets is not None:
            self._resolve_targets(state, values)
        returns, vmask = state.returns, state.value_mask
        state.metrics["value/explained_variance"] = explained_variance(values[0], returns, vmask)
        state.metrics["value/return_mean"] = float(returns[vmask].mean()) if vmask.any() else 0.0
        return values

    def fit(self, state: StepState) -> dict[str, float]:
        """How well the critic predicts the value targets of the local batch (`RLStep.value_fit`):
        one no-grad value forward, no update."""
        values = self.values(state.batch)
        _, returns, vmask = self.advantages.compute(state, values)
        v = values[0][vmask].double()
        r = returns[vmask].double()
        nan = float("nan")
        return {
            "value/explained_variance": explained_variance(values[0], returns, vmask),
            "value/mse": float((v - r).pow(2).mean()) if len(r) else nan,
            "value/value_mean": float(v.mean()) if len(v) else nan,
            "value/return_mean": float(r.mean()) if len(r) else nan,
            "value/return_std": float(r.std(unbiased=False)) if len(r) else nan,
        }

    def evaluate(self, state: StepState) -> dict[str, float]:
        """How well the critic predicts the value targets of the global batch
        (`RLStep.value_eval`): one no-grad value forward, no update, sums over the DP group."""
        values = self.values(state.batch)
        _, returns, vmask = self.advantages.compute(state, values)
        ev = explained_variance(values[0], returns, vmask, reducer=self.ctx.batch_reducer)
        err = torch.where(vmask, values[0].double() - returns.double(), 0.0)
        sums = self.ctx.dp_sum_dict({"n": float(vmask.sum()), "sq": float(err.pow(2).sum())})
        n = sums["n"]
        return {
            "value/explained_variance": ev,
            "value/mse": sums["sq"] / n if n else float("nan"),
            "value/num_tokens": n,
        }

    # ---------------------------------------------------------------------- values
    def values(self, rank: RankBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Value-model outputs for the rank's micro-batches, no gradient: (before, after)
        [R, T-1] float32 on CPU, V(state before / after token p+1) (`values_at_predictions`).
        """
        raw = compute_values(self.value.model, self.ctx.parallel, rank.model_inputs())
        return values_at_predictions(raw.float().cpu())

    def _pp_values(self, recs: list[dict], shape: tuple[int, int]) -> torch.Tensor:
        """The value records of a forward_backward, [R, T] float32 on CPU on every PP stage."""
        p = self.ctx.parallel
        raw = torch.cat([r["values"] for r in recs]) if recs else None
        if p.cfg.pp > 1:
            pp_group = p.pg_collection.pp
            if raw is None:
                raw = torch.empty(shape, dtype=torch.float32, device=p.platform.device)
            src = dist.get_global_rank(pp_group, p.cfg.pp - 1)
            dist.broadcast(raw, src=src, group=pp_group)
        return raw.float().cpu()

    # ---------------------------------------------------------------------- targets
    def _pending_targets(self, state: StepState) -> PendingTargets | None:
        """`PendingTargets` of the local batch (and its value mask on `state`), or None when a
        value forward is needed."""
        targets = self.advantages.value_targets(state)
        if targets is None:
            return None
        base, coef, vmask = targets
        rank = state.batch
        boot_row = torch.arange(rank.num_rows)
        boot_pos = torch.zeros(rank.num_rows, dtype=torch.long)
        last, _ = rank.last_actions()  # [num_traj, 2]: row, prediction position
        bootstraps = coef.ne(0).any(1)
        row_trajectory = rank.rows.row_trajectory
        for r in torch.nonzero(bootstraps).flatten().tolist():
            boot_row[r], boot_pos[r] = last[int(row_trajectory[r])]
        mbs = rank.micro_batch_size
        split = bool(((boot_row // mbs) != (torch.arange(rank.num_rows) // mbs)).any())
        if self.ctx.dp_sum(float(split)) > 0:
            return None
        state.value_mask = vmask
        return PendingTargets(base=base, coef=coef, boot_row=boot_row, boot_pos=boot_pos)

    def _resolve_targets(self, state: StepState, values: tuple[torch.Tensor, torch.Tensor]) -> None:
        """V_old := (before, after) [R, T-1] of the critic before its updates; returns from
        them."""
        state.values = values
        state.returns = state.pending_targets.returns(values[1])
        state.pending_targets = None
        self._explained_variance_before(state)

    @staticmethod
    def _explained_variance_before(state: StepState) -> None:
        state.metrics["value/explained_variance_before"] = explained_variance(
            state.values[0], state.returns, state.value_mask
        )
