"""The agent of the agent-job integration test: the calculator agent of examples/agents, run
unchanged through the gateway, plus a reward offset the test can predict and an injected
failure (``agent_error``) on every fourth seed. Loaded by the job config as
``tests/rollout/job_agent.py:run`` / ``:make_task``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "calculator_agent_for_job_test",
    Path(__file__).resolve().parents[2] / "examples" / "agents" / "calculator_agent.py",
)
calc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(calc)


def fails(seed: int) -> bool:
    """Seeds whose episode raises inside the agent (an ``agent_error``, never trained)."""
    return seed % 4 == 0


def offset(seed: int) -> float:
    """Added to the calculator's 0/1 score: 0, 0.25 or 0.5 by seed, so rewards vary."""
    return (seed % 3) / 4


def make_task(seed: int) -> dict:
    return {**calc.make_task(seed), "seed": seed}


async def run(task: dict, client) -> float:
    if fails(task["seed"]):
        raise RuntimeError(f"injected agent failure (seed {task['seed']})")
    return await calc.run(task, client) + offset(task["seed"])
