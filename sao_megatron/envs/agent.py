"""The ``agent`` environment's options and factory: an OpenAI-SDK agent run through the gateway.

The environment itself lives in `sao_megatron.rollout.gateway` (docs/AGENTS.md); this module
declares its options (`AgentOptions`, checked when the job config loads, like every
environment's) and registers the factory, which imports the gateway only when an agent is built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from sao_megatron.envs.base import options_config, register_env


def _is_reference(value: str) -> bool:
    """``"package.module:function"`` or ``"path/to/file.py:function"`` (as the gateway's
    ``resolve`` reads it: the last ``:`` splits module from name)."""
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
def make_agent(**options: Any) -> Any:
    """An OpenAI-SDK agent function run through the chat gateway (docs/AGENTS.md)."""
    from sao_megatron.rollout.gateway import make_agent_environment

    o = options_config("agent", options)
    return make_agent_environment(
        agent=o.agent,
        task=o.task,
        demonstration=o.demonstration,
        env_name=o.env_name,
        max_turns=o.max_turns,
    )
