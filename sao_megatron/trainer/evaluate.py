"""Held-out evaluation: success rate of the current engine policy on tasks never trained on.

Episodes run on the rollout engines (the same episode loop as training, `run_episode`) with
seeds from the job's eval stream, so "before RL" and "after RL" are measured on the very same
tasks. A task counts as solved when its episode's total reward is >= `success_threshold`.
With ``episodes_path`` every held-out episode is also written out, one JSON line each (its
task, seed, outcome and the decoded turns: `episode_record`), so a user can read what the policy
did and two evaluations of the same tasks can be compared task by task.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import math
import os
import random
from pathlib import Path

from sao_megatron.data.episode import EpisodeFormatter
from sao_megatron.envs.base import EnvSpec, episode_metrics, task_id
from sao_megatron.rollout.config import RolloutConfig
from sao_megatron.rollout.engine import EngineClient
from sao_megatron.rollout.runner import EpisodeError, run_episode, sample_action, stop_token_ids

log = logging.getLogger("sao_megatron.eval")


def eval_seeds(base_seed: int, env_index: int, num_tasks: int) -> list[int]:
    """Deterministic held-out seeds of one eval environment."""
    rng = random.Random(f"eval:{base_seed}:{env_index}")
    return [rng.randrange(2**31) for _ in range(num_tasks)]


def eval_labels(envs: list[EnvSpec]) -> list[str]:
    """The metric label of each eval environment: its name, or, where several entries share a
    name (two GEM games, one environment at two horizons), ``<name>:<env_id>`` for entries with
    an ``env_id`` option (GEM; "/" written "_") and ``<name>[<k>]`` (the k-th entry of that
    name, from 0) otherwise; a label that still repeats gets the ``[<k>]`` form too. Keys of
    `evaluate`'s summary are ``eval/<label>/...``."""
    counts = collections.Counter(e.name for e in envs)
    labels = [
        e.name
        if counts[e.name] == 1
        else f"{e.name}:{e.options['env_id'].replace('/', '_')}"
        if isinstance(e.options.get("env_id"), str)
        else e.name
        for e in envs
    ]
    seen, out = collections.Counter(), []
    repeated = collections.Counter(labels)
    for e, label in zip(envs, labels, strict=True):
        if repeated[label] > 1:
            label = f"{e.name}[{seen[e.name]}]"
        seen[e.name] += 1
        out.append(label)
    return out


def evaluate(
    urls: list[str],
    envs: list[EnvSpec],
    *,
    num_tasks: int,
    base_seed: int,
    formatter: EpisodeFormatter,
    rollout: RolloutConfig,
    success_threshold: float = 1.0,
    max_concurrency: int = 16,
    episodes_path: str | os.PathLike | None = None,
) -> dict[str, float]:
    """Run `num_tasks` held-out episodes per environment on the engines at `urls`.

    Returns, with <env> each environment's label (`eval_labels`: its name unless two entries
    share it), {"eval/<env>/success_rate", its binomial standard error "eval/<env>/success_se"
    (``sqrt(p (1 - p) / n)``, n = num_tasks), "eval/<env>/mean_reward", "eval/<env>/mean_turns",
    "eval/success_rate" (mean over envs), "eval/num_errors"}, plus "eval/<env>/mean_progress"
    and its standard error "eval/<env>/progress_se" for environments whose episode info
    reports "progress" (Hanoi: fraction of the initial optimal distance removed; episodes that
    failed with an error count 0), plus "eval/<env>/<metric>" for each metric the environment
    computes from its episodes' final infos (`sao_megatron.envs.base.episode_metrics`: Hanoi's
    per-move error rates). Episodes are spread round-robin
    over the engines; an episode that fails (EpisodeError) counts as unsolved and is counted in
    num_errors.

    episodes_path: when given, a JSON-lines file (parent folders created, replaced atomically)
    with one `episode_record` per held-out episode, in task order (environment, then seed).

    Held-out episodes ask for no routed experts whatever `rollout.record_routing` /
    `routing_replay` say (nothing trains on them); the engines need not have capture off.
    """
    cfg = dataclasses.replace(
        rollout,
        seed=rollout.seed if rollout.seed is not None else base_seed,
        record_routing=False,
        routing_replay=False,
    )
    labels = eval_labels(envs)

    async def main() -> dict[str, float]:
        clients = [EngineClient(u, f"eval{i}", cfg.request_timeout_s) for i, u in enumerate(urls)]
        sem = asyncio.Semaphore(max_concurrency)
        stop_ids = stop_token_ids(formatter, cfg)

        async def one(k: int, spec: EnvSpec, label: str, seed: int):
            client = clients[k % len(clients)]

            async def generate(episode_id, prompt_ids, max_tokens, req_seed):
                return await sample_action(
                    client,
                    prompt_ids,
                    max_tokens=max_tokens,
                    seed=req_seed,
                    config=cfg,
                    stop_ids=stop_ids,
                )

            async with sem:
                env = spec.build()
                kw = {
                    "seed": seed,
                    "task_id": task_id(label, seed, split="eval"),
                    "formatter": formatter,
                    "generate": generate,
                    "config": cfg,
                }
                agent_run = getattr(env, "run_episode", None)  # an AgentEnvironment (gateway)
                try:
                    if agent_run is not None:
                        traj = await agent_run(**kw)
                    else:
                        traj = await run_episode(env=env, **kw)
                except EpisodeError as e:
                    log.warning("eval episode failed: %s", e)
                    errors[k] = str(e)
                    return label, None
                return label, traj

        jobs, seeds, errors = [], [], {}
        k = 0
        for j, (spec, label) in enumerate(zip(envs, labels, strict=True)):
            for seed in eval_seeds(base_seed, j, num_tasks):
                jobs.append(one(k, spec, label, seed))
                seeds.append(seed)
                k += 1
        try:
            results = await asyncio.gather(*jobs)
        finally:
            for c in clients:
                await c.aclose()
            from sao_megatron.rollout.gateway import close_shared_gateway

            await close_shared_gateway()
        if episodes_path is not None:
            records = [
                episode_record(label, seed, traj, formatter, success_threshold, error=errors.get(i))
                for i, ((label, traj), seed) in enumerate(zip(results, seeds, strict=True))
            ]
            write_episodes(episodes_path, records)
        return _summarise(results, labels, success_threshold, dict(zip(labels, envs, strict=True)))

    return asyncio.run(main())


