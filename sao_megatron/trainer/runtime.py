"""Build what a job trains from its config: tokenizer, models, optimisers, HF weight export.

Kept apart from the controller so the loop reads top to bottom without construction details.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from sao_megatron.convert.hf_io import atomic_output_dir, write_sharded_safetensors
from sao_megatron.convert.model_io import megatron_to_hf_tensors
from sao_megatron.convert.spec import ConversionSpec
from sao_megatron.data.demonstrations import train_tokenizer_for_envs
from sao_megatron.data.tokenizer import Tokenizer, load_tokenizer, save_tokenizer
from sao_megatron.models import (
    apply_freeze,
    build_policy,
    build_value_model,
    init_value_from_policy,
)
from sao_megatron.models.config import MoEModelConfig
from sao_megatron.optim.builder import TrainState, build_optimizer
from sao_megatron.optim.config import OptimizerConfig
from sao_megatron.parallel.collectives import barrier
from sao_megatron.parallel.state import ParallelState
from sao_megatron.trainer.job import JobConfig

log = logging.getLogger("sao_megatron.trainer")


def prepare_tokenizer(job: JobConfig, rank: int) -> Tokenizer:
    """The job's tokenizer: the configured one, or one trained on the task corpus (rank 0 trains
    and saves it under ``run_dir/tokenizer``; a rerun reuses that file).

    Raises ValueError if the tokenizer has more tokens than ``model.vocab_size``.
    """
    cfg = job.tokenizer
    if cfg.path:
        tok = load_tokenizer(cfg.path, kind=cfg.kind)
    else:
        out = job.run_path / "tokenizer"
        if rank == 0 and not (out / "sao_tokenizer.json").exists():
            tok = train_tokenizer_for_envs(job.demonstrations, cfg, job.episode)
            save_tokenizer(tok, str(out))
        barrier()
        tok = load_tokenizer(str(out))
    if tok.vocab_size > job.model.vocab_size:
        raise ValueError(
            f"the tokenizer has {tok.vocab_size} tokens but model.vocab_size="
            f"{job.model.vocab_size}: raise model.vocab_size or lower tokenizer.vocab_size"
        )
    return tok


def fit_vocab_to_tokenizer(job: JobConfig, tokenizer: Tokenizer, tp: int) -> JobConfig:
    """The job with ``model.vocab_size`` shrunk to a tokenizer the job trained itself.

    A trained sentencepiece vocabulary is often smaller than asked for (templated corpora have
    few pieces); embedding rows past it would be ids the policy can sample but no tokenizer can
    decode. The new size is rounded up to a multiple of TP (Megatron splits the vocabulary).
    A configured tokenizer (``tokenizer.path``) leaves the model as configured.

    Returns a new JobConfig (`job` is not modified; it is returned as is when nothing changes)
    whose ``model.vocab_size`` is the fitted size and whose ``tokenizer.path`` is the trained
    tokenizer (run_dir/tokenizer), so that it loads and validates as it is. The caller trains,
    checkpoints and writes ``config.yaml`` from the returned config: the saved config is the
    trained one.
    """
    size = -(-tokenizer.vocab_size // tp) * tp
    if job.tokenizer.path or size >= job.model.vocab_size:
        return job
    log.info(
        "model.vocab_size %d -> %d: the trained tokenizer has %d tokens",
        job.model.vocab_size,
        size,
        tokenizer.vocab_size,
    )
    return dataclasses.replace(
        job,
        model=dataclasses.replace(job.model, vocab_size=size),
        tokenizer=dataclasses.replace(job.tokenizer, path=str(job.run_path / "tokenizer")),
    )


def hf_config_for(model: MoEModelConfig, tokenizer: Tokenizer, dtype: str) -> dict:
    """A Hugging Face ``config.json`` (Qwen3-MoE) for a model trained from scratch, so vLLM and
    transformers can load the exported weights.

    ``vocab_size`` is the tokenizer's size, not ``model.vocab_size``: the Megatron model may
    hold padding rows past the tokenizer (its vocabulary is rounded up to a multiple of TP),
    which the export drops (``split_to_hf`` keeps ``spec.vocab_size`` rows), so the engine can
    never sample an id the tokenizer cannot decode. The trainer masks the same rows out of its
    softmax (`mask_vocab_padding`).

    Raises ValueError for shapes Qwen3-MoE cannot express (shared experts, attention bias).
    """
    if model.shared_expert_intermediate_size or model.attention_bias or not model.qk_layernorm:
        raise ValueError(
            "exporting a from-scratch model writes a Qwen3-MoE config: set "
            "model.shared_expert_intermediate_size=0, model.attention_bias=false and "
            "model.qk_layernorm=true (or start from a converted HF checkpoint)"
        )
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": min(tokenizer.vocab_size, model.vocab_size),
        "hidden_size": model.hidden_size,
        "intermediate_size": model.intermediate_size or model.moe_intermediate_size,
        "num_hidden_layers": model.num_hidden_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_key_value_heads,
        "head_dim": model.head_dim,
        "num_experts": model.num_experts,
        "num_experts_per_tok": model.num_experts_per_tok,
        "moe_intermediate_size": model.moe_intermediate_size,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(model.mlp_only_layers),
        "norm_topk_prob": model.norm_topk_prob,
        "rope_theta": model.rope_theta,
        "rms_norm_eps": model.rms_norm_eps,
        "tie_word_embeddings": model.tie_word_embeddings,
        "max_position_embeddings": model.max_position_embeddings,
        "attention_bias": False,
        "hidden_act": "silu",
        "initializer_range": model.initializer_range,
        "router_aux_loss_coef": model.router_aux_loss_coef,
        "output_router_logits": False,
        "use_sliding_window": False,
        "bos_token_id": tokenizer.bos_id,
        "eos_token_id": tokenizer.eos_id,
        "pad_token_id": tokenizer.pad_id,
        "torch_dtype": {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype],
    }


def policy_hf_weights(
    policy: list[torch.nn.Module], spec: ConversionSpec, parallel: ParallelState
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream the policy's full weights under HF names (a collective over TP/EP groups).

    Yields on global rank 0 only (other ranks iterate to take part in the gathers and get
    nothing). With pipeline parallelism each stage's tensors are sent to rank 0 stage by stage.
    """
    chunk = policy[0]
    if parallel.cfg.pp == 1:
        for name, t in megatron_to_hf_tensors(chunk, spec):
            if parallel.rank == 0:
                yield name, t
        return
    stage_tensors = list(megatron_to_hf_tensors(chunk, spec))  # one stage: its own slice
    leader = parallel.tp_rank == 0 and parallel.dp_rank == 0 and parallel.ep_rank == 0
    gathered: list = [None] * parallel.cfg.pp if parallel.rank == 0 else None
    payload = stage_tensors if leader else None
    objs = [None] * dist.get_world_size()
    dist.all_gather_object(objs, (parallel.pp_rank, leader, payload))
    if parallel.rank == 0:
        for pp_rank, is_leader, tensors in objs:
            if is_leader:
                gathered[pp_rank] = tensors
        for tensors in gathered:
            yield from tensors


