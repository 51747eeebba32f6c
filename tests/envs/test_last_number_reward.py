"""The last-number reward: the replies SmolLM2-135M-Instruct actually writes (sentences) score by
their last number; no partial credit."""

from __future__ import annotations

import pytest

from sao_megatron.envs import make_env
from sao_megatron.envs.rewards import REWARDS, last_number, last_number_reward


@pytest.mark.parametrize(
    ("reply", "gold", "reward"),
    [
        # replies sampled from the de-quantised SmolLM2 (greedy / temperature 1) on chain_sum
        ("The final answer to the given arithmetic problem is 6.", "6", 1.0),
        ("The final answer to the arithmetic problem is 58 + 26 = 84.", "84", 1.0),
        ("10.", "6", 0.0),
        ("24 is the answer to 44 + 27.", "71", 0.0),
        ("The final answer is 275", "142", 0.0),
        ("5 - 9 = -4", "-4", 1.0),
        ("5 - 9 = 4", "-4", 0.0),
        ("17", "7", 0.0),
        ("7 + 1 = 8", "7", 0.0),
        ("\\boxed{1,234}", "1234", 1.0),
        ("3.50", "3.5", 1.0),
        ("no number here", "3", 0.0),
        ("", "3", 0.0),
    ],
)
def test_last_number_reward(reply, gold, reward):
    assert last_number_reward(reply, gold) == reward


def test_last_number_parsing():
    assert last_number("a -12 b 7") == 7.0
    assert last_number("x=-12") == -12.0
    assert last_number("1,000,000 and 2") == 2.0
    assert last_number("1,000,000") == 1_000_000.0
    assert last_number("v1.2.3") is not None  # digits inside words still count
    assert last_number("none") is None
    assert last_number(None) is None


def test_non_numeric_gold_falls_back_to_exact_match():
    assert last_number_reward("True", "True") == 1.0
    assert last_number_reward("it is True", "True") == 0.0
    assert last_number_reward("x = 3", "x = 3") == 1.0  # gold "x = 3" is not a bare number


def test_env_scores_a_sentence_with_the_gold_number():
    assert "last_number" in REWARDS
    env = make_env("chain_sum", reward="last_number", difficulty={"max_digits": 1})
    obs = env.reset(seed=3)
    assert obs.endswith("\nReply with only the final answer.")
    result = env.step(f"The final answer is {env.gold}.")
    assert result.reward == 1.0 and result.info["success"] and result.done
    env.reset(seed=3)
    assert env.step(f"The final answer is {int(env.gold) + 1}.").reward == 0.0
