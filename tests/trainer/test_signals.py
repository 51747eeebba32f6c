"""Signal-safe stop: a recorded SIGUSR1/SIGTERM or the stop file stops every rank at one step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch.distributed as dist

from sao_megatron.trainer import signals
from tests.conftest import launch


@pytest.fixture
def handlers():
    signals.install()
    yield
    signals.uninstall()


def _loop(num_steps: int, signal_at: int | None, sig=signal.SIGUSR1) -> int:
    """A training loop that checks stop_requested() at each step boundary; returns last step."""
    step = 0
    while step < num_steps:
        step += 1
        if step == signal_at:
            os.kill(os.getpid(), sig)  # delivered before kill() returns (main thread)
        if signals.stop_requested():
            break
    return step


def test_sigusr1_mid_loop_stops_at_that_step(handlers):
    assert _loop(10, signal_at=None) == 10
    assert _loop(10, signal_at=4) == 4
    assert signals.received() == ["SIGUSR1"]


def test_sigterm_is_recorded_not_fatal(handlers):
    assert _loop(10, signal_at=7, sig=signal.SIGTERM) == 7
    assert signals.received() == ["SIGTERM"]


def test_uninstall_restores_previous_handlers():
    before = signal.getsignal(signal.SIGUSR1)
    signals.install(["SIGUSR1"])
    assert signal.getsignal(signal.SIGUSR1) is signals._handler
    signals.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is before
    assert not signals.local_stop_requested()


def test_unknown_signal_name_is_a_value_error():
    with pytest.raises(ValueError, match="SIGNOPE"):
        signals.install(["SIGNOPE"])


def test_stop_file_requests_a_stop_and_is_consumed(tmp_path, monkeypatch, handlers):
    stop = tmp_path / ".stop_request"
    monkeypatch.setenv(signals.STOP_FILE_ENV, str(stop))
    assert not signals.stop_requested()
    stop.touch()
    assert signals.stop_requested()
    assert not stop.exists()  # renamed so the launcher knows the trainer acted on it
    assert (tmp_path / ".stop_request.consumed").exists()


def test_sao_train_process_stops_on_sigusr1_and_exits_0(tmp_path):
    """A real process: installs the handlers like sao-train, signals itself mid-loop."""
    code = textwrap.dedent(
        """
        import os, signal
        from sao_megatron.trainer import signals
        signals.install()
        step = 0
        while step < 100:
            step += 1
            if step == 5:
                os.kill(os.getpid(), signal.SIGUSR1)
            if signals.stop_requested():
                break
        print("stopped at", step)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "stopped at 5"


def _two_rank_worker(rank: int, world_size: int, out_dir: str) -> None:
    dist.init_process_group("gloo")
    signals.install()
    try:
        # Only rank 1 gets the signal, after step 3's work; rank 0 never does.
        step = _loop(20, signal_at=3 if rank == 1 else None)
    finally:
        got = signals.received()
        signals.uninstall()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"step": step, "received": got}, f)


@pytest.mark.distributed
def test_two_ranks_stop_at_the_same_step_when_one_is_signalled(tmp_path):
    launch(_two_rank_worker, 2, str(tmp_path))
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert res[0] == {"step": 3, "received": []}
    assert res[1] == {"step": 3, "received": ["SIGUSR1"]}
