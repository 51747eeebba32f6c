"""Routed experts per token: the compact layout, the wire format and the per-episode recorder.

Routing replay (R3: "rollout routing replay") needs, for every token the engine forwarded, the
top-k experts each MoE layer routed it to. This module holds the rollout side:

* **Layout.** One row per token: ``[num_layers, top_k]`` expert indices, ``uint8`` when the model
  has at most 256 experts, ``int16`` otherwise (`routing_dtype`), so a token costs
  ``num_layers * top_k`` bytes (x2 past 256 experts; `bytes_per_token`). Layers are the model's
  global decoder layers in order (dense layers of a mixed model hold zeros and are never read).
  The layout is vLLM's own (`vllm/model_executor/layers/fused_moe/routed_experts_capturer.py`,
  ``RoutedExpertsCapturer``: ``[tokens, num_layers, num_experts_per_tok]``, uint8 up to 256
  experts), so both capture paths below produce the same arrays.
* **Which tokens.** The engine routes a token when it *forwards* it: every prompt token (prefill)
  and every sampled token except the last one of a request (it is sampled, never fed back).
  A request that records from position ``start`` gets rows for positions
  ``[start, len(prompt) + len(output) - 1)`` (vLLM's ``routed_experts_prompt_start``). The
  per-episode `RoutingRecorder` asks each turn of a full-history episode only for the positions
  no earlier turn returned, so every position's row is the routing of the request that first
  forwarded it, the one whose KV the later turns reuse through the prefix cache.
* **Wire format.** Base64 of ``numpy.save`` bytes (vLLM's ``numpy2base64``, the
  ``routed_experts`` field of a ``/inference/v1/generate`` choice); `decode_routing`.

The trainer side (`sao_megatron.models.routing_replay`) replays these rows in the policy forward.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import torch


def routing_dtype(num_experts: int) -> torch.dtype:
    """The compact dtype of expert indices: uint8 for <= 256 experts, else int16 (<= 32768)."""
    if num_experts < 1:
        raise ValueError(f"num_experts={num_experts}: must be >= 1")
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 32768:
        return torch.int16
    raise ValueError(f"num_experts={num_experts}: more than int16 expert indices can hold")


def bytes_per_token(num_layers: int, top_k: int, num_experts: int) -> int:
    """Bytes of routing state per token: num_layers * top_k * itemsize(routing_dtype).

    E.g. the tiny test MoE (2 layers, top-2 of 8): 4 bytes; Qwen3-30B-A3B (48 layers, top-8 of
    128): 384 bytes; DeepSeek-V3 (58 MoE of 61 layers stored as 61, top-8 of 256): 488 bytes.
    """
    itemsize = torch.empty((), dtype=routing_dtype(num_experts)).element_size()
    return num_layers * top_k * itemsize


def decode_routing(b64: str) -> torch.Tensor:
    """vLLM's base64 ``.npy`` routing rows -> tensor [n, num_layers, top_k] (uint8/int16).

    Unsigned 16-bit indices (vLLM's uint16 past 256 experts) become int16 (they are < 32768).
    Raises ValueError if the payload is not a 3-d integer array.
    """
    arr = np.load(io.BytesIO(base64.b64decode(b64)), allow_pickle=False)
    if arr.ndim != 3 or arr.dtype.kind not in "iu":
        raise ValueError(f"routed experts must be a 3-d integer array, got {arr.dtype} {arr.shape}")
    if arr.dtype == np.uint16 or arr.dtype.itemsize > 2:
        arr = arr.astype(np.int16)
    return torch.from_numpy(np.ascontiguousarray(arr))


def encode_routing(rows: torch.Tensor | np.ndarray) -> str:
    """Inverse of `decode_routing` (base64 of ``numpy.save`` bytes)."""
    arr = rows.numpy() if isinstance(rows, torch.Tensor) else np.asarray(rows)
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


class RoutingRecorder:
    """Collects one episode's routing rows across its requests and splits them per node.

    Usage (`sao_megatron.rollout.runner.run_episode`)::

        rec = RoutingRecorder(full_history=True)
        start = rec.start(prompt)             # routing_start of the request
        gen = await generate(..., routing_start=start)
        rec.add(prompt, gen.token_ids, gen.routed_experts)
        ...
        rec.assign(trajectory)                # ActionNode.routed_experts of every node

    Full history: the episode is one growing sequence; request n returns rows for the positions
    ``[recorded, len(prompt_n) + len(action_n) - 1)``, so the rows concatenate to the first
    ``T - 1`` positions of the trajectory (the last action token was never forwarded). Window:
    every request is its own sequence (start 0); node n gets its request's rows.
    """

    def __init__(self, full_history: bool) -> None:
        self.full_history = full_history
        self.chunks: list[torch.Tensor] = []  # full history: rows in position order
        self.num_recorded = 0
        self.per_request: list[torch.Tensor] = []  # window: one per request

    def start(self, prompt: list[int]) -> int:
        """The first prompt position this request must return routing for."""
        if not self.full_history:
            return 0
        if self.num_recorded > len(prompt):
            raise ValueError(
                f"the prompt ({len(prompt)} tokens) is shorter than the {self.num_recorded} "
                "positions already recorded: a full-history prompt must extend the previous one"
            )
        return self.num_recorded

    def add(self, prompt: list[int], output: list[int], rows: torch.Tensor | None) -> None:
        """Record the rows one request returned (see `start`). Raises ValueError when the row
        count is not ``len(prompt) + len(output) - 1 - start`` (misaligned or missing)."""
        start = self.start(prompt)
        want = len(prompt) + len(output) - 1 - start
        if rows is None or rows.dim() != 3 or rows.shape[0] != want:
            got = None if rows is None else tuple(rows.shape)
            raise ValueError(
                f"routed experts of a request: expected {want} rows (positions {start}.."
                f"{len(prompt) + len(output) - 2}), got {got}"
            )
        if self.full_history:
            self.chunks.append(rows)
            self.num_recorded = start + want
        else:
            self.per_request.append(rows)

    def assign(self, traj) -> None:
        """Set ``routed_experts`` of every node of `traj` (`Trajectory`) from the rows recorded:
        rows for the first m tokens of the node's sequence segment (full history: observation +
        action tokens; window: context + action tokens), m = segment length, or one less where
        the segment ends a request's sequence (its last token was not forwarded)."""
        if not self.full_history:
            if len(self.per_request) != len(traj.nodes):
                raise ValueError(f"{len(self.per_request)} requests for {len(traj.nodes)} nodes")
            for node, rows in zip(traj.nodes, self.per_request, strict=True):
                node.routed_experts = rows
            return
        rows = torch.cat(self.chunks) if self.chunks else None
        pos = 0
        for node in traj.nodes:
            n = len(node.observation_token_ids) + len(node.action_token_ids)
            node.routed_experts = rows[pos : pos + n] if rows is not None else None
            pos += n
        if rows is None or rows.shape[0] != pos - 1:
            raise ValueError(
                f"recorded {0 if rows is None else rows.shape[0]} routing rows for a trajectory "
                f"of {pos} tokens (expected {pos - 1})"
            )


__all__ = [
    "RoutingRecorder",
    "bytes_per_token",
    "decode_routing",
    "encode_routing",
    "routing_dtype",
]
