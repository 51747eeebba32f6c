"""Loopback networking helpers shared by the trainer (torch.distributed rendezvous), the
converter and the rollout engines. Standard library only."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it; another process may
    take it before it is bound again, so bind soon)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


__all__ = ["free_port"]
