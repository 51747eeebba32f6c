"""Sparse upcycling: the MoE made from a dense model computes the dense logits at step 0, in
transformers and in Megatron (through the Mixtral / Qwen2-MoE conversion), for the real
SmolLM2 (2 layers) -> Mixtral and a tiny random Qwen2 -> Qwen2-MoE."""

import json

import pytest
import torch

from sao_megatron.convert.hf_io import HFCheckpointReader, read_hf_config
from sao_megatron.convert.model_io import megatron_to_hf_tensors
from sao_megatron.convert.upcycle import upcycle
from tests.convert.tiny_hf import fixed_batch, save_hf
from tests.real_model.conftest import real_text_ids
from tests.real_model.megatron_util import hf_logits, megatron_logits, megatron_policy

# Measured on SmolLM2 2 layers, E=4, K=2: 2.9e-05 (normal router), 0.0 (zero router).
LOGIT_TOL = 2e-4


@pytest.fixture(scope="module")
def smollm2_moe(smollm2_2layer, tmp_path_factory):
    """SmolLM2 (2 layers) upcycled to a Mixtral with 4 experts, top-2, N(0, 0.02) router."""
    out = tmp_path_factory.mktemp("upcycle") / "moe"
    return upcycle(smollm2_2layer, out, num_experts=4, top_k=2)


def test_mixtral_layout(smollm2_2layer, smollm2_moe):
    config = read_hf_config(smollm2_moe)
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (4, 2)
    assert config["tie_word_embeddings"] and config["head_dim"] == 64
    with HFCheckpointReader(smollm2_moe) as moe, HFCheckpointReader(smollm2_2layer) as dense:
        for layer in range(2):
            for hf, mx in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
                dense_w = dense.get(f"model.layers.{layer}.mlp.{hf}.weight")
                for e in range(4):
                    name = f"model.layers.{layer}.block_sparse_moe.experts.{e}.{mx}.weight"
                    assert torch.equal(moe.get(name), dense_w), name
            router = moe.get(f"model.layers.{layer}.block_sparse_moe.gate.weight")
            assert router.shape == (4, 576)
            assert 0.015 < router.std().item() < 0.025  # N(0, initializer_range=0.02)
        assert "model.layers.0.mlp.gate_proj.weight" not in moe
        assert torch.equal(
            moe.get("model.embed_tokens.weight"), dense.get("model.embed_tokens.weight")
        )
    assert json.loads((smollm2_moe / "sao_upcycle.json").read_text())["router_init"] == "normal"
    assert (smollm2_moe / "chat_template.jinja").is_file()


def test_transformers_moe_logits_equal_dense(smollm2_2layer, smollm2_moe):
    from transformers import AutoModelForCausalLM

    ids = real_text_ids(smollm2_2layer)
    dense = hf_logits(smollm2_2layer, ids)
    moe = AutoModelForCausalLM.from_pretrained(str(smollm2_moe), dtype=torch.float32).eval()
    with torch.no_grad():
        out = moe(ids, output_router_logits=True)
    diff = (out.logits - dense).abs().max().item()
    print(f"upcycled Mixtral (transformers) vs dense SmolLM2, fp32: max |logit diff| = {diff:.3g}")
    assert diff < LOGIT_TOL
    # the random router spreads the tokens over all 4 experts of each layer
    for router_logits in out.router_logits:
        counts = router_logits.topk(2, dim=-1).indices.flatten().bincount(minlength=4)
        assert (counts > 0).all(), counts


def test_zero_router_is_exact_but_ties(smollm2_2layer, tmp_path):
    from transformers import AutoModelForCausalLM

    out = upcycle(smollm2_2layer, tmp_path / "moe", num_experts=4, top_k=2, router_init="zeros")
    ids = real_text_ids(smollm2_2layer)
    moe = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        result = moe(ids, output_router_logits=True)
    diff = (result.logits - hf_logits(smollm2_2layer, ids)).abs().max().item()
    print(f"zero-router upcycled Mixtral vs dense: max |logit diff| = {diff:.3g}")
    assert diff < LOGIT_TOL
    used = result.router_logits[0].topk(2, dim=-1).indices.unique()
    assert used.numel() == 2  # every token picks the same 2 experts: why 'normal' is the default


def test_megatron_moe_logits_equal_dense(smollm2_2layer, smollm2_moe, parallel_1rank):
    ids = real_text_ids(smollm2_2layer)
    model, spec = megatron_policy(smollm2_moe, parallel_1rank)
    assert spec.family == "mixtral" and spec.num_experts == 4
    logits = megatron_logits(model, ids)
    diff = (logits - hf_logits(smollm2_2layer, ids)).abs().max().item()
    print(f"upcycled Mixtral (Megatron) vs dense SmolLM2 (transformers): max diff = {diff:.3g}")
    assert diff < LOGIT_TOL
    exported = dict(megatron_to_hf_tensors(model, spec))
    with HFCheckpointReader(smollm2_moe) as reader:
        assert sorted(exported) == sorted(reader.keys())
        for name in reader.keys():
            assert torch.equal(exported[name], reader.get(name)), name


def test_qwen2_to_qwen2_moe(tmp_path, parallel_1rank):
    """Qwen2 (q/k/v biases) -> Qwen2-MoE with renormalised top-k and a zero shared expert."""
    save_hf("qwen2", tmp_path / "dense", tie=True)
    out = upcycle(tmp_path / "dense", tmp_path / "moe", num_experts=4, top_k=2)
    config = read_hf_config(out)
    assert config["architectures"] == ["Qwen2MoeForCausalLM"] and config["norm_topk_prob"]
    ids = fixed_batch()
    dense = hf_logits(tmp_path / "dense", ids)
    assert dense.std() > 0.1
    diff = (hf_logits(out, ids) - dense).abs().max().item()
    assert diff < 1e-5, diff
    model, spec = megatron_policy(out, parallel_1rank)
    assert spec.family == "qwen2_moe" and spec.qkv_bias
    assert (megatron_logits(model, ids) - dense).abs().max().item() < 1e-4


def test_cli_upcycle_and_errors(smollm2_2layer, tmp_path, capsys):
    from sao_megatron.convert.cli import main

    args = ["upcycle", "--hf", str(smollm2_2layer), "--out", str(tmp_path / "m")]
    assert main([*args, "--num-experts", "2", "--top-k", "3"]) == 2
    assert "1 <= top_k <= num_experts" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()
    save_hf("qwen3_moe", tmp_path / "q3")
    bad = ["upcycle", "--hf", str(tmp_path / "q3"), "--out", str(tmp_path / "m")]
    assert main([*bad, "--num-experts", "2", "--top-k", "1"]) == 2
    assert "upcycling supports ['LlamaForCausalLM', 'Qwen2ForCausalLM']" in capsys.readouterr().err
    assert main([*args, "--num-experts", "2", "--top-k", "1", "--router-init", "zeros"]) == 0
    config = read_hf_config(tmp_path / "m")
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (2, 1)
