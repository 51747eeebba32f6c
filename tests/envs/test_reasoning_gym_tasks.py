import re
import subprocess
import sys
import threading

import pytest
import reasoning_gym

from sao_megatron.envs import make_env
from sao_megatron.envs.reasoning_gym_tasks import ReasoningGymConfig, ReasoningGymEnv
from sao_megatron.envs.rewards import exact_match_reward, math_verify_reward, normalize_whitespace


def test_exact_match_is_binary_and_rejects_superstrings():
    assert exact_match_reward("17", "7") == 0.0
    assert exact_match_reward("7 7", "7") == 0.0
    assert exact_match_reward("-7", "7") == 0.0
    assert exact_match_reward("7", "7") == 1.0
    assert exact_match_reward("  7\n", "7") == 1.0
    assert exact_match_reward("a \t b", "a b") == 1.0
    assert exact_match_reward(None, "7") == 0.0
    assert normalize_whitespace("\ta  b\n c ") == "a b c"
    # why we do not use reasoning-gym's scorer as the binary reward: it gives substring credit
    ds = reasoning_gym.create_dataset("chain_sum", seed=0, size=1)
    assert ds.score_answer("17", {"answer": "7"}) == 0.5


def test_math_verify_reward():
    assert math_verify_reward("$\\frac{1}{2}$", "0.5") == 1.0
    assert math_verify_reward("\\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert math_verify_reward("The answer is $\\frac{2}{4}$.", "0.5") == 1.0
    assert math_verify_reward("$\\frac{1}{3}$", "0.5") == 0.0
    assert math_verify_reward("\\boxed{17}", "7") == 0.0
    assert math_verify_reward("", "0.5") == 0.0
    assert math_verify_reward("no math here", "0.5") == 0.0


def test_math_verify_reward_from_worker_threads():
    results = []

    def work(ans):
        results.append(math_verify_reward(ans, "0.5"))

    threads = [threading.Thread(target=work, args=(a,)) for a in ["$\\frac{1}{2}$", "$3$"]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [0.0, 1.0]


# A fresh process: reasoning-gym is imported on first use (not with sao_megatron.envs), here by
# 8 threads at once, as a rollout's worker threads do; every one must see every dataset.
FIRST_USE_FROM_THREADS = """
import sys, threading
from sao_megatron.envs import make_env
assert "reasoning_gym" not in sys.modules, "imported with sao_megatron.envs"
out, errors = {}, []
def work(i):
    try:
        out[i] = make_env("chain_sum").reset(i)
    except BaseException as e:
        errors.append(repr(e))
threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert not errors, errors
assert len(out) == 8 and all("=" in q for q in out.values()), out
print("ok", len(out))
"""


def test_reasoning_gym_first_imported_by_eight_threads_at_once():
    p = subprocess.run(
        [sys.executable, "-c", FIRST_USE_FROM_THREADS], capture_output=True, text=True, check=False
    )
    assert p.returncode == 0 and p.stdout.strip() == "ok 8", p.stderr[-3000:]


@pytest.mark.parametrize("name", ["chain_sum", "basic_arithmetic"])
def test_reproducible_and_gold_scores_one(name):
    a, b = make_env(name), make_env(name)
    questions = set()
    for seed in range(20):
        qa, qb = a.reset(seed), b.reset(seed)
        assert qa == qb and a.gold == b.gold
        questions.add(qa)
        gold = a.gold_action()
        # reasoning-gym's own scorer agrees on the gold answer
        ds = reasoning_gym.create_dataset(name, seed=seed, size=1)
        assert ds[0]["answer"] == gold
        assert ds.score_answer(gold, ds[0]) == 1.0
        r = a.step(gold)
        assert (r.reward, r.done, r.info["success"]) == (1.0, True, True)
        assert a.max_steps == 1
    assert len(questions) == 20


@pytest.mark.parametrize("action", ["", "garbage", "17 + 3", None, "1\n2\n3", "\\boxed{"])
def test_bad_answers_score_zero_and_end(action):
    for reward in ["exact_match", "math_verify"]:
        env = make_env("chain_sum", reward=reward)
        env.reset(3)
        r = env.step(action)
        assert (r.reward, r.done, r.observation) == (0.0, True, "")
        with pytest.raises(RuntimeError):
            env.step("1")


def test_difficulty_knobs_are_applied():
    env = make_env(
        "chain_sum", difficulty={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    )
    for seed in range(20):
        q = env.reset(seed)
        nums = re.findall(r"\d+", q.split(":")[1])
        assert len(nums) == 2 and all(len(n) == 1 for n in nums)
    env = make_env(
        "basic_arithmetic",
        difficulty={
            "operators": ["*"],
            "allow_parentheses": False,
            "allow_negation": False,
            "max_terms": 3,
        },
    )
    for seed in range(10):
        q = env.reset(seed)
        assert "+" not in q and "*" in q


def test_math_verify_task_uses_boxed_gold():
    env = make_env("basic_arithmetic", reward="math_verify")
    obs = env.reset(1)
    assert "\\boxed{}" in obs
    assert env.gold_action() == f"\\boxed{{{env.gold}}}"
    assert env.step(env.gold_action()).reward == 1.0
    env.reset(1)
    assert env.step(env.gold).reward == 1.0  # a bare number is also parsed by math-verify


def test_generic_reasoning_gym_env_and_errors():
    env = make_env("reasoning_gym", dataset="gcd", reward="exact_match")
    env.reset(0)
    assert env.name == "gcd" and env.step(env.gold_action()).reward == 1.0
    with pytest.raises(ValueError, match="reasoning_gym.dataset"):
        ReasoningGymConfig(dataset="no_such_task")
    with pytest.raises(ValueError, match="reasoning_gym.reward"):
        ReasoningGymConfig(reward="partial")
    with pytest.raises(
        ValueError,
        match=r"^chain_sum\.difficulty\.max_digitz: unknown difficulty knob.*'max_digits'",
    ):
        make_env("chain_sum", difficulty={"max_digitz": 2})
    with pytest.raises(ValueError, match="max_terms must be >= min_terms"):
        make_env("chain_sum", difficulty={"min_terms": 4, "max_terms": 2})
    with pytest.raises(ValueError, match="'dataset' is fixed"):
        make_env("chain_sum", dataset="gcd")
    assert isinstance(ReasoningGymEnv(ReasoningGymConfig()), ReasoningGymEnv)
