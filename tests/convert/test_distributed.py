"""Conversion into TP=2 / EP=2 / PP=2 / TP2+EP2 on 2 gloo ranks gives the TP=1 logits; the
sharded export is bit-exact; a checkpoint saved from TP2+EP2 exports back exactly at 1 rank."""

import json

import pytest
import torch

from sao_megatron.convert.hf_io import HFCheckpointReader, read_hf_config
from sao_megatron.convert.model_config import model_config_from_hf
from sao_megatron.convert.model_io import load_hf_into_model
from sao_megatron.convert.spec import ConversionSpec
from tests.conftest import launch
from tests.convert.dist_worker import LAYOUTS
from tests.convert.test_logits import megatron_logits
from tests.convert.tiny_hf import fixed_batch, save_hf


@pytest.mark.distributed
def test_layouts_match_single_rank(tmp_path, parallel_1rank):
    from sao_megatron.models import build_policy

    ids = fixed_batch()
    torch.save(ids, tmp_path / "ids.pt")
    references = {}
    for folder in {f for f, _ in LAYOUTS.values()}:
        family, tie = folder.removesuffix("_tied"), folder.endswith("_tied")
        hf_model = save_hf(family, tmp_path / folder, tie=tie, shard="30KB")
        config = read_hf_config(tmp_path / folder)
        (model,) = build_policy(model_config_from_hf(config), parallel_1rank)
        with HFCheckpointReader(tmp_path / folder) as reader:
            load_hf_into_model(model, reader, ConversionSpec.from_hf_config(config))
        with torch.no_grad():
            references[folder] = (hf_model(ids).logits, megatron_logits(model.eval(), ids))
        assert (references[folder][0] - references[folder][1]).abs().max() < 1e-4

    launch(_run, 2, str(tmp_path))

    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for name, (folder, _) in LAYOUTS.items():
        hf_logits, tp1_logits = references[folder]
        holders = [r[name]["logits"] for r in ranks if r[name]["logits"] is not None]
        assert holders, name  # the last stage of every layout reports logits
        for logits in holders:
            assert logits.shape == tp1_logits.shape
            assert (logits - tp1_logits).abs().max().item() < 1e-5, name
            assert (logits - hf_logits).abs().max().item() < 1e-4, name
        for r in ranks:
            assert r[name]["wrong"] == [] and r[name]["duplicates"] == 0, name
        assert ranks[0][name]["missing"] == [] and ranks[0][name]["extra"] == [], name

    # The checkpoint written by 2 ranks in TP2+EP2 loads at TP=PP=EP=1 and exports exactly.
    from sao_megatron.convert.checkpoint import convert_megatron_to_hf

    out = convert_megatron_to_hf(tmp_path / "mg_tp2_ep2", tmp_path / "back", state=parallel_1rank)
    with HFCheckpointReader(out) as back, HFCheckpointReader(tmp_path / "mixtral") as source:
        assert sorted(back.keys()) == sorted(source.keys())
        for name in source.keys():
            assert torch.equal(back.get(name), source.get(name)), name


def _run(rank: int, world_size: int, root: str) -> None:
    from tests.convert.dist_worker import run

    run(rank, world_size, root)


@pytest.mark.distributed
def test_cli_spawns_pipeline_ranks(tmp_path, no_megatron):
    """`sao-convert hf-to-megatron --pp 2` starts 2 local ranks; the result exports exactly."""
    from sao_megatron.convert.cli import main

    hf_model = save_hf("qwen2_moe", tmp_path / "hf", tie=True)
    mg, back = tmp_path / "mg", tmp_path / "back"
    assert (
        main(["hf-to-megatron", "--hf", str(tmp_path / "hf"), "--out", str(mg), "--pp", "2"]) == 0
    )
    assert json.loads((mg / "sao_convert.json").read_text())["layout"]["pp"] == 2
    assert main(["megatron-to-hf", "--ckpt", str(mg), "--out", str(back)]) == 0
    expected = {k: v for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    with HFCheckpointReader(back) as reader:
        assert sorted(reader.keys()) == sorted(expected)
        for name, tensor in expected.items():
            assert torch.equal(reader.get(name), tensor), name
