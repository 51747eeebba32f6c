"""SAO ablations on the long-horizon task, one run each under the same wall-clock budget.

From the shared SFT checkpoint of `--config` (default examples/configs/bench_long_horizon.yaml:
Hanoi H=50, 6-10 disks, dense progress reward, windowed context), the SAO baseline
(value x2 per policy update, critic attention frozen, DIS band, GAE over action nodes with the
value at each node's last token) and one switch changed at a time:

| variant | override |
|---|---|
| value updates 1 | algorithm.sao.value_updates_per_policy_update=1 |
| critic attention trainable | value.freeze_patterns=[embedding] (only embeddings frozen) |
| PPO clip instead of DIS | algorithm.importance.weighting=ppo_clip (clip 0.2 on pi/pi_b) |
| action-token GAE | algorithm.sao.advantage_granularity=action_token |
| node-mean GAE | algorithm.sao.advantage_granularity=node_mean |

Each final policy is then evaluated on the same held-out H=50 tasks (tools/eval_horizon.py's
evaluation). The table gives the training signals (policy updates in the budget, batch reward at
the start and end, off-policy deviation, the critic's explained variance) and held-out success
and progress. One run per variant: differences within the noise of a single run (see the
repeated SAO vs GRPO runs for the run-to-run spread) are not evidence either way.

    python tools/bench_ablations.py --budget-s 300 --write

The baseline run is `<out>/sao_r0`, shared with
`tools/bench_sao_vs_grpo.py --config examples/configs/bench_long_horizon.yaml --repeats 1`
when both use the same --out and budget (finished runs are reused).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import benchlib
from benchlib import REPO, run_figures, run_job, seed_from_sft, shared_sft
from eval_horizon import evaluate_policy

VARIANTS: dict[str, list[str]] = {
    "SAO baseline": [],
    "value updates 1": ["algorithm.sao.value_updates_per_policy_update=1"],
    "critic attention trainable": ["value.freeze_patterns=[embedding]"],
    "PPO clip instead of DIS": [
        "algorithm.importance.weighting=ppo_clip",
        "algorithm.ppo.clip_low=0.2",
        "algorithm.ppo.clip_high=0.2",
    ],
    "action-token GAE": ["algorithm.sao.advantage_granularity=action_token"],
    "node-mean GAE": ["algorithm.sao.advantage_granularity=node_mean"],
}


def _dir(name: str) -> str:
    return "sao_r0" if name == "SAO baseline" else "abl_" + name.replace(" ", "_").lower()


def _mean(xs):
    v = [x for x in xs if x is not None]
    return sum(v) / len(v) if v else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/configs/bench_long_horizon.yaml")
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--num-eval-tasks", type=int, default=32, help="held-out H=50 tasks")
    ap.add_argument("--out", default="runs/bench_long_horizon")
    ap.add_argument("--only", nargs="*", help="run only these variants (names as in the table)")
    ap.add_argument("--write", action="store_true", help="update docs/BENCHMARKS.md")
    ap.add_argument("override", nargs="*", help="extra section.field=value for every job")
    args = ap.parse_args(argv)

    from sao_megatron.configs import load_config
    from sao_megatron.trainer.job import JobConfig

    job = load_config(JobConfig, str(REPO / args.config), args.override)
    train_h = next(e for e in job.tasks.train if e.name == "hanoi").options.get("horizon", 50)
    out = (REPO / args.out).resolve()
    start_info = benchlib.machine_info()
    sft = shared_sft(args.config, args.override, out / "sft")
    rows, curves = [], {}
    for name, extra in VARIANTS.items():
        if args.only and name not in args.only:
            continue
        run_dir = out / _dir(name)
        seed_from_sft(sft, run_dir)
        ov = benchlib.rl_overrides(args.override, args.budget_s, 0, 0)
        run_job(
            args.config, ov + benchlib.sao_overrides(job.value_pretrain.steps > 0) + extra, run_dir
        )
        fig = run_figures(run_dir, name)
        recs = [r for r in benchlib.read_metrics(run_dir / "rl") if "time/rl_elapsed_s" in r]
        ev_file = run_dir / "eval_h.json"
        if ev_file.exists():
            ev = {int(k): v for k, v in json.loads(ev_file.read_text()).items()}
        else:
            ev = evaluate_policy(
                run_dir / "hf_policy_final",
                job,
                [train_h],
                args.num_eval_tasks,
                run_dir / "eval_engine",
            )
            ev_file.write_text(json.dumps(ev))
        e = ev[train_h]
        rows.append(
            "| {} | {} | {:.3f} | {:.3f} | {:.2e} | {:.2f} | {:.3f} ± {:.3f} | {:.2f} ± {:.2f} "
            "| {:.2f} |".format(
                name,
                fig.steps,
                _mean(r["reward/mean"] for r in recs[:5]),
                _mean(r["reward/mean"] for r in recs[-5:]),
                fig.abs_one_minus_ratio,
                _mean(r.get("value/explained_variance") for r in recs[-5:]),
                e["success_rate"],
                e["success_se"],
                e["mean_progress"] * train_h,
                e.get("progress_se", float("nan")) * train_h,
                e["mean_turns"],
            )
        )
        curves[name] = fig.curve
    table = "\n".join(
        [
            "| variant | policy updates | batch reward, first 5 steps | batch reward, last 5 "
            f"steps | mean abs(1 - r) | critic explained variance (last 5) | held-out H={train_h} "
            "success | held-out net optimal moves | held-out moves played |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
        ]
    )
    print(table)
    png = out / "ablations.png"
    plot(curves, png, f"SAO ablations, {args.config}, budget {args.budget_s:g} s")
    (out / "ablations.md").write_text(table)
    if args.write:
        info = benchlib.measured_machine_info(out, start_info, "ablations")
        (REPO / "docs" / "img" / "bench_ablations.png").write_bytes(png.read_bytes())
        flags = [f"--budget-s {args.budget_s:g}"]
        for name in ("config", "num_eval_tasks", "out"):
            if getattr(args, name) != ap.get_default(name):
                flags.append(f"--{name.replace('_', '-')} {getattr(args, name)}")
        cmd = " ".join(["python tools/bench_ablations.py", *flags, "--write", *args.override])
        body = (
            f"Command:\n\n    {cmd}\n\n{benchlib.machine_line(info)}\n\nOne run per variant, "
            f"{args.budget_s:g} s wall-clock each from the same SFT checkpoint; held-out success "
            f"± binomial standard error over {args.num_eval_tasks} tasks.\n\n{table}\n\n"
            "![ablations](img/bench_ablations.png)\n\n<!-- reading -->\n"
        )
        benchlib.write_section("Ablations (long-horizon task)", body)
    return 0


def plot(curves: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, pts in curves.items():
        xs, ys = benchlib.smooth(pts, 5)
        ax.plot(xs, ys, label=name, lw=2.5 if name == "SAO baseline" else 1.2)
    ax.set(xlabel="wall-clock since RL start (s)", ylabel="batch reward (5-step mean)", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
