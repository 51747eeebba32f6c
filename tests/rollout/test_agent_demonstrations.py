"""Gold demonstrations of agents: the SFT tokens of a gold conversation are exactly what the
gateway records when the agent (the calculator example, unchanged, on the official `openai`
client over HTTP) talks to a policy that emits the gold replies — for SmolLM2's ChatML template
and for the from-scratch sentencepiece tokenizer with the episode-marker chat template. No
engine: the scripted engine returns the demonstration's action ids."""

from __future__ import annotations

import asyncio

import pytest
import torch

from sao_megatron.data.chat_format import ChatTemplateFormatter, build_formatter
from sao_megatron.data.demonstrations import (
    DemonstrationConfig,
    demonstration_sequences,
    generate_demonstrations,
    train_tokenizer_for_envs,
)
from sao_megatron.data.episode import EpisodeFormatConfig
from sao_megatron.data.marker_chat import MARKER_CHAT_TEMPLATE, MarkerChatTokenizer
from sao_megatron.data.tokenizer import HFTokenizer, TokenizerConfig
from sao_megatron.envs.base import EnvSpec
from sao_megatron.rollout.config import RolloutConfig
from sao_megatron.rollout.engine import Generation
from sao_megatron.rollout.gateway import ChatGateway, run_agent_episode
from sao_megatron.rollout.gateway.demonstration import assistant_text, replay_conversation
from sao_megatron.rollout.status import EpisodeStatus
from tests.rollout.test_gateway import calc, smollm2_tok_dir  # noqa: F401 (fixture)

AGENT = "examples/agents/calculator_agent.py"
SPEC = EnvSpec(
    name="agent",
    options={
        "agent": f"{AGENT}:run",
        "task": f"{AGENT}:make_task",
        "demonstration": f"{AGENT}:demonstrate",
        "env_name": "calculator",
    },
)
CONFIG = RolloutConfig(max_model_len=4096, max_tokens_per_action=256, temperature=1.0, seed=3)


@pytest.fixture(scope="module")
def marker_formatter():
    """The from-scratch path: a sentencepiece tokenizer trained on the agent's demonstrations
    (as `sao-train` trains it) under the episode-marker chat template."""
    demos = DemonstrationConfig(envs=[SPEC], num_episodes=40)
    tok = train_tokenizer_for_envs(
        demos, TokenizerConfig(vocab_size=600), EpisodeFormatConfig(format="chat_template")
    )
    return build_formatter(tok, EpisodeFormatConfig(format="chat_template"))


@pytest.fixture(scope="module")
def smollm2_formatter(smollm2_tok_dir):  # noqa: F811
    return ChatTemplateFormatter(HFTokenizer(str(smollm2_tok_dir)))


@pytest.fixture(params=["smollm2", "marker"])
def formatter(request, smollm2_formatter, marker_formatter):
    return smollm2_formatter if request.param == "smollm2" else marker_formatter


class GoldEngine:
    """generate(...): the next gold assistant message's action ids (the demonstration's own)."""

    def __init__(self, actions: list[list[int]]) -> None:
        self.actions, self.prompts = actions, []

    async def __call__(self, episode_id, prompt, max_tokens, seed) -> Generation:
        ids = self.actions[len(self.prompts)]
        self.prompts.append(list(prompt))
        return Generation(list(ids), [-0.5] * len(ids), [0] * len(ids), "stop")


async def _through_gateway(formatter, task, actions):
    gw = await ChatGateway().start()
    try:
        return await run_agent_episode(
            calc.run,
            task,
            formatter=formatter,
            generate=GoldEngine(actions),
            config=CONFIG,
            task_id="calculator/0",
            gateway=gw,
        )
    finally:
        await gw.aclose()


@pytest.mark.parametrize("seed", [0, 5, 123])
def test_demonstration_tokens_are_what_the_gateway_records(formatter, seed):
    env = SPEC.build()
    demo = env.demonstration(seed)
    (seq,) = demo.to_sft_sequences(formatter)
    gold = [m for m in demo.messages if m["role"] == "assistant"]
    actions = [formatter.action_ids(assistant_text(m)) for m in gold]

    out = asyncio.run(_through_gateway(formatter, calc.make_task(seed), actions))
    assert out.status == EpisodeStatus.COMPLETED and out.reward == 1.0, out.error
    recorded = out.trajectory.to_token_sequence()
    # the invariant: SFT tokens == the gateway's recording of the same conversation
    assert seq.token_ids.tolist() == recorded.token_ids.tolist()
    assert torch.equal(seq.action_mask, recorded.action_mask)
    assert torch.equal(seq.node_index, recorded.node_index)
    # loss only on the assistant tokens: each node's action = encode(gold text) + end of turn
    ids, mask = seq.token_ids.tolist(), seq.action_mask.tolist()
    trained = [i for i, m in zip(ids, mask, strict=True) if m]
    assert trained == actions[0] + actions[1]
    assert formatter.action_text(actions[0]).startswith('<tool_call>\n{"name": "calculator"')
    answer = calc.make_task(seed)["answer"]
    assert formatter.action_text(actions[1]) == f"ANSWER: {answer}"
    assert (seq.behaviour_logprobs == 0).all() and (seq.policy_versions == -1).all()
    text = formatter.hf.decode(ids)
    assert calc.SYSTEM_PROMPT in text and "Available tools" in text
    assert calc.make_task(seed)["question"] in text


