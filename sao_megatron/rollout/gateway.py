"""An OpenAI-compatible chat gateway: agent code written for the OpenAI SDK runs RL episodes.

A user writes one function::

    async def run(task, client: openai.AsyncOpenAI) -> float:   # the episode's reward
        r = await client.chat.completions.create(model="policy", messages=[...], tools=[...])
        ...

and wraps it as an environment: ``AgentEnvironment(run, make_task)``. For each episode the
gateway (an aiohttp server on 127.0.0.1, a free port, in the rollout's own asyncio loop) opens a
session with its own API key; the agent's ``client`` is an ``openai.AsyncOpenAI`` whose
``base_url`` points at ``http://127.0.0.1:<port>/v1`` and whose ``api_key`` names the episode.
``POST /v1/chat/completions`` then:

1. checks that the request's messages start with the conversation already recorded for this
   episode (every earlier message, and every assistant reply exactly as the gateway returned it:
   content and tool calls) — an agent that edits, drops or inserts earlier messages fails the
   episode (``agent_error``, "rewrote the history");
2. renders the conversation with the policy's chat template (the `ChatTemplateFormatter`'s
   tokenizer) and checks that the rendering of everything recorded so far is unchanged (the
   template is prefix-stable), then tokenises only the new messages' delta: the prompt is the
   recorded token ids + ``encode(delta)``; no earlier turn is re-tokenised;
3. asks an engine for the action (``generate(episode_id, prompt_ids, max_tokens, seed)``, the
   same function the runner uses: token ids in, sampled ids + behaviour log-probs + the weight
   version of every token out);
4. records an `ActionNode` (delta tokens as the observation, sampled ids, log-probs, versions)
   and returns a normal chat completion: ``choices[0].message.content``, ``tool_calls``,
   ``finish_reason`` (``stop``/``length``/``tool_calls``) and ``usage``.

The agent's return value is the reward (put on the last node). `run_agent_episode` runs one
episode and returns an `AgentOutcome` with its `EpisodeStatus` (``sao_megatron.rollout.status``);
only ``completed`` and ``truncated`` outcomes carry a trainable trajectory.

Tool calls. SmolLM2-135M-Instruct's chat template defines no tool-call format (it renders only
``role`` and ``content``), so the gateway uses the Hermes/Qwen convention in the assistant text::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2 + 3"}}
    </tool_call>

Each such block with a JSON object holding ``name`` (str) and ``arguments`` (object) becomes a
``tool_calls`` entry (the block is removed from ``content``; a malformed block stays in the text).
When the request has ``tools`` and the template does not mention ``tools``, the gateway appends
`TOOL_PROMPT` with the tools' JSON schemas to the system message (inserting one when the agent
sent none). Templates that render ``tools`` themselves (Qwen2.5/3) get them through
``apply_chat_template(tools=...)``; their format is this same convention. Assistant turns are
always rendered from the text the model sampled, so the template sees exactly those tokens.

Sampling is the rollout's (``rollout.temperature``, ``top_p``, ``seed``): the trainer must
reproduce the behaviour policy, so the agent's ``temperature``/``top_p``/``seed`` are ignored
(counted in ``info["ignored_params"]``). ``max_tokens``/``max_completion_tokens`` are honoured up
to ``rollout.max_tokens_per_action``. ``stream=True``, ``n > 1`` and concurrent requests on one
episode are refused (``agent_error``): a trajectory is one linear conversation.

Limits (proposed ``RolloutConfig`` fields, arguments here): ``step_timeout_s`` bounds the agent's
own time between two model calls (its tool runs, before the first call, after the last reply);
``episode_timeout_s`` bounds the whole episode; engine time is bounded by
``rollout.request_timeout_s``. Turn budget ``rollout.max_turns`` and ``max_model_len``: the next
request is answered HTTP 400 ``context_length_exceeded`` and the episode is ``truncated`` (the
agent may still return a reward; if it raises instead, the reward is 0 and GAE bootstraps).

Agents run as tasks of the rollout's event loop: they must not block it (run CPU-heavy tools
with ``asyncio.to_thread`` or `sao_megatron.rollout.status.call_step`).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import json
import logging
import math
import re
import secrets
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from sao_megatron.data.trajectory import ActionNode, Trajectory
from sao_megatron.rollout.config import RolloutConfig
from sao_megatron.rollout.engine import (
    REPO_ROOT,
    SERVED_MODEL_NAME,
    EngineError,
    Generation,
    MalformedReplyError,
)
from sao_megatron.rollout.runner import GenerateFn, request_seed
from sao_megatron.rollout.status import (
    EpisodeStatus,
    classify_exception,
    failure_for,
)

log = logging.getLogger("sao_megatron.rollout.gateway")

#: async def run(task, client: openai.AsyncOpenAI) -> float
AgentFn = Callable[[Any, Any], Awaitable[float]]

TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

TOOL_PROMPT = (
    "You can call tools. To call one, reply with exactly\n"
    "<tool_call>\n"
    '{{"name": <tool name>, "arguments": <JSON object of arguments>}}\n'
    "</tool_call>\n"
    "and wait for its result. Available tools (JSON schemas):\n{tools}"
)


# ====================================================================== tool-call convention
def parse_tool_calls(text: str, id_prefix: str = "call") -> tuple[str, list[dict]]:
    """Split assistant text into (content without the tool-call blocks, OpenAI ``tool_calls``).

    A block counts when its body is a JSON object with ``name`` (str) and ``arguments`` (an
    object, or a string holding one); otherwise it stays in the content. ``tool_calls[k]`` is
    ``{"id": f"{id_prefix}_{k}", "type": "function", "function": {"name", "arguments": JSON
    string}}``.
    """
    calls: list[dict] = []

    def take(m: re.Match) -> str:
        try:
            obj = json.loads(m.group(1))
            args = obj["arguments"]
            if isinstance(args, str):
                args = json.loads(args)
            if not isinstance(obj["name"], str) or not isinstance(args, dict):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            return m.group(0)
        calls.append(
            {
                "id": f"{id_prefix}_{len(calls)}",
                "type": "function",
                "function": {"name": obj["name"], "arguments": json.dumps(args)},
            }
        )
        return ""

    content = TOOL_CALL_RE.sub(take, text)
    return (content.strip() if calls else content), calls


def tool_call_text(calls: list[dict]) -> str:
    """The convention's text of OpenAI ``tool_calls`` (to render agent-supplied assistant turns
    of a first request)."""
    out = []
    for c in calls:
        f = c.get("function", c)
        args = f.get("arguments", {})
        args = json.loads(args) if isinstance(args, str) else args
        out.append(
            f"<tool_call>\n{json.dumps({'name': f['name'], 'arguments': args})}\n</tool_call>"
        )
    return "\n".join(out)


# ====================================================================== message normalisation
class RequestError(ValueError):
    """A request the gateway cannot serve (HTTP 400); `status` is the episode's fate."""

    def __init__(
        self,
        message: str,
        status: EpisodeStatus | None = EpisodeStatus.AGENT_ERROR,
        code: str = "invalid_request",
    ) -> None:
        super().__init__(message)
        self.status, self.code = status, code


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") != "text":
                raise RequestError(f"only text content parts are supported, got {p!r:.80}")
            parts.append(str(p.get("text", "")))
        return "".join(parts)
    raise RequestError(f"message content must be a string or text parts, got {content!r:.80}")


