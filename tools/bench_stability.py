"""Long-run stability under staleness: does SAO or GRPO collapse when trained for many
asynchronous steps at a loose staleness bound? (issue 14, item 6)

The paper reports vanilla GRPO collapsing after ~160 asynchronous steps while SAO stays stable
for ~1000. Here both train from one SFT start of a job config for `--steps` policy updates with
``rollout.max_staleness = --max-staleness`` (the rollout keeps sampling while the trainer
trains, so trained tokens are up to that many versions old) and the deviation controller off
(a fixed bound, as in the paper's runs). Per run the script reads run_dir/rl/metrics.jsonl and
reports, per quarter of the run: batch reward, policy entropy, mean |1 - r|, DIS-dropped or
PPO-clipped share, version lag and the critic's explained variance (SAO); it flags a collapse
when the reward of the last quarter falls below half the best quarter's and the entropy has
moved by more than 50% from the first quarter (either direction: collapse to a deterministic
or to a uniform policy).

    python tools/bench_stability.py --steps 200 --max-staleness 2 4 --write

Each (staleness bound, algorithm) pair is one run, under --out/staleness<k>/<algo>.

Runs are reused from --out (delete a folder to rerun it). `--write` rewrites the section
"Long-run stability under staleness" of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import benchlib
from bench_sao_vs_grpo import NAMES, algo_overrides
from benchlib import REPO, read_metrics, run_job, seed_from_sft, shared_sft

SECTION = "Long-run stability under staleness"
SERIES = {
    "reward": "reward/mean",
    "entropy": "policy/entropy",
    "abs(1-r)": "deviation/abs_one_minus_ratio_mean",
    "dropped": "deviation/dropped_fraction",
    "lag": "deviation/version_lag_mean",
    "value EV": "value/explained_variance",  # SAO's critic; absent for GRPO
}


def quarters(recs: list[dict], key: str) -> list[float]:
    """Mean of `key` over each quarter of the run's steps (NaN where a quarter has none)."""
    n = len(recs)
    out = []
    for q in range(4):
        part = recs[q * n // 4 : (q + 1) * n // 4]
        xs = [r[key] for r in part if r.get(key) is not None and r[key] == r[key]]
        out.append(sum(xs) / len(xs) if xs else float("nan"))
    return out


def collapsed(reward_q: list[float], entropy_q: list[float]) -> bool:
    """The collapse rule of the module docstring (False when a quarter is missing)."""
    if any(x != x for x in reward_q + entropy_q) or not reward_q:
        return False
    best = max(reward_q)
    fell = best > 0 and reward_q[-1] < 0.5 * best
    moved = entropy_q[0] > 0 and abs(entropy_q[-1] - entropy_q[0]) > 0.5 * entropy_q[0]
    return fell and moved


def figures(run_dir: Path) -> dict:
    recs = [r for r in read_metrics(run_dir / "rl") if "time/rl_elapsed_s" in r]
    summary = json.loads((run_dir / "summary.json").read_text())
    q = {name: quarters(recs, key) for name, key in SERIES.items()}
    return {
        "steps": len(recs),
        "wall_s": recs[-1]["time/rl_elapsed_s"] if recs else float("nan"),
        "quarters": q,
        "collapsed": collapsed(q["reward"], q["entropy"]),
        "lag_max": max((r.get("deviation/version_lag_max") or 0.0) for r in recs),
        "success_before": summary.get("before/eval/success_rate", float("nan")),
        "success_after": summary.get("after/eval/success_rate", float("nan")),
        "curves": {
            name: [(r["step"], r.get(key)) for r in recs if r.get(key) is not None]
            for name, key in SERIES.items()
        },
    }


def label(algo: str, staleness: int) -> str:
    """A run's row label: 'SAO, staleness 4'."""
    return f"{NAMES[algo]}, staleness {staleness}"


def plot(runs: dict[str, dict], path: Path, title: str) -> None:
    """One panel per series; colour by algorithm, line style by staleness bound. `runs` maps a
    row label to `figures()` plus 'algo' and 'staleness'."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 5, figsize=(25, 4))
    colours = {"sao": "tab:blue", "grpo": "tab:orange", "grpo_dis": "tab:green"}
    styles = ["-", "--", ":", "-."]
    bounds = sorted({f["staleness"] for f in runs.values()})
    for run_label, f in runs.items():
        style = styles[bounds.index(f["staleness"]) % len(styles)]
        for ax, name in zip(
            axes, ("reward", "entropy", "abs(1-r)", "lag", "value EV"), strict=True
        ):
            pts = f["curves"][name]
            if not pts:
                continue
            xs, ys = benchlib.smooth(pts, 10)
            ax.plot(xs, ys, style, color=colours.get(f["algo"]), label=run_label)
            ax.set(xlabel="policy update", ylabel=f"{name} (10-step mean)")
    axes[2].set_yscale("log")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.lines:  # the critic EV panel is empty for critic-free runs
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _f(x: float, fmt: str = "{:.3f}") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def table(runs: dict[str, dict]) -> str:
    """The per-quarter table and the verdict table; `runs` maps a row label to `figures()`."""
    lines = [
        "| run | steps | quarter | reward | entropy | mean abs(1 - r) | dropped / clipped | "
        "version lag | critic EV |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, f in runs.items():
        q = f["quarters"]
        for i in range(4):
            lines.append(
                f"| {name if i == 0 else ''} | {f['steps'] if i == 0 else ''} | Q{i + 1} | "
                f"{_f(q['reward'][i])} | {_f(q['entropy'][i])} | "
                f"{_f(q['abs(1-r)'][i], '{:.2e}')} | {_f(q['dropped'][i], '{:.4f}')} | "
                f"{_f(q['lag'][i], '{:.2f}')} | {_f(q['value EV'][i], '{:.2f}')} |"
            )
    lines += [
        "",
        "| run | collapsed (rule above) | max version lag | held-out success before -> after |",
        "|---|---|---:|---|",
    ]
    for name, f in runs.items():
        lines.append(
            f"| {name} | {'yes' if f['collapsed'] else 'no'} | {f['lag_max']:.0f} | "
            f"{_f(f['success_before'])} -> {_f(f['success_after'])} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/configs/quickstart.yaml")
    ap.add_argument("--steps", type=int, default=150, help="policy updates per run")
    ap.add_argument(
        "--max-staleness", type=int, nargs="+", default=[4], help="one run pair per bound"
    )
    ap.add_argument("--algorithms", nargs="+", default=["sao", "grpo"], choices=sorted(NAMES))
    ap.add_argument("--group-size", type=int, default=8, help="GRPO G")
    ap.add_argument("--num-eval-tasks", type=int, default=64)
    ap.add_argument("--out", default="runs/bench_stability")
    ap.add_argument("--write", action="store_true", help="update docs/BENCHMARKS.md")
    ap.add_argument("override", nargs="*", help="extra section.field=value for every job")
    args = ap.parse_args(argv)

    from sao_megatron.configs import load_config
    from sao_megatron.trainer.job import JobConfig

    base = load_config(JobConfig, str(REPO / args.config), args.override)
    out = (REPO / args.out).resolve()
    start_info = benchlib.machine_info()
    sft = shared_sft(args.config, args.override, out / "sft")
    runs = {}
    for k in args.max_staleness:
        for algo in args.algorithms:
            run_dir = out / f"staleness{k}" / algo
            seed_from_sft(sft, run_dir)
            ov = [
                *args.override,
                f"rl.steps={args.steps}",
                f"rollout.max_staleness={k}",
                "rollout.deviation_target=null",
                f"tasks.num_eval_tasks={args.num_eval_tasks}",
                "checkpoint.save_interval=0",
                "logging.console=false",
            ]
            run_job(
                args.config,
                ov + algo_overrides(algo, args.group_size, base.value_pretrain.steps > 0, base),
                run_dir,
            )
            runs[label(algo, k)] = {**figures(run_dir), "algo": algo, "staleness": k}
    info = benchlib.measured_machine_info(out, start_info, "stability")
    bounds = [str(k) for k in args.max_staleness]
    body_table = table(runs)
    print(body_table)
    title = (
        f"{args.config}, max_staleness {' / '.join(bounds)}, "
        f"{args.steps} updates "
        f"(GRPO G={args.group_size})"
    )
    img = REPO / "docs" / "img" / "bench_stability.png"
    plot(runs, out / "stability.png", title)
    (out / "figures.json").write_text(json.dumps(runs, indent=1))
    if args.write:
        img.write_bytes((out / "stability.png").read_bytes())
        cmd = (
            f"python tools/bench_stability.py --config {args.config} --steps {args.steps} "
            f"--max-staleness {' '.join(bounds)} "
            f"--algorithms {' '.join(args.algorithms)} "
            f"--out {args.out} --write {' '.join(args.override)}"
        ).rstrip()
        body = (
            f"Command:\n\n    {cmd}\n\n{benchlib.machine_line(info)}\n\n"
            f"Config `{args.config}`, one run per algorithm and staleness bound from the same "
            f"SFT start, `rollout.max_staleness` = "
            f"{' and '.join(bounds)} (fixed bound, deviation controller "
            f"off), {args.steps} policy updates; figures are means over each quarter of the "
            "run. 'Dropped / clipped': SAO's DIS-band drops, GRPO's share outside the band "
            "(the same metric). Collapse rule: last-quarter reward below half the best "
            "quarter's and entropy moved > 50% from the first quarter.\n\n"
            f"{body_table}\n\n![stability](img/{img.name})\n\n{benchlib.READING}\n"
        )
        benchlib.write_section(SECTION, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
