"""Replay a recorded RL run (``rl.record_batches=true``) from one of its checkpoints, with the
same or a changed config, and compare replays step by step.

An asynchronous run depends on timing, so a collapse cannot be rerun; its batches (each token's
behaviour log-prob and policy version included) can be replayed: the trainer sees exactly the
recorded trajectories, so a change of the algorithm (advantage whitening, the DIS band, the
critic) is tested on the batches that collapsed the policy, with no engine sampling
(`sao_megatron.trainer.batch_record`). A replay with the recorded config reproduces the
recorded run's losses and weights bit for bit (tests/trainer/test_batch_replay.py).

    python tools/replay_batches.py --run RUN --checkpoint CKPT --out OUT [overrides...]
    python tools/replay_batches.py --compare RUN OUT1 OUT2 ...      # per-quarter table

RUN: the recorded run's folder (its config.yaml, rl/batches, tokenizer/); CKPT: an RL checkpoint
folder of that run (``RUN/checkpoints/rl/step_XXXXXXXX``) or the value pre-training checkpoint it
started from (``<study>/_shared/value_pretrain/checkpoints/rl/step_00000000``); the replay trains
the recorded steps after it. ``--eval N`` evaluates the replayed policy on N held-out tasks
before and after (that starts an engine; the default 0 starts none).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import benchlib
from benchlib import REPO

from sao_megatron.trainer.metrics import read_metrics

#: per-quarter figures of --compare: what the collapse hypotheses look at
COMPARED = (
    "loss/policy",
    "policy/advantage_mean",
    "policy/entropy",
    "deviation/dropped_fraction",
    "value/explained_variance_before",
    "grad_norm/policy",
)


def replay_command(run: Path, checkpoint: Path, out: Path, overrides: list[str], n_eval: int):
    """The `sao-train` command of one replay (module docstring)."""
    batches = run / "rl" / "batches"
    if not (run / "config.yaml").is_file() or not batches.is_dir():
        raise SystemExit(
            f"--run {run}: needs config.yaml and rl/batches (a run trained with "
            "rl.record_batches=true)"
        )
    if not checkpoint.is_dir():
        raise SystemExit(f"--checkpoint {checkpoint}: not a checkpoint folder")
    return [
        sys.executable,
        "-m",
        "sao_megatron.cli.train",
        str(run / "config.yaml"),
        f"run_dir={out}",
        "stages=[rl]",
        f"rl.replay_batches={batches}",
        "rl.record_batches=false",
        f"checkpoint.resume={checkpoint}",
        f"tasks.num_eval_tasks={n_eval}",
        "logging.console=false",
        *overrides,
    ]


def quarters(run_dir: Path) -> dict[str, list[float | None]]:
    """Mean of each `COMPARED` metric over each quarter of the run's RL steps (last record of a
    step wins)."""
    by_step = {int(r["step"]): r for r in read_metrics(run_dir / "rl") if "step" in r}
    steps = sorted(by_step)
    out = {}
    for key in COMPARED:
        q = []
        for i in range(4):
            part = steps[i * len(steps) // 4 : (i + 1) * len(steps) // 4]
            vals = [by_step[s].get(key) for s in part]
            vals = [v for v in vals if v is not None and v == v]
            q.append(sum(vals) / len(vals) if vals else None)
        out[key] = q
    return out


def compare_text(runs: list[Path]) -> str:
    lines = ["| metric | " + " | ".join(str(r) for r in runs) + " |"]
    lines.append("|---|" + "---|" * len(runs))
    figs = [quarters(r) for r in runs]
    for key in COMPARED:
        cells = [" / ".join("-" if v is None else f"{v:.3g}" for v in f[key]) for f in figs]
        lines.append(f"| {key} (Q1 / Q2 / Q3 / Q4) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, help="the recorded run's folder")
    ap.add_argument("--checkpoint", type=Path, help="the RL checkpoint the replay starts from")
    ap.add_argument("--out", type=Path, help="the replay's run folder (must not exist)")
    ap.add_argument("--eval", type=int, default=0, help="held-out tasks before and after")
    ap.add_argument("--compare", type=Path, nargs="+", help="run folders to compare by quarter")
    ap.add_argument("override", nargs="*", help="section.field=value overrides of the replay")
    args = ap.parse_args(argv)
    if args.compare:
        print(compare_text(args.compare))
        return 0
    if not (args.run and args.checkpoint and args.out):
        ap.error("--run, --checkpoint and --out are needed (or --compare)")
    if args.out.exists():
        raise SystemExit(f"--out {args.out} exists: a replay goes into a new folder")
    cmd = replay_command(args.run, args.checkpoint, args.out, args.override, args.eval)
    args.out.mkdir(parents=True)
    if (args.run / "tokenizer").is_dir():  # the recorded run's tokenizer, not a new one
        shutil.copytree(args.run / "tokenizer", args.out / "tokenizer", copy_function=os.link)
    print("[replay] " + " ".join(cmd), flush=True)
    with open(args.out / "job.log", "w") as log:
        rc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc:
        tail = "\n".join((args.out / "job.log").read_text().splitlines()[-30:])
        raise SystemExit(f"replay failed (exit {rc}); log {args.out / 'job.log'}:\n{tail}")
    print(compare_text([args.run, args.out]))
    print(f"[replay] commit {benchlib._git('rev-parse', '--short', 'HEAD')}: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
