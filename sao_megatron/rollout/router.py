"""Load balancing across engines: least outstanding tokens, episode affinity, utilisation stats.

Why our own router and not ``vllm-router`` (a Rust load balancer on PyPI): the rollout needs
(a) affinity per *episode* (an agent's growing context stays on the engine that holds its prefix
in cache) combined with an overload escape, (b) to address every engine individually for weight
sync and health checks anyway, and (c) to requeue the episodes of an engine that dies — which a
separate proxy process would hide from us. A proxy would also add a process, a port and a failure
mode per run. The policy is a few lines:

* a request goes to the episode's previous engine unless that engine's outstanding tokens exceed
  ``affinity_overload_factor * (least outstanding tokens + one request's budget)``;
* otherwise (and for an episode's first request) to the engine with the least outstanding
  tokens, ties broken by fewer outstanding requests, then by fewer tokens served so far;
* outstanding tokens of a request = its prompt length + max_tokens (its worst-case work).

Utilisation per engine = fraction of wall time with at least one request outstanding; the
stats also give the time-averaged number of requests in flight (the load the router balances),
requests, prompt/generated tokens and affinity hits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Generic, TypeVar

E = TypeVar("E")


@dataclass
class EngineLoad:
    """Live load and counters of one engine (times in seconds, monotonic clock)."""

    name: str
    healthy: bool = True
    outstanding_requests: int = 0
    outstanding_tokens: int = 0
    num_requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    affinity_hits: int = 0
    busy_s: float = 0.0
    request_s: float = 0.0  # integral of outstanding_requests over time
    _busy_since: float | None = field(default=None, repr=False)
    _changed_at: float = field(default_factory=time.monotonic, repr=False)

    def busy_seconds(self, now: float) -> float:
        return self.busy_s + (now - self._busy_since if self._busy_since is not None else 0.0)

    def request_seconds(self, now: float) -> float:
        return self.request_s + self.outstanding_requests * (now - self._changed_at)

    def _tick(self) -> None:
        now = time.monotonic()
        self.request_s += self.outstanding_requests * (now - self._changed_at)
        self._changed_at = now


class Router(Generic[E]):
    """Chooses an engine per request. Single-threaded (call it from one event loop).

    Args:
        engines: the engine handles (any objects; `names` labels them).
        names: one label per engine.
        affinity_overload_factor: >= 1, see module docstring.
    """

    def __init__(
        self, engines: list[E], names: list[str], affinity_overload_factor: float = 2.0
    ) -> None:
        if len(engines) != len(names) or not engines:
            raise ValueError("Router needs at least one engine and one name per engine")
        self.engines = list(engines)
        self.loads = [EngineLoad(name=n) for n in names]
        self.factor = affinity_overload_factor
        self._affinity: dict[str, int] = {}
        self._t0 = time.monotonic()

    def healthy_indices(self) -> list[int]:
        return [i for i, ld in enumerate(self.loads) if ld.healthy]

    def choose(self, episode_id: str, cost_tokens: int) -> int:
        """Index of the engine for the episode's next request. Raises RuntimeError if none."""
        healthy = self.healthy_indices()
        if not healthy:
            raise RuntimeError("no healthy engine left")
        best = min(
            healthy,
            key=lambda i: (
                self.loads[i].outstanding_tokens,
                self.loads[i].outstanding_requests,
                self.loads[i].generated_tokens + self.loads[i].prompt_tokens,
            ),
        )
        prev = self._affinity.get(episode_id)
        if prev is not None and self.loads[prev].healthy and prev != best:
            limit = self.factor * (self.loads[best].outstanding_tokens + cost_tokens)
            if self.loads[prev].outstanding_tokens + cost_tokens <= limit:
                self.loads[prev].affinity_hits += 1
                return prev
        elif prev == best:
            self.loads[prev].affinity_hits += 1
        return best

    def begin(self, index: int, episode_id: str, prompt_tokens: int, cost_tokens: int) -> None:
        """Account a request sent to engine `index`."""
        ld = self.loads[index]
        ld._tick()
        if ld.outstanding_requests == 0:
            ld._busy_since = time.monotonic()
        ld.outstanding_requests += 1
        ld.outstanding_tokens += cost_tokens
        ld.num_requests += 1
        ld.prompt_tokens += prompt_tokens
        self._affinity[episode_id] = index

    def end(self, index: int, cost_tokens: int, generated_tokens: int) -> None:
        """Account a finished (or failed: generated_tokens=0) request."""
        ld = self.loads[index]
        ld._tick()
        ld.outstanding_requests -= 1
        ld.outstanding_tokens -= cost_tokens
        ld.generated_tokens += generated_tokens
        if ld.outstanding_requests == 0 and ld._busy_since is not None:
            ld.busy_s += time.monotonic() - ld._busy_since
            ld._busy_since = None

    def forget(self, episode_id: str) -> None:
        """Drop an episode's affinity when it ends."""
        self._affinity.pop(episode_id, None)

    def set_healthy(self, index: int, healthy: bool) -> None:
        self.loads[index].healthy = healthy
        if not healthy:
            self._affinity = {k: v for k, v in self._affinity.items() if v != index}

    def utilisation(self) -> dict[str, dict[str, float]]:
        """Per engine: busy fraction of wall time, requests, tokens, affinity hits, health."""
        now = time.monotonic()
        wall = max(now - self._t0, 1e-9)
        return {
            ld.name: {
                "utilisation": ld.busy_seconds(now) / wall,
                "mean_outstanding_requests": ld.request_seconds(now) / wall,
                "num_requests": ld.num_requests,
                "prompt_tokens": ld.prompt_tokens,
                "generated_tokens": ld.generated_tokens,
                "affinity_hits": ld.affinity_hits,
                "outstanding_requests": ld.outstanding_requests,
                "healthy": float(ld.healthy),
            }
            for ld in self.loads
        }

    def reset_stats(self) -> None:
        """Restart the utilisation window (counters to zero; outstanding work kept)."""
        now = time.monotonic()
        self._t0 = now
        for ld in self.loads:
            ld.num_requests = ld.prompt_tokens = ld.generated_tokens = ld.affinity_hits = 0
            ld.busy_s = ld.request_s = 0.0
            ld._changed_at = now
            ld._busy_since = now if ld.outstanding_requests else None