def _calls_key(calls: Any) -> list[tuple[str, Any]]:
    out = []
    for c in calls or []:
        f = c.get("function", {}) if isinstance(c, dict) else {}
        args = f.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            pass
        out.append((f.get("name"), args))
    return out


def message_key(m: dict) -> tuple:
    """What must not change in an earlier message: role, text, tool calls (name, arguments) and
    the tool_call_id/name of tool results. Extra SDK fields (refusal, annotations, ...) and
    tool-call ids are ignored."""
    if not isinstance(m, dict) or "role" not in m:
        raise RequestError(f"every message needs a role, got {m!r:.80}")
    role = m["role"]
    key: tuple = (role, _content_text(m.get("content")))
    if role == "assistant":
        key += (tuple(map(repr, _calls_key(m.get("tool_calls")))),)
    if role == "tool":
        key += (m.get("tool_call_id"),)
    return key


# ====================================================================== sessions
@dataclass
class AgentOutcome:
    """How one agent episode ended. ``trajectory`` holds the recorded turns (also of failed
    episodes, for logs; None if no turn was recorded); train it only when ``trainable``."""

    status: EpisodeStatus
    trajectory: Trajectory | None
    reward: float | None
    error: str = ""
    wall_s: float = 0.0

    @property
    def trainable(self) -> bool:
        return self.status.trainable and self.trajectory is not None


