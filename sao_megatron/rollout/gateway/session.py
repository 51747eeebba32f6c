"""One gateway episode behind one API key: serves its chat completions and records its turns.

`Session.complete` answers one ``POST /v1/chat/completions`` of the episode: it refuses what a
linear RL conversation cannot be (``stream=True``, ``n > 1``, concurrent requests), builds the
prompt with the episode's `Conversation` (history check, chat template, token-in/token-out),
asks an engine for the action (``generate(episode_id, prompt_ids, max_tokens, seed)``: sampled
ids + behaviour log-probs + the weight version of every token), records an `ActionNode` and
returns a normal chat completion (``content``, parsed ``tool_calls``, ``finish_reason``,
``usage``; with ``logprobs=true`` the recorded behaviour log-probs,
`sao_megatron.rollout.gateway.logprobs`). A failure marks the session (`fail`) with its
`EpisodeStatus`; the agent runner (`sao_megatron.rollout.gateway.episode`) watches it and turns
it into the episode's outcome.

Sampling is the rollout's (``rollout.temperature``, ``top_p``, ``seed``); the agent's
``temperature``/``top_p``/``seed``/penalties are ignored (counted in ``ignored_params``).
``max_tokens``/``max_completion_tokens`` are honoured up to ``rollout.max_tokens_per_action``.
When the turn budget or ``max_model_len`` is spent the request is refused with
``context_length_exceeded`` and the episode is ``truncated``.

A reply cut at its token limit (no stop token: ``finish_reason: "length"``) is recorded with
``ActionNode.truncated`` at whatever turn it comes; unlike the text runner's cut action (which
ends its episode) the agent has seen it and may go on, so the episode continues: a cut node in
the middle is an ordinary GAE step, and a truncated episode whose *last* reply was cut is not
bootstrapped (`TrainBatch.truncated` False, `cut_action` True), as for the text runner.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sao_megatron.data.trajectory import ActionNode, Trajectory
from sao_megatron.rollout.config import RolloutConfig
from sao_megatron.rollout.engine import (
    SERVED_MODEL_NAME,
    EngineError,
    Generation,
    MalformedReplyError,
)
from sao_megatron.rollout.gateway.logprobs import chat_logprobs, requested_logprobs
from sao_megatron.rollout.gateway.rendering import Conversation, RequestError
from sao_megatron.rollout.gateway.tool_calls import parse_tool_calls
from sao_megatron.rollout.runner import GenerateFn, request_seed
from sao_megatron.rollout.status import EpisodeStatus

if TYPE_CHECKING:
    from sao_megatron.rollout.gateway.server import ChatGateway

log = logging.getLogger("sao_megatron.rollout.gateway")


class Session:
    """The recorded state of one episode behind one API key (`ChatGateway.open_session`)."""

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
        self.conversation = Conversation(formatter)
        self.nodes: list[ActionNode] = []
        self.failure: tuple[EpisodeStatus, str] | None = None
        self.truncated_by: str | None = None
        self.in_flight = False
        self.pending: asyncio.Task | None = None
        self.last_activity = time.monotonic()
        self.changed = asyncio.Event()
        self.ignored_params: set[str] = set()
        self.min_version: int | None = None
        self.num_requests = 0

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

    # ------------------------------------------------------------------ one request
    def prepare(self, body: dict):
        """Check the request against the recorded episode and build its `Prompt`.

        Raises RequestError (the episode's status on it).
        """
        if body.get("stream"):
            raise RequestError("stream=True is not supported by the RL gateway")
        if int(body.get("n", 1) or 1) != 1:
            raise RequestError("n > 1 is not supported: one episode is one conversation")
        for p in ("temperature", "top_p", "seed", "frequency_penalty", "presence_penalty"):
            if body.get(p) is not None:
                self.ignored_params.add(p)
        last = self.nodes[-1].action_token_ids if self.nodes else None
        return self.conversation.prompt(
            body.get("messages"), body.get("tools") or None, len(self.nodes), last
        )

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
        want_logprobs = requested_logprobs(body)
        p = self.prepare(body)
        prompt = p.token_ids
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
        node = ActionNode(
            observation_token_ids=list(p.delta_ids),
            action_token_ids=list(gen.token_ids),
            behaviour_logprobs=[min(x, 0.0) for x in gen.logprobs],  # fp rounding above 0
            policy_versions=list(gen.policy_versions),
            action_text=text,
            truncated=not complete,  # cut at its token limit: finish_reason "length"
        )
        self.nodes.append(node)
        self.conversation.add_action(p, gen.token_ids, text)
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
        self.conversation.add_reply(p, text, reply)
        finish = "length" if not complete else ("tool_calls" if calls else "stop")
        logprobs = (
            chat_logprobs(self.f.hf, node.action_token_ids, node.behaviour_logprobs)
            if want_logprobs
            else None
        )
        return {
            "id": f"chatcmpl-{self.key[-8:]}-{turn}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": str(body.get("model") or SERVED_MODEL_NAME),
            "choices": [
                {"index": 0, "message": reply, "finish_reason": finish, "logprobs": logprobs}
            ],
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
