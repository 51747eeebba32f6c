"""1-rank policy/value models: forward helpers, padding, value init from policy, freezing."""

from __future__ import annotations

import pytest
import torch

from sao_megatron.models import (
    VALUE_DEFAULT_FREEZE_PATTERNS,
    ModelInputs,
    apply_freeze,
    build_policy,
    build_value_model,
    causal_padding_mask,
    compute_policy_logprobs,
    compute_values,
    init_value_from_policy,
)
from sao_megatron.parallel.sharding import shard_map, shard_state_dict


def _ids(b, t, seed=0):
    return torch.randint(0, 128, (b, t), generator=torch.Generator().manual_seed(seed))


def test_policy_logprobs_match_float64_reference(parallel_1rank, tiny_moe):
    policy = build_policy(tiny_moe, parallel_1rank)
    ids = _ids(4, 12)
    batch = ModelInputs(ids, torch.ones_like(ids))
    lp, ent = compute_policy_logprobs(policy, parallel_1rank, batch, 0.7, micro_batch_size=2)
    with torch.no_grad():
        logits = policy[0](ids, batch.position_ids, causal_padding_mask(batch.attention_mask))
    assert logits.shape == (4, 12, 128)
    logp = torch.log_softmax(logits.double() / 0.7, -1)[:, :-1]
    ref = logp.gather(-1, ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(lp.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), -(logp.exp() * logp).sum(-1), rtol=1e-5, atol=1e-5)


def test_left_and_right_padding_do_not_change_outputs(parallel_1rank, tiny_moe):
    policy = build_policy(tiny_moe, parallel_1rank)
    value = build_value_model(tiny_moe, parallel_1rank)
    ids = _ids(1, 10)
    plain = ModelInputs(ids, torch.ones_like(ids))
    padded_ids = torch.cat([torch.full((1, 3), 5), ids, torch.full((1, 2), 7)], 1)
    mask = torch.cat([torch.zeros(1, 3), torch.ones(1, 10), torch.zeros(1, 2)], 1).long()
    padded = ModelInputs(padded_ids, mask)
    assert padded.position_ids[0, 3:13].tolist() == list(range(10))
    lp0, _ = compute_policy_logprobs(policy, parallel_1rank, plain)
    lp1, _ = compute_policy_logprobs(policy, parallel_1rank, padded)
    torch.testing.assert_close(lp1[:, 3:12], lp0, rtol=1e-5, atol=1e-5)
    v0 = compute_values(value, parallel_1rank, plain)
    v1 = compute_values(value, parallel_1rank, padded)
    torch.testing.assert_close(v1[:, 3:13], v0, rtol=1e-5, atol=1e-5)


def test_value_init_from_policy(parallel_1rank, tiny_moe):
    policy = build_policy(tiny_moe, parallel_1rank)[0]
    value = build_value_model(tiny_moe, parallel_1rank, value_head_init_std=0.5)[0]
    report = init_value_from_policy(value, policy.state_dict())
    assert report.head_initialized == ["output_layer.weight", "output_layer.bias"]
    assert "output_layer.weight" in report.ignored_policy_keys
    assert report.missing == [] and report.unexpected == []
    pstate = policy.state_dict()
    for key in report.loaded:
        if torch.is_tensor(pstate[key]):
            assert torch.equal(value.state_dict()[key], pstate[key]), key
    assert len(report.loaded) == len([k for k in pstate if not k.startswith("output_layer")])
    assert torch.all(value.output_layer.bias == 0)
    assert 0.2 < float(value.output_layer.weight.std()) < 1.0  # N(0, 0.5^2), 64 draws
    # values = w . final_norm(h) + b: check against the policy trunk's final hidden states
    ids = _ids(2, 8)
    batch = ModelInputs(ids, torch.ones_like(ids))
    values = compute_values([value], parallel_1rank, batch)
    hidden = {}
    policy.decoder.final_layernorm.register_forward_hook(lambda m, i, o: hidden.update(h=o))
    with torch.no_grad():
        policy(ids, batch.position_ids, causal_padding_mask(batch.attention_mask))
    ref = hidden["h"].transpose(0, 1) @ value.output_layer.weight[0]
    torch.testing.assert_close(values, ref, rtol=1e-5, atol=1e-5)


