"""tools/benchlib.py (run summaries, spread, docs sections) and tools/eval_horizon.py's task
construction, on synthetic run folders (no jobs are started here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import benchlib  # noqa: E402
import eval_horizon  # noqa: E402

from sao_megatron.envs import make_env  # noqa: E402
from sao_megatron.envs.base import EnvSpec  # noqa: E402
from sao_megatron.trainer.job import JobConfig, TasksConfig  # noqa: E402


def _fake_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / "rl").mkdir(parents=True)
    recs = []
    for i in range(4):
        recs.append(
            {
                "step": i + 1,
                "time/rl_elapsed_s": 10.0 * (i + 1),
                "time/rollout": 1.0,
                "time/train": 6.0,
                "time/sync": 0.5,
                "throughput/train_tokens_per_s": 100.0 * (i + 1),
                "batch/num_trajectories": 8.0,
                "memory/peak_rss_gib": [1.0, 1.5, 1.2, 1.1][i],
                "deviation/abs_one_minus_ratio_mean": 0.01 * (i + 1),
                "deviation/version_lag_mean": 1.0,
                "rollout/worker_utilization": 0.5 + 0.1 * i,
                "reward/mean": 0.1 * i,
            }
        )
    (run / "rl" / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    summary = {"before/eval/success_rate": 0.25, "after/eval/success_rate": 0.5}
    (run / "summary.json").write_text(json.dumps(summary))
    return run


def test_run_figures_from_metrics(tmp_path):
    f = benchlib.run_figures(_fake_run(tmp_path), "x")
    assert f.steps == 4 and f.wall_s == 40.0
    assert f.trajectories_per_s == pytest.approx(32 / 40)
    # tokens = sum(rate * time/train) = 6 * (100 + 200 + 300 + 400); over 24 s of training
    assert f.train_tokens_per_s == pytest.approx(6000 / 24)
    assert f.peak_rss_gib == 1.5
    assert f.time_split == pytest.approx(
        {"rollout wait": 0.1, "train": 0.6, "sync": 0.05, "checkpoint": 0.0, "other": 0.25}
    )
    assert f.abs_one_minus_ratio == pytest.approx(0.025)
    assert f.worker_utilization == pytest.approx(0.8)
    assert f.before == {"eval/success_rate": 0.25} and f.after == {"eval/success_rate": 0.5}
    assert f.curve[-1] == (40.0, pytest.approx(0.3))


def test_spread_and_smooth():
    assert benchlib.spread([3.0, 1.0, 2.0]) == "2 [1, 3]"
    assert benchlib.spread([0.5], "{:.2f}") == "0.50"
    assert benchlib.spread([None, float("nan")]) == "-"
    xs, ys = benchlib.smooth([(1, 1.0), (2, 3.0), (3, 5.0)], window=2)
    assert xs == [1, 2, 3] and ys == [1.0, 2.0, 4.0]


def test_write_section_replaces_only_its_own_section(tmp_path):
    doc = tmp_path / "B.md"
    doc.write_text("# Benchmarks\n\n## A\n\nold a\n\n## B\n\nold b\n")
    benchlib.write_section("A", "new a", doc)
    benchlib.write_section("C", "new c", doc)
    text = doc.read_text()
    assert "old a" not in text and "new a" in text and "old b" in text
    assert text.index("## A") < text.index("## B") < text.index("## C")


def test_cached_run_of_another_job_is_refused(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "summary.json").write_text("{}")
    (run / "bench_job.json").write_text(json.dumps({"config": "c.yaml", "overrides": ["a=1"]}))
    assert benchlib.run_job("c.yaml", ["a=1"], run) == run  # same job: reused, not re-run
    with pytest.raises(RuntimeError, match="another job"):
        benchlib.run_job("c.yaml", ["a=2"], run)


def test_stopped_or_failed_run_is_never_reused(tmp_path, monkeypatch):
    """A job writes summary.json from its first stage on: a folder whose job did not end with
    exit 0 must not pass for a finished run, and a finished one is reused."""
    calls = []

    def fake_job(cmd, cwd, stdout, stderr):  # the job: summary.json first, then its exit code
        calls.append(cmd)
        run_dir = Path(next(a for a in cmd if a.startswith("run_dir=")).split("=", 1)[1])
        (run_dir / "summary.json").write_text('{"before/eval/success_rate": 0.2}')
        return subprocess.CompletedProcess(cmd, 1 if "fail=1" in cmd else 0)

    monkeypatch.setattr(benchlib.subprocess, "run", fake_job)
    bad = tmp_path / "bad"
    with pytest.raises(RuntimeError, match="job failed"):
        benchlib.run_job("c.yaml", ["fail=1"], bad)
    assert (bad / benchlib.RUNNING_MARK).exists() and (bad / "summary.json").exists()
    with pytest.raises(RuntimeError, match="unfinished run.*delete the folder"):
        benchlib.run_job("c.yaml", ["fail=1"], bad)
    assert len(calls) == 1  # refused, not re-run into the old folder
    good = tmp_path / "good"
    assert benchlib.run_job("c.yaml", ["a=1"], good) == good
    assert not (good / benchlib.RUNNING_MARK).exists()
    assert benchlib.run_job("c.yaml", ["a=1"], good) == good  # finished: reused
    assert len(calls) == 2


@pytest.mark.parametrize(("horizon", "disks"), [(50, {6, 7, 8, 9, 10}), (500, {9, 10})])
def test_eval_tasks_use_disk_counts_seen_in_training(horizon, disks):
    job = JobConfig(
        tasks=TasksConfig(train=[EnvSpec(name="hanoi", options={"horizon": 50, "extra_disks": 4})])
    )
    spec = eval_horizon.eval_env_spec(job, horizon)
    assert spec.options["horizon"] == horizon and spec.options["max_steps_factor"] == 1.0
    seen = set()
    for seed in range(200):
        env = make_env("hanoi", **spec.options)
        env.reset(seed)
        seen.add(env.num_disks)
    assert seen == disks


def test_write_section_keeps_the_hand_written_reading(tmp_path):
    doc = tmp_path / "B.md"
    benchlib.write_section("A", f"table 1\n\n{benchlib.READING}\n", doc)
    doc.write_text(doc.read_text().rstrip() + "\nSAO is slower here.\n\n## Z\n\nz\n")
    benchlib.write_section("A", f"table 2\n\n{benchlib.READING}\n", doc)
    text = doc.read_text()
    assert "table 1" not in text and "table 2" in text
    assert text.count("SAO is slower here.") == 1 and text.index("SAO is slower") < text.index(
        "## Z"
    )


def test_eval_curve_and_critic_curve_from_a_run(tmp_path):
    run = _fake_run(tmp_path)
    evals = [
        {"step": 0, "eval/success_rate": 0.25},
        {"step": 2, "eval/success_rate": 0.375, "time/rl_elapsed_s": 20.0},
        {"step": 4, "eval/success_rate": 0.5},  # the final evaluation: no clock reading
    ]
    (run / "rl" / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    recs = [json.loads(ln) for ln in (run / "rl" / "metrics.jsonl").read_text().splitlines()]
    recs[1]["value/explained_variance_before"] = 0.125
    (run / "rl" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    f = benchlib.run_figures(run, "x")
    assert f.eval_curve == [(0.0, 0.25), (20.0, 0.375), (40.0, 0.5)]
    assert f.ev_curve == [(20.0, 0.125)]
    # no eval file: no curve
    (run / "rl" / "eval.jsonl").unlink()
    assert benchlib.run_figures(run, "x").eval_curve == []


def test_time_to_accuracy_helpers_of_bench_sao_vs_grpo():
    import bench_sao_vs_grpo as b

    curve = [(0.0, 0.25), (20.0, 0.375), (40.0, 0.5)]
    assert [b._at(curve, t) for t in (0.0, 19.9, 20.0, 45.0)] == [0.25, 0.25, 0.375, 0.5]
    # mean ± sample standard deviation / sqrt(n), NaN and None ignored
    assert b.mean_se([0.5, 0.25, None, float("nan"), 0.75]) == "0.500 ± 0.144 (n = 3)"
    assert b.mean_se([0.5]) == "0.500 (n = 1)"
    assert b.mean_se([None]) == "-"


def test_sao_vs_grpo_plot_with_time_to_accuracy_panels(tmp_path):
    import argparse

    import bench_sao_vs_grpo as b

    runs = {}
    for algo in ("sao", "grpo"):
        figs = []
        for seed in range(2):
            run = _fake_run(tmp_path / f"{algo}{seed}")
            evals = [
                {"step": 0, "eval/success_rate": 0.25},
                {"step": 2, "eval/success_rate": 0.25 + 0.1 * seed, "time/rl_elapsed_s": 20.0},
                {"step": 4, "eval/success_rate": 0.5},
            ]
            (run / "rl" / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
            summary = {
                "before/eval/hanoi/success_rate": 0.25,
                "after/eval/hanoi/success_rate": 0.5 + 0.25 * seed,
                "after/eval/hanoi/num_tasks": 4.0,
            }
            (run / "summary.json").write_text(json.dumps(summary))
            figs.append(benchlib.run_figures(run, f"{algo} r{seed}"))
        runs[algo] = figs
    args = argparse.Namespace(group_size=8, config="c.yaml", budget_s=40.0)
    path = tmp_path / "plot.png"
    b.plot_curves(runs, path, args)
    assert path.stat().st_size > 10_000  # a 4-panel figure was drawn
    table = b.render_table(runs, args)
    # seeds' successes 0.5 and 0.75: mean 0.625, s.e. = 0.1768 / sqrt(2) = 0.125
    row = "| held-out hanoi success after RL, mean ± s.e. over seeds | "
    assert row + "0.625 ± 0.125 (n = 2) | 0.625 ± 0.125 (n = 2) |" in table


def test_eval_horizon_over_seeds_mean_and_standard_error(tmp_path):
    """Final policies named "<algo> r<seed>" are grouped; each cell is the mean ± s.e. over
    seeds (sample std / sqrt(n)), checked against numbers worked by hand."""
    for algo, seeds in (("sao", (0, 1, 2)), ("grpo", (0, 1))):
        for r in seeds:
            (tmp_path / f"{algo}_r{r}" / "hf_policy_final").mkdir(parents=True)
            (tmp_path / f"{algo}_r{r}" / "hf_policy_final" / "config.json").write_text("{}")
    (tmp_path / "grpo_r5").mkdir()  # unfinished run: no final policy
    pol = eval_horizon.bench_policies(tmp_path)
    assert list(pol) == ["SFT (RL start)", "SAO r0", "SAO r1", "SAO r2", "GRPO r0", "GRPO r1"]
    assert pol["SFT (RL start)"] == str(tmp_path / "sao_r0" / "hf_policy")
    assert eval_horizon.bench_policies(tmp_path / "absent") == {}

    def res(p, ill, non):
        return {50: {"success_rate": p, "illegal_move_rate": ill, "non_optimal_move_rate": non}}

    results = {
        "SFT (RL start)": res(0.5, 0.01, 0.0),
        "SAO r0": res(0.5, 0.01, 0.002),
        "SAO r1": res(0.75, 0.0, 0.004),
        "SAO r2": res(1.0, 0.02, 0.0),
        "GRPO r0": res(0.25, 0.03, 0.01),
        "GRPO r1": res(0.75, 0.01, 0.03),
    }
    assert eval_horizon.seed_groups(results) == {
        "SFT (RL start)": ["SFT (RL start)"],
        "SAO": ["SAO r0", "SAO r1", "SAO r2"],
        "GRPO": ["GRPO r0", "GRPO r1"],
    }
    m, se, n = benchlib.mean_se([0.5, 0.75, 1.0])
    assert (m, n) == (0.75, 3) and se == pytest.approx(0.25 / 3**0.5)  # std 0.25
    assert benchlib.mean_se([0.4])[2] == 1 and benchlib.mean_se([0.4])[1] != 0.0
    rows = eval_horizon.render_over_seeds(results, [50]).splitlines()
    assert rows[2] == "| SFT (RL start) | 1 | 0.500 | 0.0100 | 0.0000 |"
    assert rows[3] == "| SAO | 3 | 0.750 ± 0.144 | 0.0100 ± 0.0058 | 0.0020 ± 0.0012 |"
    assert rows[4] == "| GRPO | 2 | 0.500 ± 0.250 | 0.0200 ± 0.0100 | 0.0200 ± 0.0100 |"


def test_shared_value_pretrain_runs_once_and_each_sao_run_gets_its_own_copy(tmp_path, monkeypatch):
    """bench_sao_vs_grpo --shared-value-pretrain: the value pre-training job gets the SFT start
    and `stages=[value_pretrain]`; its figures come from its summary and last metrics record;
    every SAO run receives a copy (not links) of its RL checkpoint."""
    import bench_sao_vs_grpo as b

    sft = tmp_path / "sft"
    for sub in ("tokenizer", "checkpoints/sft/step_00000010"):
        (sft / sub).mkdir(parents=True)
        (sft / sub / "f").write_text(sub)
    calls = []

    def fake_run_job(config, overrides, run_dir):  # what the job writes
        calls.append((config, overrides, run_dir))
        step = run_dir / "checkpoints" / "rl" / "step_00000000"
        step.mkdir(parents=True)
        (step / "weights").write_text("critic")
        (run_dir / "value_pretrain").mkdir()
        recs = [{"step": 1, "value/explained_variance_before": 0.1}]
        recs.append({"step": 2, "value/explained_variance_before": 0.62})
        (run_dir / "value_pretrain" / "metrics.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in recs)
        )
        (run_dir / "summary.json").write_text(json.dumps({"rl/value_pretrain_s": 123.4}))
        return run_dir

    monkeypatch.setattr(b, "run_job", fake_run_job)
    vp = b.shared_value_pretrain("cfg.yaml", ["precision.params_dtype=fp32"], sft, tmp_path / "vp")
    assert len(calls) == 1 and calls[0][0] == "cfg.yaml"
    assert calls[0][1][:2] == ["precision.params_dtype=fp32", "stages=[value_pretrain]"]
    assert (tmp_path / "vp" / "checkpoints" / "sft" / "step_00000010" / "f").exists()
    assert (vp.steps, vp.wall_s, vp.explained_variance) == (2, 123.4, 0.62)
    assert "2 value pre-training steps, 123 s" in vp.sentence() and "0.62" in vp.sentence()

    run = tmp_path / "sao_r1"
    b.seed_critic(vp.run_dir, run)
    copied = run / "checkpoints" / "rl" / "step_00000000" / "weights"
    assert copied.read_text() == "critic"
    src = tmp_path / "vp" / "checkpoints" / "rl" / "step_00000000" / "weights"
    assert copied.stat().st_ino != src.stat().st_ino  # a copy: the run may rewrite its own


def test_eval_horizon_reuses_a_policy_result_only_for_the_same_evaluation(tmp_path):
    key = {
        "hf_dir": "/r/sao_r0/hf_policy_final",
        "horizons": [50, 200],
        "num_tasks": 24,
        "temperatures": [1.0],
        "config": "c.yaml",
        "overrides": ["a.b=1"],
    }
    by_t = {1.0: {50: {"success_rate": 0.75}, 200: {"success_rate": 0.25}}}
    assert eval_horizon.load_cached(tmp_path, "SAO r0", key) is None
    eval_horizon.save_cached(tmp_path, "SAO r0", key, by_t)
    assert eval_horizon.load_cached(tmp_path, "SAO r0", key) == by_t
    assert eval_horizon.load_cached(tmp_path, "SAO r1", key) is None
    for field, other in (("num_tasks", 16), ("horizons", [50]), ("overrides", [])):
        assert eval_horizon.load_cached(tmp_path, "SAO r0", key | {field: other}) is None


def test_bench_overrides_ask_the_run_s_algorithm_what_it_needs():
    """bench_sao_vs_grpo's runs (and bench_stability's, study's): value pre-training only for
    an algorithm with a critic, the config's SAO keys reset only for one that does not read
    them; `benchlib.job_algorithm` answers for the resolved job (critic, group size)."""
    import bench_sao_vs_grpo as b

    from sao_megatron.configs import load_config

    config = "examples/configs/quickstart.yaml"
    sao_key = "algorithm.sao.value_updates_per_policy_update"  # default 2
    base = load_config(JobConfig, str(ROOT / config), [f"{sao_key}=3"])
    assert b.algo_overrides("sao", 4, True, base) == ["stages=[value_pretrain,rl]"]
    assert b.algo_overrides("sao", 4, False, base) == ["stages=[rl]"]
    assert b.algo_overrides("grpo_dis", 4, True, base) == [
        "stages=[rl]",
        "algorithm.name=grpo_dis",
        "algorithm.grpo.group_size=4",
        "algorithm.importance.weighting=null",
        f"{sao_key}=2",
    ]
    for algo, critic, group in (("sao", True, 1), ("grpo", False, 4), ("grpo_dis", False, 4)):
        ov = [f"{sao_key}=3", *b.algo_overrides(algo, 4, True, base)]
        run = benchlib.job_algorithm(config, ov)
        assert (run.name, run.needs_value_model, run.group_size) == (algo, critic, group)
    with pytest.raises(ValueError, match="use one of sao, grpo, grpo_dis"):
        b.algo_overrides("ppo", 4, True, base)


def test_seed_from_sft_links_the_checkpoint_and_a_trained_tokenizer_only(tmp_path):
    """A sentencepiece run's tokenizer/ is linked with its SFT checkpoint; an HF-tokenizer run
    (tokenizer.kind: hf) has none, and only its checkpoint is linked; no checkpoint is an error."""
    sft = tmp_path / "sft"
    (sft / "checkpoints" / "sft" / "step_00000002").mkdir(parents=True)
    (sft / "checkpoints" / "sft" / "step_00000002" / "shard.pt").write_text("w")
    hf_run = tmp_path / "hf_run"
    benchlib.seed_from_sft(sft, hf_run)
    assert (hf_run / "checkpoints/sft/step_00000002/shard.pt").read_text() == "w"
    assert not (hf_run / "tokenizer").exists()
    (sft / "tokenizer").mkdir()
    (sft / "tokenizer" / "tokenizer.model").write_text("sp")
    sp_run = tmp_path / "sp_run"
    benchlib.seed_from_sft(sft, sp_run)
    assert (sp_run / "tokenizer" / "tokenizer.model").read_text() == "sp"
    with pytest.raises(FileNotFoundError, match="no checkpoints/sft"):
        benchlib.seed_from_sft(tmp_path / "missing", tmp_path / "x")
