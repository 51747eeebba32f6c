"""Token log-probs and entropy from vocab-parallel logits, with vLLM's temperature semantics."""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region


def _all_reduce_max(x: torch.Tensor, group) -> torch.Tensor:
    if group is not None and group.size() > 1:
        torch.distributed.all_reduce(x, op=torch.distributed.ReduceOp.MAX, group=group)
    return x


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    temperature: float = 1.0,
    tp_group: torch.distributed.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(target | context) and the entropy of pi, per position, from vocab-parallel logits.

    Temperature as vLLM applies it when sampling: ``z = logits.float() / temperature`` and
    ``pi = softmax(z)`` in float32 (vLLM ``Sampler``: logits to fp32, ``div_(temperature)``;
    its ``processed_logprobs`` mode returns ``log_softmax(z)``). Then

        log pi(y) = z_y - logZ,  logZ = m + log sum_v exp(z_v - m),  m = max_v z_v
        H(pi)     = logZ - sum_v pi_v z_v

    with the max, the sum of exponentials and sum_v pi_v z_v all-reduced over the TP group
    (Megatron's ``vocab_parallel_cross_entropy`` gives ``logZ - z_y``). Differentiable w.r.t.
    ``logits``; the TP reductions pass gradients through unchanged (each rank holds a partial
    sum), so the result is correct when the downstream loss is identical on all TP ranks.

    Args:
        logits: [..., vocab/tp] logits of this rank's vocabulary shard (any float dtype).
        target_ids: [...] int64 token ids in the full vocabulary.
        temperature: > 0, the sampling temperature of the rollout engine.
        tp_group: Megatron's tensor-parallel group (default: this rank's, from
            ``initialize_parallel``); Megatron's vocab-parallel cross entropy always uses it.

    Returns:
        (logprobs [...] float32, entropy [...] float32)

    Raises:
        ValueError: temperature <= 0 or shape mismatch.
    """
    if not temperature > 0:
        raise ValueError(
            f"temperature={temperature}: must be > 0 (greedy decoding has no log-probs; use 1.0)"
        )
    if logits.shape[:-1] != target_ids.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and target_ids {tuple(target_ids.shape)} disagree: "
            "expected logits [..., vocab/tp] and target_ids [...]"
        )
    if tp_group is None:
        from sao_megatron.parallel.state import tensor_parallel_group

        tp_group = tensor_parallel_group()
    z = logits.float() / temperature
    # Megatron's CE subtracts the max in place, so it gets its own copy.
    logprobs = -tensor_parallel.vocab_parallel_cross_entropy(z.clone(), target_ids)

    m = _all_reduce_max(z.detach().max(dim=-1, keepdim=True)[0], tp_group)
    e = torch.exp(z - m)
    sum_e = reduce_from_tensor_model_parallel_region(e.sum(dim=-1, keepdim=True), tp_group)
    sum_ez = reduce_from_tensor_model_parallel_region((e * z).sum(dim=-1, keepdim=True), tp_group)
    log_z = m + torch.log(sum_e)
    entropy = (log_z - sum_ez / sum_e).squeeze(-1)
    return logprobs, entropy