class _Session:
    """The recorded state of one episode behind one API key."""

    def __init__(
        self,
        gateway: ChatGateway,
        *,
        key: str,
        episode_id: str,
        task_id: str,
        group_index: int,
        formatter: Any,
        generate: GenerateFn,
        config: RolloutConfig,
        is_stale: Callable[[int], bool],
        max_turns: int,
    ) -> None:
        self.gateway, self.key, self.episode_id = gateway, key, episode_id
        self.task_id, self.group_index = task_id, group_index
        self.f, self.generate, self.config, self.is_stale = formatter, generate, config, is_stale
        self.max_turns = max_turns
        self.conversation: list[tuple] = []  # message_key of every message so far
        self.render_messages: list[dict] = []  # what the template renders (assistant = sampled)
        self.tools: list | None = None
        self.nodes: list[ActionNode] = []
        self.token_ids: list[int] = []
        self.text = ""  # the template text of token_ids (actions: sampled text + end of turn)
        self.failure: tuple[EpisodeStatus, str] | None = None
        self.truncated_by: str | None = None
        self.in_flight = False
        self.pending: asyncio.Task | None = None
        self.last_activity = time.monotonic()
        self.changed = asyncio.Event()
        self.ignored_params: set[str] = set()
        self.min_version: int | None = None
        self.num_requests = 0
        self.template_has_tools = "tools" in (getattr(formatter.hf, "chat_template", "") or "")

    # ------------------------------------------------------------------ state changes
    def fail(self, status: EpisodeStatus, message: str) -> None:
        if self.failure is None and not status.trainable:
            self.failure = (status, message)
            log.warning("episode %s: %s: %s", self.episode_id, status, message)
            if self.pending is not None and not self.pending.done():
                self.pending.cancel()
        self.changed.set()

    def touch(self) -> None:
        self.last_activity = time.monotonic()
        self.changed.set()

    # ------------------------------------------------------------------ rendering
    def _with_tools(self, messages: list[dict]) -> list[dict]:
        if not self.tools or self.template_has_tools:
            return messages
        prompt = TOOL_PROMPT.format(tools=json.dumps(self.tools, indent=None))
        if messages and messages[0]["role"] == "system":
            first = dict(messages[0], content=f"{messages[0]['content']}\n\n{prompt}")
            return [first, *messages[1:]]
        return [{"role": "system", "content": prompt}, *messages]

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        kw = {"tools": self.tools} if self.tools and self.template_has_tools else {}
        return self.f.hf.apply_chat_template(
            self._with_tools(messages),
            tokenize=False,
            add_generation_prompt=generation_prompt,
            **kw,
        )

    @staticmethod
    def _render_message(m: dict) -> dict:
        out = {"role": m["role"], "content": _content_text(m.get("content"))}
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = tool_call_text(m["tool_calls"])
            out["content"] = f"{out['content']}\n{calls}" if out["content"] else calls
        for k in ("tool_call_id", "name"):
            if k in m:
                out[k] = m[k]
        return out

    # ------------------------------------------------------------------ one request
    def prepare(self, body: dict) -> tuple[list[int], list[int], str, list[dict], list[tuple]]:
        """Check the request against the recorded episode and build the prompt.

        Returns (prompt ids, observation delta ids, delta text, new render messages, new keys).
        Raises RequestError (the episode's status on it).
        """
        if body.get("stream"):
            raise RequestError("stream=True is not supported by the RL gateway")
        if int(body.get("n", 1) or 1) != 1:
            raise RequestError("n > 1 is not supported: one episode is one conversation")
        for p in ("temperature", "top_p", "seed", "frequency_penalty", "presence_penalty"):
            if body.get(p) is not None:
                self.ignored_params.add(p)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list")
        keys = [message_key(m) for m in messages]
        tools = body.get("tools") or None
        turn = len(self.nodes)
        if turn == 0:
            self.tools = tools
        elif tools != self.tools:
            raise RequestError(
                "the agent rewrote the history: the request's tools differ from the episode's "
                "first request (they are part of the rendered prompt)"
            )
        k = len(self.conversation)
        for i, (got, want) in enumerate(zip(keys[:k], self.conversation, strict=False)):
            if got != want:
                raise RequestError(
                    f"the agent rewrote the history: message {i} ({want[0]}) differs from what the "
                    f"episode recorded (got {got[1][:60]!r}, recorded {want[1][:60]!r}); an RL "
                    "episode must append to its conversation, never edit it"
                )
        if len(keys) <= k:
            raise RequestError(
                f"the agent rewrote the history: {len(keys)} messages, fewer than the "
                f"{k} already recorded (append the assistant reply and new messages)"
            )
        new = messages[k:]
        if turn > 0 and any(m["role"] == "assistant" for m in new):
            raise RequestError(
                "the agent rewrote the history: a new assistant message the model did not "
                "generate (append the gateway's reply as returned, then tool/user messages)"
            )
        if new[-1]["role"] == "assistant":
            raise RequestError("the last message is an assistant message: nothing to answer")
        new_render = [self._render_message(m) for m in new]
        after = self.render(self.render_messages + new_render, generation_prompt=True)
        if turn == 0:
            prompt = self.f.encode(after)
            return prompt, prompt, after, new_render, keys[k:]
        before = self.render(self.render_messages, generation_prompt=False)
        last = self.nodes[-1].action_token_ids
        lead = (
            self.f._after_turn
            if self.f.is_complete_action(last)
            else (self.f.end_of_turn + self.f._after_turn)
        )
        if before != self.text + lead or not after.startswith(before):
            raise RequestError(
                "the chat template is not prefix-stable for this conversation: rendering it "
                f"again changes the recorded text (recorded tail {self.text[-60:]!r}, rendered "
                f"{before[-60:]!r}); agents need a template that appends turns"
            )
        delta = after[len(self.text) :]
        obs = self.f.encode(delta)
        return self.token_ids + obs, obs, delta, new_render, keys[k:]

    def max_tokens(self, body: dict, prompt_len: int) -> int:
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        cap = self.config.max_tokens_per_action
        if asked is not None:
            if not isinstance(asked, int) or asked < 1:
                raise RequestError(f"max_tokens={asked!r} must be a positive integer")
            cap = min(cap, asked)
        return min(cap, self.config.max_model_len - prompt_len)

    async def complete(self, body: dict) -> dict:
        """Serve one chat completion (the OpenAI response body). Raises RequestError."""
        if self.failure is not None:
            raise RequestError(
                f"the episode already failed ({self.failure[0]}): {self.failure[1]}",
                status=None,
                code="episode_failed",
            )
        if self.truncated_by is not None:
            raise RequestError(
                f"the episode is over ({self.truncated_by})",
                status=None,
                code="context_length_exceeded",
            )
        if self.in_flight:
            raise RequestError(
                "concurrent requests on one episode: a trajectory is one linear "
                "conversation; await each reply before the next request"
            )
        self.in_flight = True
        self.touch()
        try:
            return await self._complete(body)
        finally:
            self.in_flight = False
            self.pending = None
            self.touch()

    async def _complete(self, body: dict) -> dict:
        self.num_requests += 1
        turn = len(self.nodes)
        prompt, obs, delta, new_render, new_keys = self.prepare(body)
        room = self.config.max_model_len - len(prompt)
        if turn >= self.max_turns or room < 1:
            self.truncated_by = "max_turns" if turn >= self.max_turns else "max_model_len"
            raise RequestError(
                f"the episode's budget is spent ({self.truncated_by}: rollout.max_turns="
                f"{self.max_turns}, rollout.max_model_len={self.config.max_model_len}); the "
                "episode is truncated: return its reward",
                status=None,
                code="context_length_exceeded",
            )
        max_tokens = self.max_tokens(body, len(prompt))
        seed = request_seed(self.config.seed, self.task_id, self.group_index, turn)
        self.pending = asyncio.ensure_future(
            self.generate(self.episode_id, prompt, max_tokens, seed)
        )
        try:
            gen: Generation = await self.pending
        except asyncio.CancelledError:
            if self.failure is not None:  # a timeout/failure cancelled the engine request
                raise RequestError(self.failure[1], status=None, code="episode_failed") from None
            raise
        except (EngineError, MalformedReplyError) as e:
            raise RequestError(
                f"engine failed: {e}", status=EpisodeStatus.ENGINE_ERROR, code="engine_error"
            ) from e
        if not gen.token_ids or not all(math.isfinite(x) for x in gen.logprobs):
            raise RequestError(
                f"engine returned {len(gen.token_ids)} tokens or non-finite log-probs "
                f"(finish_reason={gen.finish_reason})",
                status=EpisodeStatus.ENGINE_ERROR,
                code="engine_error",
            )
        if self.failure is not None:
            raise RequestError(self.failure[1], status=None, code="episode_failed")
        text = self.f.action_text(gen.token_ids)
        complete = self.f.is_complete_action(gen.token_ids)
        self.nodes.append(
            ActionNode(
                observation_token_ids=list(obs),
                action_token_ids=list(gen.token_ids),
                behaviour_logprobs=[min(x, 0.0) for x in gen.logprobs],  # fp rounding above 0
                policy_versions=list(gen.policy_versions),
                action_text=text,
            )
        )
        self.token_ids = prompt + list(gen.token_ids)
        self.text += delta + text + (self.f.end_of_turn if complete else "")
        oldest = min(gen.policy_versions)
        self.min_version = oldest if self.min_version is None else min(self.min_version, oldest)
        if self.is_stale(self.min_version):
            raise RequestError(
                "the episode's oldest token exceeds rollout.max_staleness",
                status=EpisodeStatus.ABORTED_STALE,
                code="aborted_stale",
            )
        content, calls = parse_tool_calls(text, id_prefix=f"call_{turn}")
        reply: dict = {"role": "assistant", "content": content if (content or not calls) else None}
        if calls:
            reply["tool_calls"] = calls
        self.render_messages += [*new_render, {"role": "assistant", "content": text}]
        self.conversation += [*new_keys, message_key(reply)]
        finish = "length" if not complete else ("tool_calls" if calls else "stop")
        return {
            "id": f"chatcmpl-{self.key[-8:]}-{turn}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": str(body.get("model") or SERVED_MODEL_NAME),
            "choices": [{"index": 0, "message": reply, "finish_reason": finish, "logprobs": None}],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(gen.token_ids),
                "total_tokens": len(prompt) + len(gen.token_ids),
            },
        }

    def to_trajectory(self, status: EpisodeStatus, reward: float, info: dict) -> Trajectory:
        nodes = list(self.nodes)
        if nodes:
            nodes[-1].reward = float(reward)
        traj = Trajectory(
            task_id=self.task_id,
            nodes=nodes,
            terminated=status == EpisodeStatus.COMPLETED,
            truncated=status == EpisodeStatus.TRUNCATED,
            temperature=self.config.temperature,
            top_p=self.config.top_p,
            context_mode="full_history",
            group_index=self.group_index,
            info=info,
        )
        traj.status = status.value  # the proposed Trajectory.status field (also info["status"])
        return traj


