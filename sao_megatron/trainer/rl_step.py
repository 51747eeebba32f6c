"""One RL train step on a packed batch: the phases of the algorithm's schedule, on Megatron.

`RLStep` executes the `Phase`s an algorithm object lists in ``algorithm.schedule``
(`sao_megatron.algorithm.base`); the math of each phase (advantages, policy loss) is the
algorithm's, the execution (sharding, micro-batches, forward/backward, optimiser steps) is here:

SAO:      VALUE_TARGETS -> VALUE_UPDATE x K -> ADVANTAGES (updated critic) -> POLICY_UPDATE

SAO's value work is K + 1 value forwards and K backwards when the targets need no values
(`Algorithm.value_targets`, lam_value = 1): VALUE_TARGETS then runs no forward, the first
update's forward gives V_old (detached) and the bootstrap value of truncated rows. Otherwise
(lam_value != 1, or a truncated trajectory whose rows span micro-batches) VALUE_TARGETS runs a
no-grad value forward first, K + 2 forwards in all.
GRPO:     OLD_LOGPROBS -> ADVANTAGES (group statistics) -> POLICY_UPDATE (PPO-clip)
GRPO+DIS: ADVANTAGES (group statistics) -> POLICY_UPDATE (DIS on the behaviour log-probs)

Each phase's seconds go to ``time/<phase.timer>``: time/value, time/old_logprobs,
time/advantages and time/policy (the policy update alone, for every algorithm).

Data parallelism: the caller hands every rank the same global `TrainBatch`; each DP rank keeps
whole trajectories (whole GRPO groups) so GAE and group statistics stay local, pads to the same
number of rows on every rank (expert-parallel all-to-alls need equal micro-batch counts), and the
loss denominators (action tokens, sequences) are all-reduced so the gradient is that of the
*global* token-mean. Position convention: `forward_backward` returns log-probs/values at
*prediction* positions p = 0..T-2 (position p scores token p+1); `TrainBatch` tensors are at token
positions, so every extra handed to a loss is shifted with `_pred`.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from sao_megatron.algorithm.base import AdvantageInputs, Algorithm, Phase
from sao_megatron.algorithm.deviation_causes import deviation_cause_sums, finish_deviation_causes
from sao_megatron.algorithm.losses import value_loss
from sao_megatron.algorithm.metrics import explained_variance, off_policy_metrics
from sao_megatron.data.batch import TrainBatch, gather_to_streams, scatter_from_streams
from sao_megatron.models.forward import (
    ModelInputs,
    compute_policy_logprobs,
    compute_values,
    forward_backward,
)
from sao_megatron.models.routing_replay import RoutingReplay
from sao_megatron.optim.builder import TrainState
from sao_megatron.parallel.state import ParallelState
from sao_megatron.rollout.staleness import stale_token_mask

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
        top_p=batch.top_p,
        top_k=batch.top_k,
    )


@dataclass(kw_only=True)
class StepConfig:
    """Execution settings of a train step (not algorithm math).

    micro_batch_size: rows per micro-batch in forward/backward passes (rl.micro_batch_size).
    max_staleness: per-token off-policy bound (rollout.max_staleness): action tokens sampled more
        than this many versions before the trained one leave the policy loss (advantage 0; they
        stay in the token-mean denominator, like DIS-band drops) and the deviation metrics.
        None: no per-token bound.
    routing_replay: (rollout.routing_replay) the policy forwards of POLICY_UPDATE and
        OLD_LOGPROBS route every token the engine recorded to the engine's experts
        (`sao_megatron.models.routing_replay`); needs an MoE policy. Without it, batches that
        carry routing are only compared with the trainer's own (``deviation/routing_*``).
    """

    micro_batch_size: int = 4
    max_staleness: int | None = None
    routing_replay: bool = False

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1:
            raise ValueError(f"rl.micro_batch_size={self.micro_batch_size}: must be >= 1")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"rollout.max_staleness={self.max_staleness}: must be >= 0")


@dataclass(kw_only=True)
class _PendingTargets:
    """Value targets waiting for the bootstrap values, R = base + coef * V_last (padded local
    batch, token positions; see `sao_megatron.algorithm.base.ValueTargets`).

    base, coef: [R, T] float64. boot_row: [R] int64, the row holding the last action token of
    row r's trajectory (r itself where coef is 0). boot_pos: [R] int64, that token's position.
    """

    base: torch.Tensor
    coef: torch.Tensor
    boot_row: torch.Tensor
    boot_pos: torch.Tensor

    def returns(self, raw: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        """float32 returns of `rows` from raw values [R, T] (or [b, T] of those rows, whose
        boot_row then indexes from rows.start)."""
        rows = rows or slice(0, self.base.shape[0])
        src = self.boot_row[rows] - (rows.start or 0)
        v_last = raw[src, self.boot_pos[rows]].detach().to(torch.float64)
        return (self.base[rows] + self.coef[rows] * v_last[:, None]).float()


@dataclass(kw_only=True)
class StepState:
    """What the phases of one train step hand each other, on this DP rank.

    batch: this rank's trajectories, padded to a common row count [R, T] (see `RLStep.start`).
    num_real_rows: rows of `batch` before padding. train_version: the policy version trained.
    num_tokens / num_sequences: global action tokens / rows with action tokens (denominators).
    values: (at_tokens, raw) [R, T] float32 V_old of the critic before its updates (see
        `RLStep._values`): from VALUE_TARGETS' forward or the first VALUE_UPDATE's.
    returns, value_mask: [R, T] value targets and where the value loss is taken.
    pending_targets: value-free targets (`_PendingTargets`) until a forward gives V_last.
    num_value_tokens: global count of value_mask (the value loss denominator).
    value_updates: VALUE_UPDATE phases done so far.
    old_logprobs: [R, T-1] float32 l_old at prediction positions (OLD_LOGPROBS).
    advantages: [R, T] float32 at token positions (ADVANTAGES).
    logprobs, entropy: [R, T-1] float32 of the policy update's forward (POLICY_UPDATE).
    stale: [R, T-1] bool, action tokens beyond the per-token staleness bound (prediction
        positions; all False without a bound).
    routing_differs: [R, T-1] bool, the trainer's own top-k differed from the recorded one in
        some layer at the prediction position (POLICY_UPDATE; None without recorded routing).
    metrics: what the phases measured (returned by `RLStep.finish`).
    """

    batch: TrainBatch
    num_real_rows: int
    train_version: int
    num_tokens: float
    num_sequences: float
    values: tuple[torch.Tensor, torch.Tensor] | None = None
    returns: torch.Tensor | None = None
    value_mask: torch.Tensor | None = None
    pending_targets: _PendingTargets | None = None
    num_value_tokens: float = 0.0
    value_updates: int = 0
    old_logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    stale: torch.Tensor | None = None
    routing_differs: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class RLStep:
    """Runs an algorithm's update schedule on packed batches (policy and, if any, value model).

    Use ``train_step(batch, version)``, or, to see the schedule at the call site::

        state = step.start(batch, train_version=version)
        for phase in step.algorithm.schedule:     # e.g. SAO: value x K, advantages, policy
            step.run(phase, state)
        metrics = step.finish(state)

    Args:
        algorithm: the algorithm object (`sao_megatron.algorithm.registry.build(config)`).
        parallel: this rank's parallel state.
        policy: policy `TrainState` (DDP model, optimiser, LR scheduler).
        value: value-model `TrainState`; required iff ``algorithm.needs_value_model``.
        step_cfg: micro-batching.
    Raises ValueError when the value model does not match the algorithm.
    """

    def __init__(
        self,
        algorithm: Algorithm,
        parallel: ParallelState,
        policy: TrainState,
        value: TrainState | None,
        step_cfg: StepConfig,
    ) -> None:
        if algorithm.needs_value_model and value is None:
            raise ValueError(f"algorithm.name={algorithm.name!r} needs a value model")
        if not algorithm.needs_value_model and value is not None:
            raise ValueError(
                f"algorithm.name={algorithm.name!r} has no value model: pass value=None"
            )
        self.algorithm, self.config = algorithm, algorithm.config
        self.parallel, self.policy, self.value, self.cfg = parallel, policy, value, step_cfg
        self._routing: RoutingReplay | None = None
        if step_cfg.routing_replay:
            self._routing_replay()  # fails now, not at the first batch, for a dense model
        self._phases = {
            Phase.VALUE_TARGETS: self._value_targets,
            Phase.VALUE_UPDATE: self._value_update,
            Phase.OLD_LOGPROBS: self._old_logprobs,
            Phase.ADVANTAGES: self._advantages_phase,
            Phase.POLICY_UPDATE: self._policy_update,
        }

    # ---------------------------------------------------------------------- the step
    def train_step(self, batch: TrainBatch, train_version: int) -> dict[str, float]:
        """Run the algorithm's schedule on the global `batch` (identical on all ranks).

        Args:
            batch: the packed global batch.
            train_version: the policy version being trained (before this update); used for the
                version-lag metrics.
        Returns: metrics (same on every rank of the last pipeline stage).
        """
        state = self.start(batch, train_version)
        for phase in self.algorithm.schedule:
            self.run(phase, state)
        return self.finish(state)

    def value_step(self, batch: TrainBatch) -> dict[str, float]:
        """Value pre-training: the schedule's value phases on `batch`, the policy untouched."""
        if self.value is None:
            raise ValueError(
                f"value_step() needs a value model (algorithm.name={self.algorithm.name!r})"
            )
        state = self.start(batch, train_version=0)
        for phase in self.algorithm.schedule:
            if phase in (Phase.VALUE_TARGETS, Phase.VALUE_UPDATE):
                self.run(phase, state)
        self._critic_after_updates(state)
        return {k: v for k, v in state.metrics.items() if not k.startswith("batch/")}

    def value_fit(self, batch: TrainBatch) -> dict[str, float]:
        """How well the critic predicts the value targets of `batch`, without updating it.

        One no-grad value forward; the targets R are those a value update on `batch` would use
        (`Algorithm.advantages` with these values: with lam_value = 1 the reward-to-go plus the
        bootstrap V_last of truncated rows). Over this DP rank's share of `batch`, on the value
        mask (action tokens for token-level GAE):

        * ``value/explained_variance``  1 - Var[R - V] / Var[R] (`explained_variance`)
        * ``value/mse``                 mean (V - R)^2
        * ``value/value_mean``, ``value/return_mean``, ``value/return_std`` (population std)

        Held-out evaluation of a critic (tools/bench_critic.py): pass batches it never trained
        on and the explained variance is predictive. NaN where undefined (empty mask, constant R).
        """
        if self.value is None:
            raise ValueError(
                f"value_fit() needs a value model (algorithm.name={self.algorithm.name!r})"
            )
        state = self.start(batch, train_version=0)
        values = self._values(state.batch)
        _, returns, vmask = self._advantages(state, values)
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

    def start(self, batch: TrainBatch, train_version: int) -> StepState:
        """This DP rank's share of `batch` and the global loss denominators."""
        b, n_real = self._shard(batch)
        n_tokens = self._dp_sum(int(_pred(b.action_mask).sum()))
        n_seqs = self._dp_sum(int((b.action_mask.sum(1) > 0).sum()))
        versions = _pred(b.policy_versions)
        if self.cfg.max_staleness is None:
            stale = torch.zeros(versions.shape, dtype=torch.bool)
        else:
            stale = stale_token_mask(versions, train_version, self.cfg.max_staleness)
        state = StepState(
            batch=b,
            num_real_rows=n_real,
            train_version=train_version,
            num_tokens=n_tokens,
            num_sequences=n_seqs,
            stale=stale,
        )
        n_stale = self._dp_sum(int((stale & _pred(b.action_mask)).sum()))
        state.metrics |= {
            "batch/num_action_tokens": n_tokens,
            "batch/num_rows": n_seqs,
            "deviation/stale_token_fraction": n_stale / max(n_tokens, 1.0),
        }
        return state

    def run(self, phase: Phase, state: StepState) -> None:
        """Run one phase on `state`, adding its seconds to ``time/<phase.timer>``."""
        t0 = time.perf_counter()
        self._phases[phase](state)
        key = f"time/{phase.timer}"
        state.metrics[key] = state.metrics.get(key, 0.0) + time.perf_counter() - t0

    def finish(self, state: StepState) -> dict[str, float]:
        """The step's metrics, with the deviation between trainer and behaviour policy."""
        metrics, b = state.metrics, state.batch
        if state.logprobs is not None:
            mask = _pred(b.action_mask) & ~state.stale  # the tokens the policy loss trained on
            imp = self.config.importance
            dev = off_policy_metrics(
                state.logprobs,
                _pred(b.behaviour_logprobs),
                mask,
                eps_low=imp.eps_low,
                eps_high=imp.eps_high,
                policy_versions=_pred(b.policy_versions),
                train_version=state.train_version,
            )
            metrics.update({DEVIATION_NAMES.get(k, f"deviation/{k}"): v for k, v in dev.items()})
            sums = deviation_cause_sums(
                state.logprobs,
                _pred(b.behaviour_logprobs),
                mask,
                state.train_version - _pred(b.policy_versions),
                state.routing_differs,
            )
            sums = self._dp_sum_dict(sums)
            causes = finish_deviation_causes(sums)
            metrics.update({f"deviation/{k}": v for k, v in causes.items()})
            n_local = max(int(mask.sum()), 1)
            metrics["policy/entropy"] = float(torch.where(mask, state.entropy, 0.0).sum() / n_local)
            metrics["policy/advantage_mean"] = float(
                torch.where(mask, _pred(state.advantages), 0.0).sum() / n_local
            )
        return metrics

    # ---------------------------------------------------------------------- routing
    def _routing_replay(self) -> RoutingReplay:
        """The policy's `RoutingReplay` (installed on first use; every rank builds it)."""
        if self._routing is None:
            rr = RoutingReplay.for_parallel(self.policy.unwrapped, self.parallel)
            if self._world_sum(rr.num_local_layers) == 0:
                rr.remove()
                raise ValueError(
                    "rollout.routing_replay=true (or rollout.record_routing=true) needs an MoE "
                    "policy (model.num_experts > 0 with MoE layers); set it to false for a "
                    "dense model"
                )
            self._routing = rr
        return self._routing

    def _routed(self, state: StepState, replay: bool):
        """Context for a policy forward over the local batch: replays or compares the recorded
        routing when the batch carries it, else nothing."""
        b = state.batch
        if not b.has_routing:
            return contextlib.nullcontext()
        return self._routing_replay().session(
            b.token_ids,
            b.routed_experts,
            b.routing_mask,
            micro_batch_size=self.cfg.micro_batch_size,
            replay=replay,
        )

    def _routing_metrics(self, state: StepState) -> None:
        """After the policy update's forward: global mismatch fraction and the per-token map
        of prediction positions whose routing differed (for the deviation split)."""
        p, rr = self.parallel, self._routing
        mism, comp = rr.take_counts()
        counts = torch.tensor([float(mism), float(comp)], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts)
        differs = rr.last_differs.to(torch.int32)
        for size, group in ((p.cfg.tp, p.pg_collection.tp), (p.cfg.pp, p.pg_collection.pp)):
            if size > 1:
                dist.all_reduce(differs, op=dist.ReduceOp.MAX, group=group)
        state.routing_differs = _pred(differs.bool())
        b = state.batch
        n_real = self._dp_sum(int(b.loss_mask.sum()))
        n_rec = self._dp_sum(int(b.routing_mask.sum()))
        state.metrics |= {
            "deviation/routing_mismatch_frac": float(counts[0] / counts[1])
            if counts[1] > 0
            else float("nan"),
            "routing/recorded_token_fraction": n_rec / max(n_real, 1.0),
            "routing/replayed": float(self.cfg.routing_replay),
        }

    def _world_sum(self, x: float) -> float:
        t = torch.tensor([float(x)], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t)
        return float(t.item())

    # ---------------------------------------------------------------------- helpers
    def _dp_sum(self, x: float) -> float:
        t = torch.tensor([float(x)], dtype=torch.float64)
        if self.parallel.dp > 1:
            dist.all_reduce(t, group=self.parallel.pg_collection.dp)
        return float(t.item())

    def _dp_sum_dict(self, d: dict[str, float]) -> dict[str, float]:
        """`_dp_sum` of every value, in one all-reduce."""
        t = torch.tensor(list(d.values()), dtype=torch.float64)
        if self.parallel.dp > 1:
            dist.all_reduce(t, group=self.parallel.pg_collection.dp)
        return dict(zip(d, t.tolist(), strict=True))

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
        if b.routed_experts is not None:
            out.routed_experts = pad(b.routed_experts, 0)
            out.routing_mask = pad(b.routing_mask, False)
        assert out.token_ids.shape == (num_rows, t)
        return out

    def _shard(self, batch: TrainBatch) -> tuple[TrainBatch, int]:
        """This DP rank's trajectories, padded to a common row count (multiple of mbs)."""
        p = self.parallel
        rows, trajs = shard_for_data_parallel(
            batch, p.dp_rank, p.dp, by_group=self.algorithm.keeps_groups_together
        )
        counts = torch.tensor([len(rows)], dtype=torch.long)
        if p.dp > 1:
            dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=p.pg_collection.dp)
        mbs = self.cfg.micro_batch_size
        target = max(-(-int(counts) // mbs) * mbs, mbs)
        if len(trajs) == 0:
            raise ValueError(
                f"data-parallel rank {p.dp_rank} got no trajectory: the batch has "
                f"{batch.num_trajectories} trajectories (or groups) for {p.dp} DP ranks; "
                "raise rollout.trajectories_per_batch to at least the data-parallel size"
            )
        local = local_batch(batch, rows, trajs)
        return self._pad_rows(local, target), local.num_rows

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

    def _advantages(self, state: StepState, values=None):
        """The algorithm's advantages/returns/value mask at token positions [B, T] for the padded
        local batch; values: (at_tokens, raw) from `_values`, or None."""
        b, num_real_rows = state.batch, state.num_real_rows
        real = _real_rows(b, num_real_rows)
        inputs = self._advantage_inputs(real)
        if values is not None:
            at_tokens, raw = values
            inputs.values, _ = gather_to_streams(real, at_tokens[:num_real_rows])
            inputs.bootstrap_values = _last_state_values(real, raw)
        out = self.algorithm.advantages(inputs)

        def back(x):
            full = torch.zeros(b.token_ids.shape, dtype=x.dtype)
            full[:num_real_rows] = scatter_from_streams(real, x)
            return full

        adv = back(out.advantages.float())
        ret = back(out.returns.float()) if out.returns is not None else None
        vmask = back(out.value_mask.float()).bool() if out.value_mask is not None else None
        return adv, ret, vmask

    def _advantage_inputs(self, real: TrainBatch) -> AdvantageInputs:
        """`AdvantageInputs` of the real rows (one action stream per trajectory), no values."""
        node_idx, valid = gather_to_streams(real, real.node_index)
        groups = {tid: i for i, tid in enumerate(dict.fromkeys(real.task_ids))}
        return AdvantageInputs(
            node_rewards=real.node_rewards,
            node_index=node_idx,
            action_mask=valid,
            truncated=real.truncated,
            group_ids=torch.tensor([groups[t] for t in real.task_ids], dtype=torch.long),
        )

    def _critic_after_updates(self, state: StepState) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh values after the value updates, and how well they fit the targets (targets
        still pending when no update ran, K = 0, take V_last from these values)."""
        values = self._values(state.batch)
        if state.pending_targets is not None:
            self._resolve_targets(state, values[1])
        returns, vmask = state.returns, state.value_mask
        state.metrics["value/explained_variance"] = explained_variance(values[0], returns, vmask)
        state.metrics["value/return_mean"] = float(returns[vmask].mean()) if vmask.any() else 0.0
        return values

    # ---------------------------------------------------------------------- phases
    def _value_targets(self, state: StepState) -> None:
        """VALUE_TARGETS: the value targets with the critic before its updates.

        Without a value forward when the algorithm gives value-free targets and every row that
        bootstraps sits in the micro-batch of its trajectory's last action token (always for
        full-history rows); the first VALUE_UPDATE then supplies V_old and V_last. Otherwise a
        no-grad value forward gives V_old and the targets (the decision is taken over all DP
        ranks: expert-parallel forwards are collective)."""
        pending = self._pending_targets(state)
        if pending is not None:
            state.num_value_tokens = self._dp_sum(int(_pred(state.value_mask).sum()))
            state.pending_targets = pending
            return
        state.values = self._values(state.batch)
        _, state.returns, state.value_mask = self._advantages(state, state.values)
        state.num_value_tokens = self._dp_sum(int(_pred(state.value_mask).sum()))
        self._explained_variance_before(state)

    def _explained_variance_before(self, state: StepState) -> None:
        state.metrics["value/explained_variance_before"] = explained_variance(
            state.values[0], state.returns, state.value_mask
        )

    def _pending_targets(self, state: StepState) -> _PendingTargets | None:
        """`_PendingTargets` of the local batch, or None when a value forward is needed."""
        b, n = state.batch, state.num_real_rows
        real = _real_rows(b, n)
        inputs = self._advantage_inputs(real)
        targets = self.algorithm.value_targets(inputs)
        if targets is None:
            return None

        def back(x):
            full = torch.zeros(b.token_ids.shape, dtype=x.dtype)
            full[:n] = scatter_from_streams(real, x)
            return full

        base, coef = back(targets.base), back(targets.bootstrap_coef)
        vmask = back(targets.value_mask.to(torch.float64)).bool()
        boot_row = torch.arange(b.num_rows)
        boot_pos = torch.zeros(b.num_rows, dtype=torch.long)
        last = _last_action_rows(real)  # [num_traj, 2]: row, position
        bootstraps = coef.ne(0).any(1)
        for r in torch.nonzero(bootstraps).flatten().tolist():
            boot_row[r], boot_pos[r] = last[int(real.row_trajectory[r])]
        mbs = self.cfg.micro_batch_size
        split = bool(((boot_row // mbs) != (torch.arange(b.num_rows) // mbs)).any())
        if self._dp_sum(float(split)) > 0:
            return None
        state.value_mask = vmask
        return _PendingTargets(base=base, coef=coef, boot_row=boot_row, boot_pos=boot_pos)

    def _resolve_targets(self, state: StepState, raw: torch.Tensor) -> None:
        """V_old := raw values of the critic before its updates [R, T]; returns from them."""
        at_tokens = torch.zeros_like(raw)
        at_tokens[:, 1:] = raw[:, :-1]
        state.values = (at_tokens, raw)
        state.returns = state.pending_targets.returns(raw)
        state.pending_targets = None
        self._explained_variance_before(state)

    def _value_update(self, state: StepState) -> None:
        """VALUE_UPDATE: one optimiser step of the clipped value loss on V_old / returns.

        With pending targets (no VALUE_TARGETS forward) this is the first update: V_old is its
        own forward's V (detached), so V - V_old = 0, the clip branch of the loss equals the
        unclipped one (value and gradient, bit for bit), and the returns take V_last from the
        same forward; afterwards V_old and the returns are kept for the next updates."""
        clip, n_value, b = self.config.sao.value_clip, state.num_value_tokens, state.batch
        pending, mbs = state.pending_targets, self.cfg.micro_batch_size

        def loss_fn(outputs, mb):
            v = outputs["values"][:, :-1]  # prediction p scores the state before token p+1
            e = mb.extras
            if pending is None:
                old, ret = e["old_values"], e["returns"]
            else:
                start = int(e["row"][0])
                old = v.detach()
                ret = pending.returns(outputs["values"].cpu(), slice(start, start + len(v)))
                ret = _pred(ret).to(v.device)
            loss = value_loss(
                v, old, ret, e["value_mask"], clip=clip, mode="token_mean", num_tokens=n_value
            )
            return loss, {}

        extras = {"value_mask": _pred(state.value_mask)}
        if pending is None:
            extras |= {"old_values": _pred(state.values[0]), "returns": _pred(state.returns)}
        else:
            extras["row"] = torch.arange(b.num_rows)
        self.value.zero_grad()
        recs = forward_backward(
            self.value.model,
            self.parallel,
            self._inputs(b, extras),
            kind="value",
            loss_fn=loss_fn,
            micro_batch_size=mbs,
        )
        ok, grad_norm = self.value.step()
        if pending is not None:
            self._resolve_targets(state, self._pp_values(recs, tuple(b.token_ids.shape)))
        loss = self._dp_sum(sum(float(r["loss"]) for r in recs))
        lr = self.value.optimizer.param_groups[0]["lr"]
        state.metrics |= {  # standard names hold the last update's figures
            "loss/value": loss,
            "grad_norm/value": _f(grad_norm),
            "value/update_ok": float(ok),
            "lr/value": float(lr),
            f"value/loss_{state.value_updates}": loss,
        }
        state.value_updates += 1

    def _pp_values(self, recs: list[dict], shape: tuple[int, int]) -> torch.Tensor:
        """The value records of a forward_backward, [R, T] float32 on CPU on every PP stage."""
        p = self.parallel
        raw = torch.cat([r["values"] for r in recs]) if recs else None
        if p.cfg.pp > 1:
            pp_group = p.pg_collection.pp
            if raw is None:
                raw = torch.empty(shape, dtype=torch.float32, device=p.platform.device)
            src = dist.get_global_rank(pp_group, p.cfg.pp - 1)
            dist.broadcast(raw, src=src, group=pp_group)
        return raw.float().cpu()

    def _old_logprobs(self, state: StepState) -> None:
        """OLD_LOGPROBS: l_old of the policy before this update (forward, no grad)."""
        b = state.batch
        replay = self.cfg.routing_replay and b.has_routing
        with self._routed(state, replay=True) if replay else contextlib.nullcontext():
            old, _ = compute_policy_logprobs(
                self.policy.model,
                self.parallel,
                self._inputs(b, {}),
                b.temperature,
                self.cfg.micro_batch_size,
                top_p=b.top_p,
                top_k=b.top_k,
            )
        if replay:
            self._routing.take_counts()  # measured on the update's forward only
        state.old_logprobs = old.cpu()

    def _advantages_phase(self, state: StepState) -> None:
        """ADVANTAGES: the algorithm's advantages (with the critic after its updates, if any)."""
        values = self._critic_after_updates(state) if self.value is not None else None
        state.advantages, _, _ = self._advantages(state, values)

    def _policy_update(self, state: StepState) -> None:
        """POLICY_UPDATE: one optimiser step of the algorithm's policy loss (+ entropy bonus)."""
        algorithm, b = self.algorithm, state.batch
        n_tokens, n_seqs = state.num_tokens, state.num_sequences
        entropy_coef = self.config.entropy_coef

        def loss_fn(outputs, mb):
            e = mb.extras
            loss = algorithm.policy_loss(
                logprobs=outputs["logprobs"],
                behaviour_logprobs=e["behaviour_logprobs"],
                advantages=e["advantages"],
                action_mask=e["action_mask"],
                old_logprobs=e.get("old_logprobs"),
                num_tokens=n_tokens,
                num_sequences=n_seqs,
            )
            if entropy_coef:
                fresh = e["action_mask"] & ~e["stale"]
                ent = torch.where(fresh, outputs["entropy"], 0.0).sum() / n_tokens
                loss = loss - entropy_coef * ent
            return loss, {}

        extras = {
            "behaviour_logprobs": _pred(b.behaviour_logprobs),
            "advantages": torch.where(state.stale, 0.0, _pred(state.advantages)),
            "action_mask": _pred(b.action_mask),
            "stale": state.stale,
        }
        if state.old_logprobs is not None:
            extras["old_logprobs"] = state.old_logprobs
        self.policy.zero_grad()
        with self._routed(state, replay=self.cfg.routing_replay):
            recs = forward_backward(
                self.policy.model,
                self.parallel,
                self._inputs(b, extras),
                kind="policy",
                loss_fn=loss_fn,
                micro_batch_size=self.cfg.micro_batch_size,
                temperature=b.temperature,
                top_p=b.top_p,
                top_k=b.top_k,
            )
        if b.has_routing:
            self._routing_metrics(state)
        ok, grad_norm = self.policy.step()
        if recs:
            state.logprobs = torch.cat([r["logprobs"] for r in recs]).cpu()
            state.entropy = torch.cat([r["entropy"] for r in recs]).cpu()
        loss = self._dp_sum(sum(float(r["loss"]) for r in recs))
        lr = self.policy.optimizer.param_groups[0]["lr"]
        state.metrics |= {
            "loss/policy": loss,
            "grad_norm/policy": _f(grad_norm),
            "policy/update_ok": float(ok),
            "lr/policy": float(lr),
        }


def _f(x) -> float:
    return float("nan") if x is None else float(x)


def _real_rows(b: TrainBatch, n: int) -> TrainBatch:
    """Drop the dummy padding rows appended by `_pad_rows`."""
    sub = b.rows(slice(0, n))
    return TrainBatch(**{**b.__dict__, **sub})


def _last_action_rows(real: TrainBatch) -> torch.Tensor:
    """[num_traj, 2] int64: (row, position) of each trajectory's last action token (the state
    after it is the bootstrap state, as in `_last_state_values`); (0, 0) without action."""
    out = torch.zeros(real.num_trajectories, 2, dtype=torch.long)
    for r in range(real.num_rows):  # rows, not tokens
        pos = torch.nonzero(real.action_mask[r]).flatten()
        if len(pos):
            out[int(real.row_trajectory[r])] = torch.tensor([r, int(pos[-1])])
    return out


def _last_state_values(real: TrainBatch, raw: torch.Tensor) -> torch.Tensor:
    """V of the state after each trajectory's last action token, [num_traj] float32: the
    bootstrap value of truncated trajectories. raw[b, t] = V after reading tokens 0..t."""
    out = torch.zeros(real.num_trajectories, dtype=torch.float32)
    for r in range(real.num_rows):  # rows, not tokens
        pos = torch.nonzero(real.action_mask[r]).flatten()
        if len(pos):
            out[int(real.row_trajectory[r])] = raw[r, int(pos[-1])]
    return out
