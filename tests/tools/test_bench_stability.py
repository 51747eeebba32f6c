"""tools/bench_stability.py: per-quarter means and the collapse rule, and the figures of a run
read back from its metrics files."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
_spec = importlib.util.spec_from_file_location(
    "bench_stability", ROOT / "tools" / "bench_stability.py"
)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _recs(rewards, entropies):
    return [
        {"step": i + 1, "reward/mean": r, "policy/entropy": e, "time/rl_elapsed_s": float(i)}
        for i, (r, e) in enumerate(zip(rewards, entropies, strict=True))
    ]


def test_quarters_are_means_of_each_quarter_and_nan_when_absent():
    recs = _recs([1, 2, 3, 4, 5, 6, 7, 8], [0.0] * 8)
    assert bench.quarters(recs, "reward/mean") == [1.5, 3.5, 5.5, 7.5]
    q = bench.quarters(recs, "deviation/abs_one_minus_ratio_mean")
    assert all(math.isnan(x) for x in q)
    # 6 steps: quarters of 1, 2, 1, 2 steps (i * n // 4 boundaries 0, 1, 3, 4, 6)
    assert bench.quarters(_recs([1, 2, 3, 4, 5, 6], [0.0] * 6), "reward/mean") == [1, 2.5, 4, 5.5]


def test_collapse_needs_both_the_reward_fall_and_the_entropy_move():
    # 40 updates: window 10, last quarter = updates 31-40
    peak = [0.2] * 10 + [0.6] * 10 + [0.4] * 10 + [0.2] * 10
    assert bench.collapsed(peak, [1.0] * 10 + [0.9] * 10 + [0.5] * 10 + [0.3] * 10)  # -70%
    assert bench.collapsed(peak, [1.0] * 10 + [1.2] * 10 + [1.8] * 10 + [2.0] * 10)  # blew up
    held = peak[:30] + [0.31] * 10
    assert not bench.collapsed(held, [1.0] * 10 + [0.5] * 30)  # reward held (0.31 > 0.3)
    assert not bench.collapsed(peak, [1.0] * 10 + [0.8] * 30)  # entropy -20%
    assert not bench.collapsed([0.0] * 40, [1.0] + [0.1] * 39)  # never learnt
    assert not bench.collapsed(peak[:3], [1.0, 0.5, 0.1])  # too short to say


def test_collapse_within_the_first_quarter_is_flagged():
    """GRPO, bound 2, seed 1: some reward for 10 updates, none after; entropy up within Q1.
    Measured per quarter, Q1's entropy already holds most of the rise (+20% to Q4), so a
    quarter rule would miss the collapse; from the first 10 updates it is +83%."""
    rewards = [0.19, 0.0, 0.25, 0.31, 0.12, 0.12, 0.25, 0.19, 0.0, 0.06] + [0.0] * 190
    entropies = [0.18] * 10 + [0.30] * 40 + [0.33] * 150
    assert bench.collapsed(rewards, entropies)
    h = bench.quarters(_recs(rewards, entropies), "policy/entropy")
    assert abs(h[-1] - h[0]) < 0.5 * h[0]  # what the quarters alone would have said


def test_figures_read_a_run_directory(tmp_path):
    (tmp_path / "rl").mkdir()
    recs = _recs([0.1, 0.5, 0.6, 0.1], [2.0, 1.5, 1.0, 0.5])
    recs[1]["deviation/version_lag_max"] = 3.0
    recs[2]["value/explained_variance"] = 0.4
    (tmp_path / "rl" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    summary = {"before/eval/success_rate": 0.25, "after/eval/success_rate": 0.0}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    f = bench.figures(tmp_path)
    assert f["steps"] == 4 and f["wall_s"] == 3.0 and f["lag_max"] == 3.0
    assert f["quarters"]["reward"] == [0.1, 0.5, 0.6, 0.1]
    assert f["collapsed"] is True  # 0.1 < 0.3, entropy 2.0 -> 0.5
    assert (f["success_before"], f["success_after"]) == (0.25, 0.0)
    assert f["curves"]["entropy"] == [(1, 2.0), (2, 1.5), (3, 1.0), (4, 0.5)]
    assert f["curves"]["value EV"] == [(3, 0.4)]
    ev = f["quarters"]["value EV"]
    assert ev[2] == 0.4 and math.isnan(ev[0]) and math.isnan(ev[3])
    rows = bench.table({bench.label("sao", 4): f}).splitlines()
    assert rows[2].startswith("| SAO, staleness 4 | 4 | Q1 | 0.100 |")
    assert rows[4].endswith("| 0.40 |") and "| Q3 | 0.600 |" in rows[4]  # critic EV in Q3
    assert "| SAO, staleness 4 | yes | 3 | 0.250 -> 0.000 |" in rows


def _fig(algo, k, seed, reward_q, after, collapsed):
    return {
        "algo": algo,
        "staleness": k,
        "seed": seed,
        "quarters": {"reward": reward_q},
        "collapsed": collapsed,
        "success_before": 0.172,
        "success_after": after,
    }


def test_seeds_have_their_own_folders_seeds_and_a_table_over_seeds(tmp_path):
    assert bench.run_folder(tmp_path, "sao", 2, 0) == tmp_path / "staleness2" / "sao"
    assert bench.run_folder(tmp_path, "grpo", 4, 2) == tmp_path / "staleness4" / "grpo_seed2"
    assert bench.seed_overrides(3) == ["seed=3", "tasks.train_seed=3", "rollout.seed=3"]
    assert bench.label("grpo", 2, 1) == "GRPO, staleness 2, seed 1"
    runs = {
        "a": _fig("sao", 2, 0, [0.4, 0.7, 0.7, 0.8], 0.75, False),
        "b": _fig("sao", 2, 1, [0.2, 0.5, 0.3, 0.2], 0.25, True),
        "c": _fig("grpo", 2, 0, [0.1, 0.3, 0.2, 0.1], 0.10, True),
    }
    rows = bench.seeds_table(runs).splitlines()
    assert "(before: 0.172)" in rows[0]
    # SAO: last quarter (0.8, 0.2) -> 0.5 ± 0.3; best (0.8, 0.5) -> 0.65 ± 0.15; after 0.5 ± 0.25
    assert (
        rows[2]
        == "| SAO, staleness 2 | 2 | 1 / 2 | 0.500 ± 0.300 | 0.650 ± 0.150 | 0.500 ± 0.250 |"
    )
    assert rows[3] == "| GRPO, staleness 2 | 1 | 1 / 1 | 0.100 | 0.300 | 0.100 |"  # n = 1: no s.e.


def test_bad_seed_arguments_are_refused(capsys):
    import pytest

    with pytest.raises(SystemExit):
        bench.main(["--seeds", "0"])
    assert "--seeds must be >= 1" in capsys.readouterr().err


def test_the_section_shows_the_command_that_regenerates_it():
    import argparse

    args = argparse.Namespace(
        config="examples/configs/quickstart.yaml",
        steps=200,
        max_staleness=[2],
        algorithms=["sao", "grpo"],
        seeds=2,
        first_seed=1,
        out="runs/bench_stability",
        section="Stability (seeds)",
        override=["rl.lr=1e-5"],
        trajectories_per_batch=None,
        tag=None,
        rl_override=[],
    )
    assert bench.command_line(args) == (
        "python tools/bench_stability.py --config examples/configs/quickstart.yaml --steps 200 "
        "--max-staleness 2 --algorithms sao grpo --seeds 2 --first-seed 1 "
        '--out runs/bench_stability --write --section "Stability (seeds)" rl.lr=1e-5'
    )
    args.seeds, args.first_seed, args.section, args.override = 1, 0, bench.SECTION, []
    assert bench.command_line(args) == (
        "python tools/bench_stability.py --config examples/configs/quickstart.yaml --steps 200 "
        "--max-staleness 2 --algorithms sao grpo --out runs/bench_stability --write"
    )


def test_a_larger_rl_batch_has_its_own_folders_labels_and_command(capsys):
    import argparse

    import pytest

    out = Path("/tmp/x")
    assert bench.run_folder(out, "grpo", 2, 0, 32) == out / "staleness2" / "grpo_b32"
    assert bench.run_folder(out, "grpo", 2, 1, 32) == out / "staleness2" / "grpo_b32_seed1"
    assert bench.label("grpo", 2, 1, 32) == "GRPO, 32 per update, staleness 2, seed 1"
    runs = {
        "a": {**_fig("grpo", 2, 1, [0.1, 0.3, 0.2, 0.1], 0.1, True), "batch": None},
        "b": {**_fig("grpo", 2, 1, [0.2, 0.4, 0.5, 0.6], 0.5, False), "batch": 32},
    }
    rows = bench.seeds_table(runs).splitlines()  # one row per (algorithm, bound, batch)
    assert rows[2].startswith("| GRPO, staleness 2 | 1 | 1 / 1 |")
    assert rows[3] == "| GRPO, 32 per update, staleness 2 | 1 | 0 / 1 | 0.600 | 0.600 | 0.500 |"
    args = argparse.Namespace(
        config="c.yaml", steps=200, max_staleness=[2], algorithms=["grpo"], seeds=3,
        first_seed=0, out="runs/s", section=bench.SECTION, override=[], trajectories_per_batch=32,
        tag=None, rl_override=[],
    )  # fmt: skip
    assert bench.command_line(args) == (
        "python tools/bench_stability.py --config c.yaml --steps 200 --max-staleness 2 "
        "--algorithms grpo --seeds 3 --trajectories-per-batch 32 --out runs/s --write"
    )
    with pytest.raises(SystemExit):  # 20 is not a whole number of GRPO groups of 8
        bench.main(["--algorithms", "grpo", "--trajectories-per-batch", "20"])
    err = capsys.readouterr().err  # the group size asked of the GRPO run's algorithm
    assert "--trajectories-per-batch 20: must be >= 1 and a multiple of every" in err
    assert "(whole groups per update; GRPO 8)" in err


def test_a_tagged_variant_has_its_own_folders_labels_and_command(capsys):
    import argparse

    import pytest

    out = Path("/tmp/x")
    assert bench.run_folder(out, "grpo", 2, 1, tag="skip") == out / "staleness2" / "grpo_skip_seed1"
    assert bench.run_folder(out, "grpo", 0, 0, 32, "skip") == out / "staleness0" / "grpo_b32_skip"
    assert bench.label("grpo", 2, 1, tag="skip") == "GRPO, skip, staleness 2, seed 1"
    runs = {
        "a": {**_fig("grpo", 2, 1, [0.1, 0.3, 0.2, 0.1], 0.1, True), "tag": None},
        "b": {**_fig("grpo", 2, 1, [0.2, 0.4, 0.5, 0.6], 0.5, False), "tag": "skip"},
    }
    rows = bench.seeds_table(runs).splitlines()
    assert rows[2].startswith("| GRPO, staleness 2 | 1 | 1 / 1 |")
    assert rows[3].startswith("| GRPO, skip, staleness 2 | 1 | 0 / 1 |")
    args = argparse.Namespace(
        config="c.yaml", steps=200, max_staleness=[2], algorithms=["grpo"], seeds=1,
        first_seed=1, out="runs/s", section="S", override=[], trajectories_per_batch=None,
        tag="skip", rl_override=["algorithm.skip_zero_advantage_updates=true"],
    )  # fmt: skip
    assert bench.command_line(args) == (
        "python tools/bench_stability.py --config c.yaml --steps 200 --max-staleness 2 "
        "--algorithms grpo --first-seed 1 --tag skip "
        "--rl-override algorithm.skip_zero_advantage_updates=true --out runs/s --write "
        '--section "S"'
    )
    with pytest.raises(SystemExit):  # an RL-only override without its own folders
        bench.main(["--rl-override", "rl.steps=3"])
    assert "--rl-override needs --tag NAME" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--tag", "a/b", "--rl-override", "rl.steps=3"])
    assert "--tag 'a/b': use letters, digits" in capsys.readouterr().err


def test_line_specs_tell_seeds_apart_only_within_one_variant():
    def run(algo, k, seed, tag=None):
        return {"algo": algo, "staleness": k, "seed": seed, "batch": None, "tag": tag}

    seeds = {bench.label("sao", 2, s): run("sao", 2, s) for s in (0, 1, 2)}
    specs = bench.line_specs(seeds)
    assert [legend for _, legend, _, _ in specs] == list(seeds)  # one entry per seed
    assert len({colour for _, _, colour, _ in specs}) == 3
    mixed = {
        **{bench.label("sao", 2, s): run("sao", 2, s) for s in (1, 2)},
        **{bench.label("grpo", 4, s, tag="skip"): run("grpo", 4, s, "skip") for s in (1, 2)},
    }
    specs = bench.line_specs(mixed)
    assert [legend for _, legend, _, _ in specs] == [
        "SAO, staleness 2",
        None,
        "GRPO, skip, staleness 4",
        None,
    ]
    assert [(colour, style) for _, _, colour, style in specs] == [
        ("tab:blue", "-"),
        ("tab:blue", "-"),
        ("tab:orange", "--"),
        ("tab:orange", "--"),
    ]
