"""Budgets and a deadline for the checks of tools/gpu_check.py: each check runs under its own time
limit, none starts once its budget no longer fits before the overall deadline, and the report
(JSON) records every check's status (passed, failed, timed_out, skipped with a reason,
skipped_for_time), seconds and result. No torch here: tests/tools/test_gpu_check.py runs it with
plain Python callables.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
import traceback
from collections.abc import Callable
from pathlib import Path

EXIT_FAILED = 1
EXIT_SKIPPED_FOR_TIME = 3


class CheckTimeout(Exception):
    """A check outran its budget (raised in the main thread by the interval timer)."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise `CheckTimeout` in the main thread once `seconds` have passed inside the block.

    Uses the real-time interval timer (SIGALRM); a timer and handler already set (pytest-timeout
    uses them) are put back afterwards, the outer timer less the time spent here. A block stuck
    inside one C call (a hung collective) is only stopped when that call returns: the caller's
    own process timeout stays the last guard.
    """

    def on_alarm(signum, frame):
        raise CheckTimeout(f"outran its budget of {seconds:g} s")

    old_handler = signal.signal(signal.SIGALRM, on_alarm)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    t0 = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay:
            spent = time.monotonic() - t0
            signal.setitimer(signal.ITIMER_REAL, max(old_delay - spent, 1e-3), old_interval)


class Runner:
    """Runs checks under their budgets and an overall deadline; writes the report after each.

    Args:
        out_path: JSON report, rewritten after every check.
        deadline_s: seconds from `start` (monotonic clock) after which no check starts; a check
            starts only if its whole budget fits before it.
        budgets: seconds per check name.
        start: ``time.monotonic()`` the deadline counts from (default: now).
        after_each: called after every check that ran (gpu_check frees CUDA memory there).
    """

    def __init__(
        self,
        out_path: Path,
        deadline_s: float,
        budgets: dict[str, float],
        start: float | None = None,
        after_each: Callable[[], None] | None = None,
    ):
        self.out_path = out_path
        self.after_each = after_each
        self.budgets = budgets
        self.deadline = (time.monotonic() if start is None else start) + deadline_s
        self.report: dict = {
            "started_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            "deadline_s": deadline_s,
            "checks": {},
        }

    def remaining(self) -> float:
        """Seconds left before the deadline."""
        return self.deadline - time.monotonic()

    def statuses(self) -> dict[str, str]:
        """Status of every check recorded so far."""
        return {k: v["status"] for k, v in self.report["checks"].items()}

    def run(self, name: str, fn: Callable[[], object], skip: str | None = None) -> object:
        """Run `fn` as check `name` unless `skip` (a reason) or the deadline says not to.

        Returns `fn`'s value (None when it was skipped, failed or timed out). A dict value is
        the check's recorded result (other values are returned, not recorded).
        """
        budget = self.budgets[name]
        left = self.remaining()
        entry: dict = {"budget_s": budget}
        value = None
        t0 = time.perf_counter()
        if skip is not None:
            entry.update(status="skipped", reason=skip)
        elif left < budget:
            entry.update(
                status="skipped_for_time",
                reason=f"its budget of {budget:g} s does not fit in the {max(left, 0):.0f} s "
                "left before the deadline",
            )
        else:
            try:
                with time_limit(budget):
                    value = fn()
                entry.update(status="passed", result=value if isinstance(value, dict) else None)
            except CheckTimeout as e:
                entry.update(status="timed_out", error=str(e))
            except Exception as e:  # noqa: BLE001 - a check's failure is data, the next one runs
                entry.update(status="failed", error=f"{type(e).__name__}: {e}")
                entry["traceback"] = traceback.format_exc(limit=8)
            if self.after_each is not None:
                self.after_each()
        entry["seconds"] = time.perf_counter() - t0
        self.report["checks"][name] = entry
        self.write()
        note = entry.get("reason") or entry.get("error", "")
        print(
            f"gpu_check: {name}: {entry['status']}{' (' + note[:300] + ')' if note else ''} "
            f"[{entry['seconds']:.1f} s]",
            flush=True,
        )
        return value if entry["status"] == "passed" else None

    def summary(self) -> dict:
        """Check names by status (skipped ones with their reasons)."""
        checks = self.report["checks"]
        by = {
            s: [k for k, v in checks.items() if v["status"] == s]
            for s in ("passed", "failed", "timed_out", "skipped_for_time")
        }
        by["skipped"] = {k: v["reason"] for k, v in checks.items() if v["status"] == "skipped"}
        return by

    def exit_code(self) -> int:
        """0 all passed or skipped for a reason, 1 a failure or time-out, 3 skipped for time."""
        s = self.summary()
        if s["failed"] or s["timed_out"]:
            return EXIT_FAILED
        return EXIT_SKIPPED_FOR_TIME if s["skipped_for_time"] else 0

    def write(self) -> None:
        """Write the report (with its summary) to `out_path`."""
        self.report["summary"] = self.summary()
        self.out_path.write_text(json.dumps(self.report, indent=2, default=str))
