"""Helpers of the real-model conversion tests: HF folder -> 1-rank Megatron policy, logits."""

from __future__ import annotations

from pathlib import Path

import torch


def megatron_policy(hf_dir: Path, state):
    """Build the 1-rank (or ``state``-layout) policy for ``hf_dir`` and load its HF weights."""
    from sao_megatron.convert.hf_io import HFCheckpointReader, read_hf_config
    from sao_megatron.convert.model_config import model_config_from_hf
    from sao_megatron.convert.model_io import load_hf_into_model
    from sao_megatron.convert.spec import ConversionSpec
    from sao_megatron.models import build_policy

    config = read_hf_config(hf_dir)
    spec = ConversionSpec.from_hf_config(config)
    (model,) = build_policy(model_config_from_hf(config), state)
    with HFCheckpointReader(hf_dir) as reader:
        load_hf_into_model(model, reader, spec)
    return model.eval(), spec


def megatron_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """[b, s] int64 ids -> [b, s, vocab] fp32 logits of a 1-rank Megatron GPTModel."""
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        return model(ids, pos, attention_mask=None)


def hf_logits(hf_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    """[b, s] ids -> [b, s, vocab] fp32 logits of the transformers model in ``hf_dir``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits
