"""Vocabulary padding at TP=2 (issue: the engine sampled the pad id of a 416-row export).

The shipped example (`examples/configs/multirank_tp2_ep2.yaml`, 2 gloo ranks) with a 415-token
tokenizer: Megatron holds 416 rows, the HF export and its config have 415, and the trainer's
probabilities sum to 1 over the 415 real ids (float64 sum of exp(log-prob) of every id).
"""

from __future__ import annotations

import torch

from tests.conftest import launch
from tests.trainer import vocab_pad_worker


def test_export_and_softmax_exclude_vocab_padding_at_tp2(tmp_path):
    launch(vocab_pad_worker.worker, 2, str(tmp_path))
    r = torch.load(tmp_path / "result.pt")
    assert r["model_vocab"] == 416  # rounded up to a multiple of TP for Megatron
    assert r["hf_vocab"] == 415
    assert r["rows"] == {"model.embed_tokens.weight": 415, "lm_head.weight": 415}
    assert r["masked_ids"] == 1
    # without the mask the padding row takes probability mass (the bug): sum < 1
    assert float((1.0 - r["unmasked_sum"]).abs().min()) > 1e-4
    assert float((r["masked_sum"] - 1.0).abs().max()) < 1e-5
    assert r["unmasked_entropy_err"] > 1e-5
    assert r["masked_entropy_err"] < 1e-4
    assert torch.equal(r["pad_logits"], torch.full_like(r["pad_logits"], -1.0e4))
