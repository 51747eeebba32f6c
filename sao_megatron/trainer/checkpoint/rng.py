"""Capture and restore one process's RNG states (python, numpy, torch CPU/CUDA, Megatron's
model-parallel tracker), saved per rank so a resumed run draws what the uninterrupted one would."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def _megatron_rng_tracker():
    """Megatron's model-parallel RNG tracker (dropout etc. in TP regions) if initialised."""
    try:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    except ImportError:
        return None
    tracker = get_cuda_rng_tracker()
    return tracker if tracker.is_initialized() else None


def capture_rng_state() -> dict[str, Any]:
    """This process's python, numpy, torch CPU, CUDA (if initialised) and Megatron
    model-parallel tracker (if initialised) RNG states."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    tracker = _megatron_rng_tracker()
    if tracker is not None:
        state["megatron_tracker"] = {k: v.clone() for k, v in tracker.get_states().items()}
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Restore states made by `capture_rng_state` (CUDA and the Megatron tracker only when both
    sides have them)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["torch_cuda"])
    tracker = _megatron_rng_tracker()
    if "megatron_tracker" in state and tracker is not None:
        tracker.set_states({k: v.clone() for k, v in state["megatron_tracker"].items()})
