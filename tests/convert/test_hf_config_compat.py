"""transformers-5 ``config.json`` names (``rope_parameters``, ``num_local_experts`` in Qwen MoE
families) give the same conversion spec and trainer model config as the transformers-4 names."""

from __future__ import annotations

import pytest

from sao_megatron.convert.model_config import model_config_from_hf
from sao_megatron.convert.spec import ConversionSpec, hf_config_compat
from sao_megatron.convert.upcycle import moe_config
from tests.convert.tiny_hf import FAMILIES, build_hf_model


def v4_config(family: str) -> dict:
    """The transformers-4.57 config.json dict of a tiny model of `family`."""
    return build_hf_model(family).config.to_dict()


def v5_config(family: str) -> dict:
    """The same config spelled as transformers 5 writes it: rope settings in rope_parameters,
    the expert count as num_local_experts."""
    cfg = v4_config(family)
    theta = cfg.pop("rope_theta")
    cfg.pop("rope_scaling", None)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    if "num_experts" in cfg:
        cfg["num_local_experts"] = cfg.pop("num_experts")
    return cfg


@pytest.mark.parametrize("family", FAMILIES)
def test_v5_names_give_the_same_spec_and_model_config(family):
    v4, v5 = v4_config(family), v5_config(family)
    assert "rope_theta" not in v5 and v5["rope_parameters"]["rope_theta"] == 10000.0
    assert ConversionSpec.from_hf_config(v5) == ConversionSpec.from_hf_config(v4)
    m4, m5 = model_config_from_hf(v4), model_config_from_hf(v5)
    assert m5 == m4
    assert m5.rope_theta == 10000.0
    if family != "qwen2" and family != "llama":
        assert m5.num_experts == 4 and ConversionSpec.from_hf_config(v5).num_experts == 4


def test_v5_rope_theta_that_is_not_the_default_is_read():
    v5 = v5_config("llama")
    v5["rope_parameters"]["rope_theta"] = 123456.0
    assert model_config_from_hf(v5).rope_theta == 123456.0
    assert hf_config_compat(v5)["rope_theta"] == 123456.0
    assert "rope_scaling" not in hf_config_compat(v5)


def test_mixtral_also_accepts_num_experts():
    v4 = v4_config("mixtral")
    alt = dict(v4)
    alt["num_experts"] = alt.pop("num_local_experts")
    assert ConversionSpec.from_hf_config(alt).num_experts == 4
    assert model_config_from_hf(alt) == model_config_from_hf(v4)


def test_scaled_rope_in_rope_parameters_is_refused_like_rope_scaling():
    v5 = v5_config("llama")
    v5["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    out = hf_config_compat(v5)
    assert out["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(ValueError, match="rope_scaling"):
        moe_config(v5, num_experts=4, top_k=2)


def test_conflicting_spellings_name_both_keys():
    v5 = v5_config("llama")
    v5["rope_theta"] = 5.0
    with pytest.raises(ValueError, match=r"rope_theta=5.0 and rope_parameters.rope_theta"):
        ConversionSpec.from_hf_config(v5)
    q = v4_config("qwen3_moe")
    q["num_local_experts"] = 8
    with pytest.raises(ValueError, match="num_experts=4 and num_local_experts=8"):
        model_config_from_hf(q)
    bad = v5_config("llama")
    bad["rope_parameters"] = 1e4
    with pytest.raises(ValueError, match="rope_parameters"):
        hf_config_compat(bad)


def test_upcycle_of_a_v5_config_carries_rope_theta():
    out = moe_config(v5_config("llama"), num_experts=4, top_k=2)
    assert out["rope_theta"] == 10000.0 and out["num_local_experts"] == 4
