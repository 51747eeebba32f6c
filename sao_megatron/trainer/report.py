"""The table `sao-train` prints at the end: held-out success before/after RL, deviation, speed."""

from __future__ import annotations

import json
import os
from pathlib import Path

from sao_megatron.trainer.job import JobConfig

SUMMARY_FILE = "summary.json"


def read_summary(run_dir: str | os.PathLike) -> dict[str, float]:
    """``run_dir/summary.json`` as a dict ({} when absent or unreadable)."""
    path = Path(run_dir, SUMMARY_FILE)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def update_summary(run_dir: str | os.PathLike, values: dict[str, float]) -> dict[str, float]:
    """Merge `values` into ``run_dir/summary.json`` (keys already there and not in `values`
    are kept, so a resumed or re-run job keeps its before-RL figures); written atomically
    (temp file, then rename). Returns the merged summary."""
    merged = read_summary(run_dir) | dict(values)
    path = Path(run_dir, SUMMARY_FILE)
    tmp = path.with_name(f".{SUMMARY_FILE}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(merged, indent=2, sort_keys=True))
    os.replace(tmp, path)
    return merged


def final_report(job: JobConfig, summary: dict[str, float]) -> str:
    """Merge the summary into ``run_dir/summary.json`` (`update_summary`) and render the
    merged figures as a text table."""
    summary = update_summary(job.run_dir, summary)
    rows = [("metric", "before RL", "after RL")]
    keys = sorted({k.split("/", 1)[1] for k in summary if k.startswith(("before/", "after/"))})
    for k in keys:
        if k.endswith(("success_rate", "mean_reward", "mean_progress")):
            b, a = summary.get(f"before/{k}"), summary.get(f"after/{k}")
            rows.append((k, _fmt(b), _fmt(a)))
    for k in (
        "deviation/abs_one_minus_ratio_mean",
        "deviation/version_lag_mean",
        "deviation/dropped_fraction",
        "throughput/rollout_trajectories_per_s",
        "throughput/rollout_tokens_per_s",
        "throughput/train_tokens_per_s",
        "rl/steps_done",
        "rl/wall_s",
        "sft/final_loss",
    ):
        if k in summary:
            rows.append((k, "", _fmt(summary[k])))
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, width, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in width))
    return f"\n== sao-train summary ({job.algorithm.name}, {job.run_dir}) ==\n" + "\n".join(lines)


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.4g}"
