"""Run policy/value models over a padded batch with Megatron's pipeline schedules.

Micro-batching and pipeline parallelism go through ``get_forward_backward_func``; the last
pipeline stage turns logits into next-token log-probs/entropy (policy) or squeezes values
(value model) and hands them to a caller-supplied loss function.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from sao_megatron.models.logprobs import token_logprobs_and_entropy
from sao_megatron.parallel.state import ParallelState

LossFn = Callable[[dict[str, torch.Tensor], "ModelInputs"], tuple[torch.Tensor, dict]]
"""``loss_fn(outputs, micro_batch) -> (loss [] float32, metrics dict)``. ``outputs`` holds
``logprobs``/``entropy`` ``[b, T-1]`` (policy) or ``values`` ``[b, T]`` (value model);
``micro_batch`` is the micro-batch's ``ModelInputs`` (extras included) on the model's device."""


@dataclass
class ModelInputs:
    """A padded batch of token sequences (same on every TP/PP rank of one DP replica).

    Attributes:
        input_ids: [B, T] int64 token ids (padding ids are arbitrary).
        attention_mask: [B, T] bool/int, 1 on real tokens, 0 on padding (left or right).
        position_ids: [B, T] int64 or None (default: cumsum(attention_mask) - 1, clamped at
            0, so the first real token has position 0 as in the rollout engine).
        extras: per-sequence tensors [B, ...] (advantages, masks, ...) that are split into
            micro-batches with the batch and reach ``loss_fn``.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got {tuple(self.input_ids.shape)}")
        if self.attention_mask.shape != self.input_ids.shape:
            raise ValueError("attention_mask must have the shape of input_ids [B, T]")
        if self.position_ids is None:
            pos = self.attention_mask.long().cumsum(-1) - 1
            self.position_ids = pos.clamp(min=0)
        for k, v in self.extras.items():
            if v.shape[0] != self.input_ids.shape[0]:
                raise ValueError(f"extras[{k!r}] has batch size {v.shape[0]}, expected B")

    def slice(self, start: int, end: int) -> ModelInputs:
        """Rows ``start:end``."""
        return ModelInputs(
            input_ids=self.input_ids[start:end],
            attention_mask=self.attention_mask[start:end],
            position_ids=self.position_ids[start:end],
            extras={k: v[start:end] for k, v in self.extras.items()},
        )


