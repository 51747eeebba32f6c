"""Rollout routing replay (R3): the policy forward routes each token to the experts the engine
chose, through Megatron-Core's router-replay hook.

Why: the engine and the trainer compute the router logits with different kernels (and often in
different precisions), so near-tied experts flip; a flipped top-k decision changes the token's
FFN output and every later token's attention input, and with it the log-prob the importance
ratio compares (Megatron-LM issue 4168; "rollout routing replay", R3). Replaying the engine's
choice removes that source of train/inference mismatch while the *gate weights* stay the
trainer's own, so the router still learns:

    idx_t   = recorded top-k experts of token t (the engine's)        [k] int
    w_t     = softmax(logits_t[idx_t])      (norm_topk_prob, Qwen3)   [k], with gradient
            = softmax(logits_t)[idx_t]      (pre-softmax routers)
    y_t     = sum_j w_tj * expert_{idx_tj}(x_t)

Mechanism (megatron-core 0.16.1, ``transformer/moe/router_replay.py`` and ``moe_utils.
topk_routing_with_score_function``): every ``TopKRouter`` passes its ``router_replay`` object
to the top-k selection, which calls ``router_replay.get_replay_topk(scores, topk, ...,
default_compute_topk)``; in ``REPLAY_FORWARD`` Megatron's `RouterReplay` returns the target
indices and ``scores.gather(1, idx)`` as the gate scores. We use that hook and that action, with
a subclass, `LayerRoutingReplay`, for three things the upstream class does not do:

1. **Per-token fallback.** The engine never forwards a sequence's last sampled token and the
   trainer's batch has padding: those positions have no recorded row (``routing_mask`` False)
   and route as usual. Neither can change a trained log-prob (causal attention: nothing before
   them reads them).
2. **Per-model addressing.** Upstream keeps one process-global list of instances filled in
   construction order and ``set_replay_data`` takes one tensor per instance; the policy and
   the value model, pipeline stages and virtual chunks would then share one ambiguous order.
   `RoutingReplay` installs its own instance on each router of the given model chunks and
   addresses it by the router's global ``layer_number`` (pipeline offsets included).
3. **Mismatch counting.** In the same forward it compares the trainer's own top-k (computed
   from the same scores) with the recorded one, per (token, layer), for the
   ``deviation/routing_mismatch_frac`` metric — also with replay off (``mode="observe"``),
   where routing is unchanged.

Parallel layouts: the router sees this rank's tokens of one micro-batch, flattened from
``[s, b]`` (sequence-major) — with sequence parallelism (TP > 1 with MoE) the TP rank's slice
of the sequence. `RoutingReplay.session` hooks each model chunk's forward (pre-hook) and hands
its routers the rows of the micro-batch that chunk is about to run: Megatron's schedules (no
pipelining, 1F1B, interleaved) run each chunk's micro-batches in order 0, 1, 2, ..., and the
hook checks the token ids it is given against the micro-batch it expects. Expert parallelism
needs nothing: routing happens before the token dispatch, on global expert indices. Data
parallelism: each DP rank replays its own rows. Activation recomputation re-running the
router (Megatron's ``REPLAY_BACKWARD``) is not supported (the trainer does not recompute).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence

import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction


class LayerRoutingReplay(RouterReplay):
    """Megatron's `RouterReplay` for one router, with a per-token fallback and mismatch counts.

    Not registered in ``RouterReplay.global_router_replay_instances`` (see module docstring).

    Attributes:
        layer_index: 0-based global decoder layer (column of ``routed_experts``).
        target_topk_idx: [n, k] int64 recorded experts of the n tokens the router will see.
        target_valid: [n] bool, where a row was recorded (elsewhere: route as usual).
        count_tokens: whether this rank counts mismatches (False on TP ranks > 0 without
            sequence parallelism, which see the same tokens as TP rank 0).
        num_compared, num_mismatched: (token, layer) decisions compared / differing so far.
    """

    def __init__(self, layer_index: int, count_tokens: bool = True) -> None:
        # RouterReplay.__init__ would append self to the process-global instance list
        self.target_topk_idx = None
        self.recorded_topk_idx = None
        self.router_replay_action = None
        self.replay_backward_list = []
        self.layer_index = layer_index
        self.target_valid: torch.Tensor | None = None
        self.count_tokens = count_tokens
        self.num_compared = 0
        self.num_mismatched = 0
        self.on_compare = None  # session callback: ([n] bool differs & valid) -> None

    def set_targets(self, topk_idx: torch.Tensor | None, valid: torch.Tensor | None) -> None:
        """Rows for the next forward ([n, k] int64 and [n] bool), or None to route as usual."""
        self.target_topk_idx, self.target_valid = topk_idx, valid

    def clear_indices(self) -> None:
        super().clear_indices()
        self.target_valid = None
        self.on_compare = None

    def get_replay_topk(
        self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None
    ):
        """(gate scores [n, k], expert indices [n, k]) for the n tokens; see module docstring."""
        own_scores, own_idx = default_compute_topk(
            scores, topk, num_groups=num_groups, group_topk=group_topk
        )
        self.record_indices(own_idx.detach())
        target = self.target_topk_idx
        if target is None:
            return own_scores, own_idx
        if target.shape != own_idx.shape:
            raise ValueError(
                f"layer {self.layer_index}: {tuple(target.shape)} recorded expert rows for a "
                f"router that sees {tuple(own_idx.shape)} tokens x top-k (was the batch padded "
                "or sharded differently from the routing rows?)"
            )
        target = target.to(scores.device)
        valid = self.target_valid.to(scores.device)
        with torch.no_grad():
            differs = (own_idx.sort(-1).values != target.sort(-1).values).any(-1) & valid
            if self.count_tokens:
                self.num_compared += int(valid.sum())
                self.num_mismatched += int(differs.sum())
            if self.on_compare is not None:
                self.on_compare(differs.cpu())
        if self.router_replay_action != RouterReplayAction.REPLAY_FORWARD:
            return own_scores, own_idx
        idx = torch.where(valid[:, None], target, own_idx)
        return scores.gather(1, idx), idx


def _routers(chunk: torch.nn.Module) -> list[TopKRouter]:
    return [m for m in chunk.modules() if isinstance(m, TopKRouter)]


class RoutingReplay:
    """Replays (or only compares) recorded routing in the MoE routers of a policy's chunks.

    Args:
        chunks: the model chunks (unwrapped ``GPTModel``s, e.g. ``TrainState.unwrapped``).
        tp_rank, tp_size, sequence_parallel: this rank's tensor-parallel coordinates (the
            router sees the TP rank's sequence slice under sequence parallelism).
    Raises ValueError when the chunks hold no MoE router anywhere on this rank *and* the
    model is not pipeline-split (a dense model cannot replay routing).
    """

    def __init__(
        self,
        chunks: Sequence[torch.nn.Module],
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        sequence_parallel: bool = False,
    ) -> None:
        self.chunks = list(chunks)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.sequence_parallel = sequence_parallel and tp_size > 1
        count = self.sequence_parallel or tp_rank == 0
        self.last_differs: torch.Tensor | None = None
        self.layers: list[list[LayerRoutingReplay]] = []
        for chunk in self.chunks:
            per_chunk = []
            for router in _routers(chunk):
                if router.layer_number is None:
                    raise ValueError("a MoE router without layer_number: build the model first")
                replay = LayerRoutingReplay(router.layer_number - 1, count_tokens=count)
                router.router_replay = replay
                per_chunk.append(replay)
            self.layers.append(per_chunk)

    @classmethod
    def for_parallel(cls, chunks: Sequence[torch.nn.Module], parallel) -> RoutingReplay:
        """`RoutingReplay` with the TP coordinates of a `ParallelState`."""
        return cls(
            chunks,
            tp_rank=parallel.tp_rank,
            tp_size=parallel.cfg.tp,
            sequence_parallel=parallel.cfg.sequence_parallel,
        )

    @property
    def num_local_layers(self) -> int:
        return sum(len(c) for c in self.layers)

    def remove(self) -> None:
        """Take the replay objects out of the routers (plain Megatron routing again)."""
        for chunk in self.chunks:
            for router in _routers(chunk):
                router.router_replay = None

    def take_counts(self) -> tuple[int, int]:
        """(mismatched, compared) (token, layer) decisions on this rank since the last call."""
        mism = sum(r.num_mismatched for c in self.layers for r in c)
        comp = sum(r.num_compared for c in self.layers for r in c)
        for c in self.layers:
            for r in c:
                r.num_mismatched = r.num_compared = 0
        return mism, comp

    def _router_rows(
        self, routed: torch.Tensor, valid: torch.Tensor, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[b, T, L, k] / [b, T] rows of one micro-batch -> the [n, k] / [n] a router sees."""
        idx = routed[:, :, layer, :].transpose(0, 1)  # [T, b, k]: Megatron's [s, b] order
        ok = valid.transpose(0, 1)  # [T, b]
        if self.sequence_parallel:
            per = idx.shape[0] // self.tp_size
            sl = slice(self.tp_rank * per, (self.tp_rank + 1) * per)
            idx, ok = idx[sl], ok[sl]
        k = idx.shape[-1]
        return idx.reshape(-1, k).long(), ok.reshape(-1)

    @contextlib.contextmanager
    def session(
        self,
        token_ids: torch.Tensor,
        routed_experts: torch.Tensor,
        routing_mask: torch.Tensor,
        *,
        micro_batch_size: int,
        replay: bool,
    ) -> Iterator[None]:
        """Within the block, each forward of a chunk gets the routing rows of its micro-batch.

        Args:
            token_ids: [B, T] int64, the batch handed to ``forward_backward`` (checked against
                what each chunk is given).
            routed_experts: [B, T, L, k] uint8/int16; routing_mask: [B, T] bool.
            micro_batch_size: as passed to ``forward_backward`` (B must be a multiple).
            replay: True routes to the recorded experts; False only compares (`take_counts`).

        Afterwards ``last_differs`` [B, T] bool is True where some *local* router's own top-k
        differed from the recorded one (this rank's layers and, with sequence parallelism, its
        sequence slice: OR it over the pipeline and tensor-parallel groups for the whole model).
        """
        b, t = token_ids.shape
        if routed_experts.shape[:2] != (b, t) or routing_mask.shape != (b, t):
            raise ValueError(
                f"routed_experts {tuple(routed_experts.shape)} / routing_mask "
                f"{tuple(routing_mask.shape)} do not match the batch's token_ids {(b, t)}"
            )
        multiple = self.tp_size if self.sequence_parallel else 1
        pad = (-t) % multiple  # forward_backward pads T the same way
        if pad:
            routed_experts = torch.nn.functional.pad(routed_experts, (0, 0, 0, 0, 0, pad))
            routing_mask = torch.nn.functional.pad(routing_mask, (0, pad))
            token_ids = torch.nn.functional.pad(token_ids, (0, pad))
        action = RouterReplayAction.REPLAY_FORWARD if replay else None
        differs_map = torch.zeros(token_ids.shape, dtype=torch.bool)
        t_pad = token_ids.shape[1]
        per = t_pad // self.tp_size if self.sequence_parallel else t_pad
        offset = self.tp_rank * per if self.sequence_parallel else 0

        def fill(start, rows, differs):
            d = differs.view(per, rows).T  # the router's [s, b] order back to [b, s]
            differs_map[start : start + rows, offset : offset + per] |= d

        handles = []
        for chunk, layers in zip(self.chunks, self.layers, strict=True):
            counter = iter(range(0, b, micro_batch_size))

            def hook(module, args, layers=layers, counter=counter):
                start = next(counter, None)
                if start is None:
                    raise RuntimeError("a chunk ran more micro-batches than the batch holds")
                ids = args[0]
                want = token_ids[start : start + micro_batch_size]
                if ids.shape != want.shape or not torch.equal(ids.cpu(), want.cpu()):
                    raise RuntimeError(
                        f"routing replay: the chunk's micro-batch at row {start} is not the one "
                        "expected (micro-batches out of order?)"
                    )
                for r in layers:
                    rows, ok = self._router_rows(
                        routed_experts[start : start + micro_batch_size],
                        routing_mask[start : start + micro_batch_size],
                        r.layer_index,
                    )
                    r.set_targets(rows, ok)
                    r.set_router_replay_action(action)
                    r.on_compare = functools.partial(fill, start, len(want))

            handles.append(chunk.register_forward_pre_hook(hook))
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            for layers in self.layers:
                for r in layers:
                    r.clear_indices()
                    r.clear_router_replay_action()
            self.last_differs = differs_map[:, :t]


__all__ = ["LayerRoutingReplay", "RoutingReplay"]
