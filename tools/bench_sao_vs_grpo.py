"""SAO vs GRPO side by side: same model, tasks, SFT start and wall-clock budget, repeated.

For one job config (default: the quickstart, Tower of Hanoi H=7 on the 4.5M-parameter MoE):

1. the config's SFT stage runs once (`<out>/sft`); every run starts RL from its weights;
2. for each repeat r = 0..R-1 (seed r, task stream r, sampling seed r) one SAO run
   (value pre-training + RL: single trajectories, value x2 + DIS policy update) and one GRPO
   run (G samples per task, group advantages, PPO-clip on recomputed old log-probs, no critic)
   run back to back, each with `rl.time_budget_s = --budget-s` seconds of wall-clock counted
   from the end of the before-RL evaluation (value pre-training is inside SAO's budget);
   both use the same trajectories per batch, engines, micro-batch and policy learning rate;
3. the table reports median [min, max] over repeats of: end-to-end trained trajectories/s,
   train tokens/s, peak trainer memory per update (RSS on CPU, CUDA max allocated on GPU), the
   wall-clock split (waiting for rollout / train / weight sync / other), off-policy deviation
   (mean |1 - r| and version lag), rollout worker utilisation, and held-out success before and
   after RL (the config's eval tasks); a plot shows reward vs wall-clock for every run.

    python tools/bench_sao_vs_grpo.py --repeats 3 --budget-s 120 --write

Rerunning reuses finished runs under --out (delete a folder to re-measure it). `--write` puts the
table and plot into the "SAO vs GRPO" section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
from pathlib import Path

import benchlib
from benchlib import REPO, RunFigures, run_figures, run_job, seed_from_sft, shared_sft, spread

#: each algorithm's own settings in these benchmarks, beyond the job config's (``{G}``: the
#: --group-size): "sao" runs the config's algorithm as it stands (an SAO config); GRPO+DIS keeps
#: the DIS band of its default weighting; GRPO clips at 0.2 on recomputed old log-probs. What a
#: run needs besides (value pre-training, the config's settings to reset) is asked of the
#: algorithm in `algo_overrides`.
ALGORITHM_SETTINGS = {
    "sao": [],
    "grpo": [
        "algorithm.name=grpo",
        "algorithm.grpo.group_size={G}",
        "algorithm.ppo.clip_low=0.2",
        "algorithm.ppo.clip_high=0.2",
    ],
    "grpo_dis": ["algorithm.name=grpo_dis", "algorithm.grpo.group_size={G}"],
}


def algo_overrides(algo: str, group_size: int, has_value_pretrain: bool, base=None) -> list[str]:
    """Overrides of one algorithm's runs of the job config `base` (its `JobConfig`): the stages
    (the config's value pre-training only for an algorithm with a critic), the algorithm's
    `ALGORITHM_SETTINGS`, and, when those name the algorithm (it is not the config's as it
    stands), the config's importance weighting reset to the algorithm's default and its
    ``algorithm.sao`` keys to theirs where the algorithm does not read them (leaving them set is
    an error)."""
    if algo not in ALGORITHM_SETTINGS:
        raise ValueError(f"--algorithms {algo!r}: use one of {', '.join(ALGORITHM_SETTINGS)}")
    from sao_megatron.algorithm import registry
    from sao_megatron.algorithm.config import AlgorithmConfig, SAOConfig

    own = [o.format(G=group_size) for o in ALGORITHM_SETTINGS[algo]]
    named = [o.split("=", 1)[1] for o in own if o.startswith("algorithm.name=")]
    # the algorithm the run trains, asked what it needs (not told by its name)
    if named or base is None:
        algorithm = registry.build(AlgorithmConfig(name=named[-1] if named else algo))
    else:
        algorithm = registry.build(base.algorithm)
    stages = "[value_pretrain,rl]" if has_value_pretrain and algorithm.needs_value_model else "[rl]"
    resets = []
    if base is not None and named:
        # the config's weighting (an SAO config's dis_band) is its algorithm's: each takes its own
        resets.append("algorithm.importance.weighting=null")
    if base is not None and "sao" not in type(algorithm).config_sections(algorithm.config):
        default = SAOConfig()
        for f in dataclasses.fields(SAOConfig):
            if getattr(base.algorithm.sao, f.name) != getattr(default, f.name):
                value = getattr(default, f.name)
                resets.append(f"algorithm.sao.{f.name}={'null' if value is None else value}")
    return [f"stages={stages}", *own, *resets]


#: table / legend names of the algorithms
NAMES = {"sao": "SAO", "grpo": "GRPO", "grpo_dis": "GRPO+DIS"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/configs/quickstart.yaml")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=120.0, help="wall-clock per run (s)")
    ap.add_argument("--group-size", type=int, default=8, help="GRPO G")
    ap.add_argument("--num-eval-tasks", type=int, default=64)
    ap.add_argument("--out", default="runs/bench_sao_vs_grpo")
    ap.add_argument("--section", default="SAO vs GRPO")
    ap.add_argument(
        "--algorithms",
        nargs="+",
        default=["sao", "grpo"],
        choices=sorted(NAMES),
        help="which algorithms to run, interleaved per repeat (default: sao grpo)",
    )
    ap.add_argument("--first-seed", type=int, default=0, help="repeat r uses seed first_seed + r")
    ap.add_argument(
        "--eval-interval-s",
        type=float,
        default=0.0,
        help="held-out evaluation every this many seconds of training (rl.eval_interval_s, off "
        "the budget's clock): the time-to-accuracy curves (0: before and after RL only)",
    )
    ap.add_argument(
        "--shared-value-pretrain",
        action="store_true",
        help="run SAO's value pre-training once (<out>/value_pretrain, from the SFT start) and "
        "start every SAO run from that critic, its budget counting RL only (default: each SAO "
        "run pre-trains its own critic inside its budget)",
    )
    ap.add_argument("--write", action="store_true", help="update docs/BENCHMARKS.md")
    ap.add_argument("override", nargs="*", help="extra section.field=value for every job")
    args = ap.parse_args(argv)

    from sao_megatron.configs import load_config
    from sao_megatron.trainer.job import JobConfig

    base = load_config(JobConfig, str(REPO / args.config), args.override)
    has_vp = base.value_pretrain.steps > 0
    # which runs train a critic: asked of each run's algorithm (its resolved job config)
    critic = {
        a: benchlib.job_algorithm(
            args.config, [*args.override, *algo_overrides(a, args.group_size, has_vp, base)]
        ).needs_value_model
        for a in args.algorithms
    }
    out = (REPO / args.out).resolve()
    start_info = benchlib.machine_info()
    sft = shared_sft(args.config, args.override, out / "sft")
    shared_vp = None
    if args.shared_value_pretrain and has_vp and any(critic.values()):
        shared_vp = shared_value_pretrain(args.config, args.override, sft, out / "value_pretrain")
    runs: dict[str, list[RunFigures]] = {a: [] for a in args.algorithms}
    for r in range(args.first_seed, args.first_seed + args.repeats):
        for algo in args.algorithms:  # interleaved: load drift hits every algorithm alike
            run_dir = out / f"{algo}_r{r}"
            seed_from_sft(sft, run_dir)
            ov = benchlib.rl_overrides(args.override, args.budget_s, args.num_eval_tasks, r)
            if args.eval_interval_s:
                ov.append(f"rl.eval_interval_s={args.eval_interval_s:g}")
            if critic[algo] and shared_vp is not None:  # RL only, from the shared critic
                seed_critic(shared_vp.run_dir, run_dir)
                ov += algo_overrides(algo, args.group_size, False, base)
            else:
                ov += algo_overrides(algo, args.group_size, has_vp, base)
            run_job(args.config, ov, run_dir)
            runs[algo].append(run_figures(run_dir, f"{algo} r{r}"))

    info = benchlib.measured_machine_info(out, start_info, "sao_vs_grpo")
    table = render_table(runs, args)
    plot = out / "sao_vs_grpo.png"
    plot_curves(runs, plot, args)
    print(table)
    (out / "table.md").write_text(table)
    (out / "figures.json").write_text(
        json.dumps({a: [f.__dict__ for f in fs] for a, fs in runs.items()}, indent=1)
    )
    if args.write:
        img = REPO / "docs" / "img" / f"bench_{benchlib.section_slug(args.section)}.png"
        img.write_bytes(plot.read_bytes())
        flags = [f"--repeats {args.repeats}", f"--budget-s {args.budget_s:g}"]
        if args.algorithms != ap.get_default("algorithms"):
            flags.append("--algorithms " + " ".join(args.algorithms))
        if args.first_seed:
            flags.append(f"--first-seed {args.first_seed}")
        if args.shared_value_pretrain:
            flags.append("--shared-value-pretrain")
        for name in ("config", "group_size", "num_eval_tasks", "eval_interval_s", "out", "section"):
            value = getattr(args, name)
            if value != ap.get_default(name):
                text = f'"{value}"' if " " in str(value) else str(value)
                flags.append(f"--{name.replace('_', '-')} {text}")
        cmd = " ".join(["python tools/bench_sao_vs_grpo.py", *flags, "--write", *args.override])
        body = (
            f"Command:\n\n    {cmd}\n\n{benchlib.machine_line(info)}\n\n"
            f"Config `{args.config}`; GRPO G={args.group_size}; budget {args.budget_s:g} s of "
            f"wall-clock per run; {args.repeats} repeat{'s' if args.repeats > 1 else ''}"
            f"{' (median [min, max])' if args.repeats > 1 else ''}."
            f"{shared_vp.sentence() if shared_vp is not None else ''}\n\n{table}\n\n"
            f"![reward vs wall-clock](img/{img.name})\n\n{benchlib.READING}\n"
        )
        benchlib.write_section(args.section, body)
    return 0


@dataclasses.dataclass
class SharedValuePretrain:
    """The one value pre-training every SAO run of a benchmark starts from."""

    run_dir: Path
    steps: int
    wall_s: float
    explained_variance: float | None  # on the last pre-training batch, before its updates

    def sentence(self) -> str:
        ev = ""
        if self.explained_variance is not None:
            ev = f", explained variance on its last batch {self.explained_variance:.2f}"
        return (
            f" SAO's critic was pre-trained once ({self.steps} value pre-training steps, "
            f"{self.wall_s:.0f} s{ev}) and every SAO run starts from it: that cold start is not "
            "inside SAO's budget."
        )


def shared_value_pretrain(config: str, user: list[str], sft: Path, out: Path):
    """Run (once) the config's value pre-training alone from the SFT start into `out`; the job
    saves the pre-trained critic as its RL checkpoint (step 0)."""
    seed_from_sft(sft, out)
    ov = [*user, "stages=[value_pretrain]", "tasks.num_eval_tasks=0", "logging.console=false"]
    run_job(config, ov, out)
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "value_pretrain" / "metrics.jsonl").open()]
    ev = records[-1].get("value/explained_variance_before") if records else None
    return SharedValuePretrain(out, len(records), summary["rl/value_pretrain_s"], ev)


def seed_critic(vp_dir: Path, run_dir: Path) -> None:
    """Give run_dir a copy of the shared value pre-training's RL checkpoint (the job resumes
    from it at step 0: pre-trained critic and its optimiser, SFT policy). A copy, not links:
    the run's checkpoint manager rewrites and prunes its own folder."""
    dst = run_dir / "checkpoints" / "rl"
    if not dst.exists():
        shutil.copytree(vp_dir / "checkpoints" / "rl", dst)


