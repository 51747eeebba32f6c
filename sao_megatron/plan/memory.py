"""Per-rank memory of a job: parameters, gradients, optimiser state, activations, engines.

Pure arithmetic over the configs (no model is built, no torch). What each term counts:

* parameters: this rank's shard (`sao_megatron.plan.params.rank_parameters`), frozen ones
  included, at ``precision.params_dtype``;
* gradients: Megatron DDP's buffers, fp32 for every trainable parameter
  (``grad_reduce_in_fp32=True`` in `sao_megatron.optim.builder.build_optimizer`);
* optimiser: Adam's two fp32 moments, plus an fp32 master copy when parameters are bf16/fp16
  (12 or 8 bytes per trainable parameter); the distributed optimiser shards it over the
  data-parallel group (dense parameters) and the expert data-parallel group (experts);
* activations: what autograd saves for backward during one micro-batch of
  ``micro_batch_size`` rows of ``model.max_position_embeddings`` tokens (the longest row
  packing allows), per layer after Korthikanti et al. 2022 ("Reducing Activation Recomputation
  in Large Transformer Models", section 4: count each saved tensor), written out for this
  architecture (RMSNorm computed in fp32, q/k norms, GQA, SwiGLU experts after top-k token
  dispatch with balanced routing, no dropout) with sequence parallelism dividing the
  hidden-size tensors by tp. Attention is the unfused kernel (Megatron local specs, CPU: the
  ``[heads, s, s]`` probabilities are saved) or flash attention (Transformer Engine, GPU: q, k,
  v, the output and the log-sum-exp). The policy's last stage adds the float32 log-softmax
  copies of the ``[s, vocab/tp]`` logits (`sao_megatron.models.logprobs`). Pipeline stage r
  holds ``pp - r`` micro-batches at once (1F1B), the interleaved schedule its warm-up count of
  chunk micro-batches;
* transient: the gradient of the logits during the first backward step (fp32, policy last
  stage), on top of the saved activations;
* engines: a vLLM engine reserves ``--gpu-memory-utilization`` (vLLM's default 0.9) of each GPU
  it uses: its weights (``rollout.dtype``, split over its tensor-parallel size), its KV cache
  and its own activations; the KV cache is what is left after weights and
  ``ENGINE_ACTIVATION_GIB``.

tests/plan/test_memory.py checks parameters, gradients and optimiser state exactly and the
activations within 20% against a real 1-rank build and step of the example configs on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sao_megatron.models.config import MoEModelConfig
from sao_megatron.parallel.config import ParallelConfig
from sao_megatron.plan.params import ParamShard, rank_parameters, split_frozen, stage_layers

GIB = 1024**3
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "float32": 4, "bfloat16": 2, "float16": 2}
VLLM_DEFAULT_UTILIZATION = 0.9
ENGINE_ACTIVATION_GIB = 1.0
"""vLLM's own forward activations and CUDA graphs per engine GPU (a rough allowance)."""


@dataclass
class RoleMemory:
    """Bytes one rank spends on one model (policy or value) and how they were counted."""

    role: str
    num_params: int
    num_trainable: int
    num_frozen: int
    params: int
    grads: int
    optimizer: int
    optimizer_replicated: int
    optimizer_distributed: int
    activations: int
    transient: int
    micro_batch_size: int
    seq_length: int
    in_flight: float

    @property
    def static(self) -> int:
        """Parameters + gradients + optimiser state (always resident)."""
        return self.params + self.grads + self.optimizer


@dataclass(frozen=True)
class ActivationShape:
    """What one micro-batch looks like to one rank."""

    micro_batch_size: int
    seq_length: int
    dtype_bytes: int
    attention: str  # "unfused" | "flash"


def layer_activation_bytes(
    model: MoEModelConfig, parallel: ParallelConfig, shape: ActivationShape, index: int
) -> float:
    """Bytes autograd saves in layer `index` for one micro-batch (module docstring)."""
    b, s, e = shape.micro_batch_size, shape.seq_length, shape.dtype_bytes
    t, h, hd = parallel.tp, model.hidden_size, model.head_dim
    n = b * s  # tokens of the micro-batch
    n_sp = n / t if parallel.sequence_parallel else n  # tokens of a hidden-size tensor here
    nq = model.num_attention_heads / t
    nkv = max(model.num_key_value_heads / t, 1)
    norm = (4 + 2 * e) * h * n_sp + 4 * n_sp  # fp32 upcast, input, output; rstd
    total = norm
    if model.qk_layernorm:
        total += (4 + e) * (nq + nkv) * hd * n
    if shape.attention == "unfused":  # q, k and v expanded to the query heads; probabilities
        probs = 4 + (e if e != 4 else 0)  # softmax in fp32, cast back for the bmm with v
        total += e * 3 * nq * hd * n + probs * nq * s * n
    else:  # flash: q, k, v, output, log-sum-exp
        total += e * (2 * nq + 2 * nkv) * hd * n + 4 * nq * n
    total += e * nq * hd * n  # input of linear_proj
    total += norm  # pre-MLP norm
    if index in model.mlp_only_layers:
        ffn = model.intermediate_size / t
        return total + e * (h * n_sp + 4 * ffn * n)  # fc1 in, fc1 out (2f), silu, fc2 in
    k, etp = model.num_experts_per_tok, parallel.expert_tp
    total += e * h * n_sp + 12 * k * n_sp  # router input; top-k probabilities and indices
    routed = k * n_sp * etp  # tokens this rank's experts see (expert-TP gathers them)
    f = model.moe_intermediate_size / etp
    total += e * (2 * h + 4 * f) * routed  # fc1 in, fc1 out (2f), silu, fc2 in, fc2 out
    if model.shared_expert_intermediate_size:
        fs = model.shared_expert_intermediate_size / t
        total += e * (h * n_sp + 4 * fs * n)
    return total


