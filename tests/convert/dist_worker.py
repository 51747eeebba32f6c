"""Rank body of the 2-rank conversion test (run by tests/convert/test_distributed.py).

For each layout: convert the HF folder with every rank reading only its own tensors, save with
dist_checkpointing, build a fresh model in the same layout and load the saved checkpoint, compute
full logits, and export HF tensors from the sharded model (the weight-sync path). Results go to
``<root>/rank<r>.pt``.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

# name: (family folder, ParallelConfig kwargs)
LAYOUTS: dict[str, tuple[str, dict]] = {
    "tp2": ("qwen2_moe", {"tp": 2, "sequence_parallel": True}),
    "ep2": ("qwen3_moe", {"ep": 2}),
    "pp2_tied": ("qwen3_moe_tied", {"pp": 2}),
    "tp2_ep2": ("mixtral", {"tp": 2, "ep": 2, "expert_tp": 1, "sequence_parallel": True}),
}


def full_logits(chunks, state, ids: torch.Tensor) -> torch.Tensor | None:
    """[b, s] ids -> [b, s, vocab] logits on the last pipeline stage (None elsewhere)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    pos = torch.arange(ids.shape[1]).expand_as(ids)
    if state.cfg.pp == 1:
        with torch.no_grad():
            local = chunks[0](ids, pos, attention_mask=None)
    else:

        def forward_step(data_iterator, model):
            out = model(ids, pos, attention_mask=None)
            return out, lambda output: (output.sum() * 0.0, {"logits": output.detach()})

        with torch.no_grad():
            records = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter([None]),
                model=list(chunks),
                num_microbatches=1,
                seq_length=ids.shape[1],
                micro_batch_size=ids.shape[0],
                forward_only=True,
            )
        if not records:
            return None
        local = records[0]["logits"]
    tp_group = state.pg_collection.tp
    parts = [torch.empty_like(local) for _ in range(tp_group.size())]
    dist.all_gather(parts, local.contiguous(), group=tp_group)
    return torch.cat(parts, dim=-1)


def run(rank: int, world_size: int, root: str) -> None:
    """Launched by ``tests.conftest.launch``; see the module docstring."""
    from sao_megatron.convert.checkpoint import (
        convert_hf_to_megatron,
        load_converted_checkpoint,
        read_metadata,
    )
    from sao_megatron.models import MoEModelConfig, build_policy
    from sao_megatron.parallel import ParallelConfig, destroy_parallel, initialize_parallel

    base = Path(root)
    ids = torch.load(base / "ids.pt")
    results = {}
    for name, (folder, pkw) in LAYOUTS.items():
        state = initialize_parallel(ParallelConfig(**pkw))
        hf_dir = base / folder
        out = convert_hf_to_megatron(hf_dir, base / f"mg_{name}", state)
        chunks = build_policy(MoEModelConfig(**read_metadata(out)["model_config"]), state)
        load_converted_checkpoint(chunks, out)
        logits = full_logits(chunks, state, ids)
        results[name] = {"logits": logits} | export_report(chunks, hf_dir, world_size)
        destroy_parallel()
    torch.save(results, base / f"rank{rank}.pt")


def export_report(chunks, hf_dir: Path, world_size: int) -> dict:
    """Export this rank's Megatron chunk to HF names and compare with the source checkpoint:
    tensors that differ ("wrong"), names exported twice, and over all ranks the names missing
    from or extra to the checkpoint (a tied lm_head is not expected)."""
    from sao_megatron.convert.hf_io import HFCheckpointReader, read_hf_config
    from sao_megatron.convert.model_io import megatron_to_hf_tensors
    from sao_megatron.convert.spec import ConversionSpec

    spec = ConversionSpec.from_hf_config(read_hf_config(hf_dir))
    exported, wrong = [], []
    with HFCheckpointReader(hf_dir) as reader:
        for hf_name, tensor in megatron_to_hf_tensors(chunks[0], spec):
            exported.append(hf_name)
            if not torch.equal(tensor, reader.get(hf_name)):
                wrong.append(hf_name)
        expected = {
            k for k in reader.keys() if not (spec.tie_word_embeddings and k == "lm_head.weight")
        }
    gathered = [None] * world_size
    dist.all_gather_object(gathered, exported)
    union = set().union(*gathered)
    return {
        "wrong": wrong,
        "duplicates": len(exported) - len(set(exported)),
        "missing": sorted(expected - union),
        "extra": sorted(union - expected),
    }