# ====================================================================== the server
def _error(status: int, message: str, code: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "invalid_request_error", "code": code}},
        status=status,
    )


class ChatGateway:
    """The OpenAI-compatible server (``/v1/chat/completions``, ``/v1/models``) of one event loop.

    Usage (inside the loop)::

        gw = await ChatGateway().start()     # 127.0.0.1, a free port
        session = gw.open_session(...)        # per episode; session.key is its API key
        ...                                    # the agent calls gw.base_url with that key
        gw.close_session(session)
        await gw.aclose()
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host, self.port = host, port
        self.sessions: dict[str, _Session] = {}
        self._runner: web.AppRunner | None = None

    @property
    def base_url(self) -> str:
        """The ``base_url`` for ``openai.AsyncOpenAI`` (ends in ``/v1``)."""
        return f"http://{self.host}:{self.port}/v1"

    async def start(self) -> ChatGateway:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        return self

    async def aclose(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open_session(self, **kw: Any) -> _Session:
        key = f"sao-{secrets.token_hex(12)}"
        s = _Session(self, key=key, **kw)
        self.sessions[key] = s
        return s

    def close_session(self, session: _Session) -> None:
        self.sessions.pop(session.key, None)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": SERVED_MODEL_NAME, "object": "model", "owned_by": "sao_megatron"}],
            }
        )

    async def _chat(self, request: web.Request) -> web.Response:
        auth = request.headers.get("Authorization", "")
        session = self.sessions.get(auth.removeprefix("Bearer ").strip())
        if session is None:
            return _error(401, "unknown API key: not an open RL episode", "invalid_api_key")
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise RequestError("the request body must be a JSON object")
            return web.json_response(await session.complete(body))
        except RequestError as e:
            if e.status is not None:
                session.fail(e.status, str(e))
            http = 503 if e.code == "engine_error" else 400
            return _error(http, str(e), e.code)
        except ValueError as e:  # bad JSON
            session.fail(EpisodeStatus.AGENT_ERROR, f"malformed request: {e}")
            return _error(400, f"malformed request: {e}", "invalid_request")
        except Exception as e:  # a gateway bug: fail this episode loudly, keep serving others
            log.exception("gateway error in episode %s", session.episode_id)
            session.fail(EpisodeStatus.AGENT_ERROR, f"gateway error {type(e).__name__}: {e}")
            return _error(500, f"gateway error: {e}", "internal_error")


_SHARED: dict[int, ChatGateway] = {}


async def shared_gateway() -> ChatGateway:
    """The gateway of the running event loop, started on first use (one port per loop)."""
    loop = asyncio.get_running_loop()
    gw = _SHARED.get(id(loop))
    if gw is None or gw._runner is None:
        gw = ChatGateway()
        _SHARED[id(loop)] = gw
        await gw.start()
    return gw


# ====================================================================== episodes
async def run_agent_episode(
    agent: AgentFn,
    task: Any,
    *,
    formatter: Any,
    generate: GenerateFn,
    config: RolloutConfig,
    task_id: str,
    group_index: int = 0,
    episode_id: str | None = None,
    is_stale: Callable[[int], bool] = lambda version: False,
    gateway: ChatGateway | None = None,
    step_timeout_s: float | None = None,
    episode_timeout_s: float | None = None,
    max_turns: int | None = None,
    client_factory: Callable[[str, str], Any] | None = None,
) -> AgentOutcome:
    """Run ``await agent(task, client)`` as one RL episode; never raises for episode failures.

    Args:
        agent: ``async def run(task, client) -> float``; the return value is the reward.
        formatter: a `ChatTemplateFormatter` (the policy's tokenizer and chat template).
        generate: ``generate(episode_id, prompt_ids, max_tokens, seed) -> Generation`` (the
            manager's routed engine call, or `engine_generate` over one `EngineClient`).
        step_timeout_s: the agent's limit between model calls (None: none).
        episode_timeout_s: the episode's wall-clock limit (None: none).
        max_turns: model calls before the episode is truncated (default rollout.max_turns).
        client_factory: (base_url, api_key) -> client; default ``openai.AsyncOpenAI`` without
            retries (a retried request would look like a second turn).
    Returns an `AgentOutcome`: status, the recorded trajectory (``info["status"]`` set), reward.
    """
    if not hasattr(formatter, "hf") or not hasattr(formatter, "end_of_turn"):
        raise ValueError(
            "agents need the chat-template episode format: set episode.format=chat_template "
            "(a ChatTemplateFormatter over the policy's tokenizer)"
        )
    t0 = time.monotonic()
    gateway = gateway or await shared_gateway()
    episode_id = episode_id or f"{task_id}#{group_index}"
    session = gateway.open_session(
        episode_id=episode_id,
        task_id=task_id,
        group_index=group_index,
        formatter=formatter,
        generate=generate,
        config=config,
        is_stale=is_stale,
        max_turns=min(max_turns or config.max_turns, config.max_turns),
    )
    if client_factory is None:
        import openai

        def client_factory(base_url: str, api_key: str) -> Any:
            return openai.AsyncOpenAI(
                base_url=base_url,
                api_key=api_key,
                max_retries=0,
                timeout=config.request_timeout_s + 30.0,
            )

    client = client_factory(gateway.base_url, session.key)
    agent_task = asyncio.ensure_future(agent(task, client))
    loop = asyncio.get_running_loop()
    deadline = None if episode_timeout_s is None else loop.time() + episode_timeout_s
    try:
        while not agent_task.done() and session.failure is None:
            session.changed.clear()
            now = loop.time()
            limits = [deadline] if deadline is not None else []
            if step_timeout_s is not None and not session.in_flight:
                limits.append(now + step_timeout_s - (time.monotonic() - session.last_activity))
            wait = None if not limits else max(0.0, min(limits) - now)
            waiter = asyncio.ensure_future(session.changed.wait())
            await asyncio.wait(
                {agent_task, waiter}, timeout=wait, return_when=asyncio.FIRST_COMPLETED
            )
            waiter.cancel()
            if agent_task.done() or session.failure is not None:
                break
            if deadline is not None and loop.time() >= deadline:
                session.fail(
                    EpisodeStatus.TIMEOUT,
                    f"the episode ran longer than episode_timeout_s={episode_timeout_s}",
                )
            elif (
                step_timeout_s is not None
                and not session.in_flight
                and time.monotonic() - session.last_activity >= step_timeout_s
            ):
                session.fail(
                    EpisodeStatus.TIMEOUT,
                    f"the agent spent more than step_timeout_s={step_timeout_s} s "
                    "without a model call or a return",
                )
        if not agent_task.done():
            agent_task.cancel()
        done = await asyncio.gather(agent_task, return_exceptions=True)
    finally:
        gateway.close_session(session)
        close = getattr(client, "close", None)
        if close is not None:
            r = close()
            if inspect.isawaitable(r):
                await r
    result = done[0]
    reward: float | None = None
    status: EpisodeStatus
    error = ""
    if session.failure is not None:
        status, error = session.failure
    elif isinstance(result, BaseException):
        if session.truncated_by is not None:
            status, reward = EpisodeStatus.TRUNCATED, 0.0
        else:
            status = classify_exception(result, default=EpisodeStatus.AGENT_ERROR)
            if isinstance(result, asyncio.CancelledError):
                status = EpisodeStatus.AGENT_ERROR
            error = f"the agent raised {type(result).__name__}: {result}"
    elif (
        isinstance(result, bool) or not isinstance(result, int | float) or not math.isfinite(result)
    ):
        status, error = (
            EpisodeStatus.AGENT_ERROR,
            f"the agent returned {result!r}, not a finite reward",
        )
    elif not session.nodes:
        status, error = EpisodeStatus.AGENT_ERROR, "the agent returned without calling the model"
    else:
        reward = float(result)
        status = EpisodeStatus.TRUNCATED if session.truncated_by else EpisodeStatus.COMPLETED
    info: dict = {
        "status": status.value,
        "num_turns": len(session.nodes),
        "agent": getattr(agent, "__qualname__", type(agent).__name__),
    }
    if error:
        info["error"] = error
    if session.truncated_by:
        info["truncated_by"] = session.truncated_by
    if session.ignored_params:
        info["ignored_params"] = ",".join(sorted(session.ignored_params))
    if status.trainable and not session.nodes:  # the first prompt already left no room
        status, error = EpisodeStatus.ENV_ERROR, "the first prompt leaves no room to generate"
        info.update(status=status.value, error=error)
    traj = session.to_trajectory(status, reward or 0.0, info) if session.nodes else None
    if traj is not None and status.trainable:
        try:
            traj.validate()
        except ValueError as e:
            status, error = EpisodeStatus.ENGINE_ERROR, f"invalid trajectory: {e}"
            traj.info.update(status=status.value, error=error)
            traj.status = status.value
    return AgentOutcome(status, traj, reward, error, time.monotonic() - t0)


def engine_generate(client: Any, config: RolloutConfig, stop_token_ids: list[int]) -> GenerateFn:
    """A `GenerateFn` over one `EngineClient` (tests, scripts; the manager routes its own)."""

    async def generate(episode_id: str, prompt: list[int], max_tokens: int, seed: int | None):
        gen = await client.generate(
            prompt,
            max_tokens=max_tokens,
            temperature=config.temperature,
            top_p=config.top_p,
            stop_token_ids=list(stop_token_ids),
            seed=seed,
        )
        if gen.finish_reason == "abort":
            raise EngineError(f"{getattr(client, 'name', 'engine')} aborted the request")
        return gen

    return generate


def _limit(own: float | None, config: RolloutConfig, name: str) -> float | None:
    """The environment's own limit, else the rollout's (the proposed RolloutConfig field)."""
    return own if own is not None else getattr(config, name, None)


class AgentEnvironment:
    """An agent function as a rollout environment: the manager runs it with `run_episode`.

    Args:
        agent: ``async def run(task, client) -> float``.
        make_task: ``seed -> task`` (plain or async; what the agent receives as ``task``).
        step_timeout_s, episode_timeout_s: limits (see `run_agent_episode`); None: the
            rollout's ``rollout.step_timeout_s`` / ``rollout.episode_timeout_s`` (None there: none).
        max_turns: model calls before truncation (capped by ``rollout.max_turns``).
        gateway: a running `ChatGateway`; default the loop's `shared_gateway()`.

    ``reset``/``step`` raise TypeError: an agent is not stepped by the runner's text loop.
    """

    def __init__(
        self,
        agent: AgentFn,
        make_task: Callable[[int], Any],
        *,
        name: str = "agent",
        step_timeout_s: float | None = None,
        episode_timeout_s: float | None = None,
        max_turns: int | None = None,
        gateway: ChatGateway | None = None,
    ) -> None:
        self.agent, self.make_task, self.name = agent, make_task, name
        self.step_timeout_s, self.episode_timeout_s = step_timeout_s, episode_timeout_s
        self.max_steps = max_turns or 1_000_000
        self.max_turns = max_turns
        self.gateway = gateway
        self.last_outcome: AgentOutcome | None = None

    def reset(self, seed: int):
        raise TypeError(
            "AgentEnvironment is run by AgentEnvironment.run_episode (the rollout manager's agent "
            "hook), not by the text-step runner"
        )

    step = reset

    async def run(
        self,
        *,
        seed: int,
        task_id: str,
        formatter: Any,
        generate: GenerateFn,
        config: RolloutConfig,
        group_index: int = 0,
        is_stale: Callable[[int], bool] = lambda version: False,
        episode_id: str | None = None,
    ) -> AgentOutcome:
        """One episode as an `AgentOutcome` (never raises for episode failures)."""
        t0 = time.monotonic()
        try:
            task = self.make_task(seed)
            if inspect.isawaitable(task):
                task = await task
        except Exception as e:  # noqa: BLE001 - the task source failed: this episode only
            msg = f"{task_id}: make_task({seed}) raised {type(e).__name__}: {e}"
            self.last_outcome = AgentOutcome(
                EpisodeStatus.ENV_ERROR, None, None, msg, time.monotonic() - t0
            )
            return self.last_outcome
        out = await run_agent_episode(
            self.agent,
            task,
            formatter=formatter,
            generate=generate,
            config=config,
            task_id=task_id,
            group_index=group_index,
            episode_id=episode_id,
            is_stale=is_stale,
            gateway=self.gateway,
            step_timeout_s=_limit(self.step_timeout_s, config, "step_timeout_s"),
            episode_timeout_s=_limit(self.episode_timeout_s, config, "episode_timeout_s"),
            max_turns=self.max_turns,
        )
        if out.trajectory is not None:
            out.trajectory.info.setdefault("env", self.name)
            out.trajectory.info.setdefault("seed", seed)
        self.last_outcome = out
        return out

    async def run_episode(self, **kw: Any) -> Trajectory:
        """The manager's hook: the trainable trajectory, or the status's exception
        (`EngineEpisodeError`/`StaleEpisodeFailure` are requeued, the others dropped)."""
        out = await self.run(**kw)
        if out.trainable:
            return out.trajectory
        raise failure_for(out.status, f"{kw.get('task_id')}: {out.status}: {out.error}")


def resolve(spec: str | Callable, what: str = "agent") -> Callable:
    """A callable from ``"package.module:name"`` or ``"path/to/file.py:name"`` (or itself).

    Raises ValueError naming ``tasks.train[].options.<what>`` when it cannot be found."""
    if callable(spec):
        return spec
    where = f"tasks.train[].options.{what}={spec!r}"
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"{where}: give 'package.module:function' or 'file.py:function'")
    module, _, name = spec.rpartition(":")
    try:
        if module.endswith(".py"):
            path = Path(module)
            if not path.is_absolute():
                path = REPO_ROOT / path if not path.exists() else path.resolve()
            key = f"sao_agent_{abs(hash(str(path)))}"
            mod = sys.modules.get(key)
            if mod is None:
                loader_spec = importlib.util.spec_from_file_location(key, path)
                if loader_spec is None or loader_spec.loader is None:
                    raise ImportError(f"cannot load {path}")
                mod = importlib.util.module_from_spec(loader_spec)
                loader_spec.loader.exec_module(mod)
                sys.modules[key] = mod
        else:
            mod = importlib.import_module(module)
        fn = getattr(mod, name)
    except (ImportError, OSError, AttributeError) as e:
        raise ValueError(f"{where}: {type(e).__name__}: {e}") from e
    if not callable(fn):
        raise ValueError(f"{where}: {name!r} is not callable")
    return fn


def make_agent_environment(
    *,
    agent: str | AgentFn,
    task: str | Callable[[int], Any],
    name: str = "agent",
    max_turns: int | None = None,
) -> AgentEnvironment:
    """The ``agent`` environment of a job config (``tasks.train: [{name: agent, options:
    {agent: "examples/agents/calculator_agent.py:run", task: "...:make_task"}}]``).

    The time limits are the rollout's (``rollout.step_timeout_s``/``episode_timeout_s``, one
    home for every episode); ``max_turns`` caps this agent below ``rollout.max_turns``."""
    run = resolve(agent, "agent")
    if not inspect.iscoroutinefunction(run):
        raise ValueError(
            f"tasks.train[].options.agent={agent!r}: must be an `async def run(task, client)`"
        )
    if max_turns is not None and max_turns < 1:
        raise ValueError(f"tasks.train[].options.max_turns={max_turns!r}: must be >= 1 or null")
    return AgentEnvironment(run, resolve(task, "task"), name=name, max_turns=max_turns)


async def close_shared_gateway() -> None:
    """Stop the running loop's shared gateway (the manager's `_shutdown` calls it)."""
    gw = _SHARED.pop(id(asyncio.get_running_loop()), None)
    if gw is not None:
        await gw.aclose()


__all__ = [
    "AgentEnvironment",
    "AgentOutcome",
    "ChatGateway",
    "TOOL_PROMPT",
    "close_shared_gateway",
    "make_agent_environment",
    "resolve",
    "engine_generate",
    "message_key",
    "parse_tool_calls",
    "run_agent_episode",
    "shared_gateway",
    "tool_call_text",
]
