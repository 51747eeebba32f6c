"""At PP=2 (also with VPP=2), TP=2 and EP=2 on 2 gloo ranks the HF tensors gathered on rank 0
equal the 1-rank model's exactly; rank 1 gets None; no object all-gather is used; the publish
and export calls deliver the same tensors."""

from __future__ import annotations

import json

import pytest
import torch

from sao_megatron.convert.hf_io import HFCheckpointReader
from sao_megatron.convert.model_io import megatron_to_hf_tensors
from sao_megatron.convert.spec import ConversionSpec
from tests.conftest import launch, tiny_moe_kwargs
from tests.weight_sync import worker

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("weight_sync")
    launch(worker.run, 2, str(root))
    return root, [torch.load(root / f"rank{r}.pt") for r in range(2)]


@pytest.fixture(scope="module")
def references():
    """HF tensors of the 1-rank model of each layout's config (same seed)."""
    from megatron.core import parallel_state as ps

    from sao_megatron.models import MoEModelConfig, build_policy
    from sao_megatron.parallel import ParallelConfig, destroy_parallel, initialize_parallel

    if ps.model_parallel_is_initialized():
        destroy_parallel()
    state = initialize_parallel(ParallelConfig())
    out = {}
    for name, (_, overrides) in worker.LAYOUTS.items():
        model = MoEModelConfig(**{**tiny_moe_kwargs(), **overrides})
        spec = ConversionSpec.from_hf_config(model.to_hf_config(**worker.SPECIAL_IDS))
        (chunk,) = build_policy(model, state)
        out[name] = {k: v.clone() for k, v in megatron_to_hf_tensors(chunk, spec)}
    destroy_parallel()
    return out


def _assert_equal(got: dict, want: dict, layout: str) -> None:
    assert sorted(got) == sorted(want), layout
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), (layout, k)


@pytest.mark.parametrize("layout", list(worker.LAYOUTS))
def test_rank0_gets_the_single_rank_tensors_exactly(ranks, references, layout):
    _, (r0, r1) = ranks
    want = references[layout]
    # per layer q, k, v, o, q/k norms, 2 norms, router, 3 tensors per expert; + embed, norm, head
    assert len(want) == 3 + (tiny_moe_kwargs() | worker.LAYOUTS[layout][1])["num_hidden_layers"] * (
        9 + 3 * tiny_moe_kwargs()["num_experts"]
    )
    _assert_equal(r0[layout]["gathered"], want, layout)
    assert r1[layout]["gathered"] is None


@pytest.mark.parametrize("layout", list(worker.LAYOUTS))
def test_publish_policy_hands_rank0_sink_the_tensors(ranks, references, layout):
    _, (r0, r1) = ranks
    ((weights, version),) = r0[layout]["published"]
    assert version == 7
    _assert_equal(weights, references[layout], layout)
    m = r0[layout]["metrics"]
    assert (m["sync/max_pause_s"], m["sync/write_s"], m["sync/failed_engines"]) == (0.25, 0.5, 1)
    assert m["sync/gather_s"] >= 0.0
    assert r1[layout]["metrics"] == {} and r1[layout]["published"] is None


@pytest.mark.parametrize("layout", list(worker.LAYOUTS))
def test_export_hf_writes_the_tensors_config_and_tokenizer(ranks, references, layout):
    root, _ = ranks
    folder = root / f"export_{layout}"
    with HFCheckpointReader(folder) as reader:
        _assert_equal({k: reader.get(k) for k in reader.keys()}, references[layout], layout)
    config = json.loads((folder / "config.json").read_text())
    assert config["num_hidden_layers"] == len(
        {k.split(".")[2] for k in references[layout] if k.startswith("model.layers.")}
    )
    assert (folder / "sao_tokenizer" / "vocab.txt").read_text() == "tiny\n"


def test_publish_policy_rejects_a_sink_off_rank_zero():
    class State:
        rank = 1

    with pytest.raises(ValueError, match="rollout=None on every other rank"):
        from sao_megatron.weight_sync import publish_policy

        publish_policy([], None, State(), object(), 1)
