"""HF -> Megatron (1 rank) gives the transformers logits; Megatron -> HF is bit-exact."""

import pytest
import torch

from sao_megatron.convert.hf_io import HFCheckpointReader, read_hf_config
from sao_megatron.convert.model_config import model_config_from_hf
from sao_megatron.convert.model_io import load_hf_into_model, megatron_to_hf_tensors
from sao_megatron.convert.spec import ConversionSpec
from tests.convert.tiny_hf import fixed_batch, save_hf

CASES = [  # (family, tied embeddings, extra build kwargs)
    ("qwen3_moe", False, {}),
    ("qwen3_moe", True, {"dense_layers": (0,)}),  # layer 0 dense (mlp_only_layers)
    ("qwen2_moe", False, {}),
    ("mixtral", False, {}),
    ("qwen2", True, {}),
    ("llama", False, {}),
]


def megatron_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """[b, s] ids -> [b, s, vocab] float logits of a 1-rank Megatron GPTModel."""
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        return model(ids, pos, attention_mask=None)


@pytest.mark.parametrize(("family", "tie", "extra"), CASES)
def test_hf_to_megatron_logits_and_exact_export(family, tie, extra, tmp_path, parallel_1rank):
    from sao_megatron.models import build_policy

    hf_model = save_hf(family, tmp_path, tie=tie, shard="20KB", **extra)  # shards + index
    config = read_hf_config(tmp_path)
    spec = ConversionSpec.from_hf_config(config)
    (model,) = build_policy(model_config_from_hf(config), parallel_1rank)
    with HFCheckpointReader(tmp_path) as reader:
        assert len(set(reader.weight_map.values())) > 1
        load_hf_into_model(model, reader, spec)
    model.eval()
    ids = fixed_batch()
    with torch.no_grad():
        reference = hf_model(ids).logits
    logits = megatron_logits(model, ids)
    assert logits.shape == reference.shape == (2, 10, 96)
    if extra.get("dense_layers"):
        assert "decoder.layers.0.mlp.linear_fc1.weight" in dict(model.named_parameters())
    assert (logits - reference).abs().max().item() < 1e-4
    assert reference.std() > 0.1  # random weights: a wrong mapping cannot hide in tiny logits

    exported = dict(megatron_to_hf_tensors(model, spec))
    expected = hf_model.state_dict()
    if tie:
        assert "lm_head.weight" not in exported and "output_layer.weight" not in dict(
            model.named_parameters()
        )
        expected = {k: v for k, v in expected.items() if k != "lm_head.weight"}
    assert set(exported) == set(expected)
    for name, tensor in expected.items():
        assert exported[name].dtype == tensor.dtype
        assert torch.equal(exported[name], tensor), name


def test_wrong_config_shape_is_reported(tmp_path, parallel_1rank):
    """config.json saying a larger MoE FFN than the weights -> a shape error naming tensors."""
    from sao_megatron.models import build_policy

    save_hf("qwen3_moe", tmp_path)
    config = read_hf_config(tmp_path)
    spec = ConversionSpec.from_hf_config(config)
    (model,) = build_policy(
        model_config_from_hf({**config, "moe_intermediate_size": 24}), parallel_1rank
    )
    with (
        HFCheckpointReader(tmp_path) as reader,
        pytest.raises(
            ValueError,
            match=r"experts\.0\.gate_proj.*\(32, 32\).*local_experts\.0\.linear_fc1.*\(48, 32\)",
        ),
    ):
        load_hf_into_model(model, reader, spec)
