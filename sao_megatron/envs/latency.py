"""Environment step latency: wrap any environment so each step waits a heavy-tailed, seeded delay.

Agent environments whose steps are tool calls or sandbox commands answer in tens of milliseconds
to seconds, with a long tail. `LatencyEnv` reproduces that on any registered environment: before
each step it waits a delay drawn from a lognormal or Pareto distribution (parametrised by its
median, capped at `max_s`), seeded by (config seed, episode seed, step), so a run is
reproducible. The wrapped environment's behaviour is unchanged.

Not blocking the rollout loop. `LatencyEnv.step` sleeps (blocking, for synchronous callers such
as demonstrations); `LatencyEnv.astep` awaits `asyncio.sleep`, then steps the wrapped environment
the same non-blocking way, so many episodes wait concurrently in one event loop. An async caller
should use `astep(env, action)` below, which awaits `env.astep` when the environment has one and
otherwise runs the blocking `env.step` in a worker thread (`asyncio.to_thread`, the default
executor: min(32, cpus + 4) threads). The rollout's episode runner
(`sao_megatron.rollout.runner.run_episode`, through `rollout.status.call_step`) does exactly
that, so a latency-wrapped environment in a job waits without blocking other episodes
(`tests/envs/test_latency.py` checks it through the real `RolloutManager`).

Build from config::

    {name: latency, options: {env: {name: hanoi, options: {horizon: 50}},
                              distribution: lognormal, median_s: 0.2, shape: 1.0, max_s: 5.0}}

Distributions: `heavy_tail.sample_heavy_tailed` (lognormal or Pareto by median and shape, capped).
Registered as ``latency`` when `sao_megatron.envs` is imported (`register()`, idempotent).

Seeding and GRPO: the delays of an episode depend on (`seed`, episode seed, step) only, and the
G episodes of a GRPO group share their task's seed, so they draw the *same* delays unless each
member's wrapper gets its own `seed` (as `tools/bench_regimes.py` does).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from sao_megatron.envs.base import (
    EnvSpec,
    StepResult,
    episode_metrics,
    options_config,
    register_env,
    register_episode_metrics,
)
from sao_megatron.envs.heavy_tail import DISTRIBUTIONS, HEAVY_TAILED, sample_heavy_tailed  # noqa: F401


@dataclass(kw_only=True)
class LatencyConfig:
    """Options of the latency wrapper.

    Fields:
        distribution: "lognormal", "pareto", "constant" or "none".
        median_s: median delay per step, seconds (>= 0).
        shape: lognormal sigma (1.0: p99 ~ 10x the median) or Pareto alpha (1.5: mean 2.6x the
            median, infinite variance) (> 0).
        max_s: cap on one delay, seconds (>= median_s): a hung tool call times out.
        seed: base seed of the delays (with the episode seed and the step index).
    """

    CONFIG_SECTION: ClassVar[str] = "latency"  # messages say latency.<field> (see envs.options)

    distribution: str = "lognormal"
    median_s: float = 0.2
    shape: float = 1.0
    max_s: float = 10.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.distribution not in DISTRIBUTIONS:
            raise ValueError(
                f"latency.distribution={self.distribution!r}: use one of {list(DISTRIBUTIONS)}"
            )
        if not (self.median_s >= 0):
            raise ValueError(f"latency.median_s={self.median_s}: must be >= 0 seconds")
        if not (self.shape > 0):
            raise ValueError(f"latency.shape={self.shape}: must be > 0")
        if not (self.max_s >= self.median_s):
            raise ValueError(
                f"latency.max_s={self.max_s}: must be >= latency.median_s ({self.median_s})"
            )


#: the environment `make_latency_env` wraps when its options give none (for `show all`)
DEFAULT_WRAPPED = {"name": "hanoi", "options": {"horizon": 3, "extra_disks": 0}}


@dataclass(kw_only=True)
class LatencyOptions(LatencyConfig):
    """Options of the ``latency`` environment: the wrapped environment, then `LatencyConfig`'s.

    Fields:
        env: the wrapped environment, ``{name: hanoi, options: {horizon: 50}}`` (an EnvSpec,
            checked like any task entry); null: a 3-move Hanoi.
    """

    env: EnvSpec | None = None


class LatencyEnv:
    """Any environment with a seeded heavy-tailed delay before each step.

    Forwards `name`, `max_steps`, `reset` and every other attribute (`gold_action`, ...) to the
    wrapped environment. Each step's info gets ``env_latency_s`` (this step's delay) and
    ``env_latency_total_s`` (the episode's sum so far).
    """

    def __init__(self, env: Any, config: LatencyConfig | None = None) -> None:
        self.env = env
        self.config = config or LatencyConfig()
        self.name = env.name
        self._rng = random.Random(f"latency:{self.config.seed}:none")
        self.total_s = 0.0

    @property
    def max_steps(self) -> int:
        return self.env.max_steps

    def __getattr__(self, item: str) -> Any:  # only called for attributes not found here
        if item == "env":
            raise AttributeError(item)
        return getattr(self.env, item)

    def reset(self, seed: int) -> str:
        self._rng = random.Random(f"latency:{self.config.seed}:{seed}")
        self.total_s = 0.0
        return self.env.reset(seed)

    def next_delay(self) -> float:
        """The next step's delay in seconds (advances the seeded stream)."""
        c = self.config
        return sample_heavy_tailed(self._rng, c.distribution, c.median_s, c.shape, c.max_s)

    def _finish(self, result: StepResult, delay: float) -> StepResult:
        self.total_s += delay
        result.info = dict(result.info or {})
        result.info["env_latency_s"] = delay
        result.info["env_latency_total_s"] = self.total_s
        return result

    def step(self, action: str) -> StepResult:
        """Blocking: sleep the delay, then step the wrapped environment."""
        delay = self.next_delay()
        time.sleep(delay)
        return self._finish(self.env.step(action), delay)

    async def astep(self, action: str) -> StepResult:
        """Non-blocking: await the delay (other episodes run meanwhile), then step the wrapped
        environment without blocking either (its own ``astep``, else ``step`` in a thread)."""
        delay = self.next_delay()
        await asyncio.sleep(delay)
        return self._finish(await astep(self.env, action), delay)


async def astep(env: Any, action: str) -> StepResult:
    """Step `env` without blocking the event loop: ``await env.astep(action)`` when it has one,
    else the blocking ``env.step`` in a worker thread."""
    if hasattr(env, "astep"):
        return await env.astep(action)
    return await asyncio.to_thread(env.step, action)


def make_latency_env(**options: Any) -> LatencyEnv:
    """Registry factory: the options are `LatencyOptions` fields (``env``: the wrapped
    environment's EnvSpec or its mapping form ``{name, options}``; default `DEFAULT_WRAPPED`)."""
    config = options_config("latency", options)
    spec = config.env or EnvSpec(**DEFAULT_WRAPPED)
    return LatencyEnv(spec.build(), config)


def latency_episode_metrics(
    infos: Sequence[Mapping[str, Any]], options: Mapping[str, Any]
) -> dict[str, float]:
    """The wrapped environment's evaluation metrics (`episode_metrics` of ``options["env"]``):
    a delay changes no episode's outcome."""
    config = options_config("latency", options)
    return episode_metrics(config.env or EnvSpec(**DEFAULT_WRAPPED), infos)


def register() -> None:
    """Register `make_latency_env` as environment "latency", with the wrapped environment's
    evaluation metrics (idempotent; `sao_megatron.envs` calls it on import)."""
    from sao_megatron.envs.base import _REGISTRY

    if _REGISTRY.get("latency") is not make_latency_env:
        register_env("latency", options=LatencyOptions)(make_latency_env)
    register_episode_metrics("latency", latency_episode_metrics)
