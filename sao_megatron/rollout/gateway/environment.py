"""An agent function as a rollout environment, and the ``agent`` environment of job configs.

`AgentEnvironment(run, make_task)` is what the rollout manager runs through its agent hook
(``run_episode``) instead of the text-step loop; `make_agent_environment` builds one from a job
config's ``tasks.train: [{name: agent, options: {agent: "file.py:run", task:
"file.py:make_task"}}]`` (`resolve` loads ``"package.module:name"`` or ``"path/to/file.py:name"``).

This module registers the ``agent`` environment (`make_agent`, options `AgentOptions`, checked
when the job config loads like every environment's). The environment registry imports it by
its import path the first time a config or a caller names ``agent``
(`sao_megatron.envs.base.LAZY_ENVS`), so a job needs no import of its own.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from sao_megatron.data.trajectory import Trajectory
from sao_megatron.envs.base import options_config, register_env, task_id
from sao_megatron.rollout.config import RolloutConfig
from sao_megatron.rollout.engine import REPO_ROOT
from sao_megatron.rollout.gateway.demonstration import AgentDemonstration, check_record
from sao_megatron.rollout.gateway.episode import AgentFn, AgentOutcome, run_agent_episode
from sao_megatron.rollout.gateway.server import ChatGateway
from sao_megatron.rollout.runner import GenerateFn
from sao_megatron.rollout.status import EpisodeStatus, failure_for


def _limit(own: float | None, config: RolloutConfig, name: str) -> float | None:
    """The environment's own limit, else the rollout's (``rollout.<name>``)."""
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
        demonstrate: optional ``task -> {"messages": [...], "tools": [...]}``, the gold
            conversation of a task (`demonstration`; the SFT warm-up's data).

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
        demonstrate: Callable[[Any], dict] | None = None,
    ) -> None:
        self.agent, self.make_task, self.name = agent, make_task, name
        self.demonstrate = demonstrate
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

    def demonstration(self, seed: int, episode_task_id: str | None = None) -> AgentDemonstration:
        """The gold conversation of seed `seed`: ``demonstrate(make_task(seed))`` (``demonstrate``
        is a plain function; an async ``make_task`` is run to completion). The record's shape is
        checked here, its rendering by `AgentDemonstration.to_sft_sequences`. Raises ValueError
        without ``demonstrate``."""
        if self.demonstrate is None:
            raise ValueError(
                f"agent {self.name!r} has no gold demonstrations: add "
                "`demonstration: 'file.py:demonstrate'` (a function task -> {'messages': [...], "
                "'tools': [...]}) to its options in demonstrations.envs, or drop 'sft' from stages"
            )
        task = self.make_task(seed)
        if inspect.isawaitable(task):
            task = asyncio.run(task)
        where = f"{getattr(self.demonstrate, '__qualname__', 'demonstrate')}(make_task({seed}))"
        messages, tools = check_record(self.demonstrate(task), where)
        return AgentDemonstration(
            task_id=episode_task_id or task_id(self.name, seed),
            env_name=self.name,
            seed=seed,
            messages=messages,
            tools=tools,
            where=where,
        )

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
        (`failure_for`; the manager requeues or drops it by ``rollout.requeue_statuses``)."""
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
    env_name: str = "agent",
    max_turns: int | None = None,
    demonstration: str | Callable[[Any], dict] | None = None,
) -> AgentEnvironment:
    """The ``agent`` environment of a job config (``tasks.train: [{name: agent, options:
    {agent: "examples/agents/calculator_agent.py:run", task: "...:make_task"}}]``).

    Options: ``agent``/``task`` as for `resolve`; ``env_name``: the name recorded in each
    trajectory's ``info["env"]`` (not ``name``, which is the registry's: ``agent``);
    ``max_turns`` caps this agent below ``rollout.max_turns``; ``demonstration`` (optional, as
    for `resolve`): ``task -> {"messages", "tools"}``, the gold conversation the SFT stage
    trains on (`sao_megatron.rollout.gateway.demonstration`). The time limits are the
    rollout's (``rollout.step_timeout_s``/``episode_timeout_s``, one home for every episode)."""
    run = resolve(agent, "agent")
    if not inspect.iscoroutinefunction(run):
        raise ValueError(
            f"tasks.train[].options.agent={agent!r}: must be an `async def run(task, client)`"
        )
    if max_turns is not None and max_turns < 1:
        raise ValueError(f"tasks.train[].options.max_turns={max_turns!r}: must be >= 1 or null")
    demonstrate = None if demonstration is None else resolve(demonstration, "demonstration")
    return AgentEnvironment(
        run, resolve(task, "task"), name=env_name, max_turns=max_turns, demonstrate=demonstrate
    )


def _is_reference(value: str) -> bool:
    """``"package.module:function"`` or ``"path/to/file.py:function"`` (as `resolve` reads it:
    the last ``:`` splits module from name)."""
    module, _, name = value.rpartition(":")
    return bool(module) and name.isidentifier()


@dataclass(kw_only=True)
class AgentOptions:
    """Options of the ``agent`` environment (``tasks.train: [{name: agent, options: {...}}]``).

    Fields:
        agent: the agent, ``async def run(task, client) -> float``, as
            ``"package.module:function"`` or ``"path/to/file.py:function"`` (or the function).
        task: ``seed -> task`` (plain or async; what the agent receives), given the same way.
        demonstration: optional ``task -> {"messages": [...], "tools": [...]}``, the gold
            conversation of a task (the SFT stage's data), given the same way.
        env_name: the name recorded in each trajectory's ``info["env"]``.
        max_turns: model calls per episode before truncation (>= 1, capped by
            ``rollout.max_turns``); null: ``rollout.max_turns``.
    """

    CONFIG_SECTION: ClassVar[str] = "agent"  # messages say agent.<field> (see envs.options)

    agent: str | Callable[..., Any]
    task: str | Callable[..., Any]
    demonstration: str | Callable[..., Any] | None = None
    env_name: str = "agent"
    max_turns: int | None = None

    def __post_init__(self) -> None:
        for name in ("agent", "task", "demonstration"):
            value = getattr(self, name)
            if isinstance(value, str) and not _is_reference(value):
                raise ValueError(
                    f"agent.{name}={value!r}: give 'package.module:function' or 'file.py:function'"
                )
        if not self.env_name:
            raise ValueError("agent.env_name='': give the name trajectories record")
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError(f"agent.max_turns={self.max_turns!r}: must be >= 1 or null")


@register_env("agent", options=AgentOptions)
def make_agent(**options: Any) -> AgentEnvironment:
    """The ``agent`` environment: an OpenAI-SDK agent function run through the chat gateway
    (docs/AGENTS.md); the options are `AgentOptions`' fields."""
    o = options_config("agent", options)
    return make_agent_environment(
        agent=o.agent,
        task=o.task,
        demonstration=o.demonstration,
        env_name=o.env_name,
        max_turns=o.max_turns,
    )
