"""The multi-turn episode loop: one environment, one trajectory, token-in token-out.

For each turn the runner takes the prompt from the episode format (`EpisodeBuilder`: full
history ``obs_0 act_0 obs_1 ... obs_n`` for prefix caching, or a window of the last K turns),
asks an engine for one action — the token ids and behaviour log-probs the engine sampled, never
re-tokenised — decodes it only to hand the text to the environment, and records an
`ActionNode`: observation tokens, action tokens, behaviour log-probs, the weight version of every
action token, and the step's reward.

An episode ends when the environment says done (``terminated``) or truncates, when the turn budget
``min(env.max_steps, rollout.max_turns)`` is spent, when the prompt leaves no room to generate
within ``max_model_len``, or when an action is cut by its token budget (the engine's
``finish_reason == "length"``: ``max_tokens_per_action``, or the room left in
``max_model_len``). Those four are ``truncated``. A cut action is incomplete, so it is *not*
passed to the environment: it is recorded (its tokens were sampled and are trained) with reward 0
and ``ActionNode.truncated``, and the episode ends there. GAE bootstraps from V of the last state
for the first three only: after a cut action the episode is over and the policy got nothing, so
`pack_trajectories` gives it no bootstrap (`TrainBatch.truncated` False, `cut_action` True).

Episodes are never aborted for staleness: a long episode keeps generating across weight updates
(every token records its version; the trainer masks the ones older than the bound,
`sao_megatron.rollout.staleness`).

Errors: `EpisodeError` (the environment raised; empty or garbled engine reply) ends this episode
only; `EngineError` (engine down or hung) propagates so the manager requeues the task; anything
else is a bug and propagates.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from sao_megatron.data.episode import EpisodeFormatter
from sao_megatron.data.trajectory import Trajectory
from sao_megatron.rollout.config import RolloutConfig
from sao_megatron.rollout.engine import EngineClient, EngineError, Generation, MalformedReplyError
from sao_megatron.rollout.routing import RoutingRecorder
from sao_megatron.rollout.status import EpisodeError, call_step

if TYPE_CHECKING:  # importing sao_megatron.envs imports every built-in environment
    from sao_megatron.envs.base import Environment


#: generate(episode_id, prompt_ids, max_tokens, seed[, routing_start=]) -> Generation; the
#: keyword routing_start (int) is passed only with rollout.record_routing / routing_replay
GenerateFn = Callable[..., Awaitable[Generation]]


def stop_token_ids(formatter: EpisodeFormatter, config: RolloutConfig) -> list[int]:
    """Token ids that end an action: the episode format's (end-of-action marker, eos) and
    `rollout.stop_token_ids`, sorted."""
    return sorted(set(formatter.stop_token_ids) | set(config.stop_token_ids))


async def sample_action(
    client: EngineClient,
    prompt_ids: list[int],
    *,
    max_tokens: int,
    seed: int | None,
    config: RolloutConfig,
    stop_ids: list[int],
    routing_start: int | None = None,
) -> Generation:
    """One action request with the run's sampling settings (temperature, top_p), the one place
    both training rollouts (`RolloutManager`) and evaluation build it. ``routing_start`` (not
    None) also asks for the routed experts from that prompt position on
    (`EngineClient.generate`).

    Raises EngineError when the engine aborted the request (``finish_reason == "abort"``: it
    was stopped or restarted), besides the client's own EngineError/MalformedReplyError.
    """
    gen = await client.generate(
        prompt_ids,
        max_tokens=max_tokens,
        temperature=config.temperature,
        top_p=config.top_p,
        stop_token_ids=stop_ids,
        seed=seed,
        **({} if routing_start is None else {"routing_start": routing_start}),
    )
    if gen.finish_reason == "abort":
        raise EngineError(f"{client.name} aborted the request")
    return gen


def request_seed(base: int | None, task_id: str, group_index: int, turn: int) -> int | None:
    """Deterministic per-request sampling seed (None when the run has no seed)."""
    if base is None:
        return None
    h = 1469598103934665603
    for ch in f"{base}/{task_id}/{group_index}/{turn}":  # FNV-1a: stable across processes
        h = ((h ^ ord(ch)) * 1099511628211) % (1 << 63)
    return h % (1 << 31)


def _scalar_info(info: dict) -> dict:
    return {k: v for k, v in info.items() if isinstance(v, int | float | str | bool)}


async def run_episode(
    *,
    env: Environment,
    seed: int,
    task_id: str,
    formatter: EpisodeFormatter,
    generate: GenerateFn,
    config: RolloutConfig,
    group_index: int = 0,
    episode_id: str | None = None,
) -> Trajectory:
    """Run one episode of `env` (``env.reset(seed)``) and return its validated trajectory.

    Args:
        formatter: the episode format (prompt layout, context mode, stop tokens).
        generate: sends one request to an engine (the manager routes it).
    Raises EpisodeError (the caller logs and drops the episode) or EngineError (the caller
    requeues the task).
    """
    episode_id = episode_id or f"{task_id}#{group_index}"
    try:
        builder = formatter.new_episode(task_id, env.reset(seed))
    except Exception as e:  # environment bug or bad task: this episode only
        raise EpisodeError(f"{task_id}: env.reset({seed}) raised {type(e).__name__}: {e}") from e
    terminated = truncated = False
    info: dict = {"env": getattr(env, "name", type(env).__name__), "seed": seed}
    max_turns = min(int(getattr(env, "max_steps", config.max_turns)), config.max_turns)
    cut = False
    window = formatter.config.context_mode == "window"
    routing = RoutingRecorder(full_history=not window) if config.records_routing else None
    for turn in range(max_turns):
        prompt = builder.next_context_ids()
        room = config.max_model_len - len(prompt)
        if room < 1:
            truncated, info["truncated_by"] = True, "max_model_len"
            break
        max_tokens = min(config.max_tokens_per_action, room)
        seed_t = request_seed(config.seed, task_id, group_index, turn)
        extra = {} if routing is None else {"routing_start": routing.start(prompt)}
        try:
            gen = await generate(episode_id, prompt, max_tokens, seed_t, **extra)
        except MalformedReplyError as e:
            raise EpisodeError(f"{task_id}: {e}") from e
        if routing is not None:
            try:
                routing.add(prompt, gen.token_ids, gen.routed_experts)
            except ValueError as e:  # rows missing (evicted): this episode trains unreplayed
                info["routing_error"] = str(e)[:200]
                routing = None
        if not gen.token_ids or not all(math.isfinite(x) for x in gen.logprobs):
            raise EpisodeError(
                f"{task_id}: engine returned {len(gen.token_ids)} tokens or non-finite "
                f"log-probs (finish_reason={gen.finish_reason})"
            )
        try:
            action_text = formatter.action_text(gen.token_ids)
        except Exception as e:  # e.g. sentencepiece: "piece id is out of range"
            raise EpisodeError(
                f"{task_id}: cannot decode the sampled ids ({type(e).__name__}: {e}); is the "
                "engine model's vocab_size larger than the tokenizer's?"
            ) from e
        logprobs = [min(x, 0.0) for x in gen.logprobs]  # clamp fp rounding above 0
        if gen.finish_reason == "length":  # cut by the token budget: an incomplete action
            builder.add_action(gen.token_ids, logprobs, gen.policy_versions, 0.0)
            cut, truncated = True, True
            info["truncated_by"] = (
                "max_tokens_per_action"
                if max_tokens == config.max_tokens_per_action
                else "max_model_len"
            )
            break
        # an async env's astep, or its blocking step in a worker thread (other episodes go on),
        # under rollout.step_timeout_s: EpisodeTimeout, or EnvStepError if the step raises
        step = getattr(env, "astep", None) or env.step
        result = await call_step(
            step, action_text, timeout_s=config.step_timeout_s, what=f"{task_id}: env.step"
        )
        builder.add_action(gen.token_ids, logprobs, gen.policy_versions, float(result.reward))
        info.update(_scalar_info(result.info or {}))
        if result.done:
            terminated = True
            break
        if result.truncated:
            truncated = True
            break
        builder.add_observation(result.observation)
    else:
        truncated = True
    if not builder.action_ids:
        raise EpisodeError(
            f"{task_id}: the first prompt leaves no room to generate "
            f"(rollout.max_model_len={config.max_model_len})"
        )
    traj = builder.to_trajectory(
        terminated=terminated,
        truncated=truncated and not terminated,
        temperature=config.temperature,
        top_p=config.top_p,
        group_index=group_index,
        info=info,
    )
    traj.nodes[-1].truncated = cut
    if routing is not None:
        try:
            routing.assign(traj)
        except ValueError as e:
            raise EpisodeError(f"{task_id}: routing rows do not fit the trajectory: {e}") from e
    traj.status = "completed" if terminated else "truncated"  # rollout/status.py
    traj.info["status"] = traj.status
    try:
        traj.validate()
    except ValueError as e:
        raise EpisodeError(f"{task_id}: invalid trajectory: {e}") from e
    return traj
