"""summary.json is merged, not overwritten; progress lines in a file name the stage, show the
loss and never use carriage returns."""

from __future__ import annotations

import json

from sao_megatron.trainer.metrics import LoggingConfig, MetricsLogger
from sao_megatron.trainer.report import read_summary, update_summary


def test_summary_is_merged_across_runs(tmp_path):
    update_summary(tmp_path, {"before/eval/success_rate": 0.1, "rl/steps_done": 2.0})
    merged = update_summary(tmp_path, {"after/eval/success_rate": 0.3, "rl/steps_done": 4.0})
    assert merged == {
        "before/eval/success_rate": 0.1,
        "after/eval/success_rate": 0.3,
        "rl/steps_done": 4.0,
    }
    assert json.loads((tmp_path / "summary.json").read_text()) == merged == read_summary(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temp file left


def test_plain_progress_lines_when_not_a_tty(tmp_path, capsys):
    cfg = LoggingConfig(tensorboard=False, console=True, progress_interval=4)
    with MetricsLogger(cfg, tmp_path, is_logging_rank=True, total_steps=10, stage="sft") as lg:
        for step in range(1, 10):
            lg.log(step, {"sft/loss": 1.0 / step})
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    assert [line.split()[:3] for line in lines] == [
        ["[sft]", "step", "1/10"],
        ["[sft]", "step", "4/10"],
        ["[sft]", "step", "8/10"],
        ["[sft]", "step", "9/10"],  # the last step, printed at close
    ]
    assert "loss=0.25" in lines[1] and "loss=0.111" in lines[3]
