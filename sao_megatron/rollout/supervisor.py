"""Engine supervisor: runs one engine command and makes sure its process group never outlives
the job that launched it.

`EngineProcess` starts ``python -m sao_megatron.rollout.supervisor --parent PID --grace S --
CMD...`` as the leader of a new session (so of a new process group); the supervisor starts CMD
(the vLLM server) in that group and then watches:

* **the launcher**: ``os.getppid()`` no longer being ``--parent`` means the launching process
  died (crash, SIGKILL, OOM kill). A parent-death signal (Linux ``prctl(PR_SET_PDEATHSIG,
  SIGUSR1)``) reports it at once; polling every 0.2 s catches it everywhere else, including the
  moment between fork and prctl. A parent-death signal alone is not enough: vLLM handles the
  SIGTERM it used to get and, during start-up, lived on under PID 1 until its own 600 s timeout
  (issue 19.6); and the signal fires when the launching *thread* exits, so it is only a hint,
  checked against ``getppid()``;
* **SIGTERM/SIGINT** (`EngineProcess.stop` signals the whole group);
* **the server exiting**: then the rest of the group (vLLM's engine-core and worker processes)
  is killed and the supervisor exits with the server's return code.

Shutting down = SIGTERM to the group, up to ``--grace`` seconds for the server to exit, then
SIGKILL to every process left in the group. Standard library only (it must start fast and run
with any Python).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

POLL_S = 0.2
_PR_SET_PDEATHSIG = 1


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group `pgid`, from /proc (Linux; [] elsewhere)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(stat.parent.name))
    return out


def _kill_others(pgid: int, sig: int) -> None:
    """Send `sig` to every process of the group except this one."""
    me = os.getpid()
    for pid in group_members(pgid):
        if pid != me:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def _set_parent_death_signal(sig: int) -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):  # not Linux: the getppid() polling still applies
        pass


def supervise(cmd: list[str], parent: int, grace_s: float) -> int:
    """Run `cmd` in this process group until it exits, the parent dies or we are told to stop;
    return the exit code to use."""
    pgid = os.getpgrp()
    stop = {"reason": None}

    def on_term(signum, frame):  # noqa: ARG001 - signal handler signature
        stop["reason"] = stop["reason"] or signal.Signals(signum).name

    def on_parent_death(signum, frame):  # noqa: ARG001
        if os.getppid() != parent:  # the process died, not merely the launching thread
            stop["reason"] = stop["reason"] or "parent died"

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    signal.signal(signal.SIGUSR1, on_parent_death)
    _set_parent_death_signal(signal.SIGUSR1)
    if os.getppid() != parent:  # it died before prctl took effect
        return 1
    child = subprocess.Popen(cmd)  # inherits stdout/stderr (the engine log) and the group
    while True:
        rc = child.poll()
        if rc is not None:  # the server exited on its own: nothing of it may stay behind
            _kill_others(pgid, signal.SIGKILL)
            return rc
        if stop["reason"] is None and os.getppid() != parent:
            stop["reason"] = "parent died"
        if stop["reason"] is not None:
            break
        time.sleep(POLL_S)
    print(f"[supervisor] {stop['reason']}: stopping the engine group {pgid}", flush=True)
    _kill_others(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while child.poll() is None and time.monotonic() < deadline:
        time.sleep(POLL_S)
    _kill_others(pgid, signal.SIGKILL)
    try:
        child.wait(timeout=5)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
        pass
    return 0 if stop["reason"] in ("SIGTERM", "SIGINT") else 1


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parent", type=int, required=True, help="pid of the launching process")
    p.add_argument("--grace", type=float, default=10.0, help="seconds from SIGTERM to SIGKILL")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the engine command")
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("no engine command after --")
    sys.exit(supervise(cmd, args.parent, args.grace))


if __name__ == "__main__":
    main()
