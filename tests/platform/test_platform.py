"""Platform selection from torch.cuda.is_available() and Transformer Engine importability."""

from __future__ import annotations

import torch

from sao_megatron.platform import detect_platform, transformer_engine_available


def test_cpu_platform_uses_gloo_and_local_specs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    p = detect_platform()
    assert (p.device.type, p.backend, p.use_te, p.is_cuda) == ("cpu", "gloo", False, False)


def test_cuda_platform_uses_nccl_and_te_when_importable(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    p = detect_platform(local_rank=3)
    assert p.device == torch.device("cuda", 3) and p.backend == "nccl"
    assert p.use_te == transformer_engine_available()
