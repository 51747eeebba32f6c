"""plot_metrics on an SFT run: only panels with data, and per-step times without the clock."""

from __future__ import annotations

import json
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools"


def _tool():
    sys.path.insert(0, str(TOOL))
    try:
        import plot_metrics
    finally:
        sys.path.pop(0)
    return plot_metrics


def test_sft_run_draws_only_its_panels(tmp_path, monkeypatch):
    pm = _tool()
    run = tmp_path / "sft"
    run.mkdir()
    with open(run / "metrics.jsonl", "w") as f:
        for step in range(1, 11):
            rec = {"step": step, "sft/loss": 3.0 / step, "sft/token_accuracy": step / 10}
            rec |= {"sft/lr": 1e-3, "time/unix": 1.7e9 + step}
            f.write(json.dumps(rec) + "\n")
    drawn = []
    monkeypatch.setattr(pm, "draw_panel", lambda ax, panel, runs, **kw: drawn.append(panel.title))
    assert pm.plot_runs([run], tmp_path / "out").is_file()
    assert drawn == ["SFT loss", "SFT token accuracy", "Learning rate"]


def test_time_panel_has_per_step_seconds_only():
    pm = _tool()
    recs = [{"step": 1, "time/rollout": 1.0, "time/rl_elapsed_s": 9.0, "time/unix": 1.7e9}]
    assert pm.expand_keys(["time/"], {"r": recs}) == ["time/rollout"]
