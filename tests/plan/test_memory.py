"""sao-plan's parameter and memory model against a real 1-rank build and one step on CPU.

Parameters: every name and size of `rank_parameters` equals the built model's
``named_parameters()`` (policy and value, freeze patterns applied as `apply_freeze` does).
Memory: after one optimiser step, the bytes of the parameters, of Megatron DDP's gradient
buffers and of the optimiser state (Adam moments, fp32 master weights) equal the plan exactly;
the activations of one micro-batch (every tensor autograd saves for backward, by storage,
parameters excluded) are within 20% of the plan's unfused-attention figure.
"""

from __future__ import annotations

import torch

from sao_megatron.configs import load_config
from sao_megatron.models import apply_freeze, build_policy, build_value_model
from sao_megatron.models.forward import ModelInputs, forward_backward
from sao_megatron.optim.builder import build_optimizer
from sao_megatron.plan.memory import RoleSetup, role_memory
from sao_megatron.plan.params import rank_parameters, split_frozen
from sao_megatron.trainer.job import JobConfig

QUICKSTART = "examples/configs/quickstart.yaml"


def _saved_activation_bytes(state, parallel, kind: str, rows: int, seq: int) -> int:
    """Bytes of the distinct storages autograd saves during one forward/backward."""
    params = {p.untyped_storage().data_ptr() for c in state.unwrapped for p in c.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    ids = torch.randint(0, 500, (rows, seq), generator=torch.Generator().manual_seed(0))
    batch = ModelInputs(input_ids=ids, attention_mask=torch.ones(rows, seq, dtype=torch.long))
    key = "logprobs" if kind == "policy" else "values"
    state.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward_backward(
            state.model,
            parallel,
            batch,
            kind=kind,
            loss_fn=lambda out, mb: (out[key].float().mean(), {}),
            micro_batch_size=rows,
        )
    ok, _ = state.step()
    assert ok
    return sum(seen.values())


def _measured_static(state) -> tuple[int, int, int]:
    """(parameter, gradient-buffer, optimiser-state) bytes of a built TrainState."""
    params = sum(p.numel() * p.element_size() for c in state.unwrapped for p in c.parameters())
    grads = 0
    for chunk in state.model:
        for buf in chunk.buffers + chunk.expert_parallel_buffers:
            grads += buf.grad_data.numel() * buf.grad_data.element_size()
    optim = 0
    for sub in getattr(state.optimizer, "chained_optimizers", [state.optimizer]):
        for st in sub.optimizer.state.values():
            optim += sum(
                v.numel() * v.element_size()
                for k, v in st.items()
                if k in ("exp_avg", "exp_avg_sq")
            )
        for group in getattr(sub, "fp32_from_float16_groups", []):
            optim += sum(p.numel() * p.element_size() for p in group)
    return params, grads, optim


def _check(job, parallel, role: str, rows: int, seq: int) -> None:
    if role == "policy":
        chunks = build_policy(job.model, parallel, job.precision)
        patterns: tuple[str, ...] = ()
        optim_cfg = job.policy_optim
    else:
        chunks = build_value_model(job.model, parallel, job.precision)
        patterns = tuple(job.value.freeze_patterns)
        apply_freeze(chunks, patterns)
        optim_cfg = job.value_optim
    # every name and size, trainable or frozen, as the builder makes them
    planned = rank_parameters(job.model, job.parallel, role=role)
    built = {n: p.numel() for c in chunks for n, p in c.named_parameters()}
    assert {p.name: p.numel for p in planned} == built
    trainable, frozen = split_frozen(planned, patterns)
    built_trainable = {n for c in chunks for n, p in c.named_parameters() if p.requires_grad}
    assert {p.name for p in trainable} == built_trainable
    assert frozen or role == "policy"

    state = build_optimizer(chunks, parallel, optim_cfg, job.precision)
    activations = _saved_activation_bytes(state, parallel, role, rows, seq)
    params, grads, optim = _measured_static(state)
    mem = role_memory(
        job.model,
        job.parallel,
        RoleSetup(role, patterns, False, rows),
        world_size=1,
        params_dtype=job.precision.params_dtype,
        seq_length=seq,
        attention="unfused",
    )
    assert (mem.params, mem.grads, mem.optimizer) == (params, grads, optim)
    assert abs(mem.activations - activations) <= 0.2 * activations, (mem.activations, activations)


def test_policy_bf16_matches_a_real_build_and_step(parallel_1rank):
    job = load_config(JobConfig, QUICKSTART, ["precision.params_dtype=bf16"])
    _check(job, parallel_1rank, "policy", rows=2, seq=128)


def test_value_fp32_matches_a_real_build_and_step(parallel_1rank):
    job = load_config(JobConfig, QUICKSTART, ["precision.params_dtype=fp32"])
    _check(job, parallel_1rank, "value", rows=1, seq=256)


def test_variant_with_dense_layers_shared_experts_bias_and_tied_embeddings(parallel_1rank):
    overrides = [
        "precision.params_dtype=fp32",
        "model.mlp_only_layers=[0,3]",
        "model.intermediate_size=192",
        "model.shared_expert_intermediate_size=64",
        "model.shared_expert_gate=true",
        "model.attention_bias=true",
        "model.qk_layernorm=false",
        "model.tie_word_embeddings=true",
    ]
    job = load_config(JobConfig, QUICKSTART, overrides)
    _check(job, parallel_1rank, "policy", rows=2, seq=64)
