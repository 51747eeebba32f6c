"""AlgorithmConfig: defaults, algorithm-dependent importance default, field-naming errors, YAML."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from sao_megatron.algorithm.config import AlgorithmConfig


def test_defaults_follow_design():
    cfg = AlgorithmConfig()
    assert (cfg.name, cfg.advantage_granularity, cfg.importance_weighting) == (
        "sao",
        "action_token",
        "dis_band",
    )
    assert (cfg.eps_low, cfg.eps_high, cfg.value_updates_per_policy_update) == (0.3, 5.0, 2)
    assert cfg.loss_aggregation == "token_mean" and cfg.bootstrap_truncated is True
    grpo = AlgorithmConfig(name="grpo")
    assert grpo.importance_weighting == "none" and grpo.grpo_group_size == 8


@pytest.mark.parametrize(
    "field,value",
    [
        ("name", "ppo"),
        ("advantage_granularity", "token"),
        ("importance_weighting", "is"),
        ("loss_aggregation", "mean"),
        ("kl_estimator", "k4"),
        ("gamma", 1.5),
        ("lam_policy", -0.1),
        ("lam_value", float("nan")),
        ("length_adaptive_alpha", 0.0),
        ("eps_low", 1.0),
        ("eps_low", 0.0),
        ("eps_high", -1.0),
        ("tis_cap", 0.0),
        ("mis_beta", 1.0),
        ("seq_geo_low", 1.5),
        ("seq_geo_high", 0.5),
        ("decoupled_weight_cap", -2.0),
        ("clip_low", 1.0),
        ("clip_high", 0.0),
        ("dual_clip", 1.0),
        ("value_clip", 0.0),
        ("entropy_coef", -0.1),
        ("kl_coef", "high"),
        ("grpo_eps", 0.0),
        ("grpo_group_size", 0),
        ("value_updates_per_policy_update", 1.5),
        ("max_staleness", -1),
    ],
)
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"algorithm\.{field}="):
        AlgorithmConfig(**{field: value})


def test_bool_fields_type_checked():
    with pytest.raises(TypeError, match="algorithm.whiten_advantages"):
        AlgorithmConfig(whiten_advantages="yes")


@pytest.mark.parametrize("name,kind", [("sao", "decoupled_ppo"), ("grpo", "dis_band")])
def test_importance_weighting_must_fit_algorithm(name, kind):
    with pytest.raises(ValueError, match="does not apply"):
        AlgorithmConfig(name=name, importance_weighting=kind)


def test_fills_from_yaml_with_dotted_override():
    base = OmegaConf.structured(AlgorithmConfig)
    yaml = OmegaConf.create("name: grpo\nimportance_weighting: tis\nclip_high: 0.28\n")
    cli = OmegaConf.from_dotlist(["grpo_std_normalize=false"])
    cfg = OmegaConf.to_object(OmegaConf.merge(base, yaml, cli))
    assert isinstance(cfg, AlgorithmConfig)
    assert (cfg.name, cfg.importance_weighting, cfg.clip_high) == ("grpo", "tis", 0.28)
    assert cfg.grpo_std_normalize is False
    with pytest.raises(ValueError, match="algorithm.eps_low"):
        OmegaConf.to_object(OmegaConf.merge(base, OmegaConf.create("eps_low: 2.0")))
