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
import torch.distributed as dist

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
    from sao_megatron.convert.hf_io import HFCheckpointReader, read_hf_config
    from sao_megatron.convert.model_io import megatron_to_hf_tensors
    from sao_megatron.convert.spec import ConversionSpec
    from sao_megatron.models import MoEModelConfig, build_policy
    from sao_megatron.parallel import ParallelConfig, destroy_parallel, initialize_parallel
    from tests.convert.dist_worker import full_logits

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
        spec = ConversionSpec.from_hf_config(read_hf_config(hf_dir))
        exported, wrong = [], []
        with HFCheckpointReader(hf_dir) as reader:
            for hf_name, tensor in megatron_to_hf_tensors(chunks[0], spec):
                exported.append(hf_name)
                if not torch.equal(tensor, reader.get(hf_name)):
                    wrong.append(hf_name)
            expected = set(reader.keys())
        gathered = [None] * world_size
        dist.all_gather_object(gathered, exported)
        union = set().union(*gathered)
        results[name] = {
            "logits": logits,
            "wrong": wrong,
            "duplicates": len(exported) - len(set(exported)),
            "missing": sorted(expected - union),
            "extra": sorted(union - expected),
        }
        destroy_parallel()
    torch.save(results, base / f"rank{rank}.pt")
