"""The cluster a job is planned for, and every parallel-layout rule the job must meet on it.

`check_layout` collects all the rules a job's layout breaks on a target world, each as one
message that names the field and the fix, before a job queues: the rules Megatron-Core 0.16
(``TransformerConfig`` / ``ModelParallelConfig``, the pipeline schedules) and our builders
enforce at start-up (`sao_megatron.parallel.config.ParallelConfig.data_parallel_size`,
`sao_megatron.models.transformer_config.check_model_parallel_compat`,
`sao_megatron.parallel.roles.check_separate_layout`,
`sao_megatron.trainer.critic_placement.check_separate_job`, the DP sharding of
`sao_megatron.data.micro_batches.layout_micro_batches`), and the rollout engines' placement.
"""

from __future__ import annotations

from dataclasses import dataclass

from sao_megatron.algorithm import registry
from sao_megatron.trainer.job import JobConfig


@dataclass(kw_only=True)
class ClusterTarget:
    """Where the job will run (the SLURM allocation).

    Fields:
        nodes: nodes of the allocation (``sbatch --nodes``).
        gpus_per_node: GPUs per node; one trainer rank per GPU (``--gpus-per-node``).
        gpu_memory_gib: memory of one GPU, GiB (H100: 80, H200: 141).
        rollout_nodes: nodes given to the vLLM engines (``ROLLOUT_NODES`` of
            launch_scripts/train_slurm.sbatch); 0: the engines start beside rank 0, on its
            node's GPUs. Equal to ``nodes``: trainer and engines share every node.
        headroom_gib: memory per GPU kept for what the model does not count: the CUDA
            context, NCCL buffers, allocator fragmentation.
    """

    nodes: int
    gpus_per_node: int
    gpu_memory_gib: float
    rollout_nodes: int = 0
    headroom_gib: float = 2.0

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)}: must be >= 1")
        if not self.gpu_memory_gib > 0:
            raise ValueError(f"--gpu-memory-gib={self.gpu_memory_gib}: must be > 0")
        if not 0 <= self.rollout_nodes <= self.nodes:
            raise ValueError(
                f"--rollout-nodes={self.rollout_nodes}: must be 0..--nodes={self.nodes}"
            )
        if self.headroom_gib < 0:
            raise ValueError(f"--headroom-gib={self.headroom_gib}: must be >= 0")

    @property
    def trainer_nodes(self) -> int:
        """Nodes the trainer ranks run on (as train_slurm.sbatch splits them)."""
        return self.nodes - self.rollout_nodes if self.rollout_nodes < self.nodes else self.nodes

    @property
    def world_size(self) -> int:
        """Trainer ranks."""
        return self.trainer_nodes * self.gpus_per_node

    @property
    def engines_beside_trainer(self) -> bool:
        """The engines share GPUs with trainer ranks (none of their own nodes)."""
        return self.rollout_nodes in (0, self.nodes)


def engine_args(job: JobConfig) -> tuple[int, float | None]:
    """(tensor-parallel size, gpu memory utilisation or None) of one vLLM engine, read from
    ``rollout.extra_engine_args`` (``--tensor-parallel-size N`` / ``-tp N``,
    ``--gpu-memory-utilization U``, ``--flag=value`` forms too)."""
    args = list(job.rollout.extra_engine_args)
    found: dict[str, str] = {}
    for i, a in enumerate(args):
        key, eq, value = a.partition("=")
        if key in ("--tensor-parallel-size", "-tp", "--gpu-memory-utilization"):
            found[key.replace("-tp", "--tensor-parallel-size")] = (
                value if eq else (args[i + 1] if i + 1 < len(args) else "")
            )
    tp = found.get("--tensor-parallel-size", "1")
    util = found.get("--gpu-memory-utilization")
    try:
        return int(tp), (float(util) if util is not None else None)
    except ValueError:
        raise ValueError(
            f"rollout.extra_engine_args={args}: --tensor-parallel-size needs an integer and "
            "--gpu-memory-utilization a fraction"
        ) from None


def _divides(errors: list[str], value: int, size: int, field: str, by: str, fix: str) -> None:
    if size and value % size:
        errors.append(f"{field}={value} is not divisible by {by}={size}: {fix}")