def _summarise(results, names, threshold, specs=None) -> dict[str, float]:
    """The summary of `evaluate` from its ``(label, trajectory or None)`` results; `specs`
    (label -> EnvSpec) adds each environment's own metrics (`episode_metrics`)."""
    specs = specs or {}
    out: dict[str, float] = {"eval/num_errors": float(sum(t is None for _, t in results))}
    rates = []
    for name in dict.fromkeys(names):
        trajs = [t for n, t in results if n == name]
        solved = [t is not None and _solved(t, threshold) for t in trajs]
        rewards = [t.total_reward if t is not None else 0.0 for t in trajs]
        turns = [len(t.nodes) for t in trajs if t is not None]
        progress = [t.info["progress"] for t in trajs if t is not None and "progress" in t.info]
        if progress:  # environments that report partial progress (Hanoi)
            full = progress + [0.0] * (len(trajs) - len(progress))  # failed episodes: 0
            mean = sum(full) / len(full)
            out[f"eval/{name}/mean_progress"] = mean
            var = sum((x - mean) ** 2 for x in full) / max(len(full) - 1, 1)
            out[f"eval/{name}/progress_se"] = math.sqrt(var / len(full))
        if name in specs:  # the environment's own metrics, through its registry hook
            finals = [t.info for t in trajs if t is not None]  # last step's info: episode totals
            own = episode_metrics(specs[name], finals)
            out |= {f"eval/{name}/{k}": v for k, v in own.items()}
        rate = sum(solved) / max(len(trajs), 1)
        rates.append(rate)
        out[f"eval/{name}/success_rate"] = rate
        out[f"eval/{name}/success_se"] = math.sqrt(rate * (1.0 - rate) / max(len(trajs), 1))
        out[f"eval/{name}/mean_reward"] = sum(rewards) / max(len(rewards), 1)
        out[f"eval/{name}/mean_turns"] = sum(turns) / max(len(turns), 1)
        out[f"eval/{name}/num_tasks"] = float(len(trajs))
    out["eval/success_rate"] = sum(rates) / max(len(rates), 1)
    return out


def _solved(traj, threshold: float) -> bool:
    """The environment's own success flag when it reports one (dense rewards need not sum to
    exactly 1), else total reward >= threshold (up to float rounding, 1e-6)."""
    if isinstance(traj.info.get("success"), bool):
        return traj.info["success"]
    return traj.total_reward >= threshold - 1e-6


def episode_record(
    label: str,
    seed: int,
    traj,
    formatter: EpisodeFormatter,
    threshold: float = 1.0,
    *,
    error: str | None = None,
) -> dict:
    """One held-out episode as a JSON-able dict.

    Keys: ``env`` (the eval label), ``seed`` (the environment's seed: the same task in every
    evaluation of a job with the same ``tasks.eval_seed``), ``task_id``, ``solved`` (bool, as the
    success rate counts it), ``total_reward``, ``num_turns``, ``status`` (how the episode ended:
    `sao_megatron.rollout.status.EpisodeStatus`, or "error" with ``error`` its message),
    ``terminated``, ``truncated``, ``info`` (the environment's final info, values that are not
    JSON numbers, strings or booleans written as strings) and ``turns``: one
    ``{"observation", "action", "reward"}`` per agent turn, the text decoded from the token ids
    (the observation is what was appended to the context before that action: the first turn's
    holds the rendered prompt).
    """
    if traj is None:
        return {
            "env": label,
            "seed": seed,
            "task_id": None,
            "solved": False,
            "total_reward": 0.0,
            "num_turns": 0,
            "status": "error",
            "error": error,
            "turns": [],
        }
    decode = formatter.tokenizer.decode
    return {
        "env": label,
        "seed": seed,
        "task_id": traj.task_id,
        "solved": _solved(traj, threshold),
        "total_reward": traj.total_reward,
        "num_turns": len(traj.nodes),
        "status": traj.status,
        "terminated": traj.terminated,
        "truncated": traj.truncated,
        "info": {str(k): _json_value(v) for k, v in traj.info.items()},
        "turns": [
            {
                "observation": decode(list(n.observation_token_ids)),
                "action": decode(list(n.action_token_ids)),
                "reward": float(n.reward),
            }
            for n in traj.nodes
        ],
    }


def _json_value(v):
    if isinstance(v, bool | int | str) or v is None:
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    return str(v)


def write_episodes(path: str | os.PathLike, records: list[dict]) -> Path:
    """Write `records` as JSON lines to `path` at once (`checkpoint.io.atomic_write_text`)."""
    from sao_megatron.trainer.checkpoint.io import atomic_write_text

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))
    return path


def read_episodes(path: str | os.PathLike) -> list[dict]:
    """The records `write_episodes` wrote (gzip when the name ends in .gz)."""
    import gzip

    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
