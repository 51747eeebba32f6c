"""Gold demonstrations of agents: a gold OpenAI-style conversation turned into exactly the tokens
the gateway records for it, for the SFT warm-up (``stages: [sft, rl]`` with an ``agent``
environment in ``demonstrations.envs``).

An agent module may export ``def demonstrate(task) -> dict``: the gold conversation of one task
in the record format of OpenAI's chat fine-tuning files::

    {"messages": [{"role": "system", ...}, {"role": "user", ...},
                  {"role": "assistant", "content": None, "tool_calls": [...]},
                  {"role": "tool", "tool_call_id": "call_0_0", "content": "89"},
                  {"role": "assistant", "content": "ANSWER: 89"}],
     "tools": [...]}                                   # the ``tools`` the agent sends

`replay_conversation` plays it through a gateway `Session` — the gateway's own code: the
append-only history check, the chat template, the tool prompt, the token-in/token-out prompts
and the reply parsing — with an engine that "samples" each gold assistant message: its text
(content, then its tool calls in the ``<tool_call>`` convention, as the gateway renders an
assistant turn) tokenised, plus the end-of-turn token. The recorded trajectory is therefore what
the gateway records when the agent sends these messages and the policy emits these tokens; its
``to_token_sequence()`` is the SFT sequence, with the loss on the assistant tokens only (the
action mask). ``tests/rollout/test_agent_demonstrations.py`` checks this against the agent run
through the gateway over HTTP with the `openai` client.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from sao_megatron.data.trajectory import TokenSequence, Trajectory
from sao_megatron.rollout.config import RolloutConfig
from sao_megatron.rollout.engine import Generation
from sao_megatron.rollout.gateway.rendering import (
    RequestError,
    add_tool_prompt,
    message_key,
    render_message,
)
from sao_megatron.rollout.gateway.session import Session
from sao_megatron.rollout.status import EpisodeStatus

# no limit of its own: a demonstration is rendered whole (the rollout's limits apply to RL)
_REPLAY_CONFIG = RolloutConfig(max_model_len=1 << 30, max_tokens_per_action=(1 << 30) - 1)


def check_record(record: Any, where: str) -> tuple[list[dict], list | None]:
    """(messages, tools) of a ``demonstrate(task)`` return value; ValueError naming `where`."""
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
        raise ValueError(
            f"{where} must return {{'messages': [...], 'tools': [...]}} (OpenAI's chat "
            f"fine-tuning record), got {type(record).__name__}"
        )
    messages, tools = record["messages"], record.get("tools") or None
    roles = [m.get("role") if isinstance(m, dict) else None for m in messages]
    if "assistant" not in roles or roles[0] == "assistant":
        raise ValueError(
            f"{where}: the conversation needs an assistant message after the first request's "
            f"messages (roles {roles})"
        )
    if roles[-1] != "assistant":
        raise ValueError(f"{where}: the conversation must end with the assistant's final reply")
    return messages, tools


def assistant_text(message: dict) -> str:
    """The text the policy emits for a gold assistant message: its content, then its tool
    calls in the ``<tool_call>`` convention (as the gateway renders an assistant turn)."""
    return render_message(message)["content"]


async def _replay(messages: list[dict], tools: list | None, formatter: Any, task_id: str):
    gold = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    actions = [formatter.action_ids(assistant_text(messages[i])) for i in gold]

    async def generate(episode_id, prompt, max_tokens, seed) -> Generation:
        ids = actions[len(session.nodes)]
        return Generation(list(ids), [0.0] * len(ids), [-1] * len(ids), "stop")

    session = Session(
        None,  # type: ignore[arg-type]  # no HTTP: the session is called directly
        key="demonstration",
        episode_id=task_id,
        task_id=task_id,
        group_index=0,
        formatter=formatter,
        generate=generate,
        config=_REPLAY_CONFIG,
        is_stale=lambda version: False,
        max_turns=len(gold),
    )
    for i in gold:
        body = {"model": "policy", "messages": messages[:i]}
        if tools:
            body["tools"] = tools
        reply = (await session.complete(body))["choices"][0]["message"]
        if message_key(reply) != message_key(messages[i]):
            raise RequestError(
                f"message {i} (assistant) is not what the gateway returns for its text "
                f"{assistant_text(messages[i])[:80]!r} (it parses to {reply!r:.120}): write tool "
                "calls as OpenAI tool_calls with a JSON object of arguments"
            )
    return session.to_trajectory(EpisodeStatus.COMPLETED, 0.0, {"demonstration": True})


def replay_conversation(
    record: dict, formatter: Any, *, task_id: str = "demonstration", where: str = "demonstrate"
) -> Trajectory:
    """The trajectory the gateway records for the gold conversation `record` (see the module
    docstring): one node per assistant message, its observation tokens the prompt delta, its
    action tokens ``encode(text) + [end of turn]``, behaviour log-probs 0.0 and versions -1.

    Raises ValueError (naming `where`) for a malformed record, a formatter without a chat
    template, or a conversation the gateway would refuse (e.g. history rewritten).
    """
    if not hasattr(formatter, "hf") or not hasattr(formatter, "end_of_turn"):
        raise ValueError(
            "agent demonstrations need the chat-template episode format: set "
            "episode.format=chat_template"
        )
    messages, tools = check_record(record, where)
    try:
        return asyncio.run(_replay(messages, tools, formatter, task_id))
    except RequestError as e:
        raise ValueError(f"{where}: the gateway refuses this conversation: {e}") from None


@dataclass(kw_only=True)
class AgentDemonstration:
    """One gold agent conversation (what ``demonstrate(task)`` returned for one seed).

    ``text()`` and ``to_sft_sequences()`` are the `Demonstration` methods the tokenizer corpus
    and the SFT stage call (`sao_megatron.data.demonstrations`).
    """

    task_id: str
    env_name: str
    seed: int
    messages: list[dict]
    tools: list | None = None
    where: str = "demonstrate"

    @property
    def record(self) -> dict:
        return {"messages": self.messages, "tools": self.tools}

    def text(self, config: Any = None) -> str:
        """The conversation in the episode-marker chat template (tool prompt included): the
        text the from-scratch tokenizer is trained on. `config` is unused (the chat format has
        no marker fields)."""
        from sao_megatron.data.marker_chat import render_marker_chat

        rendered = [render_message(m) for m in self.messages]
        return render_marker_chat(
            add_tool_prompt(rendered, self.tools), add_generation_prompt=False
        )

    def to_trajectory(self, formatter: Any) -> Trajectory:
        return replay_conversation(self.record, formatter, task_id=self.task_id, where=self.where)

    def to_sft_sequences(self, formatter: Any, train_on_noise: bool = False) -> list[TokenSequence]:
        """[the recorded trajectory's token sequence]: action mask on the assistant tokens."""
        return [self.to_trajectory(formatter).to_token_sequence()]
