"""Admission capacity when the trainer takes several batches at one policy version (value
pre-training): each extra batch frees one batch of capacity, so the rollout cannot deadlock,
and the staleness bound still holds."""

import threading
import time

import pytest

from sao_megatron.rollout.buffer import StalenessBuffer
from tests.rollout.test_units import traj


def _fill(buf: StalenessBuffer, version: int, start: int) -> int:
    """Start and finish as many single trajectories as admission allows; return the count."""
    n = 0
    while buf.can_start(version):
        buf.mark_started()
        buf.put_group([traj(f"t{start + n}", [version])])
        n += 1
    return n


def test_batches_at_one_version_free_capacity():
    buf = StalenessBuffer(trajectories_per_batch=2, max_staleness=1)
    assert _fill(buf, 0, 0) == 4  # AReaL: (0 + 1 + 1) * 2
    buf.get_batch(0, timeout=1)
    assert _fill(buf, 0, 4) == 0  # the version's first batch frees nothing
    buf.get_batch(0, timeout=1)
    assert _fill(buf, 0, 4) == 2  # a second batch at version 0 frees one batch
    assert len(buf.get_batch(0, timeout=1)) == 2
    assert _fill(buf, 0, 6) == 2  # and so does a third
    buf.get_batch(1, timeout=1)  # a new version: AReaL's rule grants the next batch itself
    assert _fill(buf, 1, 8) == 2


def test_staleness_still_bounded_after_extra_batches():
    buf = StalenessBuffer(trajectories_per_batch=2, max_staleness=1)
    _fill(buf, 0, 0)
    for _ in range(2):
        buf.get_batch(0, timeout=1)
    _fill(buf, 0, 4)
    buf.set_train_version(2)  # version-0 data is now 2 versions old: dropped, not trained
    assert buf.num_ready() == 0


def test_synchronous_bound_does_not_deadlock_at_one_version():
    """eta = 0 (a synchronous run's bound) with value pre-training: the capacity of one batch
    is freed when the trainer *asks* for the next batch at the same version, so the batch it
    waits for can start (freed only after the wait, it never could: the job hung)."""
    buf = StalenessBuffer(trajectories_per_batch=2, max_staleness=0)
    assert _fill(buf, 0, 0) == 2  # (0 + 0 + 1) * 2
    assert len(buf.get_batch(0, timeout=1)) == 2
    assert _fill(buf, 0, 2) == 0
    with pytest.raises(TimeoutError):
        buf.get_batch(0, timeout=0.05)  # nothing ready yet, but the capacity is freed
    assert _fill(buf, 0, 2) == 2
    assert len(buf.get_batch(0, timeout=1)) == 2  # the retry does not free a second batch
    assert _fill(buf, 0, 4) == 0

    stop, started = threading.Event(), [4]

    def rollout():  # the engines: start whatever admission allows, as the manager does
        while not stop.is_set():
            started[0] += _fill(buf, 0, started[0])
            time.sleep(0.01)

    worker = threading.Thread(target=rollout, daemon=True)
    worker.start()
    try:
        for _ in range(3):  # three more value pre-training batches at version 0
            assert len(buf.get_batch(0, timeout=300)) == 2
    finally:
        stop.set()
        worker.join()
    assert started[0] == 10  # exactly one batch of capacity per consumed batch
