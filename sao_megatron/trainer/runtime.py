"""Build what a job trains from its config: tokenizer, models, optimisers, HF weight export.

Kept apart from the controller so the loop reads top to bottom without construction details.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from sao_megatron.convert.hf_io import (
    HFCheckpointReader,
    read_hf_config,
)
from sao_megatron.convert.model_io import load_hf_into_model
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
    """The HF ``config.json`` of a from-scratch model (`MoEModelConfig.to_hf_config`) with the
    tokenizer's special ids and the ``precision.params_dtype`` name (fp32/bf16/fp16).

    ``vocab_size`` is the tokenizer's size, not ``model.vocab_size``: the Megatron model may
    hold padding rows past the tokenizer (its vocabulary is rounded up to a multiple of TP),
    which the export drops (``split_to_hf`` keeps ``spec.vocab_size`` rows), so the engine can
    never sample an id the tokenizer cannot decode. The trainer masks the same rows out of its
    softmax (`mask_vocab_padding`).
    """
    hf = model.to_hf_config(
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id,
        torch_dtype=_HF_DTYPE[dtype],
    )
    return hf | {"vocab_size": min(tokenizer.vocab_size, model.vocab_size)}


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
