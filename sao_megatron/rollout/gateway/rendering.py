"""The conversation of one gateway episode: the append-only history check, the chat-template
rendering and the token-in/token-out prompt of each request.

`Conversation.prompt` checks a request's messages against what the episode recorded (every
earlier message and every assistant reply exactly as returned: role, text, tool calls), renders
the conversation with the policy's chat template and checks that the rendering of everything
recorded so far is unchanged (prefix stability). The prompt of turn n is then the recorded token
ids + ``encode(delta)``, where ``delta`` is the text the template adds for the new messages and
the next generation prompt: earlier turns are never re-tokenised. Assistant turns are rendered
from the text the model sampled, so the template sees exactly the sampled tokens.

When a request has ``tools`` and the template does not mention ``tools``, `TOOL_PROMPT` with
the tools' JSON schemas is appended to the system message (one is inserted when the agent sent
none); templates that render ``tools`` get them through ``apply_chat_template(tools=...)``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sao_megatron.rollout.gateway.tool_calls import TOOL_PROMPT, tool_call_text
from sao_megatron.rollout.status import EpisodeStatus


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


def content_text(content: Any) -> str:
    """The text of a message's ``content`` (a string, None, or a list of text parts)."""
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
    key: tuple = (role, content_text(m.get("content")))
    if role == "assistant":
        key += (tuple(map(repr, _calls_key(m.get("tool_calls")))),)
    if role == "tool":
        key += (m.get("tool_call_id"),)
    return key


def render_message(m: dict) -> dict:
    """The message as the template renders it (assistant tool calls as the convention's text)."""
    out = {"role": m["role"], "content": content_text(m.get("content"))}
    if m["role"] == "assistant" and m.get("tool_calls"):
        calls = tool_call_text(m["tool_calls"])
        out["content"] = f"{out['content']}\n{calls}" if out["content"] else calls
    for k in ("tool_call_id", "name"):
        if k in m:
            out[k] = m[k]
    return out


def add_tool_prompt(messages: list[dict], tools: list | None) -> list[dict]:
    """`messages` with `TOOL_PROMPT` and the tools' JSON schemas appended to the system message
    (one is inserted when there is none), for templates that do not render ``tools``."""
    if not tools:
        return messages
    prompt = TOOL_PROMPT.format(tools=json.dumps(tools, indent=None))
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0], content=f"{messages[0]['content']}\n\n{prompt}")
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


@dataclass
class Prompt:
    """One request's prompt. ``token_ids``: the engine prompt (recorded ids + ``delta_ids``);
    ``delta_ids``/``delta``: the observation tokens of this turn and their text; ``new_render``/
    ``new_keys``: the new messages, recorded once the reply is."""

    token_ids: list[int]
    delta_ids: list[int]
    delta: str
    new_render: list[dict]
    new_keys: list[tuple]


class Conversation:
    """The recorded conversation of one episode and its token stream.

    Attributes:
        keys: `message_key` of every message so far (agent messages and the gateway's replies).
        render_messages: what the template renders (assistant = the sampled text).
        tools: the first request's ``tools`` (later requests must send the same).
        token_ids: the episode's token ids so far (prompts and actions).
        text: the template text of ``token_ids`` (actions: sampled text + end of turn).
    """

    def __init__(self, formatter: Any) -> None:
        self.f = formatter
        self.keys: list[tuple] = []
        self.render_messages: list[dict] = []
        self.tools: list | None = None
        self.token_ids: list[int] = []
        self.text = ""
        self.template_has_tools = "tools" in (getattr(formatter.hf, "chat_template", "") or "")

    # ------------------------------------------------------------------ rendering
    def _with_tools(self, messages: list[dict]) -> list[dict]:
        if self.template_has_tools:
            return messages
        return add_tool_prompt(messages, self.tools)

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        kw = {"tools": self.tools} if self.tools and self.template_has_tools else {}
        return self.f.hf.apply_chat_template(
            self._with_tools(messages),
            tokenize=False,
            add_generation_prompt=generation_prompt,
            **kw,
        )

    # ------------------------------------------------------------------ one request
    def prompt(
        self, messages: Any, tools: list | None, turn: int, last_action: list[int] | None
    ) -> Prompt:
        """Check `messages` (a request's) against the recorded conversation; build the prompt.

        Args:
            turn: model calls recorded so far; last_action: the last one's sampled ids.
        Raises RequestError (``agent_error``): history rewritten, tools changed, nothing to
        answer, or a template that is not prefix-stable for this conversation.
        """
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list")
        keys = [message_key(m) for m in messages]
        if turn == 0:
            self.tools = tools
        elif tools != self.tools:
            raise RequestError(
                "the agent rewrote the history: the request's tools differ from the episode's "
                "first request (they are part of the rendered prompt)"
            )
        k = len(self.keys)
        for i, (got, want) in enumerate(zip(keys[:k], self.keys, strict=False)):
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
        new_render = [render_message(m) for m in new]
        after = self.render(self.render_messages + new_render, generation_prompt=True)
        if turn == 0:
            ids = self.f.encode(after)
            return Prompt(ids, ids, after, new_render, keys[k:])
        before = self.render(self.render_messages, generation_prompt=False)
        lead = (
            self.f._after_turn
            if self.f.is_complete_action(last_action)
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
        return Prompt(self.token_ids + obs, obs, delta, new_render, keys[k:])

    def add_action(self, prompt: Prompt, action_ids: list[int], text: str) -> None:
        """Extend the token stream by `prompt`'s delta and the sampled action (its `text`)."""
        complete = self.f.is_complete_action(action_ids)
        self.token_ids = prompt.token_ids + list(action_ids)
        self.text += prompt.delta + text + (self.f.end_of_turn if complete else "")

    def add_reply(self, prompt: Prompt, text: str, reply: dict) -> None:
        """Record `prompt`'s new messages and the gateway's `reply` (sampled `text`)."""
        self.render_messages += [*prompt.new_render, {"role": "assistant", "content": text}]
        self.keys += [*prompt.new_keys, message_key(reply)]