def check_layout(job: JobConfig, target: ClusterTarget) -> list[str]:
    """Every rule the layout of `job` breaks on `target`: one message each (empty: it fits).

    Rules: the trainer world is divisible by ``tp*pp`` and ``expert_tp*ep*pp``; heads, the
    q/k/v projection, the vocabulary and dense FFNs by ``tp``; key/value heads a multiple or a
    divisor of ``tp``; experts by ``ep``; the expert FFN by ``expert_tp``; layers by
    ``pp*virtual_pp``; sequence parallelism on when ``tp > 1`` (Megatron MoE layers need it);
    every DP rank gets a trajectory (or group); with ``virtual_pp`` at least ``pp``
    micro-batches per step; ``value.placement=separate`` only with pure data parallelism on an
    even world and no distributed optimiser; the engines' tensor-parallel size fits a node.
    """
    p, m, world = job.parallel, job.model, target.world_size
    errors: list[str] = []
    layout_fix = "change parallel.tp/pp/ep/expert_tp or the number of nodes/GPUs"
    _divides(errors, world, p.tp * p.pp, "the trainer world", "parallel.tp*parallel.pp", layout_fix)
    _divides(
        errors,
        world,
        p.expert_tp * p.ep * p.pp,
        "the trainer world",
        "parallel.expert_tp*parallel.ep*parallel.pp",
        layout_fix,
    )
    tp_fix = "change parallel.tp"
    _divides(
        errors, m.num_attention_heads, p.tp, "model.num_attention_heads", "parallel.tp", tp_fix
    )
    qkv = (m.num_attention_heads + 2 * m.num_key_value_heads) * m.head_dim
    _divides(
        errors, qkv, p.tp, "the q/k/v projection (heads+2*kv_heads)*head_dim", "parallel.tp", tp_fix
    )
    kv = m.num_key_value_heads
    if kv % p.tp and p.tp % kv:
        errors.append(
            f"model.num_key_value_heads={kv} must be a multiple or a divisor of parallel.tp="
            f"{p.tp} (Megatron replicates k/v heads when there are fewer than tp): {tp_fix}"
        )
    _divides(
        errors,
        m.vocab_size,
        p.tp,
        "model.vocab_size",
        "parallel.tp",
        tp_fix + " (or pad the vocabulary)",
    )
    if m.mlp_only_layers:
        _divides(
            errors, m.intermediate_size, p.tp, "model.intermediate_size", "parallel.tp", tp_fix
        )
    if m.shared_expert_intermediate_size:
        _divides(
            errors,
            m.shared_expert_intermediate_size,
            p.tp,
            "model.shared_expert_intermediate_size",
            "parallel.tp",
            tp_fix,
        )
    _divides(errors, m.num_experts, p.ep, "model.num_experts", "parallel.ep", "change parallel.ep")
    _divides(
        errors,
        m.moe_intermediate_size,
        p.expert_tp,
        "model.moe_intermediate_size",
        "parallel.expert_tp",
        "change parallel.expert_tp (1 keeps experts whole)",
    )
    vpp = p.virtual_pp or 1
    _divides(
        errors,
        m.num_hidden_layers,
        p.pp * vpp,
        "model.num_hidden_layers",
        "parallel.pp*parallel.virtual_pp",
        "change parallel.pp or parallel.virtual_pp",
    )
    if p.tp > 1 and not p.sequence_parallel:
        errors.append(
            f"parallel.sequence_parallel=false with parallel.tp={p.tp}: Megatron MoE layers need "
            "sequence parallelism when tp > 1 (the model builder refuses it at start-up); set "
            "parallel.sequence_parallel=true"
        )
    algorithm = registry.build(job.algorithm)
    if world % (p.tp * p.pp) == 0:
        dp = world // (p.tp * p.pp)
        units = job.rollout.trajectories_per_batch
        what = "trajectories"
        if algorithm.keeps_groups_together and algorithm.group_size > 1:
            units //= algorithm.group_size
            what = f"groups of algorithm.grpo.group_size={algorithm.group_size}"
        if job.value.placement == "separate":
            dp = max(dp // 2, 1)
        if units < dp:
            need = dp * (job.rollout.trajectories_per_batch // max(units, 1))
            errors.append(
                f"rollout.trajectories_per_batch={job.rollout.trajectories_per_batch} gives "
                f"{units} {what} for {dp} data-parallel ranks: every DP rank needs one; raise "
                f"rollout.trajectories_per_batch to at least {need} or use fewer ranks (or more "
                "model parallelism)"
            )
        if p.virtual_pp and p.pp > 1:
            micro = -(-units // dp) // job.rl.micro_batch_size
            if micro < p.pp:
                errors.append(
                    f"parallel.virtual_pp={p.virtual_pp}: the interleaved schedule needs at least "
                    f"parallel.pp={p.pp} micro-batches per step, and {units} {what} over {dp} DP "
                    f"ranks at rl.micro_batch_size={job.rl.micro_batch_size} give {micro}: "
                    "raise rollout.trajectories_per_batch, lower rl.micro_batch_size, or unset "
                    "parallel.virtual_pp"
                )
    if job.value.placement == "separate":
        others = {k: getattr(p, k) for k in ("tp", "pp", "ep", "expert_tp") if getattr(p, k) != 1}
        if others or p.virtual_pp not in (None, 1):
            got = ", ".join(f"parallel.{k}={v}" for k, v in others.items())
            errors.append(
                f"value.placement=separate supports data parallelism only (got "
                f"{got or f'parallel.virtual_pp={p.virtual_pp}'}): set parallel.tp=parallel.pp="
                "parallel.ep=1, or use value.placement=colocated"
            )
        if world < 2 or world % 2:
            errors.append(
                f"value.placement=separate splits the world into policy and value halves: the "
                f"trainer world {world} must be even and >= 2, or use value.placement=colocated"
            )
        for name in ("policy_optim", "value_optim"):
            if getattr(job, name).distributed_optimizer:
                errors.append(
                    f"value.placement=separate does not support {name}.distributed_optimizer="
                    f"true: set {name}.distributed_optimizer=false, or use value.placement="
                    "colocated"
                )
    engine_tp, util = engine_args(job)
    if job.rollout.launches_engines or target.rollout_nodes:
        if engine_tp > target.gpus_per_node:
            errors.append(
                f"rollout.extra_engine_args asks for --tensor-parallel-size {engine_tp} but a node "
                f"has {target.gpus_per_node} GPUs: lower it to at most {target.gpus_per_node}"
            )
        if util is not None and not 0 < util <= 1:
            errors.append(
                f"rollout.extra_engine_args --gpu-memory-utilization {util}: must be in (0, 1]"
            )
    if target.rollout_nodes and not job.rollout.launches_engines and job.rollout.engine_urls:
        errors.append(
            f"--rollout-nodes={target.rollout_nodes} but rollout.engine_urls is set: the engines "
            "would not run on those nodes; drop one of the two"
        )
    return errors
