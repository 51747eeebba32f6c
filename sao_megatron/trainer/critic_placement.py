"""Critic placement ``separate``: the value model on its own ranks, pipelined with the policy.

SAO's order within a step is kept: VALUE_TARGETS -> VALUE_UPDATE x K -> ADVANTAGES (the critic
after its updates) -> POLICY_UPDATE. The critic's updates and its advantages depend only on the
batch (rewards, tokens) and the critic's own weights, never on the policy's, so the value work of
batch n+1 can run while the policy trains on batch n:

    value ranks:   [targets, update x K, advantages](n) -> send(n) -> [...](n+1) -> send(n+1)
    policy ranks:                          recv(n) -> POLICY_UPDATE(n) -> recv(n+1) -> ...

Every number is the colocated step's (`RLStep` with both models on every rank): the value ranks
run the same value phases on the same DP shard, the policy ranks the same policy update on the
received advantages (float32 tensors sent bit for bit). Steady-state step time is then about
max(value phases, policy update) + the exchange instead of their sum (docs/TRAINING.md,
"Critic placement").

The exchange (`PeerChannel`): value DP rank i sends to policy DP rank i (they hold the same
trajectories: `layout_micro_batches` deals by DP rank and size, equal in both roles) one message
per step, point to point on the default process group (gloo on CPU, NCCL on GPU): the per-token
advantages [R, T-1] float32 of the local padded batch (prediction positions) and the value
side's metrics (``value/*``, ``loss/value``, ``grad_norm/value``, ``lr/value``, ``time/value``,
``time/advantages``), so the policy ranks return the same metric keys and values as a colocated
step. The send is
non-blocking: the value ranks go on to the next batch at once and wait for a send only when the
one after it is posted (at most two messages in flight).

Use on every rank, with the `RoleLayout` of `sao_megatron.parallel.roles.split_roles`::

    step = SeparateCriticStep(algorithm, roles, policy=p_or_None, value=v_or_None, step_cfg=cfg)
    for n, batch in enumerate(batches):        # the same batches on every rank, in order
        metrics = step.train_step(batch, train_version=n)
    step.flush()

Limits: the caller must hand both roles the same batches in the same order (the job does:
`sao_megatron.trainer.controller.Controller` broadcasts every batch to both roles and, with
rollout.max_staleness >= 1, hands out batch n+1 before the policy's update on batch n);
data parallelism only (`split_roles`); the value side's metrics reach the policy ranks, the
policy's never reach the value ranks.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from sao_megatron.algorithm.base import Algorithm, Phase
from sao_megatron.data.batch import TrainBatch
from sao_megatron.optim.builder import TrainState
from sao_megatron.parallel.roles import RoleLayout, check_separate_layout
from sao_megatron.parallel.state import ParallelState
from sao_megatron.trainer.rl_step import RLStep, StepConfig
from sao_megatron.trainer.step_state import StepState

#: phases the policy ranks run; the value ranks run the others (value phases and ADVANTAGES)
POLICY_PHASES = (Phase.OLD_LOGPROBS, Phase.POLICY_UPDATE)
TAG = 3  # point-to-point tag of the exchange (gloo matches on it; NCCL orders sends instead)


def check_separate_job(job, parallel: ParallelState) -> None:
    """Raise ValueError for a ``value.placement: separate`` job (a `JobConfig`) that
    `sao_megatron.trainer.controller.Controller` cannot run: a layout `split_roles` rejects
    (tp/pp/ep/expert_tp != 1, an odd or 1-rank world) or a distributed optimiser (its state is
    sharded over the DP ranks under replica ids of Megatron's global data-parallel group, which
    spans both roles; not built)."""
    check_separate_layout(parallel.world_size, parallel.cfg)
    for name in ("policy_optim", "value_optim"):
        if getattr(job, name).distributed_optimizer:
            raise ValueError(
                f"value.placement=separate does not support {name}.distributed_optimizer=true "
                f"(its checkpoint shards are not split by role): set "
                f"{name}.distributed_optimizer=false, or use value.placement=colocated"
            )


class PeerChannel:
    """Python objects (tensors, dicts of floats) sent point to point to one peer rank.

    A message is its `torch.save` bytes, sent as a uint8 tensor after its int64 length, on
    `device` (CPU for gloo, the rank's GPU for NCCL). `isend` returns at once and keeps the
    buffers until `wait`; `recv` blocks. Messages between two ranks arrive in order.
    """

    def __init__(self, peer: int, device: torch.device | str = "cpu") -> None:
        self.peer, self.device = peer, torch.device(device)
        self._pending: list[tuple[list, tuple[torch.Tensor, ...]]] = []

    def isend(self, obj) -> None:
        """Post the sends of `obj` (non-blocking)."""
        buf = io.BytesIO()
        torch.save(obj, buf)
        payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8).to(self.device)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)
        works = [
            dist.isend(size, self.peer, tag=TAG),
            dist.isend(payload, self.peer, tag=TAG),
        ]
        self._pending.append((works, (size, payload)))

    def wait(self, keep: int = 0) -> None:
        """Wait for the posted sends, all but the newest `keep` messages."""
        while len(self._pending) > keep:
            works, _ = self._pending.pop(0)
            for w in works:
                w.wait()

    def recv(self):
        """The next object from the peer (blocking)."""
        size = torch.empty(1, dtype=torch.int64, device=self.device)
        dist.recv(size, self.peer, tag=TAG)
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        dist.recv(payload, self.peer, tag=TAG)
        return torch.load(io.BytesIO(payload.cpu().numpy().tobytes()), weights_only=True)


class SeparateCriticStep:
    """`RLStep` with the value model on its own ranks, the value work of batch n+1 overlapping
    the policy update of batch n (module docstring).

    Args:
        algorithm: an algorithm with a value model (SAO).
        roles: this rank's `RoleLayout` (`split_roles`); its ``parallel`` is the role's.
        policy: the policy `TrainState` on policy ranks (built with ``roles.parallel``), None on
            value ranks.
        value: the value-model `TrainState` on value ranks, None on policy ranks.
        step_cfg: as for `RLStep` (the same on every rank).
        on_event: optional ``fn(event, step_index)`` called at "value_start" (value ranks, before
            a batch's value phases), "value_sent" (after its send is posted), "policy_start"
            (policy ranks, advantages received, before the policy phases) and "policy_end";
            for tests and tracing.
    Raises ValueError when the algorithm has no value model or the wrong model is given for the
    role.
    """

    def __init__(
        self,
        algorithm: Algorithm,
        roles: RoleLayout,
        *,
        policy: TrainState | None,
        value: TrainState | None,
        step_cfg: StepConfig,
        on_event: Callable[[str, int], None] | None = None,
    ) -> None:
        wrong = value is not None if roles.is_policy else policy is not None
        if wrong:
            raise ValueError(
                f"a {roles.role} rank of value.placement=separate holds only the {roles.role} "
                "model: pass the other one as None"
            )
        if Phase.ADVANTAGES not in algorithm.schedule or any(
            algorithm.schedule.index(p) < algorithm.schedule.index(Phase.ADVANTAGES)
            for p in POLICY_PHASES
            if p in algorithm.schedule
        ):
            raise ValueError(
                f"value.placement=separate: the schedule of algorithm.name={algorithm.name!r} "
                "must run every policy phase after ADVANTAGES"
            )
        self.algorithm, self.roles = algorithm, roles
        self.step = RLStep(algorithm, roles.parallel, policy, value, step_cfg, separate_critic=True)
        self.channel = PeerChannel(roles.peer, roles.parallel.platform.device)
        self._on_event = on_event or (lambda event, index: None)
        self._index = 0  # train steps done
        self.wait_s = 0.0  # policy ranks: seconds the last step waited for its advantages
        self.last_state: StepState | None = None  # the last train step's state (tracing, tests)

    @property
    def policy(self) -> TrainState | None:
        return self.step.policy

    @property
    def value(self) -> TrainState | None:
        return self.step.value

    def train_step(
        self, batch: TrainBatch, train_version: int, max_staleness: int | None = None
    ) -> dict[str, float]:
        """One step on the global `batch` (the same on every rank, in the same order).

        `max_staleness`: this batch's tighter per-token bound, as for `RLStep.start` (the same
        on both roles).

        Value ranks: the value phases and ADVANTAGES, the send posted; returns the value side's
        metrics (``batch/*`` included). Policy ranks: receive this batch's advantages and value
        metrics, run the policy phases; returns the colocated step's metrics (same keys; the
        ``time/value`` and ``time/advantages`` measured on the value ranks).
        """
        index, self._index = self._index, self._index + 1
        step = self.step
        if not self.roles.is_policy:
            self._on_event("value_start", index)
            state = self.last_state = step.start(batch, train_version, max_staleness)
            for phase in self.algorithm.schedule:
                if phase not in POLICY_PHASES:
                    step.run(phase, state)
            metrics = step.finish(state)
            sent = {k: v for k, v in metrics.items() if not k.startswith("batch/")}
            self.channel.isend(
                {"kind": "train", "index": index, "advantages": state.advantages, "metrics": sent}
            )
            self.channel.wait(keep=1)
            self._on_event("value_sent", index)
            return metrics
        state = self.last_state = step.start(batch, train_version, max_staleness)
        t0 = time.perf_counter()
        msg = self._receive("train", index)
        self.wait_s = time.perf_counter() - t0
        if tuple(msg["advantages"].shape) != state.batch.prediction_shape:
            raise RuntimeError(
                f"advantages {tuple(msg['advantages'].shape)} from rank {self.roles.peer} do not "
                f"fit this rank's batch {state.batch.prediction_shape}: the roles got "
                "different batches"
            )
        state.advantages = msg["advantages"]
        state.metrics |= msg["metrics"]
        self._on_event("policy_start", index)
        for phase in self.algorithm.schedule:
            if phase in POLICY_PHASES:
                step.run(phase, state)
        metrics = step.finish(state)
        self._on_event("policy_end", index)
        return metrics

    def value_step(self, batch: TrainBatch, fit_after: bool = False) -> dict[str, float]:
        """Value pre-training (`RLStep.value_step`) on the value ranks only; the policy ranks
        receive and return the same metrics (the logging rank is a policy rank)."""
        if not self.roles.is_policy:
            metrics = self.step.value_step(batch, fit_after=fit_after)
            self.channel.isend({"kind": "value", "index": -1, "metrics": metrics})
            self.channel.wait(keep=1)
            return metrics
        return self._receive("value", -1)["metrics"]

    def value_eval(self, batch: TrainBatch) -> dict[str, float]:
        """The critic's held-out fit (`RLStep.value_eval`) on the value ranks only; the policy
        ranks receive and return the same metrics."""
        if not self.roles.is_policy:
            metrics = self.step.value_eval(batch)
            self.channel.isend({"kind": "value_eval", "index": -1, "metrics": metrics})
            self.channel.wait(keep=1)
            return metrics
        return self._receive("value_eval", -1)["metrics"]

    def flush(self) -> None:
        """Wait until every posted send has been received (call before tearing down the
        process group or saving a checkpoint of the value model)."""
        self.channel.wait()

    def _receive(self, kind: str, index: int) -> dict:
        msg = self.channel.recv()
        if msg["kind"] != kind or msg["index"] != index:
            raise RuntimeError(
                f"expected the value ranks' {kind} message of step {index}, got "
                f"{msg['kind']} of step {msg['index']}: both roles must run the same steps"
            )
        return msg
