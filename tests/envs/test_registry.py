from pathlib import Path

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

REPO = Path(__file__).resolve().parents[2]


def test_builtins_registered_and_satisfy_protocols():
    names = registered_envs()
    for name in ["hanoi", "chain_sum", "basic_arithmetic", "reasoning_gym", "babyai"]:
        assert name in names
    for name in ["hanoi", "chain_sum", "basic_arithmetic", "babyai"]:
        env = make_env(name)
        assert isinstance(env, Environment) and isinstance(env, SupportsGoldAction)


def test_unknown_name_lists_known_ones():
    with pytest.raises(ValueError, match="'hanio' is not a registered environment.*hanoi"):
        make_env("hanio")


@pytest.mark.parametrize(
    ("override", "path", "typo", "suggestion"),
    [
        ("tasks.train=[{name: hanoii}]", "tasks.train[0]", "hanoii", "hanoi"),
        (
            "tasks.eval=[{name: hanoi}, {name: chain_sun}]",
            "tasks.eval[1]",
            "chain_sun",
            "chain_sum",
        ),
        (
            "demonstrations.envs=[{name: basic_arithmetc}]",
            "demonstrations.envs[0]",
            "basic_arithmetc",
            "basic_arithmetic",
        ),
    ],
)
def test_misspelt_env_name_fails_when_the_config_loads(override, path, typo, suggestion):
    """Issue 19.5: found at config load (before SFT and engine start), with a suggestion, at
    the entry's path (issue 31.3)."""
    from sao_megatron.configs import load_config
    from sao_megatron.trainer.job import JobConfig

    with pytest.raises(ValueError) as info:
        load_config(JobConfig, REPO / "examples/configs/quickstart.yaml", [override])
    assert str(info.value).startswith(
        f"{path}.name={typo!r} is not a registered environment; did you mean {suggestion!r}"
    )


def test_unknown_name_without_a_close_match_and_optional_envs():
    with pytest.raises(ValueError) as e:
        EnvSpec(name="zzzzzz")
    assert "did you mean" not in str(e.value) and "registered: [" in str(e.value)
    from sao_megatron.envs.base import OPTIONAL_ENVS, check_env_name

    assert OPTIONAL_ENVS == {"babyai": "minigrid"}
    saved = _REGISTRY.pop("babyai")
    try:
        with pytest.raises(ValueError, match="pip install minigrid"):
            check_env_name("babyai")
    finally:
        _REGISTRY["babyai"] = saved


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


def test_task_id_is_one_format_for_every_split_and_stream():
    from sao_megatron.envs import task_id
    from sao_megatron.trainer.run_state import task_index

    assert task_id("hanoi", 7) == "hanoi:7"
    assert task_id("hanoi", 7, split="eval") == "eval/hanoi:7"
    assert task_id("hanoi", 1234, draw=5) == "hanoi:1234:5"
    assert task_index(task_id("gem:game_X", 3, draw=11)) == 11  # ':' in a name is allowed
    for bad in ("", "a/b", "a:b"):
        with pytest.raises(ValueError, match="split"):
            task_id("hanoi", 1, split=bad)
    with pytest.raises(ValueError, match="draw"):
        task_id("hanoi", 1, draw=-1)
