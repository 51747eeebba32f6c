"""The policy's part of a train step: OLD_LOGPROBS and POLICY_UPDATE, with routing replay.

POLICY_UPDATE minimises the algorithm's policy loss (`Algorithm.policy_loss`; DIS for SAO,
PPO-clip for GRPO) minus ``algorithm.entropy_coef`` times the token-mean entropy over the fresh
action tokens. Action tokens beyond the per-token staleness bound (`StepState.stale`) get
advantage 0 and no entropy bonus; they stay in the token-mean denominator N (global action
tokens), like DIS-band drops. With ``algorithm.skip_zero_advantage_updates`` a batch whose
fresh action tokens all have advantage 0 (on every rank) and no entropy bonus has an exactly-zero
gradient, and the optimiser step is skipped, so that Adam's momentum does not move the policy on
a batch without signal (``policy/skipped_zero_advantage``).

When the batch carries the experts the engine routed each token to, the policy forwards either
replay them (``rollout.routing_replay``: POLICY_UPDATE and OLD_LOGPROBS route every recorded
token to the engine's experts) or only compare them with the trainer's own choice
(``deviation/routing_*``, and `StepState.routing_differs` for the deviation split).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from sao_megatron.algorithm.base import Algorithm
from sao_megatron.data.micro_batches import at_predictions
from sao_megatron.models.forward import compute_policy_logprobs
from sao_megatron.models.routing_replay import RoutingReplay
from sao_megatron.optim.builder import TrainState
from sao_megatron.trainer.step_context import StepContext
from sao_megatron.trainer.step_state import StepState


class PolicyPhases:
    """The policy-model phases of a train step.

    Args:
        ctx: the step's execution context (DP sums, the update pass).
        algorithm: the algorithm object (its policy loss and ``config.entropy_coef``).
        policy: policy `TrainState` (DDP model, optimiser, LR scheduler).
        routing_replay: replay the recorded routing in the policy forwards.
    Raises ValueError when `routing_replay` is set for a dense policy.
    """

    def __init__(
        self,
        ctx: StepContext,
        algorithm: Algorithm,
        policy: TrainState,
        *,
        routing_replay: bool,
    ) -> None:
        self.ctx, self.algorithm, self.policy = ctx, algorithm, policy
        self.routing_replay = routing_replay
        self._routing: RoutingReplay | None = None
        if routing_replay:
            self._routing_hooks()  # fails now, not at the first batch, for a dense model

    # ---------------------------------------------------------------------- phases
    def old_logprobs(self, state: StepState) -> None:
        """OLD_LOGPROBS: l_old of the policy before this update (forward, no grad)."""
        rank, sampling = state.batch, state.batch.trajectories
        replay = self.routing_replay and sampling.has_routing
        with self._routed(state, replay=True) if replay else contextlib.nullcontext():
            old, _ = compute_policy_logprobs(
                self.policy.model,
                self.ctx.parallel,
                rank.model_inputs(),
                sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
            )
        if replay:
            self._routing.take_counts()  # measured on the update's forward only
        state.old_logprobs = old.cpu()

    def update(self, state: StepState) -> None:
        """POLICY_UPDATE: one optimiser step of the algorithm's policy loss (+ entropy bonus)."""
        algorithm, rank, sampling = self.algorithm, state.batch, state.batch.trajectories
        n_tokens, n_seqs = state.num_tokens, state.num_sequences
        entropy_coef = algorithm.config.entropy_coef

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

        # the micro-batches carry behaviour_logprobs and action_mask; the step adds its own
        extras = {
            "advantages": torch.where(state.stale, 0.0, state.advantages),
            "stale": state.stale,
        }
        if state.old_logprobs is not None:
            extras["old_logprobs"] = state.old_logprobs
        with self._routed(state, replay=self.routing_replay):
            recs = self.ctx.forward_backward(
                self.policy,
                rank,
                extras,
                kind="policy",
                loss_fn=loss_fn,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
            )
        if sampling.has_routing:
            self._routing_metrics(state)
        skip = algorithm.config.skip_zero_advantage_updates and not self._has_signal(
            rank.rows.action_mask, extras, entropy_coef
        )
        # a skipped step: the gradient is exactly 0 (norm 0), nothing applied, schedule unchanged
        ok, grad_norm = (False, 0.0) if skip else self.policy.step()
        state.metrics["policy/skipped_zero_advantage"] = float(skip)
        if recs:
            state.logprobs = torch.cat([r["logprobs"] for r in recs]).cpu()
            state.entropy = torch.cat([r["entropy"] for r in recs]).cpu()
        state.metrics |= self.ctx.update_metrics("policy", self.policy, recs, ok, grad_norm)

    def _has_signal(
        self, action_mask: torch.Tensor, extras: dict[str, torch.Tensor], entropy_coef: float
    ) -> bool:
        """Whether the policy loss can have a non-zero gradient on any rank of this model:
        some fresh action token with a non-zero advantage, or the entropy bonus on some fresh
        action token (action_mask and extras [R, T-1]). One float64 all-reduce over the
        model's ranks (every rank decides alike).
        """
        fresh = action_mask & ~extras["stale"]
        local = (fresh & (extras["advantages"] != 0)).sum() if not entropy_coef else fresh.sum()
        return self.ctx.world_sum(float(local))[0] > 0

    # ---------------------------------------------------------------------- routing
    def _routing_hooks(self) -> RoutingReplay:
        """The policy's `RoutingReplay` (installed on first use; every rank builds it)."""
        if self._routing is None:
            rr = RoutingReplay.for_parallel(self.policy.unwrapped, self.ctx.parallel)
            (num_layers,) = self.ctx.world_sum(rr.num_local_layers)
            if num_layers == 0:
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
        rank = state.batch
        if rank.rows.routed_experts is None:
            return contextlib.nullcontext()
        return self._routing_hooks().session(
            rank.rows.token_ids,
            rank.rows.routed_experts,
            rank.rows.routing_mask,
            micro_batch_size=rank.micro_batch_size,
            replay=replay,
        )

    def _routing_metrics(self, state: StepState) -> None:
        """After the policy update's forward: global mismatch fraction and the map [R, T-1]
        of the tokens whose routing differed (for the deviation split)."""
        p, rr, ctx = self.ctx.parallel, self._routing, self.ctx
        mismatched, compared = ctx.world_sum(*rr.take_counts())
        differs = rr.last_differs.to(torch.int32)
        for size, group in ((p.cfg.tp, p.pg_collection.tp), (p.cfg.pp, p.pg_collection.pp)):
            if size > 1:
                dist.all_reduce(differs, op=dist.ReduceOp.MAX, group=group)
        state.routing_differs = at_predictions(differs.bool())  # the session's map: tokens
        rows = state.batch.rows
        n_real = ctx.dp_sum(int(rows.attention_mask.sum()))
        n_rec = ctx.dp_sum(int(rows.routing_mask.sum()))
        state.metrics |= {
            "deviation/routing_mismatch_frac": mismatched / compared
            if compared > 0
            else float("nan"),
            "routing/recorded_token_fraction": n_rec / max(n_real, 1.0),
            "routing/replayed": float(self.routing_replay),
        }
