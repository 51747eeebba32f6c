"""Build the policy (Megatron ``GPTModel``) and the value model (same trunk, scalar head)."""

from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel

from sao_megatron.models.config import MoEModelConfig
from sao_megatron.models.init import init_layout_independent
from sao_megatron.models.specs import build_block_spec
from sao_megatron.models.transformer_config import build_transformer_config
from sao_megatron.models.value_head import ValueHead
from sao_megatron.optim.config import PrecisionConfig
from sao_megatron.parallel.state import ParallelState


class ValueGPTModel(GPTModel):
    """Megatron ``GPTModel`` whose last pipeline stage ends in a ``ValueHead`` instead of the
    vocabulary output layer; ``forward`` returns values ``[b, s, 1]`` there (and hidden states on
    other stages, as GPTModel). Embeddings are never tied to an output layer."""

    def __init__(
        self, *args, value_head_init_std: float = 0.02, value_head_seed: int = 0, **kwargs
    ) -> None:
        kwargs["share_embeddings_and_output_weights"] = False
        super().__init__(*args, **kwargs)
        if self.post_process:
            self.output_layer = ValueHead(self.config, value_head_init_std, value_head_seed)


def _build(
    cls: type,
    model: MoEModelConfig,
    parallel: ParallelState,
    precision: PrecisionConfig | None,
    **extra,
) -> list[GPTModel]:
    precision = precision or PrecisionConfig()
    precision.check_platform(parallel.platform.is_cuda, parallel.platform.use_te)
    config = build_transformer_config(
        model,
        parallel.cfg,
        precision,
        use_cuda=parallel.platform.is_cuda,
        use_te=parallel.platform.use_te,
    )
    num_chunks = parallel.cfg.virtual_pp or 1
    chunks = []
    for i in range(num_chunks):
        vp_stage = i if parallel.cfg.virtual_pp else None
        pre, post = parallel.pre_post_process(vp_stage)
        chunk = cls(
            config=config,
            transformer_layer_spec=build_block_spec(config, parallel.platform.use_te, vp_stage),
            vocab_size=model.vocab_size,
            max_sequence_length=model.max_position_embeddings,
            pre_process=pre,
            post_process=post,
            parallel_output=True,
            position_embedding_type="rope",
            rotary_base=model.rope_theta,
            pg_collection=parallel.pg_collection,
            vp_stage=vp_stage,
            **extra,
        )
        if parallel.platform.is_cuda:
            chunk.cuda(torch.cuda.current_device())
        else:
            init_layout_independent(chunk, config, parallel.cfg.seed, **parallel.shard_coords())
        chunks.append(chunk)
    return chunks


def build_policy(
    model: MoEModelConfig,
    parallel: ParallelState,
    precision: PrecisionConfig | None = None,
) -> list[GPTModel]:
    """Policy: Megatron ``GPTModel`` with MoE layers (RMSNorm, RoPE, SwiGLU experts, router).

    TE specs on CUDA (when TE is importable), Megatron local specs on CPU. Each chunk holds this
    rank's layers for one (virtual) pipeline stage; the first stage has the embedding, the last
    the output layer, whose forward returns vocab-parallel logits ``[b, s, vocab/tp]``.

    Returns:
        The model chunks (length ``parallel.cfg.virtual_pp or 1``), params in
        ``precision.params_dtype``. Init is seeded by ``parallel.cfg.seed``: on CPU
        layout-independent (``sao_megatron.models.init``: any TP/EP/PP layout gets the slices of
        the same 1-rank model), on GPU Megatron's own init with its RNG tracker.

    Raises:
        ValueError: model and layout incompatible (field named), fp8 without CUDA/TE.
    """
    return _build(
        GPTModel,
        model,
        parallel,
        precision,
        share_embeddings_and_output_weights=model.tie_word_embeddings,
    )


def build_value_model(
    model: MoEModelConfig,
    parallel: ParallelState,
    precision: PrecisionConfig | None = None,
    value_head_init_std: float = 0.02,
) -> list[ValueGPTModel]:
    """Value model: the policy's trunk with a scalar ``ValueHead`` on the last pipeline stage.

    The last stage's forward returns values ``[b, s, 1]`` (one per position: V of the state
    after reading tokens ``0..t``). Initialise the trunk from policy weights with
    ``init_value_from_policy``. Same errors as ``build_policy``.
    """
    return _build(
        ValueGPTModel,
        model,
        parallel,
        precision,
        value_head_init_std=value_head_init_std,
        value_head_seed=parallel.cfg.seed,
    )
