"""Rank body of the 2-rank weight-sync tests (run by tests/weight_sync/test_gather.py).

Per layout: build the tiny policy (layout-independent CPU init: the slices of the 1-rank model),
gather its HF tensors with ``torch.distributed.all_gather_object`` and
``broadcast_object_list`` patched to raise, publish them to a recording sink, and export them as
an HF folder. Results go to ``<root>/rank<r>.pt``.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from tests.conftest import tiny_moe_kwargs

# name: (ParallelConfig kwargs, MoEModelConfig overrides)
LAYOUTS: dict[str, tuple[dict, dict]] = {
    "pp2": ({"pp": 2}, {}),
    "tp2": ({"tp": 2, "sequence_parallel": True}, {}),
    "ep2": ({"ep": 2}, {}),
    "pp2_vpp2": ({"pp": 2, "virtual_pp": 2}, {"num_hidden_layers": 4}),
}
SPECIAL_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)


class RecordingSink:
    """Stands in for the RolloutManager: keeps what `publish_policy` hands it."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict, int]] = []

    def publish_weights(self, weights, version):
        self.calls.append((dict(weights), version))

        class Result:
            max_pause_s, write_s, failed_engines = 0.25, 0.5, ["engine1"]

        return Result()


def _forbidden(*args, **kwargs):
    raise AssertionError("the weight gather must not use an object all-gather or broadcast")


def run(rank: int, world_size: int, root: str) -> None:
    """Launched by ``tests.conftest.launch``; see the module docstring."""
    from sao_megatron.convert.spec import ConversionSpec
    from sao_megatron.models import MoEModelConfig, build_policy
    from sao_megatron.parallel import ParallelConfig, destroy_parallel, initialize_parallel
    from sao_megatron.weight_sync import export_hf, gather_hf_weights, publish_policy

    dist.all_gather_object = _forbidden
    dist.broadcast_object_list = _forbidden
    results = {}
    for name, (pkw, overrides) in LAYOUTS.items():
        state = initialize_parallel(ParallelConfig(**pkw))
        model = MoEModelConfig(**{**tiny_moe_kwargs(), **overrides})
        spec = ConversionSpec.from_hf_config(model.to_hf_config(**SPECIAL_IDS))
        chunks = build_policy(model, state)
        gathered = gather_hf_weights(chunks, spec, state)
        sink = RecordingSink() if rank == 0 else None
        metrics = publish_policy(chunks, spec, state, sink, version=7)
        export_hf(
            chunks,
            spec,
            model.to_hf_config(**SPECIAL_IDS),
            _Tokenizer(),
            state,
            Path(root) / f"export_{name}",
        )
        results[name] = {
            "gathered": gathered,
            "metrics": metrics,
            "published": sink.calls if sink else None,
        }
        destroy_parallel()
    torch.save(results, Path(root) / f"rank{rank}.pt")


class _Tokenizer:
    """The part of a tokenizer `export_hf` uses (``save_tokenizer``: files and fingerprint)."""

    kind, vocab_size = "test", 128

    def sha256(self) -> str:
        return "0" * 64

    def save(self, directory: str) -> None:
        (Path(directory) / "vocab.txt").write_text("tiny\n")
