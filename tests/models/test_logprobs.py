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


def _reference_keep(z64: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """Float64 nucleus/top-k set written from the definition, independently of the code: top-k
    keeps values >= the k-th largest; top-p then keeps, in descending probability order of the
    top-k-renormalised distribution, every token whose strictly-more-likely mass is < p."""
    keep = torch.ones_like(z64, dtype=torch.bool)
    if top_k:
        kth = z64.topk(top_k, dim=-1).values[..., -1:]
        keep &= z64 >= kth
    if top_p < 1:
        q = torch.softmax(z64.masked_fill(~keep, float("-inf")), dim=-1)
        order = q.argsort(dim=-1, descending=True)
        qs = q.gather(-1, order)
        before = qs.cumsum(-1) - qs  # mass of the strictly more likely tokens
        keep_sorted = before < top_p
        keep = keep & torch.zeros_like(keep).scatter(-1, order, keep_sorted)
    return keep


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k"),
    [(1.0, 0.7, 0), (0.6, 0.9, 0), (1.3, 0.3, 0), (1.0, 1.0, 5), (0.8, 0.8, 12), (1.0, 0.05, 0)],
)
def test_top_p_top_k_logprobs_entropy_and_grads_match_float64(
    parallel_1rank, temperature, top_p, top_k
):
    """Issue 19.2: log pi and H of softmax(z / T) restricted to vLLM's kept set and
    renormalised, against a float64 reference; gradients too."""
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(4, 6, 64, generator=g) * 3).requires_grad_()
    x = logits.detach().double().requires_grad_()
    keep = _reference_keep(x.detach() / temperature, top_p, top_k)
    assert keep.sum(-1).min() >= 1 and (~keep).any()  # the truncation is active
    # targets drawn from the kept set (what the engine can sample)
    probs = torch.softmax((x.detach() / temperature).masked_fill(~keep, float("-inf")), -1)
    target = torch.multinomial(probs.reshape(-1, 64), 1, generator=g).reshape(4, 6)

    lp, ent = token_logprobs_and_entropy(logits, target, temperature, top_p=top_p, top_k=top_k)
    logp = torch.log_softmax((x / temperature).masked_fill(~keep, float("-inf")), dim=-1)
    ref_lp = logp.gather(-1, target[..., None])[..., 0]
    kept_logp = torch.where(keep, logp, 0.0)  # (where() on 0 * -inf would give NaN gradients)
    ref_ent = -(torch.where(keep, kept_logp.exp(), 0.0) * kept_logp).sum(-1)
    torch.testing.assert_close(lp.double(), ref_lp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent.detach(), rtol=1e-5, atol=1e-5)
    full = torch.log_softmax(x.detach() / temperature, -1).gather(-1, target[..., None])[..., 0]
    assert (ref_lp.detach() > full + 1e-6).all()  # renormalisation raises every log-prob

    w = torch.randn(4, 6, generator=g)
    (w * lp + 0.3 * w * ent).sum().backward()
    (w.double() * ref_lp + 0.3 * w.double() * ref_ent).sum().backward()
    assert torch.isfinite(logits.grad).all()
    torch.testing.assert_close(logits.grad.double(), x.grad, rtol=1e-4, atol=1e-6)


def test_truncation_mask_keeps_ties_at_the_boundary_and_the_top_token():
    from sao_megatron.models.logprobs import truncation_mask

    # probs ~ [0.4, 0.2, 0.2, 0.2]: top_p=0.5 keeps the 0.4 and at least one 0.2; vLLM's
    # unstable sort picks one of the tied ones, we keep all three (a superset).
    z = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.2]]))
    assert truncation_mask(z, top_p=0.5).tolist() == [[True, True, True, True]]
    assert truncation_mask(z, top_p=0.3).tolist() == [[True, False, False, False]]
    # top-k: ties with the k-th value stay, as in vLLM (values < threshold are dropped)
    assert truncation_mask(z, top_k=2).tolist() == [[True, True, True, True]]
    assert truncation_mask(z, top_k=1).tolist() == [[True, False, False, False]]
    # a tiny top_p keeps exactly the most likely token
    z = torch.tensor([[0.0, 3.0, 1.0]])
    assert truncation_mask(z, top_p=1e-6).tolist() == [[False, True, False]]
    assert truncation_mask(z, top_p=1.0, top_k=0).all()


def test_top_p_errors(parallel_1rank):
    x, t = torch.zeros(2, 4), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="top_p=0"):
        token_logprobs_and_entropy(x, t, top_p=0.0)
    with pytest.raises(ValueError, match="top_k=-1"):
        token_logprobs_and_entropy(x, t, top_k=-1)


def _tp2_worker(rank: int, world_size: int, out_dir: str) -> None:
    """TP=2: each rank holds half the vocabulary; top-p/top-k results and the gradient of each
    shard must equal the 1-rank computation on the full logits."""
    from sao_megatron.parallel import ParallelConfig, destroy_parallel, initialize_parallel

    state = initialize_parallel(ParallelConfig(tp=2))
    g = torch.Generator().manual_seed(7)
    full = torch.randn(3, 5, 64, generator=g) * 3
    target = torch.randint(0, 64, (3, 5), generator=g)
    w = torch.randn(3, 5, generator=g)
    shard = full[..., rank * 32 : (rank + 1) * 32].clone().requires_grad_()
    for top_p, top_k in [(0.8, 0), (1.0, 10), (0.9, 20), (1.0, 0)]:
        shard.grad = None
        lp, ent = token_logprobs_and_entropy(
            shard, target, 0.9, tp_group=state.pg_collection.tp, top_p=top_p, top_k=top_k
        )
        (w * lp.clamp(min=-50) + 0.3 * w * ent).sum().backward()
        ref = full.clone().requires_grad_()
        rlp, rent = _single_rank(ref, target, top_p, top_k)
        (w * rlp.clamp(min=-50) + 0.3 * w * rent).sum().backward()
        # truncated: the gathered logits go through the 1-rank code, bit for bit; untruncated:
        # the vocab-parallel reductions sum in another order than a full log_softmax
        tol = 0.0 if (top_p < 1 or top_k) else 1e-5
        torch.testing.assert_close(lp, rlp, rtol=0, atol=tol)
        torch.testing.assert_close(ent, rent, rtol=0, atol=tol)
        grad = ref.grad[..., rank * 32 : (rank + 1) * 32]
        torch.testing.assert_close(shard.grad, grad, rtol=0, atol=max(tol, 1e-7))
    destroy_parallel()
    open(f"{out_dir}/ok{rank}", "w").close()


def _single_rank(logits, target, top_p, top_k):
    """The 1-rank formula (no process group) on the full vocabulary."""
    from sao_megatron.models.logprobs import _truncated_logprobs_and_entropy

    z = logits.float() / 0.9
    if top_p < 1 or top_k > 0:
        return _truncated_logprobs_and_entropy(z, target, top_p, top_k)
    logp = torch.log_softmax(z, -1)
    return logp.gather(-1, target[..., None])[..., 0], -(logp.exp() * logp).sum(-1)


def test_top_p_under_tensor_parallel_equals_one_rank(tmp_path):
    from tests.conftest import launch

    launch(_tp2_worker, 2, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok0", "ok1"]
