"""A vLLM worker extension that also refreshes the CPU output layer after a weight reload.

Runs inside the vLLM server (``.venv-vllm``). Found with the tied-embedding SmolLM2: on CPU,
``UnquantizedEmbeddingMethod.process_weights_after_loading`` (vllm 0.32.0,
``vocab_parallel_embedding.py``) builds ``layer.cpu_linear`` from a packed copy of the lm_head
weight (``dispatch_cpu_unquantized_gemm(layer, remove_weight=False)``: sgl
``convert_weight_packed`` or a oneDNN handle). A tied lm_head receives no tensor of its own in
``reload_weights`` (``model.embed_tokens.weight`` is copied into the shared parameter), so its
packing is not redone and the engine keeps computing logits with the *old* embedding: after a
sync that changed the embedding, log-probs were off by ~1 nat. Re-running the method on every
``ParallelLMHead`` after the reload repacks from the current weight (idempotent for an untied
head). The fix belongs in ``sao_megatron/rollout/vllm_worker_ext.py``; this subclass is what the
real-model tests start their engines with until then.
"""

from __future__ import annotations

from sao_megatron.rollout.vllm_worker_ext import SAOWorkerExtension

EXTENSION = "tests.real_model.vllm_tied_ext.TiedHeadWorkerExtension"


class TiedHeadWorkerExtension(SAOWorkerExtension):
    def sao_reload_weights(self, path: str) -> dict:
        import torch
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        out = super().sao_reload_weights(path)
        model = self.model_runner.get_model()
        n = 0
        with torch.inference_mode():
            for module in model.modules():
                if isinstance(module, ParallelLMHead) and hasattr(module, "cpu_linear"):
                    module.quant_method.process_weights_after_loading(module)
                    n += 1
        out["num_repacked_lm_heads"] = n
        return out
