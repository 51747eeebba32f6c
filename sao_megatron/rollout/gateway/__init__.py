"""An OpenAI-compatible chat gateway: agent code written for the OpenAI SDK runs RL episodes.

A user writes one function::

    async def run(task, client: openai.AsyncOpenAI) -> float:   # the episode's reward
        r = await client.chat.completions.create(model="policy", messages=[...], tools=[...])
        ...

and wraps it as an environment: ``AgentEnvironment(run, make_task)`` (in a job config: the
``agent`` environment, `make_agent_environment`). For each episode the gateway (an aiohttp
server on 127.0.0.1, a free port, in the rollout's own asyncio loop) opens a session with its
own API key; the agent's ``client`` is an ``openai.AsyncOpenAI`` whose ``base_url`` points at
``http://127.0.0.1:<port>/v1`` and whose ``api_key`` names the episode.
``POST /v1/chat/completions`` then:

1. checks that the request's messages start with the conversation already recorded for this
   episode (every earlier message, and every assistant reply exactly as the gateway returned
   it) — an agent that edits, drops or inserts earlier messages fails the episode
   (``agent_error``, "rewrote the history");
2. renders the conversation with the policy's chat template and checks that the rendering of
   everything recorded so far is unchanged (prefix stability), then tokenises only the new
   messages' delta: the prompt is the recorded token ids + ``encode(delta)``;
3. asks an engine for the action (token ids in; sampled ids, behaviour log-probs and the weight
   version of every token out);
4. records an `ActionNode` and returns a normal chat completion (``content``, ``tool_calls``
   parsed from ``<tool_call>{json}</tool_call>`` blocks, ``finish_reason``, ``usage``, and
   with ``logprobs=true`` the recorded behaviour log-probs); a reply cut at its token limit
   (``finish_reason: "length"``) is flagged ``ActionNode.truncated`` and the episode goes on.

The agent's return value is the reward (put on the last node); every episode ends with an
`EpisodeStatus` and only ``completed``/``truncated`` ones carry a trainable trajectory. Time
limits are ``rollout.step_timeout_s`` (the agent's own time between two model calls) and
``rollout.episode_timeout_s``; engine time is bounded by ``rollout.request_timeout_s``. Agents
run as tasks of the rollout's event loop: they must not block it (run CPU-heavy tools with
``asyncio.to_thread`` or `sao_megatron.rollout.status.call_step`). docs/AGENTS.md has the rules.

Modules:
    tool_calls   the ``<tool_call>`` convention <-> OpenAI ``tool_calls``; `TOOL_PROMPT`
    rendering    the append-only history check, chat-template rendering, per-turn prompts
    logprobs     ``logprobs=true``: the recorded behaviour log-probs in OpenAI's chat format
    session      one episode behind one API key: serves its requests, records its nodes
    server       the aiohttp app (``/v1/chat/completions``, ``/v1/models``), shared per loop
    episode      the agent runner: time limits, outcome and status of one episode
    environment  `AgentEnvironment` (the manager's agent hook) and the config's ``agent`` env
"""

from sao_megatron.rollout.gateway.environment import (
    AgentEnvironment,
    make_agent_environment,
    resolve,
)
from sao_megatron.rollout.gateway.episode import (
    AgentFn,
    AgentOutcome,
    engine_generate,
    run_agent_episode,
)
from sao_megatron.rollout.gateway.rendering import Conversation, RequestError, message_key
from sao_megatron.rollout.gateway.server import ChatGateway, close_shared_gateway, shared_gateway
from sao_megatron.rollout.gateway.session import Session
from sao_megatron.rollout.gateway.tool_calls import TOOL_PROMPT, parse_tool_calls, tool_call_text

__all__ = [
    "AgentEnvironment",
    "AgentFn",
    "AgentOutcome",
    "ChatGateway",
    "Conversation",
    "RequestError",
    "Session",
    "TOOL_PROMPT",
    "close_shared_gateway",
    "engine_generate",
    "make_agent_environment",
    "message_key",
    "parse_tool_calls",
    "resolve",
    "run_agent_episode",
    "shared_gateway",
    "tool_call_text",
]