def _in_flight(parallel: ParallelConfig, pp_rank: int) -> float:
    """Micro-batches' worth of this stage's layers held at the activation peak."""
    pp, vpp = parallel.pp, parallel.virtual_pp or 1
    if vpp == 1:
        return float(pp - pp_rank)
    chunk_microbatches = (pp - pp_rank - 1) * 2 + (vpp - 1) * pp + 1  # Megatron's warm-up + 1
    return chunk_microbatches / vpp


def activation_bytes(
    model: MoEModelConfig,
    parallel: ParallelConfig,
    shape: ActivationShape,
    *,
    role: str,
    pp_rank: int = 0,
) -> tuple[int, int, float]:
    """(saved activations, transient, micro-batches in flight) of one rank at its peak."""
    b, s, e, t = shape.micro_batch_size, shape.seq_length, shape.dtype_bytes, parallel.tp
    n = b * s
    n_sp = n / t if parallel.sequence_parallel else n
    layers = [i for chunk in stage_layers(model, parallel, pp_rank) for i in chunk]
    per_mb = sum(layer_activation_bytes(model, parallel, shape, i) for i in layers)
    in_flight = _in_flight(parallel, pp_rank)
    saved = per_mb * in_flight + b * s * s * in_flight  # + the [b, 1, s, s] bool mask
    transient = 0.0
    if pp_rank == parallel.pp - 1:
        h, vocab = model.hidden_size, model.vocab_size / t
        saved += (4 + 2 * e) * h * n_sp + e * h * n_sp  # final norm; output layer input
        if role == "policy":
            saved += 3 * 4 * n * vocab  # float32 logits, log-softmax and probabilities
            transient = 4 * n * vocab + e * n * vocab  # their gradient, the logits' gradient
    return int(saved), int(transient), in_flight


@dataclass(frozen=True)
class RoleSetup:
    """How one model trains: trainable parameters, optimiser, micro-batch."""

    role: str
    freeze_patterns: tuple[str, ...] = ()
    distributed_optimizer: bool = False
    micro_batch_size: int = 1


def role_memory(
    model: MoEModelConfig,
    parallel: ParallelConfig,
    setup: RoleSetup,
    *,
    world_size: int,
    params_dtype: str,
    seq_length: int,
    attention: str,
    pp_rank: int = 0,
) -> RoleMemory:
    """Memory of `setup.role` on one rank of pipeline stage `pp_rank` (module docstring)."""
    e = DTYPE_BYTES[params_dtype]
    shards = rank_parameters(model, parallel, role=setup.role, pp_rank=pp_rank)
    trainable, frozen = split_frozen(shards, setup.freeze_patterns)
    dp = world_size // (parallel.tp * parallel.pp)
    expert_dp = world_size // (parallel.expert_tp * parallel.ep * parallel.pp)
    per_param = 8 + (0 if e == 4 else 4)  # Adam moments (+ fp32 master weights)

    def numel(ps: list[ParamShard], expert: bool | None = None) -> int:
        return sum(p.numel for p in ps if expert is None or p.expert == expert)

    replicated = per_param * numel(trainable)
    distributed = per_param * (
        numel(trainable, False) / max(dp, 1) + numel(trainable, True) / max(expert_dp, 1)
    )
    shape = ActivationShape(setup.micro_batch_size, seq_length, e, attention)
    saved, transient, in_flight = activation_bytes(
        model, parallel, shape, role=setup.role, pp_rank=pp_rank
    )
    return RoleMemory(
        role=setup.role,
        num_params=numel(shards),
        num_trainable=numel(trainable),
        num_frozen=numel(frozen),
        params=e * numel(shards),
        grads=4 * numel(trainable),
        optimizer=int(distributed if setup.distributed_optimizer else replicated),
        optimizer_replicated=replicated,
        optimizer_distributed=int(distributed),
        activations=saved,
        transient=transient,
        micro_batch_size=setup.micro_batch_size,
        seq_length=seq_length,
        in_flight=in_flight,
    )


@dataclass
class EngineMemory:
    """One vLLM engine on each GPU it uses."""

    tensor_parallel: int
    utilization: float
    weights: int
    kv_cache: int
    kv_bytes_per_token: int
    reserved: int
    fits_one_sequence: bool
    max_model_len: int
    sequences: float = field(default=0.0)


def engine_memory(
    model: MoEModelConfig,
    *,
    dtype: str,
    tensor_parallel: int,
    utilization: float | None,
    gpu_memory: float,
    max_model_len: int,
) -> EngineMemory:
    """What one engine holds on each of its GPUs (module docstring)."""
    e = DTYPE_BYTES[dtype]
    total = sum(p.numel for p in rank_parameters(model, ParallelConfig(), role="policy"))
    weights = e * total / tensor_parallel
    kv_heads = max(model.num_key_value_heads / tensor_parallel, 1)
    per_token = int(2 * model.num_hidden_layers * kv_heads * model.head_dim * e)
    util = VLLM_DEFAULT_UTILIZATION if utilization is None else utilization
    reserved = util * gpu_memory
    kv = reserved - weights - ENGINE_ACTIVATION_GIB * GIB
    return EngineMemory(
        tensor_parallel=tensor_parallel,
        utilization=util,
        weights=int(weights),
        kv_cache=int(max(kv, 0)),
        kv_bytes_per_token=per_token,
        reserved=int(max(reserved, weights + ENGINE_ACTIVATION_GIB * GIB)),
        fits_one_sequence=kv >= per_token * max_model_len,
        max_model_len=max_model_len,
        sequences=max(kv, 0) / (per_token * max_model_len),
    )
