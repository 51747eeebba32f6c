"""One RL train step on a packed batch: SAO (value, value, policy with DIS) or GRPO (PPO-clip).

The order of work per step (DESIGN.md section 3, "Schedule"):

SAO:  value forward -> returns (lam_value) and V_old -> value update x K (K =
      algorithm.value_updates_per_policy_update) -> value forward -> advantages (lam_policy) with
      the updated critic -> policy update with direct importance sampling on the behaviour
      log-probs recorded by the rollout engine (no recomputation of "old" log-probs).
GRPO: policy forward (no grad) for the old log-probs -> group advantages -> PPO-clip update.

Data parallelism: the caller hands every rank the same global `TrainBatch`; each DP rank keeps
whole trajectories (whole GRPO groups) so GAE and group statistics stay local, pads to the same
number of rows on every rank (expert-parallel all-to-alls need equal micro-batch counts), and the
loss denominators (action tokens, sequences) are all-reduced so the gradient is that of the
*global* token-mean. Position convention: `forward_backward` returns log-probs/values at
*prediction* positions p = 0..T-2 (position p scores token p+1); `TrainBatch` tensors are at token
positions, so every extra handed to a loss is shifted with `_pred`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sao_megatron.algorithm.advantages import compute_advantages
from sao_megatron.algorithm.config import AlgorithmConfig
from sao_megatron.algorithm.losses import policy_loss, value_loss
from sao_megatron.algorithm.metrics import explained_variance, off_policy_metrics
from sao_megatron.data.batch import TrainBatch, gather_to_streams, scatter_from_streams
from sao_megatron.models.forward import (
    ModelInputs,
    compute_policy_logprobs,
    compute_values,
    forward_backward,
)
from sao_megatron.optim.builder import TrainState
from sao_megatron.parallel.state import ParallelState

#: off_policy_metrics() names -> logged names (sao_megatron.trainer.metrics.STANDARD_METRICS)
DEVIATION_NAMES = {
    "mean_abs_one_minus_ratio": "deviation/abs_one_minus_ratio_mean",
    "fraction_dropped": "deviation/dropped_fraction",
}


def _pred(x: torch.Tensor) -> torch.Tensor:
    """Token-position tensor [B, T] -> prediction positions [B, T-1] (entry p is token p+1)."""
    return x[:, 1:]


def shard_for_data_parallel(batch: TrainBatch, dp_rank: int, dp_size: int, by_group: bool):
    """Rows of the trajectories this DP rank trains on, and their trajectory indices.

    Trajectories (or, with ``by_group``, all trajectories sharing a task id) are dealt to DP ranks
    greedily by token count (largest first), so ranks get similar work and every trajectory stays
    on one rank. Returns (row indices [R] int64, trajectory indices [n] int64), sorted.
    """
    rows_of = [[] for _ in range(batch.num_trajectories)]
    for r, t in enumerate(batch.row_trajectory.tolist()):
        rows_of[t].append(r)
    tokens = batch.loss_mask.sum(1).tolist()
    units: dict[object, list[int]] = {}
    for t in range(batch.num_trajectories):
        units.setdefault(batch.task_ids[t] if by_group else t, []).append(t)
    cost = {k: sum(tokens[r] for t in ts for r in rows_of[t]) for k, ts in units.items()}
    load = [0] * dp_size
    mine: list[int] = []
    for key in sorted(units, key=lambda k: (-cost[k], str(k))):
        owner = min(range(dp_size), key=lambda i: (load[i], i))
        load[owner] += cost[key]
        if owner == dp_rank:
            mine += units[key]
    mine.sort()
    rows = sorted(r for t in mine for r in rows_of[t])
    return torch.tensor(rows, dtype=torch.long), torch.tensor(mine, dtype=torch.long)


def local_batch(batch: TrainBatch, rows: torch.Tensor, trajs: torch.Tensor) -> TrainBatch:
    """The sub-batch of `rows` / `trajs` with trajectory indices renumbered from 0."""
    remap = torch.full((batch.num_trajectories,), -1, dtype=torch.long)
    remap[trajs] = torch.arange(len(trajs))
    sub = batch.rows(rows)
    return TrainBatch(
        **{k: v for k, v in sub.items() if k != "row_trajectory"},
        row_trajectory=remap[sub["row_trajectory"]],
        node_rewards=batch.node_rewards[trajs],
        num_nodes=batch.num_nodes[trajs],
        truncated=batch.truncated[trajs],
        task_ids=[batch.task_ids[i] for i in trajs.tolist()],
        group_index=batch.group_index[trajs],
        temperature=batch.temperature,
    )


@dataclass(kw_only=True)
class StepConfig:
    """Execution settings of a train step (not algorithm math).

    micro_batch_size: rows per micro-batch in forward/backward passes.
    """

    micro_batch_size: int = 4

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1:
            raise ValueError(f"trainer.micro_batch_size={self.micro_batch_size}: must be >= 1")


class RLStep:
    """Runs SAO or GRPO updates of the policy (and value model) on packed batches.

    Args:
        algorithm: the algorithm config (name "sao" or "grpo").
        parallel: this rank's parallel state.
        policy: policy `TrainState` (DDP model, optimiser, LR scheduler).
        value: value-model `TrainState`; required for SAO, must be None for GRPO.
        step_cfg: micro-batching.
    """

    def __init__(
        self,
        algorithm: AlgorithmConfig,
        parallel: ParallelState,
        policy: TrainState,
        value: TrainState | None,
        step_cfg: StepConfig,
    ) -> None:
        if algorithm.name == "sao" and value is None:
            raise ValueError("algorithm.name='sao' needs a value model")
        if algorithm.kl_coef > 0:
            raise ValueError(
                "algorithm.kl_coef > 0 needs a reference model, which the trainer does not build "
                "yet; set algorithm.kl_coef=0"
            )
        self.algo, self.parallel, self.policy, self.value, self.cfg = (
            algorithm,
            parallel,
            policy,
            value,
            step_cfg,
        )

    # ---------------------------------------------------------------------- helpers
    def _dp_sum(self, x: float) -> float:
        t = torch.tensor([float(x)], dtype=torch.float64)
        if self.parallel.dp > 1:
            dist.all_reduce(t, group=self.parallel.pg_collection.dp)
        return float(t.item())

    def _inputs(self, b: TrainBatch, extras: dict[str, torch.Tensor]) -> ModelInputs:
        return ModelInputs(
            input_ids=b.token_ids,
            attention_mask=b.loss_mask,
            position_ids=b.position_ids,
            extras=extras,
        )

    def _pad_rows(self, b: TrainBatch, num_rows: int) -> TrainBatch:
        """Append dummy rows (one pad token, all masks False) up to `num_rows`."""
        extra = num_rows - b.num_rows
        if extra <= 0:
            return b
        t = b.token_ids.shape[1]

        def pad(x, fill):
            return torch.cat([x, torch.full((extra, *x.shape[1:]), fill, dtype=x.dtype)])

        out = TrainBatch(**{**b.__dict__})
        out.token_ids = pad(b.token_ids, int(b.token_ids[0, 0]))
        out.position_ids = pad(b.position_ids, 0)
        out.loss_mask = pad(b.loss_mask, False)
        out.loss_mask[b.num_rows :, 0] = True  # one visible token keeps attention finite
        out.action_mask = pad(b.action_mask, False)
        out.node_index = pad(b.node_index, -1)
        out.behaviour_logprobs = pad(b.behaviour_logprobs, 0.0)
        out.policy_versions = pad(b.policy_versions, -1)
        out.row_trajectory = pad(b.row_trajectory, -1)
        assert out.token_ids.shape == (num_rows, t)
        return out

    def _shard(self, batch: TrainBatch) -> tuple[TrainBatch, int]:
        """This DP rank's trajectories, padded to a common row count (multiple of mbs)."""
        p = self.parallel
        rows, trajs = shard_for_data_parallel(
            batch, p.dp_rank, p.dp, by_group=self.algo.name == "grpo"
        )
        counts = torch.tensor([len(rows)], dtype=torch.long)
        if p.dp > 1:
            dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=p.pg_collection.dp)
        mbs = self.cfg.micro_batch_size
        target = max(-(-int(counts) // mbs) * mbs, mbs)
        if len(trajs) == 0:
            raise ValueError(
                f"data-parallel rank {p.dp_rank} got no trajectory: the batch has "
                f"{batch.num_trajectories} trajectories (or GRPO groups) for {p.dp} DP ranks; "
                "raise rl.trajectories_per_step to at least the data-parallel size"
            )
        local = local_batch(batch, rows, trajs)
        return self._pad_rows(local, target), local.num_rows

    # ---------------------------------------------------------------------- values/advantages
    def _values(self, b: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Value-model outputs for the local batch, no gradient.

        Returns (at_tokens, raw): raw[b, t] = V(state after reading tokens 0..t) [B, T];
        at_tokens[b, t] = V(state before token t) = raw[b, t-1], column 0 = 0 [B, T].
        """
        raw = (
            compute_values(
                self.value.model, self.parallel, self._inputs(b, {}), self.cfg.micro_batch_size
            )
            .float()
            .cpu()
        )
        at_tokens = torch.zeros_like(raw)
        at_tokens[:, 1:] = raw[:, :-1]
        return at_tokens, raw

    def _advantages(self, b: TrainBatch, num_real_rows: int, values=None):
        """Advantages/returns/value mask at token positions [B, T] for the padded local batch.

        values: (at_tokens, raw) from `_values` (SAO) or None (GRPO).
        """
        real = _real_rows(b, num_real_rows)
        node_idx, valid = gather_to_streams(real, real.node_index)
        kw = dict(node_rewards=real.node_rewards, node_index=node_idx, action_mask=valid)
        if self.algo.name == "grpo":
            groups = {tid: i for i, tid in enumerate(dict.fromkeys(real.task_ids))}
            gid = torch.tensor([groups[t] for t in real.task_ids], dtype=torch.long)
            out = compute_advantages(self.algo, **kw, group_ids=gid)
        else:
            at_tokens, raw = values
            v_streams, _ = gather_to_streams(real, at_tokens[:num_real_rows])
            boot = _last_state_values(real, raw)
            out = compute_advantages(
                self.algo, **kw, values=v_streams, truncated=real.truncated, bootstrap_values=boot
            )

        def back(x):
            full = torch.zeros(b.token_ids.shape, dtype=x.dtype)
            full[:num_real_rows] = scatter_from_streams(real, x)
            return full

        adv = back(out.advantages.float())
        ret = back(out.returns.float()) if out.returns is not None else None
        vmask = back(out.value_mask.float()).bool() if out.value_mask is not None else None
        return adv, ret, vmask

    # ---------------------------------------------------------------------- updates
    def _value_update(self, b, old_values, returns, vmask, n_value) -> dict[str, float]:
        algo = self.algo

        def loss_fn(outputs, mb):
            v = outputs["values"][:, :-1]  # prediction p scores the state before token p+1
            e = mb.extras
            loss = value_loss(
                v,
                e["old_values"],
                e["returns"],
                e["value_mask"],
                clip=algo.value_clip,
                mode="token_mean",
                num_tokens=n_value,
            )
            return loss, {}

        extras = {
            "old_values": _pred(old_values),
            "returns": _pred(returns),
            "value_mask": _pred(vmask),
        }
        self.value.zero_grad()
        recs = forward_backward(
            self.value.model,
            self.parallel,
            self._inputs(b, extras),
            kind="value",
            loss_fn=loss_fn,
            micro_batch_size=self.cfg.micro_batch_size,
        )
        ok, grad_norm = self.value.step()
        loss = self._dp_sum(sum(float(r["loss"]) for r in recs))
        lr = self.value.optimizer.param_groups[0]["lr"]
        return {
            "loss/value": loss,
            "grad_norm/value": _f(grad_norm),
            "value/update_ok": float(ok),
            "lr/value": float(lr),
        }

    def _policy_update(self, b, adv, old_logprobs, n_tokens, n_seqs):
        algo = self.algo

        def loss_fn(outputs, mb):
            e = mb.extras
            lp = outputs["logprobs"]
            loss = policy_loss(
                algo,
                logprobs=lp,
                behaviour_logprobs=e["behaviour_logprobs"],
                advantages=e["advantages"],
                action_mask=e["action_mask"],
                old_logprobs=e.get("old_logprobs"),
                num_tokens=n_tokens,
                num_sequences=n_seqs,
            )
            if algo.entropy_coef:
                ent = torch.where(e["action_mask"], outputs["entropy"], 0.0).sum() / n_tokens
                loss = loss - algo.entropy_coef * ent
            return loss, {}

        extras = {
            "behaviour_logprobs": _pred(b.behaviour_logprobs),
            "advantages": _pred(adv),
            "action_mask": _pred(b.action_mask),
        }
        if old_logprobs is not None:
            extras["old_logprobs"] = old_logprobs
        self.policy.zero_grad()
        recs = forward_backward(
            self.policy.model,
            self.parallel,
            self._inputs(b, extras),
            kind="policy",
            loss_fn=loss_fn,
            micro_batch_size=self.cfg.micro_batch_size,
            temperature=b.temperature,
        )
        ok, grad_norm = self.policy.step()
        logprobs = torch.cat([r["logprobs"] for r in recs]).cpu() if recs else None
        entropy = torch.cat([r["entropy"] for r in recs]).cpu() if recs else None
        loss = self._dp_sum(sum(float(r["loss"]) for r in recs))
        lr = self.policy.optimizer.param_groups[0]["lr"]
        metrics = {
            "loss/policy": loss,
            "grad_norm/policy": _f(grad_norm),
            "policy/update_ok": float(ok),
            "lr/policy": float(lr),
        }
        return metrics, logprobs, entropy

    # ---------------------------------------------------------------------- the step
    def _value_phase(self, b: TrainBatch, n_real: int, metrics: dict) -> tuple:
        """V_old and returns, K value updates, then fresh values; returns the fresh values."""
        values = self._values(b)
        _, returns, vmask = self._advantages(b, n_real, values)
        n_value = self._dp_sum(int(_pred(vmask).sum()))
        metrics["value/explained_variance_before"] = explained_variance(values[0], returns, vmask)
        for k in range(self.algo.value_updates_per_policy_update):
            m = self._value_update(b, values[0], returns, vmask, n_value)
            metrics.update(m)  # standard names hold the last update's figures
            metrics[f"value/loss_{k}"] = m["loss/value"]
        values_new = self._values(b)
        metrics["value/explained_variance"] = explained_variance(values_new[0], returns, vmask)
        metrics["value/return_mean"] = float(returns[vmask].mean()) if vmask.any() else 0.0
        return values_new

    def value_step(self, batch: TrainBatch) -> dict[str, float]:
        """Value pre-training: the critic's K updates on `batch`, the policy untouched."""
        if self.value is None:
            raise ValueError("value_step() needs a value model (algorithm.name='sao')")
        b, n_real = self._shard(batch)
        metrics: dict[str, float] = {}
        self._value_phase(b, n_real, metrics)
        return metrics

    def train_step(self, batch: TrainBatch, train_version: int) -> dict[str, float]:
        """Run one SAO or GRPO step on the global `batch` (identical on all ranks).

        Args:
            batch: the packed global batch.
            train_version: the policy version being trained (before this update); used for the
                version-lag metrics.
        Returns: metrics (same on every rank of the last pipeline stage).
        """
        b, n_real = self._shard(batch)
        n_tokens = self._dp_sum(int(_pred(b.action_mask).sum()))
        n_seqs = self._dp_sum(int((b.action_mask.sum(1) > 0).sum()))
        metrics: dict[str, float] = {"batch/num_action_tokens": n_tokens, "batch/num_rows": n_seqs}
        old_logprobs = None
        t0 = time.perf_counter()
        if self.algo.name == "sao":
            values = self._value_phase(b, n_real, metrics)
            adv, _, _ = self._advantages(b, n_real, values)  # with the critic after its updates
            metrics["time/value"] = time.perf_counter() - t0
        else:
            old_logprobs, _ = compute_policy_logprobs(
                self.policy.model,
                self.parallel,
                self._inputs(b, {}),
                b.temperature,
                self.cfg.micro_batch_size,
            )
            old_logprobs = old_logprobs.cpu()
            adv, _, _ = self._advantages(b, n_real, None)
        t1 = time.perf_counter()
        pm, logprobs, entropy = self._policy_update(b, adv, old_logprobs, n_tokens, n_seqs)
        metrics.update(pm)
        metrics["time/policy"] = time.perf_counter() - (t1 if self.algo.name == "sao" else t0)
        if logprobs is not None:
            mask = _pred(b.action_mask)
            dev = off_policy_metrics(
                logprobs,
                _pred(b.behaviour_logprobs),
                mask,
                eps_low=self.algo.eps_low,
                eps_high=self.algo.eps_high,
                policy_versions=_pred(b.policy_versions),
                train_version=train_version,
            )
            metrics.update({DEVIATION_NAMES.get(k, f"deviation/{k}"): v for k, v in dev.items()})
            n_local = max(int(mask.sum()), 1)
            metrics["policy/entropy"] = float(torch.where(mask, entropy, 0.0).sum() / n_local)
            metrics["policy/advantage_mean"] = float(
                torch.where(_pred(b.action_mask), _pred(adv), 0.0).sum() / n_local
            )
        return metrics


def _f(x) -> float:
    return float("nan") if x is None else float(x)


def _real_rows(b: TrainBatch, n: int) -> TrainBatch:
    """Drop the dummy padding rows appended by `_pad_rows`."""
    sub = b.rows(slice(0, n))
    return TrainBatch(**{**b.__dict__, **sub})


def _last_state_values(real: TrainBatch, raw: torch.Tensor) -> torch.Tensor:
    """V of the state after each trajectory's last action token, [num_traj] float32: the
    bootstrap value of truncated trajectories. raw[b, t] = V after reading tokens 0..t."""
    out = torch.zeros(real.num_trajectories, dtype=torch.float32)
    for r in range(real.num_rows):  # rows, not tokens
        pos = torch.nonzero(real.action_mask[r]).flatten()
        if len(pos):
            out[int(real.row_trajectory[r])] = raw[r, int(pos[-1])]
    return out
