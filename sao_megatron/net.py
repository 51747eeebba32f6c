"""Loopback networking helpers shared by the trainer (torch.distributed rendezvous), the
converter and the rollout engines. Standard library only."""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

#: what a rank's traceback says when the rendezvous port was taken between `free_port` and the
#: bind (errno 98 on Linux; torch's TCPStore prints the symbolic name)
ADDRESS_IN_USE_MARKERS = ("EADDRINUSE", "Address already in use", "address already in use")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it; another process may
    take it before it is bound again, so bind soon, or start through `with_free_port`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def address_in_use(exc: BaseException) -> bool:
    """Whether ``exc`` (or the traceback text a spawned rank passed up in its message) reports
    that a port was taken: ``OSError`` EADDRINUSE or one of `ADDRESS_IN_USE_MARKERS`."""
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return True
    return any(marker in str(exc) for marker in ADDRESS_IN_USE_MARKERS)


def with_free_port(start: Callable[[int], T], attempts: int = 4) -> T:
    """``start(port)`` on a `free_port`, again on a new port when the first one was taken before
    ``start`` bound it (another process got it from the OS in between: the window `free_port`
    cannot close). ``start`` must be safe to repeat after such a failure (e.g. spawning a local
    world whose rank 0 hosts the rendezvous store: it fails at the bind, before any work).

    Raises:
        ValueError: ``attempts < 1``.
        Exception: what ``start`` raised, when it is not a port clash or the last attempt clashed.
    """
    if attempts < 1:
        raise ValueError(f"attempts={attempts}: give at least 1")
    for attempt in range(1, attempts + 1):
        try:
            return start(free_port())
        except Exception as exc:
            if attempt == attempts or not address_in_use(exc):
                raise
    raise AssertionError("unreachable")


__all__ = ["ADDRESS_IN_USE_MARKERS", "address_in_use", "free_port", "with_free_port"]
