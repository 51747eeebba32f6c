import pytest

from sao_megatron.envs import (
    Environment,
    EnvSpec,
    StepResult,
    SupportsGoldAction,
    make_env,
    register_env,
    registered_envs,
)
from sao_megatron.envs.base import _REGISTRY


def test_builtins_registered_and_satisfy_protocols():
    names = registered_envs()
    for name in ["hanoi", "chain_sum", "basic_arithmetic", "reasoning_gym", "babyai"]:
        assert name in names
    for name in ["hanoi", "chain_sum", "basic_arithmetic", "babyai"]:
        env = make_env(name)
        assert isinstance(env, Environment) and isinstance(env, SupportsGoldAction)


def test_unknown_name_lists_known_ones():
    with pytest.raises(ValueError, match="unknown environment 'hanio'.*hanoi"):
        make_env("hanio")


def test_register_your_own_env_and_build_from_spec():
    @register_env("test_echo")
    class Echo:
        name = "test_echo"
        max_steps = 1

        def __init__(self, word: str = "hi"):
            self.word = word

        def reset(self, seed: int) -> str:
            self.seed = seed
            return f"say {self.word}{seed}"

        def step(self, action: str) -> StepResult:
            ok = action == f"{self.word}{self.seed}"
            return StepResult(observation="", reward=float(ok), done=True)

    try:
        env = EnvSpec(name="test_echo", options={"word": "yo"}).build()
        assert isinstance(env, Environment)
        assert env.reset(3) == "say yo3"
        assert env.step("yo3").reward == 1.0
        with pytest.raises(ValueError, match="already registered"):
            register_env("test_echo")(lambda: None)
    finally:
        _REGISTRY.pop("test_echo", None)


def test_env_spec_validation():
    with pytest.raises(ValueError, match="EnvSpec.name"):
        EnvSpec(name="")
    with pytest.raises(ValueError, match="EnvSpec.weight"):
        EnvSpec(name="hanoi", weight=0)
    env = EnvSpec(name="hanoi", options={"horizon": 9}).build()
    assert env.max_steps == 9


def test_configs_fill_from_yaml_with_omegaconf():
    from omegaconf import OmegaConf

    from sao_megatron.data.demonstrations import DemonstrationConfig
    from sao_megatron.data.episode import EpisodeFormatConfig
    from sao_megatron.data.tokenizer import TokenizerConfig
    from sao_megatron.envs.hanoi import HanoiConfig
    from sao_megatron.envs.reasoning_gym_tasks import ReasoningGymConfig

    yaml = OmegaConf.create(
        "envs:\n- {name: hanoi, options: {horizon: 200}}\n"
        "- {name: chain_sum, options: {difficulty: {max_digits: 2}}}\nnum_episodes: 3\n"
    )
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DemonstrationConfig), yaml))
    assert cfg.num_episodes == 3 and [e.build().name for e in cfg.envs] == ["hanoi", "chain_sum"]
    assert cfg.envs[0].build().max_steps == 200
    for cls in [HanoiConfig, ReasoningGymConfig, TokenizerConfig, EpisodeFormatConfig]:
        assert isinstance(OmegaConf.to_object(OmegaConf.structured(cls)), cls)
    with pytest.raises(ValueError, match="hanoi.horizon"):
        OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(HanoiConfig), {"horizon": -3}))
