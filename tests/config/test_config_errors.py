"""load_config error messages: close-match suggestions for unknown keys, removed keys, and
validation errors of a reused component named after the section it sits in."""

from __future__ import annotations

import pytest

from sao_megatron.configs import load_config
from sao_megatron.trainer.job import JobConfig


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "rl.stpes=3",
            "unknown config key 'rl.stpes': not a field of RLConfig; did you mean 'rl.steps'?",
        ),
        (
            "policy_optim.lrr=1",
            "unknown config key 'policy_optim.lrr': not a field of OptimizerConfig; did you "
            "mean 'policy_optim.lr'?",
        ),
        (
            "rll.steps=3",
            "unknown config key 'rll': not a field of JobConfig; did you mean 'rl' or 'rollout'?",
        ),
        (
            "checkpoint.savedir=x",
            "unknown config key 'checkpoint.savedir': not a field of CheckpointConfig; did you "
            "mean 'checkpoint.save_dir' or 'checkpoint.save_interval'?",
        ),
        (
            "rl.zzz=1",
            "unknown config key 'rl.zzz': not a field of RLConfig; check the spelling against "
            "`sao-train --help`",
        ),
        (
            "checkpoint.async_save=true",
            "config key 'checkpoint.async_save' was removed: saving is synchronous "
            "(asynchronous saving was never implemented); delete the key",
        ),
    ],
)
def test_unknown_and_removed_keys(override, message):
    with pytest.raises(ValueError) as info:
        load_config(JobConfig, None, [override])
    assert str(info.value) == message


def test_unknown_key_in_yaml_file_gets_a_suggestion(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text("sft:\n  optim:\n    warmup_step: 3\n")
    with pytest.raises(ValueError, match=r"'sft.optim.warmup_step'.*did you mean 'sft.optim.w"):
        load_config(JobConfig, f)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("policy_optim.lr=0", "policy_optim.lr=0.0: must be > 0"),
        ("value_optim.lr=-1", "value_optim.lr=-1.0: must be > 0"),
        ("sft.optim.lr=-2", "sft.optim.lr=-2.0: must be > 0"),
        ("value_optim.adam_beta2=1", "value_optim.adam_beta2=1.0: must be in [0, 1)"),
        (
            "sft.optim.decay_steps=null",
            "sft.optim.decay_style='cosine' needs sft.optim.decay_steps > 0",
        ),
        ("rl.steps=-1", "rl.steps=-1: must be >= 0"),  # a section with its own name: unchanged
    ],
)
def test_optimizer_errors_name_the_section(override, message):
    with pytest.raises(ValueError) as info:
        load_config(JobConfig, None, [override])
    assert str(info.value) == message
