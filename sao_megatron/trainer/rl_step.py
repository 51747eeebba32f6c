"""One RL train step on a packed batch: the phases of the algorithm's schedule, on Megatron.

`RLStep` executes the `Phase`s an algorithm object lists in ``algorithm.schedule``
(`sao_megatron.algorithm.base`); the math of each phase (advantages, policy loss) is the
algorithm's, the execution (sharding, micro-batches, forward/backward, optimiser steps) is in the
phase modules this file composes:

SAO:      VALUE_TARGETS -> VALUE_UPDATE x K -> ADVANTAGES (updated critic) -> POLICY_UPDATE
GRPO:     OLD_LOGPROBS -> ADVANTAGES (group statistics) -> POLICY_UPDATE (PPO-clip)
GRPO+DIS: ADVANTAGES (group statistics) -> POLICY_UPDATE (DIS on the behaviour log-probs)

* `sao_megatron.data.micro_batches`: this DP rank's share of the global batch, padded, shifted
  to prediction positions and cut into micro-batches, once (`layout_micro_batches`);
* `step_state`: `StepState`, what the phases hand each other;
* `step_context`: DP sums and the update pass both models share;
* `step_advantages`: the algorithm's advantage math on the local batch;
* `value_phase`: VALUE_TARGETS, VALUE_UPDATE, the critic after its updates (K + 1 value
  forwards when the targets need no values, see there);
* `policy_phase`: OLD_LOGPROBS, POLICY_UPDATE, routing replay;
* `step_metrics`: the batch and deviation figures.

Each phase's seconds go to ``time/<phase.timer>``: time/value, time/old_logprobs,
time/advantages and time/policy (the policy update alone, for every algorithm).

Data parallelism: the caller hands every rank the same global `TrainBatch`; each DP rank keeps
whole trajectories (whole GRPO groups) so GAE and group statistics stay local, and the loss
denominators (action tokens, sequences) are all-reduced so the gradient is that of the *global*
token-mean.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from sao_megatron.algorithm.base import Algorithm, Phase
from sao_megatron.data.batch import TrainBatch
from sao_megatron.data.micro_batches import layout_micro_batches
from sao_megatron.optim.builder import TrainState
from sao_megatron.parallel.state import ParallelState
from sao_megatron.rollout.staleness import stale_token_mask
from sao_megatron.trainer.policy_phase import PolicyPhases
from sao_megatron.trainer.step_advantages import StepAdvantages
from sao_megatron.trainer.step_context import StepContext
from sao_megatron.trainer.step_metrics import batch_metrics, policy_metrics
from sao_megatron.trainer.step_state import StepState
from sao_megatron.trainer.value_phase import ValuePhases


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
        policy: policy `TrainState` (DDP model, optimiser, LR scheduler); None on the value
            ranks of a separate critic (`sao_megatron.trainer.critic_placement`), which run
            only the value phases and ADVANTAGES.
        value: value-model `TrainState`; required iff ``algorithm.needs_value_model``.
        step_cfg: micro-batching, staleness bound, routing replay.
        separate_critic: this rank holds one of the two models of a separate critic (exactly
            one of `policy` / `value`); the phases of the other model are not available here.
    Raises ValueError when the value model does not match the algorithm, or when routing replay
    is asked of a dense policy.
    """

    def __init__(
        self,
        algorithm: Algorithm,
        parallel: ParallelState,
        policy: TrainState | None,
        value: TrainState | None,
        step_cfg: StepConfig,
        *,
        separate_critic: bool = False,
    ) -> None:
        if separate_critic:
            if not algorithm.needs_value_model:
                raise ValueError(
                    f"value.placement=separate: algorithm.name={algorithm.name!r} has no value "
                    "model; use value.placement=colocated"
                )
            if (policy is None) == (value is None):
                raise ValueError(
                    "separate_critic=True: pass the policy on policy ranks and the value model "
                    "on value ranks (exactly one of them)"
                )
        elif algorithm.needs_value_model and value is None:
            raise ValueError(f"algorithm.name={algorithm.name!r} needs a value model")
        if not algorithm.needs_value_model and value is not None:
            raise ValueError(
                f"algorithm.name={algorithm.name!r} has no value model: pass value=None"
            )
        if policy is None and not separate_critic:
            raise ValueError("RLStep needs the policy (policy=None only with separate_critic)")
        self.algorithm, self.config = algorithm, algorithm.config
        self.parallel, self.policy, self.value, self.cfg = parallel, policy, value, step_cfg
        self._ctx = StepContext(parallel)
        self._advantages = StepAdvantages(algorithm, self._ctx.batch_reducer)
        self._phases = {}
        if policy is not None:
            self._policy = PolicyPhases(
                self._ctx, algorithm, policy, routing_replay=step_cfg.routing_replay
            )
            self._phases[Phase.OLD_LOGPROBS] = self._policy.old_logprobs
            self._phases[Phase.POLICY_UPDATE] = self._policy.update
        self._critic = None
        if value is not None:
            self._critic = ValuePhases(self._ctx, self._advantages, value, algorithm.config)
            self._phases[Phase.VALUE_TARGETS] = self._critic.targets
            self._phases[Phase.VALUE_UPDATE] = self._critic.update
        if value is not None or not algorithm.needs_value_model:  # a separate critic's policy
            self._phases[Phase.ADVANTAGES] = self._advantages_phase  # ranks receive them

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

    def value_step(self, batch: TrainBatch, fit_after: bool = False) -> dict[str, float]:
        """Value pre-training: the schedule's value phases on `batch`, the policy untouched.

        The K value updates and nothing else: ``value/explained_variance_before`` (the critic
        on this batch before it trained on it, from the first update's own forward) is the
        step's fit. `fit_after` adds one no-grad value forward after the updates for
        ``value/explained_variance`` (the fit on the batch just trained on; an RL step's
        ADVANTAGES phase runs that forward anyway, pre-training has no use for it). A schedule
        without a value update (K = 0) always runs it: the targets need its values.
        """
        critic = self._value_model("value_step")
        state = self.start(batch, train_version=0)
        for phase in self.algorithm.schedule:
            if phase in (Phase.VALUE_TARGETS, Phase.VALUE_UPDATE):
                self.run(phase, state)
        if fit_after or state.pending_targets is not None:
            critic.after_updates(state)
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
        critic = self._value_model("value_fit")
        return critic.fit(self.start(batch, train_version=0))

    def value_eval(self, batch: TrainBatch) -> dict[str, float]:
        """How well the critic predicts the value targets of the global `batch`, without
        updating it (value pre-training's held-out evaluation, `value_pretrain`).

        As `value_fit` (one no-grad value forward; R the targets a value update on `batch`
        would use), but every figure is over the whole `batch`, not this DP rank's share: the
        sums go through the step's DP reducer (`StepContext.batch_reducer`), so every rank of
        every layout the value step runs in (DP, TP, EP, PP: values reach every stage) returns
        the same numbers. A collective: every rank training the critic calls it.

        * ``value/explained_variance``  1 - Var[R - V] / Var[R] (`explained_variance`)
        * ``value/mse``                 mean (V - R)^2
        * ``value/num_tokens``          value-masked tokens of `batch`

        NaN where undefined (empty mask, constant R).
        """
        critic = self._value_model("value_eval")
        return critic.evaluate(self.start(batch, train_version=0))

    def start(
        self, batch: TrainBatch, train_version: int, max_staleness: int | None = None
    ) -> StepState:
        """This DP rank's share of `batch` (`layout_micro_batches`), the global loss
        denominators and the action tokens beyond the staleness bound.

        `max_staleness`: a tighter per-token bound for this batch than ``StepConfig``'s (the
        deviation controller's, ``rollout.deviation_bound_trained``); None: the configured one.
        """
        bound = self.cfg.max_staleness
        if max_staleness is not None:
            bound = max_staleness if bound is None else min(bound, max_staleness)
        ctx, p = self._ctx, self.parallel
        rank = layout_micro_batches(
            batch,
            dp_rank=p.dp_rank,
            dp_size=p.dp,
            micro_batch_size=self.cfg.micro_batch_size,
            by_group=self.algorithm.keeps_groups_together,
        )
        action, versions = rank.rows.action_mask, rank.rows.policy_versions
        stale = torch.zeros(action.shape, dtype=torch.bool)
        if bound is not None:
            stale = stale_token_mask(versions, train_version, bound)
        state = StepState(
            batch=rank,
            train_version=train_version,
            num_tokens=ctx.dp_sum(int(action.sum())),
            num_sequences=ctx.dp_sum(int((action.sum(1) > 0).sum())),
            stale=stale,
        )
        state.metrics |= batch_metrics(state, ctx)
        return state

    def run(self, phase: Phase, state: StepState) -> None:
        """Run one phase on `state`, adding its seconds to ``time/<phase.timer>``."""
        if phase not in self._phases:
            raise ValueError(
                f"phase {phase.name} runs on the other ranks of a separate critic "
                "(sao_megatron.trainer.critic_placement)"
            )
        t0 = time.perf_counter()
        self._phases[phase](state)
        key = f"time/{phase.timer}"
        state.metrics[key] = state.metrics.get(key, 0.0) + time.perf_counter() - t0

    def finish(self, state: StepState) -> dict[str, float]:
        """The step's metrics, with the deviation between trainer and behaviour policy."""
        if state.logprobs is not None:
            state.metrics |= policy_metrics(state, self.config.importance, self._ctx)
        return state.metrics

    def _advantages_phase(self, state: StepState) -> None:
        """ADVANTAGES: the algorithm's advantages (with the critic after its updates, if any)."""
        values = self._critic.after_updates(state) if self._critic is not None else None
        state.advantages, _, _ = self._advantages.compute(state, values)

    def _value_model(self, caller: str) -> ValuePhases:
        if self._critic is None:
            raise ValueError(
                f"{caller}() needs a value model (algorithm.name={self.algorithm.name!r})"
            )
        return self._critic