def render_table(runs: dict[str, list[RunFigures]], args) -> str:
    def row(label, fn, fmt="{:.3g}"):
        cells = [spread([fn(f) for f in runs[a]], fmt) for a in runs]
        return f"| {label} | " + " | ".join(cells) + " |"

    first = next(f for fs in runs.values() for f in fs)
    envs = sorted({k.split("/")[1] for k in first.after if k.count("/") == 2})
    lines = [
        "| metric | " + " | ".join(NAMES[a] for a in runs) + " |",
        "|---" * (len(runs) + 1) + "|",
        row("policy updates in budget", lambda f: f.steps, "{:.0f}"),
        row("trained trajectories / s (end to end)", lambda f: f.trajectories_per_s),
        row("train tokens / s (in train steps)", lambda f: f.train_tokens_per_s, "{:.0f}"),
        row("peak trainer RSS per update (GiB)", lambda f: f.peak_rss_gib, "{:.2f}"),
    ]
    if any(f.peak_gpu_gib is not None for fs in runs.values() for f in fs):
        lines.append(row("peak CUDA allocated per update (GiB)", lambda f: f.peak_gpu_gib))
    labels = {
        "rollout wait": "trainer idle, waiting for rollout",
        "train": "train (value + policy updates)",
        "sync": "weight sync",
        "other": "other (value pre-training, logging)",
    }
    for part, label in labels.items():
        lines.append(
            row(f"wall-clock fraction: {label}", lambda f, p=part: f.time_split[p], "{:.2f}")
        )
    lines += [
        row("mean abs(1 - r) over action tokens", lambda f: f.abs_one_minus_ratio, "{:.2e}"),
        row("policy-version lag (mean)", lambda f: f.version_lag, "{:.2f}"),
        row("rollout engine busy fraction", lambda f: f.worker_utilization, "{:.2f}"),
    ]
    for env in envs:
        for stat in ("success_rate", "mean_progress"):
            k = f"eval/{env}/{stat}"
            if k not in first.after:
                continue
            label = f"held-out {env} {stat.replace('_', ' ')}"
            lines.append(row(f"{label} before RL", lambda f, k=k: f.before.get(k), "{:.3f}"))
            lines.append(row(f"{label} after RL", lambda f, k=k: f.after.get(k), "{:.3f}"))
        cells = []
        for a in runs:
            n = sum(f.after.get(f"eval/{env}/num_tasks", 0.0) for f in runs[a])
            solved = sum(
                f.after.get(f"eval/{env}/success_rate", 0.0)
                * f.after.get(f"eval/{env}/num_tasks", 0.0)
                for f in runs[a]
            )
            p = solved / n if n else float("nan")
            se = math.sqrt(p * (1 - p) / n) if n else float("nan")
            cells.append(f"{p:.3f} ± {se:.3f} ({solved:.0f}/{n:.0f})")
        lines.append(
            f"| held-out {env} success after RL, pooled over repeats | " + " | ".join(cells) + " |"
        )
        key = f"eval/{env}/success_rate"
        lines.append(
            f"| held-out {env} success after RL, mean ± s.e. over seeds | "
            + " | ".join(mean_se([f.after.get(key) for f in runs[a]]) for a in runs)
            + " |"
        )
        for stat in ("illegal_move_rate", "non_optimal_move_rate"):
            k = f"eval/{env}/{stat}"
            if k in first.after:
                label = f"held-out {env} {stat.replace('_', ' ')} after RL, mean ± s.e."
                lines.append(
                    f"| {label} | "
                    + " | ".join(mean_se([f.after.get(k) for f in runs[a]], "{:.4f}") for a in runs)
                    + " |"
                )
    if any(f.ev_curve for fs in runs.values() for f in fs):
        lines.append(
            "| critic explained variance before the updates, last 5 RL steps (mean over seeds) | "
            + " | ".join(
                mean_se([_tail_mean([e for _, e in f.ev_curve], 5) for f in runs[a]])
                if any(f.ev_curve for f in runs[a])
                else "-"
                for a in runs
            )
            + " |"
        )
    return "\n".join(lines)


