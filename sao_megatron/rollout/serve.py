"""Rollout engines in their own process (a cluster's engine nodes), found by the trainer via files.

`serve` starts ``rollout.num_engines`` vLLM servers on this node with the command line of
`EngineProcess` (`EngineProcess.command`), listening on this node's address instead of
loopback, and tells the trainer their URLs through files next to ``rollout.engine_urls_file`` on
storage both see. Its command line, which reads the job config, is ``sao-serve CONFIG [--import
MODULE] [section.field=value ...]`` (`sao_megatron.cli.serve`); the SLURM script runs it as a
job step of its own on ``ROLLOUT_NODES`` nodes, one task per node (docs/CLUSTERS.md). The
hand-off, all JSON files written atomically (``os.replace``):

1. the trainer (rank 0) exports its policy to a Hugging Face folder and writes
   ``<urls_file>.request``: ``{"nonce", "model_path"}`` (`request_engines`); the engines need
   that folder (the architecture and the tokenizer the trainer fitted) to start;
2. every serving task waits for it, starts its engines on ``model_path`` (logs under
   ``<urls_file dir>/remote/<host>/engines/``), waits until they answer ``/health`` (the
   log-progress deadline of `EngineProcess.wait_ready`) and writes ``<urls_file>.part<task>``:
   ``{"nonce", "host", "urls", "logs"}``, or ``{"nonce", "host", "error"}`` when they failed;
3. task 0 waits for every task's part and writes ``<urls_file>``: ``{"nonce", "urls", "logs"}``;
4. the trainer waits for that file with its nonce (`wait_for_engine_urls`: no deadline while the
   engines' logs grow, ``rollout.startup_timeout_s`` without progress), loads its current weights
   into every engine (the weight-sync path: a safetensors file the engines read from the shared
   storage, by absolute path) and trains;
5. when it ends (or stops on a signal) the trainer writes ``{"nonce", "done": true}`` to the
   request file (`release_engines`): every task stops its engines and exits 0. SIGTERM/SIGINT
   (``scancel``, the batch script) do the same.

The nonce (one per trainer run) keeps a trainer from attaching to the URLs a previous run of the
same run_dir left behind. The engines' dev endpoints (weight reload, pause) are reachable by
anyone who can reach the node's port: run on a trusted cluster network.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
import uuid
from pathlib import Path

import httpx

from sao_megatron.rollout.config import RolloutConfig
from sao_megatron.rollout.engine import EngineClient, EngineError, EngineProcess, start_engines

log = logging.getLogger("sao_megatron.rollout.serve")

HOST_ENV = "SAO_ENGINE_HOST"  # the address engines listen on and advertise (default: hostname)


# ---------------------------------------------------------------- the files of the hand-off
def resolve_urls_file(config: RolloutConfig, run_dir: str | Path) -> Path:
    """Absolute path of ``rollout.engine_urls_file`` (relative paths are taken from run_dir).

    Raises ValueError when the field is not set.
    """
    if not config.engine_urls_file:
        raise ValueError(
            "rollout.engine_urls_file is not set: give the JSON file through which the trainer "
            "finds these engines (the SLURM script passes RUN_DIR/rollout/engine_urls.json)"
        )
    path = Path(config.engine_urls_file)
    return (path if path.is_absolute() else Path(run_dir) / path).resolve()


def request_path(urls_file: Path) -> Path:
    return Path(f"{urls_file}.request")


def part_path(urls_file: Path, task: int) -> Path:
    return Path(f"{urls_file}.part{task}")


def log_root(urls_file: Path) -> Path:
    """Folder of the engine logs, one sub-folder per host."""
    return urls_file.parent / "remote"


def write_json(path: Path, obj: dict) -> None:
    """Write `obj` as JSON so that readers see the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def read_json(path: Path) -> dict | None:
    """The JSON object in `path`, or None when it is missing (or not yet complete)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def request_engines(urls_file: Path, model_path: str | Path) -> str:
    """Ask the serving tasks for engines on `model_path` (trainer, rank 0); returns the nonce.

    Old part and URL files (a previous run of this run_dir) are removed first.
    """
    for old in [urls_file, *urls_file.parent.glob(f"{urls_file.name}.part*")]:
        old.unlink(missing_ok=True)
    nonce = uuid.uuid4().hex
    write_json(
        request_path(urls_file), {"nonce": nonce, "model_path": str(Path(model_path).resolve())}
    )
    return nonce


def release_engines(urls_file: Path, nonce: str) -> None:
    """Tell the serving tasks of request `nonce` to stop their engines and exit (trainer)."""
    write_json(request_path(urls_file), {"nonce": nonce, "done": True})


def _progress_signature(urls_file: Path) -> tuple:
    """Changes whenever an engine log grows or a part file appears (the trainer's progress)."""
    sig = []
    for root in (log_root(urls_file), urls_file.parent):
        pattern = "*/engines/*.log" if root == log_root(urls_file) else f"{urls_file.name}.part*"
        for f in sorted(root.glob(pattern)):
            try:
                sig.append((str(f), f.stat().st_size))
            except OSError:
                pass
    return tuple(sig)


def wait_for_engine_urls(
    urls_file: Path, nonce: str, stall_s: float, poll_s: float = 1.0
) -> list[str]:
    """Block until the serving tasks published healthy engines for request `nonce`; their URLs.

    `stall_s` counts seconds without progress (an engine log growing, a task reporting), as in
    `EngineProcess.wait_ready`: a slow start on a loaded node is not cut short, a missing engine
    step is reported. Raises EngineError naming the logs when a task reports a failure or
    nothing moves for `stall_s`.
    """
    last, last_change = _progress_signature(urls_file), time.monotonic()
    waited_since = time.monotonic()
    while True:
        for part in sorted(urls_file.parent.glob(f"{urls_file.name}.part*")):
            info = read_json(part)
            if info and info.get("nonce") == nonce and "error" in info:
                raise EngineError(
                    f"the engine step failed on {info.get('host')}: {info['error']} (engine logs "
                    f"under {log_root(urls_file)})"
                )
        info = read_json(urls_file)
        if info and info.get("nonce") == nonce:
            urls = [str(u) for u in info["urls"]]
            for url in urls:
                _wait_healthy(url, stall_s)
            log.info(
                "remote engines ready after %.1f s: %s (logs %s)",
                time.monotonic() - waited_since,
                " ".join(urls),
                " ".join(info.get("logs", [])),
            )
            return urls
        sig = _progress_signature(urls_file)
        if sig != last:
            last, last_change = sig, time.monotonic()
        if time.monotonic() - last_change > stall_s:
            raise EngineError(
                f"no engine URLs in {urls_file} and no progress in the engine logs under "
                f"{log_root(urls_file)} for {stall_s:.0f} s: is the engine step "
                "(`sao-serve`, the SLURM script's ROLLOUT_NODES) "
                "running with the same rollout.engine_urls_file? (raise "
                "rollout.startup_timeout_s if it was still starting)"
            )
        time.sleep(poll_s)


def _wait_healthy(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url + "/health", timeout=5.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise EngineError(f"engine {url} listed but not answering /health for {timeout_s} s")
        time.sleep(1.0)


# ---------------------------------------------------------------- the serving side
class NodeEngine(EngineProcess):
    """An `EngineProcess` that listens on `host` (this node's address) instead of loopback, so
    trainer ranks on other nodes reach it; same command line otherwise."""

    def __init__(self, config: RolloutConfig, index: int, model_path, run_dir, host: str) -> None:
        super().__init__(config, index, model_path, run_dir)
        self.host = host

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = super().command()
        cmd[cmd.index("--host") + 1] = self.host
        return cmd


class _Stop:
    """SIGTERM/SIGINT/SIGHUP handler: record, and let the loop stop the engines."""

    def __init__(self) -> None:
        self.signal: str | None = None
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        self.signal = signal.Signals(signum).name


def _wait_request(req_file: Path, stop: _Stop, poll_s: float) -> dict | None:
    """The trainer's request (None if stopped first); says every minute that it is waiting."""
    t0 = last_said = time.monotonic()
    while stop.signal is None:
        req = read_json(req_file)
        if req and not req.get("done") and req.get("model_path"):
            return req
        if time.monotonic() - last_said >= 60:
            log.info(
                "waiting for the trainer's request %s (%.0f s)", req_file, time.monotonic() - t0
            )
            last_said = time.monotonic()
        time.sleep(poll_s)
    return None


async def _weight_versions(urls: list[str]) -> list[int | str]:
    out: list[int | str] = []
    for i, url in enumerate(urls):
        client = EngineClient(url, f"engine{i}")
        try:
            out.append(await client.weight_version())
        except EngineError as e:
            out.append(f"unknown ({e})")
        finally:
            await client.aclose()
    return out


def serve(
    config: RolloutConfig,
    urls_file: Path,
    *,
    host: str,
    task: int = 0,
    num_tasks: int = 1,
    poll_s: float = 1.0,
) -> int:
    """Serve the trainer's requests on this node (steps 2-5 of the module docstring) until one
    is released or a signal arrives. A new request (another nonce: a restarted trainer) while
    serving restarts the engines on its model.

    Returns the exit code: 0 when released or stopped by a signal, 1 when the engines failed to
    start (the part file says why, for the trainer) or all of them died.
    """
    stop = _Stop()
    req_file = request_path(urls_file)
    log.info(
        "task %d/%d on %s: waiting for the trainer's request %s", task, num_tasks, host, req_file
    )
    while True:
        req = _wait_request(req_file, stop, poll_s)
        if req is None:
            log.info("stopped by %s before any request", stop.signal)
            return 0
        code, next_request = _serve_one(config, urls_file, req, host, task, num_tasks, stop, poll_s)
        if not next_request:
            return code


def _serve_one(config, urls_file, req, host, task, num_tasks, stop, poll_s) -> tuple[int, bool]:
    """Start the engines for `req`, publish them, serve until released; (exit code, True when a
    newer request replaced this one)."""
    nonce, model_path = req["nonce"], req["model_path"]
    req_file, part = request_path(urls_file), part_path(urls_file, task)
    node_dir = log_root(urls_file) / host
    engines = [NodeEngine(config, i, model_path, node_dir, host) for i in range(config.num_engines)]
    code, replaced, failed = 0, False, False
    try:
        try:
            start_engines(engines)
        except EngineError as err:
            write_json(part, {"nonce": nonce, "host": host, "error": str(err)})
            log.error("%s", err)
            failed = True
            return 1, False
        urls = [e.url for e in engines]
        logs = [str(e.log_path) for e in engines]
        write_json(part, {"nonce": nonce, "host": host, "urls": urls, "logs": logs})
        if task == 0 and not _publish_all(urls_file, nonce, num_tasks, stop, poll_s):
            return (0 if stop.signal else 1), False
        log.info("serving %s for request %s (model %s)", " ".join(urls), nonce, model_path)
        while stop.signal is None:
            now = read_json(req_file) or {}
            if now.get("nonce") != nonce:
                log.info("a new request replaced %s: restarting the engines", nonce)
                replaced = True
                break
            if now.get("done"):
                log.info("released by the trainer")
                break
            if not any(e.is_alive() for e in engines):
                log.error("every engine on %s died; see %s", host, ", ".join(logs))
                code = 1
                break
            time.sleep(poll_s)
        if stop.signal:
            log.info("%s received: stopping the engines", stop.signal)
        versions = asyncio.run(_weight_versions(urls))
        for url, version in zip(urls, versions, strict=True):
            log.info("engine %s: weight version %s at shutdown", url, version)
        return code, replaced
    finally:
        for e in engines:
            e.stop()
        if not failed:  # an error part stays for the trainer to read
            part.unlink(missing_ok=True)
        if task == 0 and (read_json(urls_file) or {}).get("nonce") == nonce:
            urls_file.unlink(missing_ok=True)


def _publish_all(urls_file: Path, nonce: str, num_tasks: int, stop: _Stop, poll_s: float) -> bool:
    """Task 0: merge every task's part into `urls_file` once all reported; False on an error
    part or a stop signal."""
    while stop.signal is None:
        parts = [read_json(part_path(urls_file, t)) or {} for t in range(num_tasks)]
        if any(p.get("nonce") == nonce and "error" in p for p in parts):
            log.error("an engine task failed: %s", [p.get("error") for p in parts if "error" in p])
            return False
        if all(p.get("nonce") == nonce and "urls" in p for p in parts):
            urls = [u for p in parts for u in p["urls"]]
            logs = [x for p in parts for x in p["logs"]]
            write_json(urls_file, {"nonce": nonce, "urls": urls, "logs": logs})
            log.info("wrote %d engine URL(s) of %d task(s) to %s", len(urls), num_tasks, urls_file)
            return True
        time.sleep(poll_s)
    return False