def test_value_init_reports_mismatch(parallel_1rank, tiny_moe):
    policy = build_policy(tiny_moe, parallel_1rank)[0]
    value = build_value_model(tiny_moe, parallel_1rank)[0]
    state = dict(policy.state_dict())
    del state["decoder.final_layernorm.weight"]
    state["decoder.extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match="final_layernorm.weight.*decoder.extra.weight"):
        init_value_from_policy(value, state)
    report = init_value_from_policy(value, state, strict=False)
    assert report.missing == ["decoder.final_layernorm.weight"]
    assert report.unexpected == ["decoder.extra.weight"]


def test_default_value_freeze(parallel_1rank, tiny_moe):
    value = build_value_model(tiny_moe, parallel_1rank)
    report = apply_freeze(value, VALUE_DEFAULT_FREEZE_PATTERNS)
    frozen = set(report.frozen_names)
    assert "embedding.word_embeddings.weight" in frozen
    for layer in range(2):
        for name in ("linear_qkv.weight", "linear_proj.weight"):
            assert f"decoder.layers.{layer}.self_attention.{name}" in frozen
    trainable = set(report.trainable_names)
    assert "output_layer.weight" in trainable and "decoder.layers.0.mlp.router.weight" in trainable
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight" in trainable
    assert "decoder.layers.0.self_attention.q_layernorm.weight" in trainable
    assert len(frozen) == 5
    # 128*64 embedding + 2 layers * (128*64 qkv + 64*64 proj)
    assert report.num_frozen_params == 128 * 64 + 2 * (128 * 64 + 64 * 64)
    total = sum(p.numel() for p in value[0].parameters())
    assert report.num_trainable_params == total - report.num_frozen_params
    assert all(p.requires_grad == (n in trainable) for n, p in value[0].named_parameters())


def test_freeze_pattern_matching_nothing_is_an_error(parallel_1rank, tiny_moe):
    value = build_value_model(tiny_moe, parallel_1rank)
    with pytest.raises(ValueError, match=r"\['self_atention'\]"):
        apply_freeze(value, ["embedding", "self_atention"])
    with pytest.raises(ValueError, match="not a valid regular expression"):
        apply_freeze(value, ["("])


def test_shard_map_reads_splits_from_the_model(parallel_1rank, tiny_moe):
    """TP dims and SwiGLU halves come from Megatron's parameter attributes; experts carry their
    global index; the value head is replicated."""
    policy = build_policy(tiny_moe, parallel_1rank)[0]
    value = build_value_model(tiny_moe, parallel_1rank)[0]
    shards = {s.global_name: s for s in shard_map(policy)}
    fc1 = shards["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert (fc1.tp_dim, fc1.glu, fc1.expert, fc1.global_expert, fc1.global_layer) == (
        0,
        True,
        True,
        3,
        1,
    )
    assert (
        shards["decoder.layers.0.self_attention.linear_proj.weight"].tp_dim,
        shards["decoder.layers.0.self_attention.linear_proj.weight"].glu,
    ) == (1, False)
    assert shards["decoder.layers.0.mlp.router.weight"].tp_dim is None
    assert shards["embedding.word_embeddings.weight"].tp_dim == 0
    assert shards["output_layer.weight"].tp_dim == 0
    assert not shards["decoder.layers.0.self_attention.linear_qkv._extra_state"].is_param
    head = {s.global_name: s for s in shard_map(value)}
    assert head["output_layer.weight"].tp_dim is None and head["output_layer.bias"].is_param


def test_shard_state_dict_identity_at_one_rank(parallel_1rank, tiny_moe):
    policy = build_policy(tiny_moe, parallel_1rank)[0]
    full = policy.state_dict()
    local = shard_state_dict(full, policy, **parallel_1rank.shard_coords())
    assert local.keys() == full.keys()
    assert all(torch.equal(local[k], full[k]) for k in full if torch.is_tensor(full[k]))


def test_qwen2_moe_shaped_variant_builds_and_matches_reference(parallel_1rank):
    """Shared expert with gate, a dense layer, q/k/v biases, tied embeddings, pre-softmax router."""
    from sao_megatron.models import MoEModelConfig
    from tests.conftest import tiny_moe_kwargs

    cfg = MoEModelConfig(
        **{**tiny_moe_kwargs(), "qk_layernorm": False},
        shared_expert_intermediate_size=48,
        shared_expert_gate=True,
        mlp_only_layers=[1],
        intermediate_size=80,
        attention_bias=True,
        tie_word_embeddings=True,
        norm_topk_prob=False,
    )
    policy = build_policy(cfg, parallel_1rank)
    names = dict(policy[0].named_parameters())
    assert "decoder.layers.0.mlp.shared_experts.gate_weight" in names
    assert names["decoder.layers.1.mlp.linear_fc1.weight"].shape == (160, 64)  # dense SwiGLU
    assert "decoder.layers.0.self_attention.linear_qkv.bias" in names
    assert "output_layer.weight" not in names  # tied to the embedding
    ids = _ids(2, 8)
    batch = ModelInputs(ids, torch.ones_like(ids))
    lp, _ = compute_policy_logprobs(policy, parallel_1rank, batch)
    with torch.no_grad():
        logits = policy[0](ids, batch.position_ids, causal_padding_mask(batch.attention_mask))
    ref = torch.log_softmax(logits.double(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(lp.double(), ref, rtol=1e-5, atol=1e-5)
