"""`sao_megatron.net`: the retry around the window between `free_port` and the bind."""

from __future__ import annotations

import errno
import socket

import pytest

from sao_megatron.net import address_in_use, free_port, with_free_port


def test_address_in_use_reads_errors_and_rank_tracebacks():
    assert address_in_use(OSError(errno.EADDRINUSE, "Address already in use"))
    # what torch.multiprocessing's ProcessRaisedException carries from a rank (text only)
    assert address_in_use(RuntimeError("DistNetworkError: ... code: -98, name: EADDRINUSE, ..."))
    assert not address_in_use(OSError(errno.ECONNREFUSED, "Connection refused"))
    assert not address_in_use(RuntimeError("rank 0: shapes differ"))


def test_with_free_port_starts_again_on_a_taken_port():
    """A port taken between `free_port` and the bind (here: bound by this test before ``start``
    binds it) makes ``start`` fail; the next attempt gets a new port and succeeds."""
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    taken = holder.getsockname()[1]
    tried = []

    def start(port: int) -> int:
        tried.append(port)
        if len(tried) == 1:
            port = taken  # the first attempt loses the race
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))
            return s.getsockname()[1]

    try:
        bound = with_free_port(start)
    finally:
        holder.close()
    assert len(tried) == 2 and bound == tried[1] and bound != taken


def test_with_free_port_raises_other_errors_at_once_and_the_last_clash():
    calls = []

    def fails(port: int) -> None:
        calls.append(port)
        raise RuntimeError("rank 1: loss is nan")

    with pytest.raises(RuntimeError, match="loss is nan"):
        with_free_port(fails)
    assert len(calls) == 1

    def clashes(port: int) -> None:
        calls.append(port)
        raise OSError(errno.EADDRINUSE, "Address already in use")

    calls.clear()
    with pytest.raises(OSError, match="already in use"):
        with_free_port(clashes, attempts=3)
    assert len(calls) == 3
    with pytest.raises(ValueError, match="attempts=0"):
        with_free_port(clashes, attempts=0)
    assert 0 < free_port() < 65536
