"""Runs of `tests/trainer/test_critic_placement.py`: SAO on the tiny MoE, colocated and with the
critic on its own ranks, on the same fixed batches (fp32, K = 2 value updates per step).

The models are built the same way on every rank and in every run (seeded init, the value model
from the policy's trunk, the default freeze patterns); the batches come from a file written by
the colocated run, so every run trains on the same bytes.
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from tests.conftest import tiny_moe_kwargs
from tests.golden.golden_worker import _set_behaviour, _trajectories
from tests.train_states import build_train_states

NUM_STEPS = 3
GATE_TAG = 99  # the test's own point-to-point messages (the step's exchange uses another tag)


def algorithm():
    from sao_megatron.algorithm import registry
    from sao_megatron.algorithm.config import AlgorithmConfig, SAOConfig

    return registry.build(
        AlgorithmConfig(sao=SAOConfig(value_updates_per_policy_update=2, length_adaptive_alpha=0.5))
    )


def step_config():
    from sao_megatron.trainer.rl_step import StepConfig

    return StepConfig(micro_batch_size=3)


def build(parallel, role: str | None):
    """(policy TrainState, value TrainState); role "policy" / "value" leaves the other None (its
    model is still built, so the seeded init and the value's trunk are the colocated ones)."""
    return build_train_states(parallel, role=role, warmup_steps=2)


def make_batches(p_state, parallel):
    """NUM_STEPS batches of 8 trajectories (a quarter truncated), behaviour log-probs = the
    initial policy's own + noise (golden_worker)."""
    vocab = tiny_moe_kwargs()["vocab_size"]
    return [
        _set_behaviour(p_state.model, parallel, _trajectories(s, 8, 1, vocab), s)
        for s in range(NUM_STEPS)
    ]


def params(train) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in train.unwrapped[0].named_parameters()}


def colocated(parallel, batches) -> dict:
    """RLStep with both models on this rank: one value pre-training step on batches[0], then per
    train step the metrics and advantages, then the final weights."""
    from sao_megatron.trainer.rl_step import RLStep

    p_state, v_state = build(parallel, None)
    initial = {"initial_policy": params(p_state), "initial_value": params(v_state)}
    step = RLStep(algorithm(), parallel, p_state, v_state, step_config())
    pretrain = step.value_step(batches[0])  # one value pre-training step first
    metrics, advantages = [], []
    for n, batch in enumerate(batches):
        state = step.start(batch, train_version=n)
        for phase in step.algorithm.schedule:
            step.run(phase, state)
        metrics.append(step.finish(state))
        advantages.append(state.advantages.clone())
    return initial | {
        "pretrain": pretrain,
        "metrics": metrics,
        "advantages": advantages,
        "policy": params(p_state),
        "value": params(v_state),
    }


def separate_worker(rank: int, world_size: int, out_dir: str) -> None:
    """2*D ranks: D policy ranks, D value ranks (`split_roles`), one value pre-training step
    and NUM_STEPS pipelined steps on the batches of out_dir/batches.pt; every event is
    time-stamped (time.monotonic, one clock for all processes of the machine). With
    out_dir/gate present the policy update of step n waits until the value rank has started
    step n + 1 (it would wait until the 300 s guard if the critic waited for the policy)."""
    from pathlib import Path

    from sao_megatron.parallel import ParallelConfig, destroy_parallel, initialize_parallel
    from sao_megatron.parallel.roles import split_roles
    from sao_megatron.trainer.critic_placement import SeparateCriticStep

    parallel = initialize_parallel(ParallelConfig())
    roles = split_roles(parallel)
    batches = torch.load(f"{out_dir}/batches.pt", weights_only=False)
    gate = Path(f"{out_dir}/gate").exists()
    events: list[tuple[str, int, float]] = []
    marker = torch.zeros(1, dtype=torch.int64)
    gate_sends: list = []

    def on_event(event: str, index: int) -> None:
        events.append((event, index, time.monotonic()))
        if not gate:
            return
        if event == "value_start" and index > 0:  # tell the policy step n+1 has begun
            box = torch.tensor([index])
            gate_sends.append((box, dist.isend(box, roles.peer, tag=GATE_TAG)))
        if event == "policy_start" and index + 1 < NUM_STEPS:
            # (gloo's is_completed() never turns True before wait(): wait with a guard)
            work = dist.irecv(marker, roles.peer, tag=GATE_TAG)
            if not work.wait(timeout=datetime.timedelta(seconds=300)):
                raise RuntimeError(f"the critic did not start step {index + 1} in 300 s")
            assert int(marker) == index + 1
        events.append((event + "_released", index, time.monotonic()))

    try:
        role = roles.role
        p_state, v_state = build(roles.parallel, role)
        step = SeparateCriticStep(
            algorithm(),
            roles,
            policy=p_state,
            value=v_state,
            step_cfg=step_config(),
            on_event=on_event,
        )
        pretrain = step.value_step(batches[0])  # value ranks train, policy ranks get metrics
        metrics, advantages = [], []
        for n, batch in enumerate(batches):
            metrics.append(step.train_step(batch, train_version=n))
            advantages.append(step.last_state.advantages.clone())
        step.flush()
        for _, work in gate_sends:
            work.wait()
        out = {"role": role, "pretrain": pretrain, "metrics": metrics, "events": events}
        out["exchange_s"] = _exchange_seconds(step.channel, role)
        if role == "policy":
            out["policy"] = params(p_state)
        else:
            out["value"] = params(v_state)
        dist.barrier()
        torch.save(out | {"advantages": advantages}, f"{out_dir}/rank{rank}.pt")
    finally:
        destroy_parallel()


def colocated_worker(rank: int, world_size: int, out_dir: str) -> None:
    """The colocated reference at DP = world_size on the batches of out_dir/batches.pt."""
    from sao_megatron.parallel import ParallelConfig, destroy_parallel, initialize_parallel

    parallel = initialize_parallel(ParallelConfig())
    try:
        batches = torch.load(f"{out_dir}/batches.pt", weights_only=False)
        torch.save(colocated(parallel, batches), f"{out_dir}/colocated{rank}.pt")
    finally:
        destroy_parallel()


def _exchange_seconds(channel, role: str, reps: int = 20) -> float:
    """Median one-way time of a step's message (advantages [16, 256] float32 + 40 metrics)
    between the paired ranks: half a ping-pong round trip, timed on the policy rank."""
    msg = {
        "kind": "train",
        "index": 0,
        "advantages": torch.zeros(16, 256),
        "metrics": {f"value/m{i}": float(i) for i in range(40)},
    }
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        if role == "policy":
            channel.isend(msg)
            channel.wait()
            channel.recv()
        else:
            channel.recv()
            channel.isend(msg)
            channel.wait()
        times.append((time.perf_counter() - t0) / 2)
    return sorted(times)[reps // 2]
