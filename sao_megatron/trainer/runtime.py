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

from sao_megatron.convert.hf_io import (
    HFCheckpointReader,
    atomic_output_dir,
    read_hf_config,
    write_sharded_safetensors,
)
from sao_megatron.convert.model_io import load_hf_into_model, megatron_to_hf_tensors
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


_HF_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def job_hf_config(job: JobConfig, tokenizer: Tokenizer) -> dict:
    """The ``config.json`` the exported policy (and so the rollout engines) uses: the HF model's
    own (its ``torch_dtype`` set to the training dtype) when the job starts from one
    (``init_from_hf``), else the Qwen3-MoE config of `hf_config_for`."""
    dtype = job.precision.params_dtype
    if job.init_from_hf is None:
        return hf_config_for(job.model, tokenizer, dtype)
    hf = read_hf_config(job.init_from_hf)
    hf.pop("dtype", None)
    return hf | {"torch_dtype": _HF_DTYPE[dtype]}


@torch.no_grad()
def init_policy_from_hf(chunks: list[torch.nn.Module], hf_dir: str, spec: ConversionSpec) -> None:
    """Copy the HF weights of `hf_dir` into this rank's policy chunks, in place.

    The converter's loader (`load_hf_into_model`, as ``sao-convert hf-to-megatron``): each rank
    reads only its own shards (TP slices, its pipeline stage's layers, its EP rank's experts),
    one tensor at a time; a tied output layer gets the embedding. Call before the optimiser is
    built (it copies the parameters into its fp32 main weights).

    Raises:
        ValueError: HF tensors missing/unexpected or shapes that do not match the model.
    """
    with HFCheckpointReader(hf_dir) as reader:
        for chunk in chunks:
            load_hf_into_model(chunk, reader, spec)


def hf_config_for(model: MoEModelConfig, tokenizer: Tokenizer, dtype: str) -> dict:
    """A Hugging Face ``config.json`` (Qwen3-MoE) for a model trained from scratch, so vLLM and
    transformers can load the exported weights.

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
        "vocab_size": model.vocab_size,
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
        "torch_dtype": _HF_DTYPE[dtype],
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


def build_policy_state(
    job: JobConfig, parallel: ParallelState, optim: OptimizerConfig, init_from=None
) -> TrainState:
    """Policy chunks + Megatron DDP/optimiser/LR schedule; weights copied from `init_from`
    (unwrapped chunks of the same layout) when given, else from the HF model of
    ``job.init_from_hf`` when set (`init_policy_from_hf`), else the random init."""
    chunks = build_policy(job.model, parallel, job.precision)
    if init_from is not None:
        for new, old in zip(chunks, init_from, strict=True):
            new.load_state_dict(old.state_dict())
    elif job.init_from_hf is not None:
        hf_config = read_hf_config(job.init_from_hf)
        init_policy_from_hf(chunks, job.init_from_hf, ConversionSpec.from_hf_config(hf_config))
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