def causal_padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Megatron attention mask [B, 1, T, T] bool, True = masked out: future keys and padding
    keys; every query keeps itself (so padding rows stay finite)."""
    t = attention_mask.shape[-1]
    future = torch.ones(t, t, dtype=torch.bool, device=attention_mask.device).triu(1)
    pad_key = ~attention_mask.bool()[:, None, None, :]
    mask = future[None, None] | pad_key
    eye = torch.eye(t, dtype=torch.bool, device=attention_mask.device)
    return mask & ~eye


def _pad_to_multiple(batch: ModelInputs, multiple: int) -> tuple[ModelInputs, int]:
    t = batch.input_ids.shape[1]
    extra = (-t) % multiple
    if not extra:
        return batch, t
    pad = functools.partial(torch.nn.functional.pad, pad=(0, extra))
    return (
        ModelInputs(
            input_ids=pad(batch.input_ids),
            attention_mask=pad(batch.attention_mask),
            position_ids=pad(batch.position_ids),
            extras=batch.extras,
        ),
        t,
    )


def split_micro_batches(
    batch: ModelInputs | Sequence[ModelInputs], micro_batch_size: int | None
) -> list[ModelInputs]:
    """`batch` as micro-batches: a `ModelInputs` is cut into consecutive slices of
    `micro_batch_size` rows (default: the whole batch), which must divide B; a sequence of
    `ModelInputs` is taken as the micro-batches themselves (already laid out, e.g. by
    `sao_megatron.data.micro_batches`), all of one shape, `micro_batch_size` None or their rows.

    Raises ValueError when the rows do not divide or the micro-batches differ in shape.
    """
    if isinstance(batch, ModelInputs):
        bsz = batch.input_ids.shape[0]
        mbs = micro_batch_size or bsz
        if bsz % mbs:
            raise ValueError(f"batch size {bsz} is not divisible by micro_batch_size={mbs}")
        return [batch.slice(i, i + mbs) for i in range(0, bsz, mbs)]
    micro_batches = list(batch)
    shapes = {tuple(mb.input_ids.shape) for mb in micro_batches}
    if len(shapes) != 1:
        raise ValueError(f"micro-batches must share one [b, T] shape, got {sorted(shapes)}")
    (shape,) = shapes
    if micro_batch_size not in (None, shape[0]):
        raise ValueError(
            f"micro_batch_size={micro_batch_size} does not match the micro-batches' {shape[0]} rows"
        )
    return micro_batches


def forward_backward(
    model: Sequence[torch.nn.Module],
    parallel: ParallelState,
    batch: ModelInputs | Sequence[ModelInputs],
    *,
    kind: str,
    loss_fn: LossFn | None = None,
    micro_batch_size: int | None = None,
    temperature: float = 1.0,
    forward_only: bool = False,
    top_p: float = 1.0,
    top_k: int = 0,
) -> list[dict[str, torch.Tensor]]:
    """Forward (and backward unless ``forward_only``) over ``batch`` in micro-batches
    (`split_micro_batches`: a `ModelInputs`, or its micro-batches).

    Gradient convention ("global sum"): the accumulated gradient is that of the SUM of the
    ``loss_fn`` values over all micro-batches and all data-parallel ranks (Megatron's division
    by the number of micro-batches and its DP averaging are undone). So a token-mean loss over
    the global batch is ``loss_fn = sum_tokens(...) / N_global``.

    Args:
        model: model chunks from ``build_policy``/``build_value_model`` (optionally wrapped in
            Megatron DDP by ``build_optimizer``).
        kind: ``"policy"`` or ``"value"``.
        loss_fn: see ``LossFn``; None = outputs only (then ``forward_only`` must be True).
        micro_batch_size: rows per micro-batch (default: the whole batch, or the given
            micro-batches'); must divide B.
        temperature, top_p, top_k: the engine's sampling settings for policy log-probs and
            entropies (see ``token_logprobs_and_entropy``; top_p=1, top_k=0: off).

    Returns:
        On the last pipeline stage, one dict per micro-batch with the detached outputs
        (``logprobs``, ``entropy`` [b, T-1] or ``values`` [b, T]; float32), ``loss`` and the
        ``loss_fn`` metrics; on other stages an empty list.

    Attention: on CPU (local specs) the explicit causal+padding mask supports left and right
    padding; with Transformer Engine specs (GPU) only the causal mask is applied, so batches must
    be right-padded (checked).

    Raises:
        ValueError: unknown kind, B not divisible by micro_batch_size, loss_fn missing,
            left padding with TE specs.
    """
    if kind not in ("policy", "value"):
        raise ValueError(f"kind={kind!r}: must be 'policy' or 'value'")
    if loss_fn is None and not forward_only:
        raise ValueError("loss_fn is required unless forward_only=True")
    unpadded = split_micro_batches(batch, micro_batch_size)
    num_mb, (mbs, seq_len) = len(unpadded), tuple(unpadded[0].input_ids.shape)
    if parallel.platform.use_te:
        am = torch.cat([mb.attention_mask for mb in unpadded]).bool()
        later_token = am.flip(-1).cummax(-1).values.flip(-1)  # a real token at or after t
        if bool((later_token & ~am).any()):
            raise ValueError(
                "padding before real tokens (left/middle padding) is not supported with the "
                "Transformer Engine specs: TE attention applies the causal mask only. "
                "Right-pad the batch."
            )
    tp = parallel.cfg.tp if parallel.cfg.sequence_parallel else 1
    micro_batches = [_pad_to_multiple(mb, tp)[0] for mb in unpadded]
    device = parallel.platform.device
    scale = float(num_mb * parallel.dp)

    def loss_func(mb: ModelInputs, output: torch.Tensor):
        if kind == "policy":
            logits = output[:, : seq_len - 1]
            targets = mb.input_ids[:, 1:seq_len].to(device)
            lp, ent = token_logprobs_and_entropy(
                logits,
                targets,
                temperature,
                tp_group=parallel.pg_collection.tp,
                top_p=top_p,
                top_k=top_k,
            )
            outputs = {"logprobs": lp, "entropy": ent}
        else:
            outputs = {"values": output[:, :seq_len, 0].float()}
        trimmed = ModelInputs(  # unpadded, on the model's device
            input_ids=mb.input_ids[:, :seq_len].to(device),
            attention_mask=mb.attention_mask[:, :seq_len].to(device),
            position_ids=mb.position_ids[:, :seq_len].to(device),
            extras={k: v.to(device) for k, v in mb.extras.items()},
        )
        if loss_fn is None:
            loss, metrics = outputs[next(iter(outputs))].sum() * 0.0, {}
        else:
            loss, metrics = loss_fn(outputs, trimmed)
        record = {k: v.detach() for k, v in outputs.items()}
        record.update({k: (v.detach() if torch.is_tensor(v) else v) for k, v in metrics.items()})
        record["loss"] = loss.detach()
        return loss * scale, record

    def forward_step(data_iterator, chunk):
        mb = next(data_iterator)
        out = chunk(
            mb.input_ids.to(device),
            mb.position_ids.to(device),
            causal_padding_mask(mb.attention_mask).to(device),
        )
        return out, functools.partial(loss_func, mb)

    num_chunks = len(model)
    iterators = [iter(micro_batches) for _ in range(num_chunks)]
    fb = get_forward_backward_func()
    ctx = torch.no_grad() if forward_only else torch.enable_grad()
    with ctx:
        out = fb(
            forward_step_func=forward_step,
            data_iterator=iterators if num_chunks > 1 else iterators[0],
            model=list(model),
            num_microbatches=num_mb,
            seq_length=micro_batches[0].input_ids.shape[1],
            micro_batch_size=mbs,
            forward_only=forward_only,
        )
    return list(out) if out else []


def _gather_outputs(
    records: list[dict[str, torch.Tensor]],
    key: str,
    parallel: ParallelState,
    shape: tuple[int, int],
    broadcast: bool,
) -> torch.Tensor | None:
    result = torch.cat([r[key] for r in records]) if records else None
    if not broadcast or parallel.cfg.pp == 1:
        return result
    pp_group = parallel.pg_collection.pp
    src = torch.distributed.get_global_rank(pp_group, parallel.cfg.pp - 1)
    if result is None:
        result = torch.empty(shape, dtype=torch.float32, device=parallel.platform.device)
    torch.distributed.broadcast(result, src=src, group=pp_group)
    return result


def compute_policy_logprobs(
    model: Sequence[torch.nn.Module],
    parallel: ParallelState,
    batch: ModelInputs | Sequence[ModelInputs],
    temperature: float = 1.0,
    micro_batch_size: int | None = None,
    broadcast: bool = True,
    top_p: float = 1.0,
    top_k: int = 0,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Log-probs and entropy of each next token, no gradient (`batch`: a `ModelInputs` or
    its micro-batches, as for `forward_backward`; B rows in all).

    ``logprobs[b, t] = log pi(input_ids[b, t+1] | input_ids[b, :t+1])`` (temperature, top-k and
    top-p applied as in vLLM). Positions whose target is padding hold garbage; mask them.

    Returns:
        (logprobs [B, T-1] float32, entropy [B, T-1] float32); on non-last pipeline stages
        (None, None) unless ``broadcast`` (then every PP rank gets them).
    """
    records = forward_backward(
        model,
        parallel,
        batch,
        kind="policy",
        micro_batch_size=micro_batch_size,
        temperature=temperature,
        forward_only=True,
        top_p=top_p,
        top_k=top_k,
    )
    b, t = _rows_and_length(batch)
    return (
        _gather_outputs(records, "logprobs", parallel, (b, t - 1), broadcast),
        _gather_outputs(records, "entropy", parallel, (b, t - 1), broadcast),
    )


def compute_values(
    model: Sequence[torch.nn.Module],
    parallel: ParallelState,
    batch: ModelInputs | Sequence[ModelInputs],
    micro_batch_size: int | None = None,
    broadcast: bool = True,
) -> torch.Tensor | None:
    """Values ``V[b, t]`` (state after reading tokens ``0..t``), no gradient (`batch`: a
    `ModelInputs` or its micro-batches, as for `forward_backward`; B rows in all).

    Returns:
        values [B, T] float32; on non-last pipeline stages None unless ``broadcast``.
    """
    records = forward_backward(
        model,
        parallel,
        batch,
        kind="value",
        micro_batch_size=micro_batch_size,
        forward_only=True,
    )
    return _gather_outputs(records, "values", parallel, _rows_and_length(batch), broadcast)


def _rows_and_length(batch: ModelInputs | Sequence[ModelInputs]) -> tuple[int, int]:
    """(B, T) of a batch or of its micro-batches together."""
    if isinstance(batch, ModelInputs):
        return tuple(batch.input_ids.shape)
    return sum(mb.input_ids.shape[0] for mb in batch), batch[0].input_ids.shape[1]
