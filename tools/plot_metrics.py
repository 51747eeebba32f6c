#!/usr/bin/env python
"""Render a run's metrics.jsonl as PNG curves (one grid of panels; several runs overlay).

    python tools/plot_metrics.py runs/quickstart                      # -> runs/quickstart/plots/
    python tools/plot_metrics.py runs/sao runs/grpo --out runs/compare  # SAO vs GRPO overlaid
    python tools/plot_metrics.py runs/sao --keys loss/policy lr/policy  # one panel per key

    python tools/plot_metrics.py runs/quickstart/sft                  # SFT: loss, accuracy, lr
    python tools/plot_metrics.py runs/quickstart/value_pretrain       # critic: loss, EV (held-out)
    python tools/plot_metrics.py runs/sao/rl runs/grpo/rl --x time --smooth 8
        # same wall-clock comparison: x = seconds into RL (time/rl_elapsed_s), 8-step means

Writes ``metrics.png`` (the grid) into --out (default: <first run>/plots). Only the panels with
data in some run are drawn (a stage's own panels: SFT's loss and accuracy, RL's reward and
deviation); a --keys panel without data says "no data". Keys are the names in
sao_megatron/trainer/metrics.py STANDARD_METRICS. Per-step times are seconds per step; the
cumulative clock (``time/rl_elapsed_s``) is not one of them.
``--x time`` puts the RL clock (``time/rl_elapsed_s``, seconds since the RL stage started,
value pre-training included) on the x axis, for runs compared at the same wall-clock;
``--smooth N`` draws the trailing mean of the last N points (the raw points faint behind it).
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
    Panel(  # value pre-training adds its held-out evaluations (every eval_interval updates)
        "Value explained variance",
        "1 - Var(R-V)/Var(R)",
        ["value/explained_variance", "value_pretrain/heldout_explained_variance"],
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


#: x axes of --x: the record field each reads and its axis label
X_AXES = {"step": ("step", "train step"), "time": ("time/rl_elapsed_s", "seconds into RL")}


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def series(records: list[dict], key: str, x_key: str = "step") -> tuple[list[float], list[float]]:
    """(x, values) of one key, x read from ``x_key`` (the step, or e.g. ``time/rl_elapsed_s``);
    skips records without the key or the x field and null (non-finite) values."""
    xs, ys = [], []
    for r in records:
        v, x = r.get(key), r.get(x_key)
        if _finite(v) and _finite(x):
            xs.append(x)
            ys.append(float(v))
    return xs, ys


def trailing_mean(ys: list[float], window: int) -> list[float]:
    """Mean of the last ``window`` values at each point (fewer at the start): y_i' =
    mean(y_{max(0, i-window+1)} .. y_i). ``window`` <= 1 returns the values unchanged."""
    if window <= 1:
        return list(ys)
    out, total = [], 0.0
    for i, y in enumerate(ys):
        total += y
        if i >= window:
            total -= ys[i - window]
        out.append(total / min(i + 1, window))
    return out


def expand_keys(keys: list[str], runs: dict[str, list[dict]]) -> list[str]:
    """Exact keys stay; a key ending in '/' expands to every present key with that prefix."""
    present = sorted({k for recs in runs.values() for r in recs for k in r} - SKIP_KEYS)
    out = []
    for key in keys:
        out += [k for k in present if k.startswith(key)] if key.endswith("/") else [key]
    return out


def draw_panel(
    ax, panel: Panel, runs: dict[str, list[dict]], x: str = "step", smooth: int = 1
) -> None:
    """Draw one panel against ``x`` (a key of X_AXES); ``smooth`` > 1 draws trailing means
    over the faint raw points; a run's label is added when several runs are overlaid."""
    x_key, x_label = X_AXES[x]
    keys = expand_keys(panel.keys, runs)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    drawn = 0
    for ri, (run, records) in enumerate(runs.items()):
        for ki, key in enumerate(keys):
            xs, ys = series(records, key, x_key)
            if not xs:
                continue
            short = key.split("/")[-1].replace("_", " ")
            label_parts = ([run] if len(runs) > 1 else []) + ([short] if len(keys) > 1 else [])
            color = colors[(ri if len(runs) > 1 else ki) % len(colors)]
            if smooth > 1:
                ax.plot(xs, ys, color=color, alpha=0.25, linewidth=0.8)
                label_parts.append(f"mean of {smooth}")
            ax.plot(
                xs,
                trailing_mean(ys, smooth),
                color=color,
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
    ax.set_xlabel(x_label)
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


def plot_runs(
    run_dirs: list[Path],
    out_dir: Path,
    keys: list[str] | None = None,
    x: str = "step",
    smooth: int = 1,
) -> Path:
    """Render the grid for one or more runs; return the PNG path.

    Args:
        x: ``"step"`` or ``"time"`` (X_AXES); smooth: trailing-mean window (1 = raw).

    Raises:
        FileNotFoundError: a run dir without metrics.jsonl (named).
        ValueError: an unknown ``x`` or a ``smooth`` below 1.
    """
    if x not in X_AXES:
        raise ValueError(f"x={x!r}: use one of {sorted(X_AXES)}")
    if smooth < 1:
        raise ValueError(f"smooth={smooth}: give a window of 1 (raw) or more steps")
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
        draw_panel(ax, panel, runs, x=x, smooth=smooth)
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
    parser.add_argument(
        "--x",
        choices=sorted(X_AXES),
        default="step",
        help="x axis: train step, or seconds into RL (time/rl_elapsed_s) for same-clock runs",
    )
    parser.add_argument(
        "--smooth", type=int, default=1, help="trailing mean over N points (default 1 = raw)"
    )
    args = parser.parse_args(argv)
    if args.smooth < 1:
        parser.error(f"--smooth {args.smooth}: give 1 (raw) or more points")
    out_dir = args.out or (args.run_dirs[0] / "plots")
    try:
        path = plot_runs(args.run_dirs, out_dir, args.keys, x=args.x, smooth=args.smooth)
    except FileNotFoundError as exc:
        print(f"plot_metrics: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