def export_policy_hf(
    policy: list[torch.nn.Module],
    spec: ConversionSpec,
    hf_config: dict,
    tokenizer: Tokenizer,
    parallel: ParallelState,
    out_dir: Path,
) -> None:
    """Write the policy as a Hugging Face checkpoint folder (config, safetensors, tokenizer).

    Collective; rank 0 writes atomically (temp folder, then rename; an existing folder is
    replaced).
    """
    weights = policy_hf_weights(policy, spec, parallel)
    if parallel.rank == 0:
        with atomic_output_dir(out_dir, overwrite=True) as tmp:
            write_sharded_safetensors(weights, tmp)
            (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
            save_tokenizer(tokenizer, str(tmp / "sao_tokenizer"))
    else:
        for _ in weights:
            pass
    barrier()


#: Logit written over the vocabulary-padding columns. Finite so that ``p * z`` stays 0 (not
#: ``0 * -inf = nan``) in the entropy, and low enough that ``exp((PAD_LOGIT - max_z) / T)``
#: underflows to exactly 0 in float32 (below exp(-104)) for any max real logit > -9000 and
#: temperature <= 80; representable in fp16/bf16.
PAD_LOGIT = -1.0e4


def mask_vocab_padding(
    chunks: list[torch.nn.Module], vocab_size: int, parallel: ParallelState
) -> int:
    """Keep the output layer's padding columns (token ids >= `vocab_size`) out of every softmax.

    Megatron's vocabulary is ``model.vocab_size`` rows, split over TP ranks (rank r holds ids
    ``[r * V/tp, (r + 1) * V/tp)``); ids past the tokenizer (``vocab_size``, the exported HF
    model's vocabulary) are padding the engine cannot sample. A forward hook on each chunk's
    ``output_layer`` (last pipeline stage only) sets those logit columns to `PAD_LOGIT`, so
    the SFT cross-entropy, the RL log-probs, the entropy and any top-p/top-k transform all see
    a distribution over exactly the engine's vocabulary: probability 0 (exactly, float32) and
    no gradient for the padding rows.

    Args:
        chunks: unwrapped policy chunks (`build_policy`).
        vocab_size: number of real token ids (<= ``model.vocab_size``).
    Returns:
        the number of padding ids (``model.vocab_size - vocab_size``; 0: nothing to mask). A
        hook is registered only on the TP ranks whose shard holds padding ids.
    """
    padding = 0
    for chunk in chunks:
        layer = getattr(chunk, "output_layer", None)
        total = getattr(chunk, "vocab_size", None)
        if layer is None or total is None or vocab_size >= total:
            continue
        padding = total - vocab_size
        per_rank = total // parallel.cfg.tp
        first = parallel.tp_rank * per_rank
        pad = torch.arange(first, first + per_rank) >= vocab_size  # [V/tp] bool
        if not bool(pad.any()):
            continue

        def hook(_module, _args, output, pad=pad):
            logits, bias = output  # ColumnParallelLinear: (logits [s, b, V/tp], bias)
            mask = pad.to(logits.device)
            return logits.masked_fill(mask, PAD_LOGIT), bias

        layer.register_forward_hook(hook)
    return padding


def build_policy_state(
    job: JobConfig, parallel: ParallelState, optim: OptimizerConfig, init_from=None
) -> TrainState:
    """Policy chunks + Megatron DDP/optimiser/LR schedule; weights copied from `init_from`
    (unwrapped chunks of the same layout) when given."""
    chunks = build_policy(job.model, parallel, job.precision)
    if init_from is not None:
        for new, old in zip(chunks, init_from, strict=True):
            new.load_state_dict(old.state_dict())
    return build_optimizer(chunks, parallel, optim, job.precision)


def build_value_state(
    job: JobConfig, parallel: ParallelState, policy_chunks: list[torch.nn.Module]
) -> TrainState:
    """Value model initialised from the policy's trunk, frozen per `value.freeze_patterns`."""
    chunks = build_value_model(job.model, parallel, job.precision, job.value.head_init_std)
    for v, p in zip(chunks, policy_chunks, strict=True):
        init_value_from_policy(v, p.state_dict())
    report = apply_freeze(chunks, job.value.freeze_patterns, group=parallel.pg_collection.pp)
    if parallel.rank == 0:
        log.info("value model: %s", report.summary())
    return build_optimizer(chunks, parallel, job.value_optim, job.precision)
