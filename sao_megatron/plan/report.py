"""The plan of a job on a cluster: layout errors, memory of every kind of GPU, table and JSON.

`make_plan` composes `sao_megatron.plan.layout` (rules) and `sao_megatron.plan.memory`
(bytes): trainer ranks are grouped by what they hold (pipeline stage, role under
``value.placement=separate``, engines sharing the GPU), engine-node GPUs get rows of their own.
A row fits when its total plus the target's headroom is within the GPU's memory.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from sao_megatron.algorithm import registry
from sao_megatron.plan.layout import ClusterTarget, check_layout, engine_args
from sao_megatron.plan.memory import (
    GIB,
    EngineMemory,
    RoleMemory,
    RoleSetup,
    engine_memory,
    role_memory,
)
from sao_megatron.plan.params import count_all
from sao_megatron.trainer.job import JobConfig


@dataclass
class GpuRow:
    """One kind of GPU of the allocation and what it holds at its peak."""

    label: str
    ranks: list[int]
    roles: list[RoleMemory]
    num_engines: int
    engine_bytes: int
    total: int
    limit: int

    @property
    def fits(self) -> bool:
        return self.total <= self.limit


@dataclass
class Plan:
    """Result of `make_plan`: ``errors`` (layout rules broken) or the rows."""

    target: ClusterTarget
    errors: list[str] = field(default_factory=list)
    rows: list[GpuRow] = field(default_factory=list)
    engine: EngineMemory | None = None
    engine_problems: list[str] = field(default_factory=list)
    params_dtype: str = ""
    seq_length: int = 0
    attention: str = ""
    num_params: int = 0
    dp: int = 0
    expert_dp: int = 0

    @property
    def fits(self) -> bool:
        return not self.errors and not self.engine_problems and all(r.fits for r in self.rows)

    @property
    def worst(self) -> GpuRow | None:
        return max(self.rows, key=lambda r: r.total - r.limit, default=None)


def _ranks_text(ranks: list[int]) -> str:
    spans, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None], strict=True):
        if b != a + 1:
            spans.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ",".join(spans)


def make_plan(job: JobConfig, target: ClusterTarget, *, attention: str = "flash") -> Plan:
    """Check `job`'s layout on `target` and size every GPU (module docstring).

    Args:
        attention: "flash" (Transformer Engine on GPU, the default) or "unfused" (Megatron
            local specs, CPU).
    """
    plan = Plan(target=target, errors=check_layout(job, target), attention=attention)
    if plan.errors:
        return plan
    p, m, world = job.parallel, job.model, target.world_size
    # "auto" was resolved on the machine that loaded the config; a GPU computes in bf16.
    dtype = "bf16" if job.precision.auto_reason is not None else job.precision.params_dtype
    seq = m.max_position_embeddings
    if p.sequence_parallel:
        seq = -(-seq // p.tp) * p.tp
    algorithm = registry.build(job.algorithm)
    policy_mbs = max(
        [job.rl.micro_batch_size] * ("rl" in job.stages)
        + [job.sft.micro_batch_size] * ("sft" in job.stages)
        or [job.rl.micro_batch_size]
    )
    separate = job.value.placement == "separate"
    role_world = world // 2 if separate else world
    setups = [RoleSetup("policy", (), job.policy_optim.distributed_optimizer, policy_mbs)]
    if algorithm.needs_value_model:
        setups.append(
            RoleSetup(
                "value",
                tuple(job.value.freeze_patterns),
                job.value_optim.distributed_optimizer,
                job.rl.micro_batch_size,
            )
        )
    plan.params_dtype, plan.seq_length, plan.num_params = dtype, seq, count_all(m)
    plan.dp = role_world // (p.tp * p.pp)
    plan.expert_dp = role_world // (p.expert_tp * p.ep * p.pp)

    def memory(setup: RoleSetup, pp_rank: int) -> RoleMemory:
        return role_memory(
            m,
            p,
            setup,
            world_size=role_world,
            params_dtype=dtype,
            seq_length=seq,
            attention=attention,
            pp_rank=pp_rank,
        )

    engine_tp, util = engine_args(job)
    gpus, limit = target.gpus_per_node, int((target.gpu_memory_gib - target.headroom_gib) * GIB)
    engines_run = not job.rollout.engine_urls
    if engines_run:
        plan.engine = engine_memory(
            m,
            dtype=dtype if job.rollout.dtype == "auto" else job.rollout.dtype,
            tensor_parallel=engine_tp,
            utilization=util,
            gpu_memory=target.gpu_memory_gib * GIB,
            max_model_len=job.rollout.max_model_len,
        )
        if not plan.engine.fits_one_sequence:
            plan.engine_problems.append(
                f"a vLLM engine's KV cache ({plan.engine.kv_cache / GIB:.1f} GiB after "
                f"{plan.engine.weights / GIB:.1f} GiB of weights per GPU at "
                f"--gpu-memory-utilization {plan.engine.utilization}) cannot hold one "
                f"rollout.max_model_len={job.rollout.max_model_len} sequence "
                f"({plan.engine.kv_bytes_per_token * job.rollout.max_model_len / GIB:.2f} GiB): "
                "raise --gpu-memory-utilization or --tensor-parallel-size in "
                "rollout.extra_engine_args, or lower rollout.max_model_len"
            )
    per_engine = plan.engine.reserved if plan.engine else 0
    n_eng = job.rollout.num_engines
    # which trainer GPUs the engines share: GPUs 0..tp-1 of node 0 (engines started by rank 0)
    # or of every node (engine step on the trainer's nodes); engines are not pinned to GPUs.
    shared_nodes: set[int] = set()
    if engines_run and target.rollout_nodes == 0 and job.rollout.launches_engines:
        shared_nodes = {0}
    elif engines_run and target.rollout_nodes == target.nodes:
        shared_nodes = set(range(target.nodes))
    groups: dict[tuple, list[int]] = {}
    per_stage = world // p.pp
    for g in range(world):
        pp_rank = g // per_stage
        role = ("policy" if g < role_world else "value") if separate else None
        with_engines = g // gpus in shared_nodes and g % gpus < engine_tp
        groups.setdefault((pp_rank, role, with_engines), []).append(g)
    cache: dict[tuple, RoleMemory] = {}
    for (pp_rank, role, with_engines), ranks in sorted(groups.items(), key=lambda kv: kv[1][0]):
        roles = []
        for s in setups:
            if role in (None, s.role):
                key = (s.role, pp_rank)
                cache.setdefault(key, memory(s, pp_rank))
                roles.append(cache[key])
        peak = max(r.activations + r.transient for r in roles)
        engines = n_eng * per_engine if with_engines else 0
        total = sum(r.static for r in roles) + peak + engines
        label = "+".join(r.role for r in roles) + (f" stage {pp_rank}" if p.pp > 1 else "")
        if with_engines:
            label += f" + {n_eng} engine(s)"
        plan.rows.append(
            GpuRow(label, ranks, roles, n_eng if with_engines else 0, engines, total, limit)
        )
    if engines_run and 0 < target.rollout_nodes < target.nodes:
        busy = min(engine_tp, gpus)
        plan.rows.append(
            GpuRow(
                f"engine node GPU 0-{busy - 1} ({n_eng} engine(s))",
                [],
                [],
                n_eng,
                n_eng * per_engine,
                n_eng * per_engine,
                limit,
            )
        )
    return plan


def _gib(x: float) -> str:
    return f"{x / GIB:.2f}"


def _count(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def format_plan(plan: Plan, config: str) -> str:
    """The table `sao-plan` prints."""
    t = plan.target
    lines = [
        f"sao-plan: {config} on {t.nodes} node(s) x {t.gpus_per_node} GPU(s) of "
        f"{t.gpu_memory_gib:g} GiB: trainer {t.trainer_nodes} node(s), {t.world_size} rank(s)"
        + (f"; engines on {t.rollout_nodes} node(s)" if t.rollout_nodes else "")
    ]
    if plan.errors:
        lines.append(f"layout: {len(plan.errors)} problem(s):")
        lines += [f"  - {e}" for e in plan.errors]
        return "\n".join(lines)
    lines.append(
        f"layout: dp={plan.dp}, expert dp={plan.expert_dp}; {plan.params_dtype} parameters, "
        f"{plan.seq_length}-token rows, {plan.attention} attention; model "
        f"{_count(plan.num_params)} parameters"
    )
    lines.append("")
    lines.append(
        f"{'GiB per GPU (ranks)':<34} {'role':<7} {'params':>7} {'grads':>6} {'optim':>6} "
        f"{'(repl/dist)':>12} {'activ':>6} {'trans':>6}"
    )
    for row in plan.rows:
        head = f"{row.label} ({_ranks_text(row.ranks)})" if row.ranks else row.label
        for i, r in enumerate(row.roles):
            repl_dist = f"{_gib(r.optimizer_replicated)}/{_gib(r.optimizer_distributed)}"
            lines.append(
                f"{head if i == 0 else '':<34} {r.role:<7} {_gib(r.params):>7} {_gib(r.grads):>6} "
                f"{_gib(r.optimizer):>6} {repl_dist:>12} "
                f"{_gib(r.activations):>6} {_gib(r.transient):>6}"
            )
        if row.engine_bytes:
            lines.append(f"{head if not row.roles else '':<34} engines {_gib(row.engine_bytes):>7}")
        verdict = "fits" if row.fits else f"DOES NOT FIT by {_gib(row.total - row.limit)} GiB"
        lines.append(
            f"{'':<34} total {_gib(row.total)} GiB of {_gib(row.limit)} "
            f"(GPU {t.gpu_memory_gib:g} - headroom {t.headroom_gib:g}): {verdict}"
        )
    for r in {(x.role): x for row in plan.rows for x in row.roles}.values():
        lines.append(
            f"{r.role}: {_count(r.num_params)} parameters on a rank ({_count(r.num_trainable)} "
            f"trainable, {_count(r.num_frozen)} frozen); activations of {r.micro_batch_size} x "
            f"{r.seq_length} tokens, {r.in_flight:g} micro-batch(es) in flight"
        )
    if plan.engine:
        e = plan.engine
        lines.append(
            f"engine: tp={e.tensor_parallel}, --gpu-memory-utilization {e.utilization}: "
            f"{_gib(e.reserved)} GiB per GPU = weights {_gib(e.weights)} + KV cache "
            f"{_gib(e.kv_cache)} (~{e.sequences:.0f} sequences of {e.max_model_len} tokens) + "
            "activations"
        )
    lines += [f"engine problem: {x}" for x in plan.engine_problems]
    worst = plan.worst
    if plan.fits:
        lines.append(f"fits: peak {_gib(worst.total)} GiB per GPU ({worst.label})")
    elif worst is not None and not worst.fits:
        where = _ranks_text(worst.ranks) if worst.ranks else "none: an engine node"
        lines.append(
            f"does not fit: {worst.label} (ranks {where}) "
            f"needs {_gib(worst.total)} GiB, {_gib(worst.total - worst.limit)} GiB over its "
            f"{_gib(worst.limit)} GiB"
        )
    return "\n".join(lines)


def plan_json(plan: Plan) -> str:
    """The plan as JSON (bytes, counts, verdicts)."""
    out = {
        "fits": plan.fits,
        "target": dataclasses.asdict(plan.target) | {"world_size": plan.target.world_size},
        "errors": plan.errors,
        "engine_problems": plan.engine_problems,
        "params_dtype": plan.params_dtype,
        "seq_length": plan.seq_length,
        "attention": plan.attention,
        "num_params": plan.num_params,
        "dp": plan.dp,
        "expert_dp": plan.expert_dp,
        "engine": dataclasses.asdict(plan.engine) if plan.engine else None,
        "rows": [
            {
                "label": r.label,
                "ranks": r.ranks,
                "roles": [dataclasses.asdict(x) for x in r.roles],
                "engine_bytes": r.engine_bytes,
                "total_bytes": r.total,
                "limit_bytes": r.limit,
                "fits": r.fits,
            }
            for r in plan.rows
        ],
    }
    return json.dumps(out, indent=2)
