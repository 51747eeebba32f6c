"""Recorded RL batches: write each trained batch to disk, and read them back to replay a run.

An asynchronous run depends on timing (which episodes finish first, which policy version sampled
each token), so a run cannot be rerun; it can be recorded (``rl.record_batches``) and its
batches replayed (``rl.replay_batches``) from one of its checkpoints, with the same or a changed
config: the trainer then sees exactly the trajectories, behaviour log-probs and policy versions
the recorded run trained on, and no engine samples for training (tools/replay_batches.py).

One file per train step, ``step_XXXXXXXX.pt`` (the step the batch is trained at, 1-based like
``rl/metrics.jsonl``), written by rank 0 with `torch.save` of plain containers only (dicts,
lists, numbers, strings, tensors: `dataclasses.asdict` of each `Trajectory`), so it loads with
``torch.load(weights_only=True)``: no pickled classes (a rename of `Trajectory` cannot break an
old recording and loading one runs no code), and the optional ``routed_experts`` tensors are
stored as tensors, not as pickled Python lists. Log-probs stay Python floats (exact). A record:

* ``step``: the train step; ``policy_version``: the trainer's policy version at that step;
* ``trajectories``: the batch as the rollout returned it, sorted (`BatchSource.next_trajectories`);
* ``bound``: the deviation controller's per-token bound of the batch (None without one).

Resume-safe: a resumed run continues the numbering (files are named by train step). A step
recorded before a crash and trained again after the resume gets the new batch; the earlier file,
if it differs, is kept as ``step_XXXXXXXX.superseded_N.pt`` (never overwritten).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import torch

from sao_megatron.data.trajectory import ActionNode, Trajectory

log = logging.getLogger("sao_megatron.trainer")

#: the folder under run_dir that ``rl.record_batches`` writes
BATCHES_DIR = Path("rl") / "batches"


def batch_file(folder: Path, step: int) -> Path:
    """The file of train step `step` in `folder`."""
    return Path(folder) / f"step_{step:08d}.pt"


def _to_plain(trajs: list[Trajectory]) -> list[dict]:
    return [dataclasses.asdict(t) for t in trajs]


def _from_plain(items: list[dict]) -> list[Trajectory]:
    out = []
    for d in items:
        nodes = [ActionNode(**n) for n in d["nodes"]]
        out.append(Trajectory(**(d | {"nodes": nodes})))
    return out


def _same(a: dict, b: dict) -> bool:
    """Whether two records are equal (tensors compared by value)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


class BatchRecorder:
    """Writes each RL batch rank 0 trains on into `folder` (`record`; module docstring)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    def record(
        self, step: int, policy_version: int, trajs: list[Trajectory], bound: int | None
    ) -> Path:
        """Write train step `step`'s batch; returns the file. An existing different record of
        the step is moved aside first (``.superseded_N.pt``), an identical one is kept."""
        rec = {
            "step": step,
            "policy_version": policy_version,
            "bound": bound,
            "trajectories": _to_plain(trajs),
        }
        path = batch_file(self.folder, step)
        if path.exists():
            old = torch.load(path, weights_only=True)
            if _same(old, rec):
                return path
            n = 0
            while (aside := path.with_suffix(f".superseded_{n}.pt")).exists():
                n += 1
            os.replace(path, aside)
            log.warning(
                "rl.record_batches: step %d was recorded before (a resumed run trains it on a "
                "new batch); the earlier record is kept as %s",
                step,
                aside,
            )
        tmp = path.with_suffix(".pt.tmp")
        torch.save(rec, tmp)
        os.replace(tmp, path)  # a crash mid-write leaves no partial step file
        return path


class MissingBatch(Exception):
    """The replayed folder has no record of the next step (the replay ends there)."""


class BatchReplay:
    """Reads the batches of a recorded run (`BatchRecorder`) in step order.

    Args:
        folder: a ``run_dir/rl/batches`` folder of a run with ``rl.record_batches``.
        max_seq_len: this job's ``model.max_position_embeddings``; a recorded trajectory
            longer than that is an error (`load`).

    Raises:
        ValueError: `folder` is not a folder of recorded batches.
    """

    def __init__(self, folder: str | Path, max_seq_len: int) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir() or not any(self.folder.glob("step_*.pt")):
            raise ValueError(
                f"rl.replay_batches={str(folder)!r}: no recorded batches (step_XXXXXXXX.pt) "
                "there; point it at the run_dir/rl/batches folder of a run trained with "
                "rl.record_batches=true"
            )
        self.max_seq_len = max_seq_len

    def load(self, step: int) -> tuple[list[Trajectory], int, int | None]:
        """(trajectories, recorded policy version, bound) of train step `step`.

        Raises:
            MissingBatch: no file for `step`.
            ValueError: the file holds another step, or a trajectory longer than max_seq_len.
        """
        path = batch_file(self.folder, step)
        if not path.is_file():
            raise MissingBatch(
                f"rl.replay_batches: {path} does not exist: the recorded run has no batch for "
                f"step {step} (it recorded {self.recorded_steps()})"
            )
        rec = torch.load(path, weights_only=True)
        if rec["step"] != step:
            raise ValueError(f"{path} holds step {rec['step']}, not {step}: a renamed file?")
        trajs = _from_plain(rec["trajectories"])
        for t in trajs:
            n = _longest_sequence(t)
            if n > self.max_seq_len:
                raise ValueError(
                    f"rl.replay_batches: {path} holds trajectory {t.task_id!r} of {n} tokens, "
                    f"longer than this job's model.max_position_embeddings={self.max_seq_len}: "
                    "replay with the recorded run's model.max_position_embeddings (or higher)"
                )
        return trajs, int(rec["policy_version"]), rec["bound"]

    def recorded_steps(self) -> str:
        """The recorded steps as a range text (``1..40``, or a list when not contiguous)."""
        steps = sorted(int(p.name[5:13]) for p in self.folder.glob("step_????????.pt"))
        if steps and steps == list(range(steps[0], steps[-1] + 1)):
            return f"steps {steps[0]}..{steps[-1]}"
        return f"steps {steps}"


def _longest_sequence(t: Trajectory) -> int:
    """Tokens of the longest sequence `t` packs into (the whole trajectory, or one node)."""
    if t.context_mode == "full_history":
        return sum(len(n.observation_token_ids) + len(n.action_token_ids) for n in t.nodes)
    return max(len(n.context_token_ids or ()) + len(n.action_token_ids) for n in t.nodes)
