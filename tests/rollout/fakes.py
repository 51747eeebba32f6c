"""In-process stand-ins for unit tests: a fake vLLM engine client, a small multi-turn env, and a
sentencepiece tokenizer trained in memory. (The vLLM integration tests use a real server.)"""

from __future__ import annotations

import asyncio
import math
import random

from sao_megatron.data.episode import EpisodeFormatConfig, EpisodeFormatter
from sao_megatron.data.tokenizer import TokenizerConfig, train_sentencepiece
from sao_megatron.envs.base import StepResult
from sao_megatron.rollout.engine import EngineError, Generation, MalformedReplyError, PauseClock

CORPUS = [f"count {i} steps, then say {i % 7} done; state={i * 13 % 101}" for i in range(300)]


def make_formatter(context_mode: str = "full_history", window_size: int = 2) -> EpisodeFormatter:
    """Our real episode format over a 300-token sentencepiece model (ids fit the tiny model)."""
    tok = train_sentencepiece(CORPUS, TokenizerConfig(vocab_size=300))
    cfg = EpisodeFormatConfig(context_mode=context_mode, window_size=window_size)
    return EpisodeFormatter(tok, cfg)


class CountEnv:
    """Episode of `1 + seed % max_len` steps; reward = 1 if the action is non-empty else 0 and
    +10 on the last step. Observations name the step. Optionally raises on a given step."""

    name = "count"

    def __init__(self, max_len: int = 3, raise_on_step: int | None = None) -> None:
        self.max_len = max_len
        self.max_steps = 50
        self.raise_on_step = raise_on_step

    def reset(self, seed: int) -> str:
        self.steps = 1 + seed % self.max_len
        self.t = 0
        return f"count {self.steps} steps"

    def step(self, action: str) -> StepResult:
        self.t += 1
        if self.raise_on_step is not None and self.t == self.raise_on_step:
            raise RuntimeError("environment bug")
        done = self.t >= self.steps
        reward = float(bool(action)) + (10.0 if done else 0.0)
        return StepResult(observation="" if done else f"state={self.t}", reward=reward, done=done)


class FakeEngine:
    """State of one fake engine: weight version, pause gate, failure mode, per-token latency."""

    def __init__(self, name: str, token_latency_s: float = 0.001, vocab: int = 300) -> None:
        self.name = name
        self.version = "default"
        self.token_latency_s = token_latency_s
        self.vocab = vocab
        self.mode = "ok"  # "ok" | "dead" | "hang" | "malformed"
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.requests: list[list[int]] = []
        self.reloads: list[str] = []
        self.generated = 0


class FakeEngineClient:
    """Implements the `EngineClient` methods the manager uses, against a `FakeEngine`."""

    registry: dict[str, FakeEngine] = {}

    def __init__(self, url: str, name: str, request_timeout_s: float = 120.0) -> None:
        self.url, self.name = url, name
        self.engine = self.registry[url]
        self.pause_clock = PauseClock()

    def _check(self) -> None:
        if self.engine.mode == "dead":
            raise EngineError(f"{self.name}: connection refused")

    async def generate(
        self,
        prompt_ids,
        *,
        max_tokens,
        temperature,
        top_p,
        stop_token_ids,
        seed=None,
        request_id=None,
        ignore_eos=False,
    ) -> Generation:
        e = self.engine
        self._check()
        if e.mode == "hang":
            await asyncio.sleep(3600)
        if e.mode == "malformed":
            raise MalformedReplyError(f"{self.name}: garbled reply")
        e.requests.append(list(prompt_ids))
        rng = random.Random(hash((tuple(prompt_ids), seed)))
        n = min(max_tokens, rng.randint(1, 6))
        ids, lps, vers = [], [], []
        for k in range(n):
            await e.unpaused.wait()
            await asyncio.sleep(e.token_latency_s)
            self._check()
            last = k == n - 1 and stop_token_ids
            ids.append(stop_token_ids[0] if last else rng.randrange(7, e.vocab))
            lps.append(-abs(rng.gauss(1.0, 0.5)) / temperature)
            vers.append(int(e.version))
        e.generated += n
        assert all(math.isfinite(x) for x in lps)
        return Generation(ids, lps, vers, "stop" if stop_token_ids else "length")

    async def pause(self) -> None:
        self._check()
        self.pause_clock.start()
        self.engine.unpaused.clear()

    async def resume(self) -> None:
        self._check()
        self.engine.unpaused.set()
        self.pause_clock.stop()

    async def reload_weights(self, path: str) -> dict:
        self._check()
        self.engine.reloads.append(path)
        return {"num_tensors": 1, "num_repacked_layers": 0, "seconds": 0.0}

    async def set_weight_version(self, version: int) -> None:
        self._check()
        self.engine.version = str(version)

    async def weight_version(self) -> int:
        self._check()
        return int(self.engine.version)

    async def reset_prefix_cache(self) -> None:
        self._check()

    async def healthy(self, timeout_s: float = 5.0) -> bool:
        return self.engine.mode != "dead"

    async def aclose(self) -> None:
        pass


class FakeProcess:
    """Stands in for a local `EngineProcess` over a `FakeEngine`: `kill` makes the process exit
    and the engine refuse connections; `start` brings both back."""

    def __init__(self, url: str, engine: FakeEngine) -> None:
        self.url, self.engine = url, engine
        self.log_path = f"/nonexistent/{engine.name}.log"
        self.exit_code: int | None = None
        self.starts = 0

    def is_alive(self) -> bool:
        return self.exit_code is None

    def kill(self) -> None:
        self.exit_code = -9
        self.engine.mode = "dead"

    def stop(self) -> None:
        if self.exit_code is None:
            self.exit_code = 0

    def start(self) -> None:
        self.starts += 1
        self.exit_code = None
        self.engine.mode = "ok"
        self.engine.version = "default"

    def wait_ready(self) -> float:
        return 0.0


class FixedLengthEnv(CountEnv):
    """A `CountEnv` whose every episode lasts exactly `steps` actions (seed-independent)."""

    def __init__(self, steps: int) -> None:
        super().__init__(max_len=steps)
        self.fixed_steps = steps
        self.max_steps = max(50, steps)

    def reset(self, seed: int) -> str:
        super().reset(seed)
        self.steps = self.fixed_steps
        return f"count {self.steps} steps"


def short_long_tasks(num_tasks: int, long_every: int, long_steps: int, short_steps: int = 1):
    """Tasks "short/<i>" (`short_steps` actions) with every `long_every`-th task "long/<i>"
    (`long_steps` actions); deterministic order, seeds 0, 1, ..."""
    from sao_megatron.rollout.manager import Task

    out = []
    for i in range(num_tasks):
        long = i % long_every == long_every - 1
        steps = long_steps if long else short_steps
        out.append(
            Task(
                task_id=f"{'long' if long else 'short'}/{i}",
                make_env=lambda steps=steps: FixedLengthEnv(steps),
                seed=i,
            )
        )
    return out
