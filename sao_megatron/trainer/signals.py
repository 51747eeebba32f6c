"""Signal-safe stop: record SIGTERM/SIGUSR1 (or a stop file) and agree across ranks on when to stop.

Like Megatron-LM's exit signal handler (``megatron/training/dist_signal_handler.py``): the
handler only records that a stop was asked for; the training loop calls `stop_requested()` on
every rank at each step boundary, which all-reduces the local flags (MAX), so every rank stops
after the same step, saves a checkpoint there and exits 0. A cluster's scheduler then requeues
the job and it resumes from that checkpoint (`launch_scripts/train_slurm.sbatch`).

Two ways to ask, either on any rank:
- a signal (default SIGTERM and SIGUSR1, see `install`);
- a stop file: when the environment variable ``SAO_STOP_FILE`` names a path and that file
  exists, the stop is requested. The SLURM script uses it because signalling a job step reaches
  every process of the step, the rollout engines included, which die from SIGUSR1; the file
  reaches only the trainer. When a stop is agreed, the global rank 0 renames the file to
  ``<file>.consumed`` so the launcher knows the trainer acted on it (and requeues only then).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger("sao_megatron.trainer")

STOP_FILE_ENV = "SAO_STOP_FILE"
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")

_received: list[str] = []  # names of the signals received since install(), in order
_previous: dict[int, object] = {}  # signal number -> handler before install()


class StoppedBySignal(Exception):  # noqa: N818 - a control-flow outcome, not an error
    """Raised by the trainer after it saved a checkpoint because a stop was requested.

    Attributes:
        step: the train step that was completed and saved.
        checkpoint: the step folder written (or already present) for `step`.
    """

    def __init__(self, step: int, checkpoint: Path | str) -> None:
        self.step, self.checkpoint = step, Path(checkpoint)
        super().__init__(f"stopped by signal at step {step}; checkpoint saved at {checkpoint}")


def _handler(signum, frame) -> None:  # noqa: ARG001 - signal handler signature
    name = signal.Signals(signum).name
    _received.append(name)
    log.warning("%s received: stopping after the current step (checkpoint, then exit 0)", name)


def install(signals: Iterable[str | int] = DEFAULT_SIGNALS) -> None:
    """Install the recording handler for `signals` (names like "SIGUSR1" or numbers).

    Call once per process, from the main thread, before training. Idempotent; `uninstall()`
    restores the previous handlers.

    Raises:
        ValueError: a name that is not a signal of this platform.
    """
    for s in signals:
        try:
            sig = signal.Signals[s] if isinstance(s, str) else signal.Signals(s)
        except (KeyError, ValueError):
            raise ValueError(
                f"signal {s!r}: not a signal name here (e.g. SIGTERM, SIGUSR1)"
            ) from None
        prev = signal.signal(sig, _handler)
        _previous.setdefault(int(sig), prev)


def uninstall() -> None:
    """Restore the handlers replaced by `install` and forget received signals."""
    for num, prev in _previous.items():
        signal.signal(num, prev)
    _previous.clear()
    _received.clear()


def received() -> list[str]:
    """The signals this process received since `install()` (names, in order)."""
    return list(_received)


def _stop_file() -> Path | None:
    name = os.environ.get(STOP_FILE_ENV)
    return Path(name) if name else None


def local_stop_requested() -> bool:
    """This process alone: a handled signal arrived or the stop file exists."""
    f = _stop_file()
    return bool(_received) or (f is not None and f.exists())


def stop_requested(group: dist.ProcessGroup | None = None) -> bool:
    """True on every rank of `group` when any of them was asked to stop; a collective.

    All ranks of `group` (default: the world) must call it at the same point, e.g. at the end
    of every train step. Without torch.distributed (or with one rank) it is the local flag.
    Cost: one all-reduce of one int32 (on the CUDA device with NCCL, else on the CPU).
    """
    flag = local_stop_requested()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        on_cuda = dist.get_backend(group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else "cpu"
        t = torch.tensor([int(flag)], dtype=torch.int32, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        flag = bool(t.item())
    if flag and (not dist.is_initialized() or dist.get_rank() == 0):
        f = _stop_file()
        if f is not None and f.exists():
            f.replace(f.with_name(f.name + ".consumed"))
    return flag
