"""Rank body of the 2-rank real-model test (run by tests/real_model/test_distributed.py).

Layouts: the dense SmolLM2 (2 layers, tied embeddings) in PP=2 (one layer per stage, the
embedding on stage 0 and the tied output layer on stage 1), and its upcycled Mixtral in EP=2 (2
of the 4 experts per rank). TP=2 cannot split SmolLM2's 9 heads. For each: convert with every
rank reading only its own tensors, load the saved checkpoint into a fresh model of the same
layout, compute logits, and export HF tensors from the sharded model (the weight-sync path).
Results go to ``<root>/rank<r>.pt``.
"""

from __future__ import annotations

from pathlib import Path

import torch

LAYOUTS: dict[str, tuple[str, dict]] = {
    "pp2_dense": ("dense", {"pp": 2}),
    "ep2_moe": ("moe", {"ep": 2}),
}


def run(rank: int, world_size: int, root: str) -> None:
    """Launched by ``tests.conftest.launch``; see the module docstring."""
    from sao_megatron.convert.checkpoint import (
        convert_hf_to_megatron,
        load_converted_checkpoint,
        read_metadata,
    )
    from sao_megatron.models import MoEModelConfig, build_policy
    from sao_megatron.parallel import ParallelConfig, destroy_parallel, initialize_parallel
    from tests.convert.dist_worker import export_report, full_logits

    base = Path(root)
    ids = torch.load(base / "ids.pt")
    results = {}
    for name, (folder, pkw) in LAYOUTS.items():
        state = initialize_parallel(ParallelConfig(**pkw))
        hf_dir = Path((base / folder).read_text())
        out = convert_hf_to_megatron(hf_dir, base / f"mg_{name}", state)
        chunks = build_policy(MoEModelConfig(**read_metadata(out)["model_config"]), state)
        load_converted_checkpoint(chunks, out)
        for chunk in chunks:
            chunk.eval()
        logits = full_logits(chunks, state, ids)
        results[name] = {"logits": logits} | export_report(chunks, hf_dir, world_size)
        destroy_parallel()
    torch.save(results, base / f"rank{rank}.pt")