def _tail_mean(xs: list[float], k: int) -> float | None:
    xs = [x for x in xs[-k:] if x == x]
    return sum(xs) / len(xs) if xs else None


def mean_se(xs: list[float | None], fmt: str = "{:.3f}") -> str:
    """'mean ± s.e. (n = k)' of the values that are not None/NaN; s.e. = sample std / sqrt(k)."""
    m, se, n = benchlib.mean_se(xs)
    if not n:
        return "-"
    if n < 2:
        return f"{fmt.format(m)} (n = 1)"
    return f"{fmt.format(m)} ± {fmt.format(se)} (n = {n})"


def _repeats(runs) -> str:
    n = len(next(iter(runs.values())))
    return f"{n} repeats each" if n > 1 else "one run each"


def _plot_time_to_accuracy(ax, runs: dict[str, list[RunFigures]], colours: dict) -> None:
    """Held-out success against the RL stage's clock: each run thin, the mean over runs (each
    run's last evaluation carried forward, up to the shortest run's end) thick."""
    for algo, figs in runs.items():
        curves = [f.eval_curve for f in figs if f.eval_curve]
        for c in curves:
            xs, ys = zip(*c, strict=True)
            ax.step(xs, ys, where="post", color=colours[algo], alpha=0.25, lw=0.8)
        if not curves:
            continue
        end = min(c[-1][0] for c in curves)
        grid = sorted({t for c in curves for t, _ in c if t <= end})
        mean = [sum(_at(c, t) for c in curves) / len(curves) for t in grid]
        ax.step(grid, mean, where="post", color=colours[algo], lw=2.2, label=NAMES[algo])
    ax.set(
        xlabel="wall-clock since RL start (s, evaluations off the clock)",
        ylabel="held-out success rate",
        title="Time to accuracy (mean over seeds, thick)",
    )


