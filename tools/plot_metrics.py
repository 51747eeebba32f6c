#!/usr/bin/env python
"""Render a run's metrics.jsonl as PNG curves (one grid of panels; several runs overlay).

    python tools/plot_metrics.py runs/quickstart                      # -> runs/quickstart/plots/
    python tools/plot_metrics.py runs/sao runs/grpo --out runs/compare  # SAO vs GRPO overlaid
    python tools/plot_metrics.py runs/sao --keys loss/policy lr/policy  # one panel per key

    python tools/plot_metrics.py runs/quickstart/sft                  # SFT: loss, accuracy, lr

Writes ``metrics.png`` (the grid) into --out (default: <first run>/plots). Only the panels with
data in some run are drawn (a stage's own panels: SFT's loss and accuracy, RL's reward and
deviation); a --keys panel without data says "no data". Keys are the names in
sao_megatron/trainer/metrics.py STANDARD_METRICS. Per-step times are seconds per step; the
cumulative clock (``time/rl_elapsed_s``) is not one of them.
Reads the JSONL directly (no sao_megatron import), so it runs anywhere matplotlib is installed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


@dataclass
class Panel:
    """One subplot: the keys drawn (exact names, or a prefix ending in '/'), labels, targets."""

    title: str
    ylabel: str
    keys: list[str]
    targets: list[tuple[float, str]] = field(default_factory=list)
    ylim: tuple[float, float] | None = None


PANELS = [
    Panel("SFT loss", "cross-entropy (nats/token)", ["sft/loss"]),
    Panel(
        "SFT token accuracy",
        "fraction of action tokens",
        ["sft/token_accuracy"],
        ylim=(-0.02, 1.02),
    ),
    Panel("Learning rate", "lr", ["sft/lr", "lr/policy", "lr/value"]),
    Panel("Reward", "mean episode return", ["reward/mean"]),
    Panel("Success rate", "fraction solved", ["reward/success_rate"], ylim=(-0.02, 1.02)),
    Panel("Policy loss", "loss", ["loss/policy"]),
    Panel("Value loss", "loss", ["loss/value"]),
    Panel(
        "Off-policy deviation",
        "mean |1 - r| over action tokens",
        ["deviation/abs_one_minus_ratio_mean"],
        targets=[(0.05, "target 0.05")],
    ),
    Panel(
        "Version lag",
        "versions behind trainer",
        ["deviation/version_lag_mean", "deviation/version_lag_max"],
    ),
    Panel(
        "Value explained variance",
        "1 - Var(R-V)/Var(R)",
        ["value/explained_variance"],
        targets=[(1.0, "perfect")],
    ),
    Panel(
        "Throughput",
        "tokens / s",
        ["throughput/rollout_tokens_per_s", "throughput/train_tokens_per_s"],
    ),
    Panel("Time per phase", "seconds per step", ["time/"]),
]
#: keys never drawn by a prefix panel: wall-clock stamps and cumulative seconds (not per step)
SKIP_KEYS = {"time/unix", "time/rl_elapsed_s"}


def read_jsonl(path: Path) -> list[dict]:
    """Records of metrics.jsonl; a truncated last line (crash mid-write) is skipped."""
    lines = path.read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                if i != len(lines) - 1:
                    raise ValueError(f"{path}:{i + 1}: not JSON") from None
    return out


def series(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of one key, skipping records without it and null (non-finite) values."""
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def expand_keys(keys: list[str], runs: dict[str, list[dict]]) -> list[str]:
    """Exact keys stay; a key ending in '/' expands to every present key with that prefix."""
    present = sorted({k for recs in runs.values() for r in recs for k in r} - SKIP_KEYS)
    out = []
    for key in keys:
        out += [k for k in present if k.startswith(key)] if key.endswith("/") else [key]
    return out


def draw_panel(ax, panel: Panel, runs: dict[str, list[dict]]) -> None:
    """Draw one panel; a run's label is added when several runs are overlaid."""
    keys = expand_keys(panel.keys, runs)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    drawn = 0
    for ri, (run, records) in enumerate(runs.items()):
        for ki, key in enumerate(keys):
            xs, ys = series(records, key)
            if not xs:
                continue
            short = key.split("/")[-1].replace("_", " ")
            label_parts = ([run] if len(runs) > 1 else []) + ([short] if len(keys) > 1 else [])
            ax.plot(
                xs,
                ys,
                color=colors[(ri if len(runs) > 1 else ki) % len(colors)],
                linestyle=styles[ki % len(styles)] if len(runs) > 1 else "-",
                marker="o" if len(xs) <= 30 else None,
                markersize=3,
                label=" · ".join(label_parts) or None,
            )
            drawn += 1
    for value, label in panel.targets:
        if drawn:
            ax.axhline(value, color="grey", linestyle="--", linewidth=1, label=label)
    ax.set_title(panel.title, fontsize=11)
    ax.set_xlabel("train step")
    ax.set_ylabel(panel.ylabel)
    ax.grid(alpha=0.3)
    if panel.ylim and drawn:
        ax.set_ylim(*panel.ylim)
    if not drawn:
        ax.text(
            0.5,
            0.5,
            "no data\n(" + ", ".join(panel.keys) + ")",
            ha="center",
            va="center",
            transform=ax.transAxes,
            color="grey",
            fontsize=9,
        )
        ax.set_xticks([])
        ax.set_yticks([])
    elif ax.get_legend_handles_labels()[1]:
        ax.legend(fontsize=7)


def _has_data(panel: Panel, runs: dict[str, list[dict]]) -> bool:
    return any(series(r, k)[0] for k in expand_keys(panel.keys, runs) for r in runs.values())


def plot_runs(run_dirs: list[Path], out_dir: Path, keys: list[str] | None = None) -> Path:
    """Render the grid for one or more runs; return the PNG path.

    Raises:
        FileNotFoundError: a run dir without metrics.jsonl (named).
    """
    runs: dict[str, list[dict]] = {}
    for d in run_dirs:
        path = d / "metrics.jsonl" if d.is_dir() else d
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no metrics.jsonl (pass a run directory)")
        name = (d if d.is_dir() else d.parent).name
        runs[name if name not in runs else str(d)] = read_jsonl(path)
    if keys:
        panels = [Panel(k, k, [k]) for k in keys]
    else:
        panels = [p for p in PANELS if _has_data(p, runs)]
        if not panels:
            raise FileNotFoundError(
                f"{', '.join(str(d) for d in run_dirs)}: no known metric in metrics.jsonl "
                "(pass --keys to plot others)"
            )
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.6 * nrows), squeeze=False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        draw_panel(ax, panel, runs)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle("Training metrics: " + " vs ".join(runs), fontsize=13)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / "metrics.png"
    fig.savefig(out, dpi=110, bbox_inches="tight", pad_inches=0.15)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, help="run folder(s) with metrics.jsonl")
    parser.add_argument("--out", type=Path, help="output folder (default: <first run>/plots)")
    parser.add_argument("--keys", nargs="+", help="plot these metric keys, one panel each")
    args = parser.parse_args(argv)
    out_dir = args.out or (args.run_dirs[0] / "plots")
    try:
        path = plot_runs(args.run_dirs, out_dir, args.keys)
    except FileNotFoundError as exc:
        print(f"plot_metrics: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
