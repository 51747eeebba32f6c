"""tools/plot_metrics.py renders readable PNGs from synthetic runs (single, overlaid, --keys)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "plot_metrics.py"


def _import_tool():
    """tools/plot_metrics.py as a module (tools/ is not a package)."""
    sys.path.insert(0, str(TOOL.parent))
    try:
        import plot_metrics
    finally:
        sys.path.pop(0)
    return plot_metrics


def _write_run(run_dir: Path, *, seed: int, with_value: bool, num_steps: int = 40) -> None:
    """A plausible SAO (with_value) or GRPO (no value model) metrics.jsonl."""
    rng = np.random.default_rng(seed)
    run_dir.mkdir(parents=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for step in range(1, num_steps + 1):
            success = 1 - math.exp(-step / 15) + rng.normal(0, 0.03)
            rec = {
                "step": step,
                "reward/mean": success * 2 - 0.5,
                "reward/success_rate": min(max(success, 0.0), 1.0),
                "loss/policy": float(rng.normal(-0.02, 0.01)),
                "deviation/abs_one_minus_ratio_mean": 0.03 + 0.01 * rng.random(),
                "deviation/version_lag_mean": 0.6 + 0.2 * rng.random(),
                "deviation/version_lag_max": 2,
                "throughput/rollout_tokens_per_s": 900 + 50 * rng.random(),
                "throughput/train_tokens_per_s": 1500 + 80 * rng.random(),
                "time/rollout": 1.2,
                "time/policy": 0.8,
                "time/unix": 1.7e9 + step,
                "time/rl_elapsed_s": 2.5 * step,
            }
            if with_value:
                rec["loss/value"] = 0.5 * math.exp(-step / 10)
                rec["value/explained_variance"] = 1 - math.exp(-step / 8)
                rec["time/value"] = 1.1
            if step == 7:
                rec["loss/policy"] = None  # a non-finite value written as null
            f.write(json.dumps(rec) + "\n")
        f.write('{"step": 41, "reward/me')  # a crash mid-line


def _check_png(path: Path, min_kib: int, min_hw: tuple[int, int] = (600, 900)) -> np.ndarray:
    assert path.is_file()
    assert path.stat().st_size > min_kib * 1024
    image = mpimg.imread(path)
    assert image.shape[0] >= min_hw[0] and image.shape[1] >= min_hw[1]
    assert image[..., :3].std() > 0.05  # not blank
    return image


def test_single_run_cli(tmp_path):
    _write_run(tmp_path / "sao", seed=0, with_value=True)
    proc = subprocess.run(
        [sys.executable, str(TOOL), str(tmp_path / "sao")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = Path(proc.stdout.strip())
    assert out == tmp_path / "sao" / "plots" / "metrics.png"
    _check_png(out, min_kib=60)


def test_overlay_missing_keys_and_key_panels(tmp_path):
    plot_metrics = _import_tool()
    _write_run(tmp_path / "sao", seed=0, with_value=True)
    _write_run(tmp_path / "grpo", seed=1, with_value=False)  # no value panels' keys
    assert (
        plot_metrics.main(
            [str(tmp_path / "sao"), str(tmp_path / "grpo"), "--out", str(tmp_path / "cmp")]
        )
        == 0
    )
    _check_png(tmp_path / "cmp" / "metrics.png", min_kib=60)
    records = plot_metrics.read_jsonl(tmp_path / "sao" / "metrics.jsonl")
    assert len(records) == 40
    xs, ys = plot_metrics.series(records, "loss/policy")
    assert 7 not in xs and len(xs) == 39
    assert plot_metrics.expand_keys(["time/"], {"r": records}) == [
        "time/policy",
        "time/rollout",
        "time/value",
    ]
    out = plot_metrics.plot_runs(
        [tmp_path / "grpo"], tmp_path / "keys", keys=["loss/policy", "loss/value"]
    )  # loss/value: "no data"
    _check_png(out, min_kib=15, min_hw=(350, 900))
    assert plot_metrics.main([str(tmp_path / "nowhere")]) == 2


def test_time_axis_and_smoothing(tmp_path):
    plot_metrics = _import_tool()
    _write_run(tmp_path / "sao", seed=0, with_value=True)
    records = plot_metrics.read_jsonl(tmp_path / "sao" / "metrics.jsonl")
    xs, ys = plot_metrics.series(records, "reward/mean", "time/rl_elapsed_s")
    assert xs[:3] == [2.5, 5.0, 7.5] and len(ys) == 40
    assert plot_metrics.trailing_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert plot_metrics.trailing_mean([1.0, 3.0, 5.0], 8) == [1.0, 2.0, 3.0]
    assert plot_metrics.trailing_mean([1.0, 3.0], 1) == [1.0, 3.0]
    smooth = plot_metrics.trailing_mean(ys, 5)
    assert abs(smooth[9] - sum(ys[5:10]) / 5) < 1e-12
    assert plot_metrics.main([str(tmp_path / "sao"), "--x", "time", "--smooth", "4"]) == 0
    _check_png(tmp_path / "sao" / "plots" / "metrics.png", min_kib=60)
    proc = subprocess.run(
        [sys.executable, str(TOOL), str(tmp_path / "sao"), "--smooth", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "--smooth 0" in proc.stderr


def test_value_pretrain_run_draws_the_heldout_curve(tmp_path):
    """A value pre-training run: the explained-variance panel draws the per-batch EV of every
    update and the held-out EV of the evaluations (every 2nd update here) as a second series."""
    import matplotlib.pyplot as plt

    pm = _import_tool()
    heldout = "value_pretrain/heldout_explained_variance"
    recs = []
    for step in range(1, 7):
        rec = {"step": step, "loss/value": 1.0 / step, "value/explained_variance": 0.1 * step}
        if step % 2 == 0:
            rec[heldout] = step / 20
        recs.append(rec)
    run = tmp_path / "value_pretrain"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert pm.series(recs, heldout) == ([2, 4, 6], [0.1, 0.2, 0.3])
    panel = next(p for p in pm.PANELS if heldout in p.keys)
    fig, ax = plt.subplots()
    pm.draw_panel(ax, panel, {"value_pretrain": recs})
    assert ax.get_legend_handles_labels()[1] == [
        "explained variance",
        "heldout explained variance",
        "perfect",
    ]
    plt.close(fig)
    assert pm.plot_runs([run], tmp_path / "out").is_file()
