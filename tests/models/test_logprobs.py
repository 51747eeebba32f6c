"""token_logprobs_and_entropy vs float64 log_softmax (temperature as vLLM: logits / T)."""

from __future__ import annotations

import pytest
import torch

from sao_megatron.models import token_logprobs_and_entropy


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_logprobs_entropy_and_grads_match_float64(parallel_1rank, temperature):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 50, generator=g) * 4).requires_grad_()
    target = torch.randint(0, 50, (3, 5), generator=g)
    lp, ent = token_logprobs_and_entropy(logits, target, temperature)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (3, 5)

    x = logits.detach().double().requires_grad_()
    logp = torch.log_softmax(x / temperature, dim=-1)
    ref_lp = logp.gather(-1, target[..., None])[..., 0]
    ref_ent = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(lp.double(), ref_lp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent.detach(), rtol=1e-5, atol=1e-5)

    w = torch.randn(3, 5, generator=g)
    (w * lp + 0.3 * w * ent).sum().backward()
    (w.double() * ref_lp + 0.3 * w.double() * ref_ent).sum().backward()
    torch.testing.assert_close(logits.grad.double(), x.grad, rtol=1e-4, atol=1e-6)


def test_bf16_logits_are_upcast(parallel_1rank):
    logits = torch.randn(4, 32).bfloat16()
    target = torch.arange(4)
    lp, _ = token_logprobs_and_entropy(logits, target, 1.0)
    ref = torch.log_softmax(logits.double(), -1).gather(-1, target[:, None])[:, 0]
    torch.testing.assert_close(lp.double(), ref, rtol=1e-5, atol=1e-5)


def test_errors(parallel_1rank):
    with pytest.raises(ValueError, match="temperature=0"):
        token_logprobs_and_entropy(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), 0.0)
    with pytest.raises(ValueError, match="disagree"):
        token_logprobs_and_entropy(torch.zeros(2, 4), torch.zeros(3, dtype=torch.long))
