"""The real SmolLM2 (2 layers) on 2 gloo ranks: PP=2 (dense, tied embeddings across stages) and
EP=2 (its upcycled Mixtral) give the 1-rank logits and bit-exact sharded exports; the PP=2
checkpoint exports back exactly at 1 rank."""

import pytest
import torch

from sao_megatron.convert.hf_io import HFCheckpointReader
from sao_megatron.convert.upcycle import upcycle
from tests.conftest import launch
from tests.real_model.conftest import real_text_ids
from tests.real_model.dist_worker import LAYOUTS
from tests.real_model.megatron_util import hf_logits, megatron_logits, megatron_policy


@pytest.mark.distributed
def test_two_rank_layouts_match_single_rank(smollm2_2layer, tmp_path, parallel_1rank):
    ids = real_text_ids(smollm2_2layer, num_tokens=24)
    torch.save(ids, tmp_path / "ids.pt")
    moe = upcycle(smollm2_2layer, tmp_path / "moe_hf", num_experts=4, top_k=2)
    folders = {"dense": smollm2_2layer, "moe": moe}
    references = {}
    for folder, hf_dir in folders.items():
        (tmp_path / folder).write_text(str(hf_dir))
        model, _ = megatron_policy(hf_dir, parallel_1rank)
        references[folder] = (hf_logits(smollm2_2layer, ids), megatron_logits(model, ids))

    launch(_run, 2, str(tmp_path))

    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for name, (folder, _) in LAYOUTS.items():
        dense_hf, tp1 = references[folder]
        holders = [r[name]["logits"] for r in ranks if r[name]["logits"] is not None]
        assert holders, name
        for logits in holders:
            assert logits.shape == tp1.shape == (2, 24, 49152)
            one_rank = (logits - tp1).abs().max().item()
            to_dense = (logits - dense_hf).abs().max().item()
            print(
                f"{name}: vs 1-rank Megatron {one_rank:.3g}, vs dense transformers {to_dense:.3g}"
            )
            assert one_rank < 1e-4, name
            assert to_dense < 2e-4, name
        for r in ranks:
            assert r[name]["wrong"] == [] and r[name]["duplicates"] == 0, name
        assert ranks[0][name]["missing"] == [] and ranks[0][name]["extra"] == [], name

    from sao_megatron.convert.checkpoint import convert_megatron_to_hf

    back = convert_megatron_to_hf(
        tmp_path / "mg_pp2_dense", tmp_path / "back", state=parallel_1rank
    )
    with HFCheckpointReader(back) as b, HFCheckpointReader(smollm2_2layer) as source:
        assert sorted(b.keys()) == sorted(source.keys())
        for name in source.keys():
            assert torch.equal(b.get(name), source.get(name)), name


def _run(rank: int, world_size: int, root: str) -> None:
    from tests.real_model.dist_worker import run

    run(rank, world_size, root)
