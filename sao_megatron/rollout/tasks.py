"""The tasks the rollout runs (an environment factory and a seed each), endless task sources,
and one attempt at a task's episode (`run_task_episode`)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from sao_megatron.data.episode import EpisodeFormatter
from sao_megatron.data.trajectory import Trajectory
from sao_megatron.envs.base import task_id
from sao_megatron.rollout.config import RolloutConfig
from sao_megatron.rollout.runner import GenerateFn, run_episode
from sao_megatron.rollout.status import EpisodeError


@dataclass
class Task:
    """One task: build a fresh environment with `make_env()` and reset it with `seed`.

    task_id must be unique per task (GRPO groups by it; the fault tests count it); the
    package builds it with `sao_megatron.envs.base.task_id`.
    """

    task_id: str
    make_env: Callable[[], object]
    seed: int


def round_robin_tasks(
    make_envs: dict[str, Callable[[], object]],
    start_seed: int = 0,
) -> Iterator[Task]:
    """Endless tasks cycling over named environment factories, seeds start_seed, +1, ...

    task_id = ``task_id(name, seed)``: "<name>:<seed>".
    """
    for seed in itertools.count(start_seed):
        for name, make in make_envs.items():
            yield Task(task_id=task_id(name, seed), make_env=make, seed=seed)


def agent_tasks(name: str, make_env: Callable[[], object], start_seed: int = 0) -> Iterator[Task]:
    """Endless manager tasks ``task_id(name, seed)`` ("<name>:<seed>") of one agent environment
    (seeds start_seed, ...)."""
    seed = start_seed
    while True:
        yield Task(task_id=task_id(name, seed), make_env=make_env, seed=seed)
        seed += 1


async def run_task_episode(
    task: Task,
    group_index: int,
    attempt: int,
    episode_id: str,
    formatter: EpisodeFormatter,
    config: RolloutConfig,
    generate: GenerateFn,
) -> Trajectory:
    """One episode of `task` on a fresh environment: an agent environment's own
    ``run_episode`` (rollout/gateway/, which enforces ``rollout.episode_timeout_s`` itself) or
    `run_episode` within ``rollout.episode_timeout_s``. Records the attempt in ``info``.
    Raises EpisodeError when the environment cannot be built."""
    try:
        env = task.make_env()
    except Exception as e:
        raise EpisodeError(f"{task.task_id}: make_env raised {type(e).__name__}: {e}") from e
    kw = {
        "seed": task.seed,
        "task_id": task.task_id,
        "formatter": formatter,
        "generate": generate,
        "config": config,
        "group_index": group_index,
        "episode_id": episode_id,
    }
    agent_run = getattr(env, "run_episode", None)  # an AgentEnvironment
    if agent_run is not None:
        traj = await agent_run(**kw)
    else:
        traj = await asyncio.wait_for(run_episode(env=env, **kw), timeout=config.episode_timeout_s)
    traj.info["attempt"] = attempt
    return traj
