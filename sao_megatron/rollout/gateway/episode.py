"""The agent runner: one ``await agent(task, client)`` as one RL episode through the gateway.

`run_agent_episode` opens a `Session` on the gateway, hands the agent an ``openai.AsyncOpenAI``
whose ``base_url`` is the gateway and whose ``api_key`` names the episode, watches the time
limits while the agent runs, and turns how it ended into an `AgentOutcome`:

* the agent returned a finite float after at least one model call: ``completed`` (``truncated``
  when the turn budget or ``max_model_len`` was spent); the float is the reward, put on the
  last node;
* the session failed (history rewritten, engine failure, stale tokens, ...): its status;
* the agent raised: the exception's status (`classify_exception`; ``agent_error`` by default,
  ``env_error`` for `EnvStepError`), or ``truncated`` with reward 0 after a refused
  over-budget request;
* ``step_timeout_s`` (the agent's own time between two model calls) or ``episode_timeout_s``
  (the whole episode) exceeded: ``timeout``; an engine request in flight is cancelled.

Only ``completed`` and ``truncated`` outcomes carry a trainable trajectory.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from sao_megatron.data.trajectory import Trajectory
from sao_megatron.rollout.config import RolloutConfig
from sao_megatron.rollout.engine import EngineError
from sao_megatron.rollout.gateway.server import ChatGateway, shared_gateway
from sao_megatron.rollout.gateway.session import Session
from sao_megatron.rollout.runner import GenerateFn
from sao_megatron.rollout.status import EpisodeStatus, classify_exception

#: async def run(task, client: openai.AsyncOpenAI) -> float
AgentFn = Callable[[Any, Any], Awaitable[float]]


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


def _openai_client(config: RolloutConfig) -> Callable[[str, str], Any]:
    """The default client factory: ``openai.AsyncOpenAI`` without retries (a retried request
    would look like a second turn), its timeout above the engine's."""
    import openai

    def client_factory(base_url: str, api_key: str) -> Any:
        return openai.AsyncOpenAI(
            base_url=base_url,
            api_key=api_key,
            max_retries=0,
            timeout=config.request_timeout_s + 30.0,
        )

    return client_factory


async def _watch(
    agent_task: asyncio.Future,
    session: Session,
    step_timeout_s: float | None,
    episode_timeout_s: float | None,
) -> None:
    """Wait until the agent returns or the session fails; fail it ``timeout`` when the agent
    spends `step_timeout_s` without a model call or the episode exceeds `episode_timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = None if episode_timeout_s is None else loop.time() + episode_timeout_s
    while not agent_task.done() and session.failure is None:
        session.changed.clear()
        now = loop.time()
        limits = [deadline] if deadline is not None else []
        if step_timeout_s is not None and not session.in_flight:
            limits.append(now + step_timeout_s - (time.monotonic() - session.last_activity))
        wait = None if not limits else max(0.0, min(limits) - now)
        waiter = asyncio.ensure_future(session.changed.wait())
        await asyncio.wait({agent_task, waiter}, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
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


def _ending(session: Session, result: Any) -> tuple[EpisodeStatus, float | None, str]:
    """(status, reward, error) of an episode whose agent ended with `result` (its return value
    or exception)."""
    if session.failure is not None:
        status, error = session.failure
        return status, None, error
    if isinstance(result, BaseException):
        if session.truncated_by is not None:
            return EpisodeStatus.TRUNCATED, 0.0, ""
        status = classify_exception(result, default=EpisodeStatus.AGENT_ERROR)
        if isinstance(result, asyncio.CancelledError):
            status = EpisodeStatus.AGENT_ERROR
        return status, None, f"the agent raised {type(result).__name__}: {result}"
    if isinstance(result, bool) or not isinstance(result, int | float) or not math.isfinite(result):
        return (
            EpisodeStatus.AGENT_ERROR,
            None,
            f"the agent returned {result!r}, not a finite reward",
        )
    if not session.nodes:
        return EpisodeStatus.AGENT_ERROR, None, "the agent returned without calling the model"
    status = EpisodeStatus.TRUNCATED if session.truncated_by else EpisodeStatus.COMPLETED
    return status, float(result), ""


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
    client = (client_factory or _openai_client(config))(gateway.base_url, session.key)
    agent_task = asyncio.ensure_future(agent(task, client))
    try:
        await _watch(agent_task, session, step_timeout_s, episode_timeout_s)
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
    status, reward, error = _ending(session, done[0])
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