def _at(curve: list[tuple[float, float]], t: float) -> float:
    """The curve's value at time t (the last point at or before t)."""
    return [y for x, y in curve if x <= t][-1]


def plot_curves(runs: dict[str, list[RunFigures]], path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = any(len(f.eval_curve) > 2 for fs in runs.values() for f in fs)
    fig, axes = plt.subplots(1, 4 if timed else 2, figsize=(22 if timed else 11, 4))
    colours = {"sao": "tab:blue", "grpo": "tab:orange", "grpo_dis": "tab:green"}
    if timed:
        _plot_time_to_accuracy(axes[2], runs, colours)
        for algo, figs in runs.items():  # the runs that trained a critic log its EV
            critic_runs = [f for f in figs if f.ev_curve]
            for i, f in enumerate(critic_runs):
                xs, ys = zip(*f.ev_curve, strict=True)
                label = NAMES[algo] if i == 0 else None
                axes[3].plot(xs, ys, color=colours[algo], alpha=0.7, label=label)
        axes[3].axhline(0.3, color="grey", ls=":", lw=1)
        axes[3].set(
            xlabel="wall-clock since RL start (s)",
            ylabel="explained variance (before the step's updates)",
            title="Critic",
            ylim=(-0.5, 1.0),
        )
    for algo, figs in runs.items():
        for i, f in enumerate(figs):
            xs, ys = benchlib.smooth(f.curve, 5)
            axes[0].plot(
                xs, ys, color=colours[algo], alpha=0.8, label=NAMES[algo] if i == 0 else None
            )
            if f.deviation_curve:
                dx, dy = zip(*f.deviation_curve, strict=True)
                axes[1].plot(
                    dx, dy, color=colours[algo], alpha=0.8, label=NAMES[algo] if i == 0 else None
                )
    axes[0].set(
        xlabel="wall-clock since RL start (s)",
        ylabel="batch reward (5-step mean)",
        title=f"Reward vs wall-clock ({_repeats(runs)})",
    )
    axes[1].set(
        xlabel="wall-clock since RL start (s)",
        ylabel="mean |1 - r| (action tokens)",
        yscale="log",
        title="Off-policy deviation",
    )
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"SAO vs GRPO (G={args.group_size}), {args.config}, budget {args.budget_s:g} s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
