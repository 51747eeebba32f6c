"""A job that starts from a pretrained HF model (``init_from_hf``): the model section comes from
config.json, the policy's first forward equals transformers' logits, the critic's trunk is the
policy's, and conflicting settings are refused with the field named."""

from __future__ import annotations

import pytest
import torch

from sao_megatron.configs import load_config
from sao_megatron.trainer import runtime
from sao_megatron.trainer.controller import Controller
from sao_megatron.trainer.job import JobConfig, _default_model, model_from_hf
from tests.real_model.conftest import real_text_ids
from tests.real_model.megatron_util import hf_logits, megatron_logits

# fp32 on both sides; the 2-layer conversion test measures 3.4e-05 on logits of std 8.3.
LOGIT_TOL = 2e-4


def job_overrides(hf_dir, tmp_path, *extra: str) -> list[str]:
    return [
        f"run_dir={tmp_path / 'run'}",
        "stages=[rl]",
        f"init_from_hf={hf_dir}",
        "tokenizer.kind=hf",
        f"tokenizer.path={hf_dir}",
        "episode.format=chat_template",
        *extra,
    ]


def test_policy_starts_from_the_hf_weights(smollm2_2layer, parallel_1rank, tmp_path):
    job = load_config(JobConfig, None, job_overrides(smollm2_2layer, tmp_path))
    m = job.model
    assert (m.num_hidden_layers, m.hidden_size, m.num_attention_heads) == (2, 576, 9)
    assert (m.num_key_value_heads, m.vocab_size, m.rope_theta) == (3, 49152, 100000.0)
    assert m.tie_word_embeddings and m.mlp_only_layers == [0, 1] and not m.qk_layernorm

    job.run_path.mkdir(parents=True)  # sao-train creates it
    ctrl = Controller(job, parallel_1rank)
    ctrl.prepare()
    assert ctrl.hf_config["architectures"] == ["LlamaForCausalLM"]
    assert ctrl.spec.family == "llama" and ctrl.spec.tie_word_embeddings
    assert ctrl.tokenizer.kind == "hf" and ctrl.tokenizer.vocab_size == 49152

    policy = runtime.build_policy_state(ctrl.job, parallel_1rank, ctrl.job.policy_optim)
    value = runtime.build_value_state(ctrl.job, parallel_1rank, policy.unwrapped)
    ids = real_text_ids(smollm2_2layer)
    chunk = policy.unwrapped[0].eval()
    logits = megatron_logits(chunk, ids)
    reference = hf_logits(smollm2_2layer, ids)
    diff = (logits - reference).abs().max().item()
    print(f"init_from_hf policy vs transformers fp32: max |logit diff| = {diff:.3g}")
    assert logits.shape == reference.shape == (2, 48, 49152)
    assert diff < LOGIT_TOL and reference.std() > 1.0
    assert torch.equal(logits.argmax(-1), reference.argmax(-1))

    # the critic's trunk is the pretrained policy's (everything but the value head)
    pol = dict(chunk.named_parameters())
    shared = 0
    for name, p in value.unwrapped[0].named_parameters():
        if name in pol:
            assert torch.equal(p, pol[name]), name
            shared += 1
    assert shared == len(pol) - ("output_layer.weight" in pol)

    # a random-init policy would differ: the HF load did the work
    random_job = load_config(JobConfig, None, [f"run_dir={tmp_path / 'r'}", "stages=[rl]"])
    assert random_job.init_from_hf is None and random_job.model.num_hidden_layers == 4


def test_conflicting_model_field_is_refused(smollm2_2layer, tmp_path):
    extra = ("model.hidden_size=512",)
    with pytest.raises(ValueError, match=r"model\.hidden_size=512 but config.json gives 576"):
        load_config(JobConfig, None, job_overrides(smollm2_2layer, tmp_path, *extra))


def test_training_fields_are_kept(smollm2_2layer, tmp_path):
    extra = ("model.max_position_embeddings=512", "model.router_aux_loss_coef=0.01")
    job = load_config(JobConfig, None, job_overrides(smollm2_2layer, tmp_path, *extra))
    assert job.model.max_position_embeddings == 512 and job.model.router_aux_loss_coef == 0.01
    too_long = ("model.max_position_embeddings=100000",)
    with pytest.raises(ValueError, match="max_position_embeddings=100000"):
        load_config(JobConfig, None, job_overrides(smollm2_2layer, tmp_path, *too_long))


def test_a_set_value_equal_to_the_job_default_counts_as_set(smollm2_2layer, tmp_path):
    """The job default model has max_position_embeddings 2048 and hidden_size 256; the HF model
    8192 and 576. Written out, 2048 is kept (not read as unset and replaced by 8192) and 256 is
    refused; left out, both come from config.json. In Python (no `load_config`) the rule falls
    back on 'differs from the default'."""
    keep = ("model.max_position_embeddings=2048",)
    job = load_config(JobConfig, None, job_overrides(smollm2_2layer, tmp_path, *keep))
    assert job.model.max_position_embeddings == 2048 and job.model.hidden_size == 576
    plain = load_config(JobConfig, None, job_overrides(smollm2_2layer, tmp_path))
    assert plain.model.max_position_embeddings == 8192
    with pytest.raises(ValueError, match=r"model\.hidden_size=256 but config.json gives 576"):
        load_config(
            JobConfig, None, job_overrides(smollm2_2layer, tmp_path, "model.hidden_size=256")
        )
    yaml = tmp_path / "job.yaml"  # the same from a file's model section
    yaml.write_text("model:\n  max_position_embeddings: 2048\n")
    assert load_config(JobConfig, yaml, job_overrides(smollm2_2layer, tmp_path)).model == job.model
    default = _default_model()
    assert model_from_hf(default, str(smollm2_2layer)).max_position_embeddings == 8192
    assert model_from_hf(default, str(smollm2_2layer), {"max_position_embeddings"}) == job.model


def test_tokenizer_must_be_the_models(smollm2_2layer, tmp_path):
    over = job_overrides(smollm2_2layer, tmp_path)
    wrong_kind = [o for o in over if not o.startswith("tokenizer.")]
    with pytest.raises(ValueError, match="tokenizer.kind=hf and tokenizer.path="):
        load_config(JobConfig, None, wrong_kind)
    other = [o for o in over if not o.startswith("tokenizer.path")] + [f"tokenizer.path={tmp_path}"]
    with pytest.raises(ValueError, match="needs the model's own tokenizer"):
        load_config(JobConfig, None, other)


def test_missing_folder_is_a_config_error(tmp_path):
    over = job_overrides(tmp_path / "nope", tmp_path)
    with pytest.raises(ValueError, match="init_from_hf=.*config.json"):
        load_config(JobConfig, None, over)
