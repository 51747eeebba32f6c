"""SAO's defaults are the paper's settings (issue: long horizons, item 4), but for the policy loss:
PPO's clip on the behaviour log-probs instead of the DIS band (measured: docs/ALGORITHM.md)."""

import pytest
import torch

from sao_megatron.algorithm.advantages import length_adaptive_lambda
from sao_megatron.algorithm.config import AlgorithmConfig, ImportanceConfig, SAOConfig
from sao_megatron.trainer.job import JobConfig


def test_sao_defaults_are_the_papers_settings():
    sao = SAOConfig()
    assert sao.advantage_granularity == "action_token"  # GAE over action tokens, obs skipped
    assert sao.lam_policy is None and sao.policy_lambda_alpha == 1.5  # 1 - 1/(1.5 l)
    assert sao.lam_value == 1.0 and sao.value_updates_per_policy_update == 2
    imp = ImportanceConfig()
    assert (imp.eps_low, imp.eps_high) == (0.3, 5.0)
    assert AlgorithmConfig().name == "sao"
    assert AlgorithmConfig().importance.weighting == "ppo_clip"  # the documented deviation
    job = JobConfig()
    assert job.value_optim.lr == 5 * job.policy_optim.lr and job.value_optim.warmup_steps == 10
    frozen = " ".join(job.value.freeze_patterns)  # critic attention (and embeddings) frozen
    assert "linear_qkv" in frozen and "linear_proj" in frozen
    # l = 1, 2, 10 GAE steps -> 1 - 1/1.5, 1 - 1/3, 1 - 1/15
    lam = length_adaptive_lambda(torch.tensor([1, 2, 10]), 1.5)
    torch.testing.assert_close(
        lam, torch.tensor([1 - 1 / 1.5, 1 - 1 / 3, 1 - 1 / 15], dtype=lam.dtype)
    )


def test_a_fixed_lam_policy_turns_the_adaptive_lambda_off():
    assert SAOConfig(lam_policy=0.9).policy_lambda_alpha is None


def test_no_lambda_at_all_is_an_error_naming_both_fields():
    with pytest.raises(ValueError, match="lam_policy and algorithm.sao.length_adaptive_alpha"):
        SAOConfig(length_adaptive_alpha=None)