def test_marker_template_renders_the_marker_layout(marker_formatter):
    f = marker_formatter
    assert isinstance(f.hf, MarkerChatTokenizer) and f.hf.chat_template == MARKER_CHAT_TEMPLATE
    assert (f.end_of_turn, f._after_turn) == ("<|eoa|>", "")
    assert f.stop_token_ids == [f.hf.convert_tokens_to_ids("<|eoa|>"), f.hf.eos_token_id]
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A"},
        {"role": "tool", "content": "R"},
    ]
    assert f.render(msgs, generation_prompt=True) == (
        "<|obs|>system\nS<|obs|>user\nQ<|act|>A<|eoa|><|obs|>tool\nR<|act|>"
    )
    # the corpus text the tokenizer was trained on is the decoded stream of the SFT sequence
    demo = SPEC.build().demonstration(9)
    (seq,) = demo.to_sft_sequences(f)
    assert f.hf.decode(seq.token_ids.tolist()) == demo.text()
    assert demo.text().startswith(f"<|obs|>system\n{calc.SYSTEM_PROMPT}\n\nYou can call tools.")
    # markers are single tokens: 4 observations/actions open with one, each action ends with one
    ids = seq.token_ids.tolist()
    assert ids.count(f.hf.convert_tokens_to_ids("<|eoa|>")) == 2
    assert ids.count(f.hf.convert_tokens_to_ids("<|obs|>")) == 3


def test_sft_stage_data_of_an_agent(marker_formatter):
    """What the SFT stage trains on (`demonstration_sequences`): one sequence per conversation,
    deterministic, the demonstration seeds distinct."""
    cfg = DemonstrationConfig(envs=[SPEC], num_episodes=6, seed=2)
    seqs = demonstration_sequences(cfg, marker_formatter)
    again = demonstration_sequences(cfg, marker_formatter)
    assert len(seqs) == 6
    assert [s.token_ids.tolist() for s in seqs] == [s.token_ids.tolist() for s in again]
    demos = generate_demonstrations(cfg)
    assert len({d.seed for d in demos}) == 6
    assert all(d.task_id == f"agent:{d.seed}" for d in demos)
    assert all(int(s.action_mask.sum()) > 10 for s in seqs)


def test_bad_demonstrations_are_clear_errors(marker_formatter):
    record = calc.demonstrate(calc.make_task(1))
    no_reply = {"messages": record["messages"][:4], "tools": record["tools"]}
    with pytest.raises(ValueError, match="must end with the assistant"):
        replay_conversation(no_reply, marker_formatter)
    with pytest.raises(ValueError, match="OpenAI's chat fine-tuning record"):
        replay_conversation([{"role": "user"}], marker_formatter)
    bad_args = [dict(m) for m in record["messages"]]
    call = {"id": "c", "type": "function", "function": {"name": "calculator", "arguments": "[1]"}}
    bad_args[2] = {"role": "assistant", "content": None, "tool_calls": [call]}
    with pytest.raises(ValueError, match="JSON object of arguments"):
        replay_conversation({"messages": bad_args, "tools": record["tools"]}, marker_formatter)
    markers = build_formatter(marker_formatter.hf.sp, EpisodeFormatConfig(format="markers"))
    with pytest.raises(ValueError, match="episode.format=chat_template"):
        replay_conversation(record, markers)
    plain = EnvSpec(name="agent", options={"agent": f"{AGENT}:run", "task": f"{AGENT}:make_task"})
    with pytest.raises(ValueError, match="demonstration: 'file.py:demonstrate'"):
        plain.build().demonstration(0)


def test_marker_template_needs_the_markers():
    """A sentencepiece model without the episode markers cannot take the marker template."""
    from sao_megatron.data.tokenizer import train_sentencepiece

    lines = ["What is (2 * 3) + 4?", "ANSWER: 10"] * 20
    cfg = TokenizerConfig(vocab_size=300)
    cfg.user_defined_symbols = []  # set after the config's own check, which refuses it
    with pytest.raises(ValueError, match="lacks the episode markers"):
        MarkerChatTokenizer(train_sentencepiece(lines, cfg))
