import numpy as np
import pytest

from sao_megatron.data.demonstrations import run_demonstration
from sao_megatron.envs import make_env
from sao_megatron.envs.babyai import ACTION_NAMES, BabyAIConfig, describe_view


@pytest.mark.parametrize(
    "level", ["BabyAI-GoToLocal-v0", "BabyAI-PickupLoc-v0", "BabyAI-UnlockLocal-v0"]
)
def test_bot_solves_levels_reproducibly(level):
    env_a, env_b = make_env("babyai", level=level), make_env("babyai", level=level)
    for seed in range(4):
        a, b = run_demonstration(env_a, seed), run_demonstration(env_b, seed)
        assert a.observations == b.observations and a.actions == b.actions
        assert a.total_reward == 1.0 and a.terminated and a.info["success"]
        assert set(a.actions) <= set(ACTION_NAMES)


@pytest.mark.parametrize(
    "action", ["", "garbage", "go forward", "forward\nforward", "FORWARD", None]
)
def test_malformed_actions_end_episode(action):
    env = make_env("babyai")
    env.reset(0)
    r = env.step(action)
    assert (r.reward, r.done, r.info["error"]) == (0.0, True, "malformed")
    with pytest.raises(RuntimeError):
        env.step("left")


def test_malformed_as_no_op_and_binary_vs_shaped_reward():
    env = make_env("babyai", invalid_action_ends_episode=False)
    obs0 = env.reset(2)
    r = env.step("dance")
    assert not r.done and r.observation == obs0.split("\n", 1)[1]  # same view, no instructions
    shaped = make_env("babyai", binary_reward=False)
    demo = run_demonstration(shaped, 2)
    steps = len(demo.actions)
    assert demo.total_reward == pytest.approx(1 - 0.9 * steps / shaped.max_steps)


def test_describe_view_relative_positions():
    from minigrid.core.constants import COLOR_TO_IDX, OBJECT_TO_IDX

    img = np.zeros((7, 7, 3), dtype=np.uint8)
    img[:, :, 0] = OBJECT_TO_IDX["empty"]
    img[3, 6] = (OBJECT_TO_IDX["agent"], 0, 0)
    img[1, 4] = (OBJECT_TO_IDX["ball"], COLOR_TO_IDX["red"], 0)  # 2 forward, 2 left
    img[3, 5] = (OBJECT_TO_IDX["door"], COLOR_TO_IDX["blue"], 2)  # directly ahead, locked
    text = describe_view(img)
    assert text == (
        "You see: blue door (locked) 1 forward; red ball 2 forward 2 left\n"
        "In front of you: blue door\nYou carry: nothing"
    )


def test_bad_level_is_a_config_error():
    with pytest.raises(ValueError, match="babyai.level"):
        BabyAIConfig(level="CartPole-v1")
