"""Long-run stability under staleness: does SAO or GRPO collapse when trained for many
asynchronous steps at a loose staleness bound? (issue 14, item 6)

The paper reports vanilla GRPO collapsing after ~160 asynchronous steps while SAO stays stable
for ~1000. Here both train from one SFT start of a job config for `--steps` policy updates with
``rollout.max_staleness = --max-staleness`` (the rollout keeps sampling while the trainer
trains, so trained tokens are up to that many versions old) and the deviation controller off
(a fixed bound, as in the paper's runs). Per run the script reads run_dir/rl/metrics.jsonl and
reports, per quarter of the run: batch reward, policy entropy, mean |1 - r|, DIS-dropped or
PPO-clipped share, version lag and the critic's explained variance (SAO); it flags a collapse
when the mean reward of the last quarter falls below half the best mean of any 10 consecutive
updates and the last quarter's mean entropy has moved by more than 50% from that of the first
10 updates (either direction: collapse to a deterministic or to a uniform policy). Windows of
10 updates rather than quarters, so that a run which loses all reward within its first quarter
(GRPO, bound 2, seed 1: reward 0 from update 11 on, entropy up 70%) is flagged too.

    python tools/bench_stability.py --steps 200 --max-staleness 2 4 --write
    python tools/bench_stability.py --steps 200 --max-staleness 2 --seeds 3 --write

Each (staleness bound, algorithm, seed) is one run, under --out/staleness<k>/<algo> (seed 0)
or --out/staleness<k>/<algo>_seed<s>; seed s sets ``seed``, ``tasks.train_seed`` and
``rollout.seed`` to s (the model/data seed, the task stream and the sampling), and every seed
starts from the same SFT policy. `--trajectories-per-batch B` sets
``rollout.trajectories_per_batch`` of the RL runs only (GRPO then trains B / G groups per
update; the SFT start and ``rollout.max_concurrent_episodes`` stay the config's), in folders
<algo>_b<B>[_seed<s>]. `--tag T --rl-override K=V ...` does the same for any RL-only
overrides (folders <algo>_<T>[_seed<s>], rows "GRPO, T, staleness k"). With more than one seed
the section adds a table over seeds per (algorithm, bound): collapses counted, last-quarter
reward and held-out success after RL as mean ± standard error.

Runs are reused from --out (delete a folder to rerun it). `--write` rewrites the section
"Long-run stability under staleness" of docs/BENCHMARKS.md (another with --section, e.g. for
more seeds of a study whose first runs are no longer on this machine).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from statistics import fmean

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


WINDOW = 10  # updates


def collapsed(rewards: list[float], entropies: list[float], window: int = WINDOW) -> bool:
    """The collapse rule of the module docstring, on per-update batch rewards and entropies
    (equal lengths, NaN-free). The window shrinks to a quarter of the run for runs shorter than
    4 windows; False for runs of fewer than 4 updates."""
    n = len(rewards)
    if n < 4 or len(entropies) != n:
        return False
    w = max(1, min(window, n // 4))
    last = slice(3 * n // 4, n)
    best = max(sum(rewards[i : i + w]) / w for i in range(n - w + 1))
    fell = best > 0 and fmean(rewards[last]) < 0.5 * best
    first_h, last_h = fmean(entropies[:w]), fmean(entropies[last])
    moved = first_h > 0 and abs(last_h - first_h) > 0.5 * first_h
    return fell and moved


def _finite(x) -> bool:
    return x is not None and x == x


def figures(run_dir: Path) -> dict:
    recs = [r for r in read_metrics(run_dir / "rl") if "time/rl_elapsed_s" in r]
    summary = json.loads((run_dir / "summary.json").read_text())
    q = {name: quarters(recs, key) for name, key in SERIES.items()}
    both = [r for r in recs if _finite(r.get("reward/mean")) and _finite(r.get("policy/entropy"))]
    return {
        "steps": len(recs),
        "wall_s": recs[-1]["time/rl_elapsed_s"] if recs else float("nan"),
        "quarters": q,
        "collapsed": collapsed(
            [r["reward/mean"] for r in both], [r["policy/entropy"] for r in both]
        ),
        "lag_max": max((r.get("deviation/version_lag_max") or 0.0) for r in recs),
        "success_before": summary.get("before/eval/success_rate", float("nan")),
        "success_after": summary.get("after/eval/success_rate", float("nan")),
        "curves": {
            name: [(r["step"], r.get(key)) for r in recs if r.get(key) is not None]
            for name, key in SERIES.items()
        },
    }


def label(
    algo: str,
    staleness: int,
    seed: int | None = None,
    batch: int | None = None,
    tag: str | None = None,
) -> str:
    """A run's row label: 'SAO, staleness 4' (seed None, the config's batch, no tag), 'SAO,
    staleness 4, seed 1', or with --trajectories-per-batch and --tag 'GRPO, 32 per update,
    skip, staleness 2, seed 1'."""
    return (
        NAMES[algo]
        + (f", {batch} per update" if batch is not None else "")
        + (f", {tag}" if tag else "")
        + f", staleness {staleness}"
        + (f", seed {seed}" if seed is not None else "")
    )


def run_folder(
    out: Path,
    algo: str,
    staleness: int,
    seed: int,
    batch: int | None = None,
    tag: str | None = None,
) -> Path:
    """Where one run lives: out/staleness<k>/<algo> for seed 0 (the layout of single-seed
    studies, so their runs are reused), out/staleness<k>/<algo>_seed<s> otherwise; with
    --trajectories-per-batch B and --tag T the algorithm part is <algo>_b<B>_<T>."""
    name = algo + (f"_b{batch}" if batch is not None else "") + (f"_{tag}" if tag else "")
    return out / f"staleness{staleness}" / (name if seed == 0 else f"{name}_seed{seed}")


def seed_overrides(seed: int) -> list[str]:
    """The job fields one seed sets: model/data seed, training task stream, sampling seed."""
    return [f"seed={seed}", f"tasks.train_seed={seed}", f"rollout.seed={seed}"]


def line_specs(runs: dict[str, dict]) -> list[tuple[str, str | None, str, str]]:
    """(row label, legend entry or None, colour, line style) of each run's curves: colour by
    algorithm and line style by staleness bound, one legend entry per variant (seeds share
    them); when every run is a seed of one variant, a colour and a legend entry per seed."""
    colours = {"sao": "tab:blue", "grpo": "tab:orange", "grpo_dis": "tab:green"}
    styles = ["-", "--", ":", "-."]
    bounds = sorted({f["staleness"] for f in runs.values()})
    variant = {
        k: label(f["algo"], f["staleness"], batch=f.get("batch"), tag=f.get("tag"))
        for k, f in runs.items()
    }
    per_seed = len(runs) > 1 and len(set(variant.values())) == 1
    specs, labelled = [], set()
    for i, (key, f) in enumerate(runs.items()):
        name = key if per_seed else variant[key]
        specs.append(
            (
                key,
                name if name not in labelled else None,
                f"C{i % 10}" if per_seed else colours.get(f["algo"], "tab:gray"),
                styles[bounds.index(f["staleness"]) % len(styles)],
            )
        )
        labelled.add(name)
    return specs


def plot(runs: dict[str, dict], path: Path, title: str) -> None:
    """One panel per series (reward, entropy, abs(1 - r), lag, critic EV; 10-update means),
    lines as `line_specs`. `runs` maps a row label to `figures()` plus 'algo' and
    'staleness'."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 5, figsize=(25, 4))
    for key, legend, colour, style in line_specs(runs):
        f = runs[key]
        for ax, name in zip(
            axes, ("reward", "entropy", "abs(1-r)", "lag", "value EV"), strict=True
        ):
            pts = f["curves"][name]
            if not pts:
                continue
            xs, ys = benchlib.smooth(pts, 10)
            ax.plot(xs, ys, style, color=colour, alpha=0.8, label=legend)
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


def seeds_table(runs: dict[str, dict]) -> str:
    """Per (algorithm, bound) over its seeds: runs flagged collapsed, last-quarter batch reward,
    its best quarter, and held-out success after RL, each mean ± standard error over seeds."""
    cells: dict[tuple, list[dict]] = {}
    for f in runs.values():
        cells.setdefault((f["algo"], f["staleness"], f.get("batch"), f.get("tag")), []).append(f)
    lines = [
        "| algorithm, bound | seeds | collapsed (rule above) | last-quarter reward | "
        "best-quarter reward | held-out success after RL (before: "
        + "/".join(sorted({_f(f["success_before"]) for f in runs.values()}))
        + ") |",
        "|---|---:|---:|---:|---:|---:|",
    ]

    def ms(xs: list[float]) -> str:
        m, se, n = benchlib.mean_se(xs)
        return "-" if n == 0 else f"{m:.3f}" + (f" ± {se:.3f}" if n > 1 else "")

    for (algo, k, batch, tag), fs in cells.items():
        lines.append(
            f"| {label(algo, k, batch=batch, tag=tag)} | {len(fs)} | "
            f"{sum(f['collapsed'] for f in fs)} / {len(fs)} | "
            f"{ms([f['quarters']['reward'][-1] for f in fs])} | "
            f"{ms([max(f['quarters']['reward']) for f in fs])} | "
            f"{ms([f['success_after'] for f in fs])} |"
        )
    return "\n".join(lines)


def command_line(args: argparse.Namespace) -> str:
    """The command that regenerates a section, as the section shows it (non-default flags)."""
    return (
        f"python tools/bench_stability.py --config {args.config} --steps {args.steps} "
        f"--max-staleness {' '.join(str(k) for k in args.max_staleness)} "
        f"--algorithms {' '.join(args.algorithms)} "
        + (f"--seeds {args.seeds} " if args.seeds != 1 else "")
        + (f"--first-seed {args.first_seed} " if args.first_seed else "")
        + (
            f"--trajectories-per-batch {args.trajectories_per_batch} "
            if args.trajectories_per_batch
            else ""
        )
        + (f"--tag {args.tag} " if args.tag else "")
        + "".join(f"--rl-override {o} " for o in args.rl_override)
        + f"--out {args.out} --write "
        + (f'--section "{args.section}" ' if args.section != SECTION else "")
        + " ".join(args.override)
    ).rstrip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/configs/quickstart.yaml")
    ap.add_argument("--steps", type=int, default=150, help="policy updates per run")
    ap.add_argument(
        "--max-staleness", type=int, nargs="+", default=[4], help="one run pair per bound"
    )
    ap.add_argument("--algorithms", nargs="+", default=["sao", "grpo"], choices=sorted(NAMES))
    ap.add_argument("--seeds", type=int, default=1, help="runs per (algorithm, bound)")
    ap.add_argument("--first-seed", type=int, default=0, help="seeds first_seed .. +seeds-1")
    ap.add_argument("--group-size", type=int, default=8, help="GRPO G")
    ap.add_argument(
        "--trajectories-per-batch",
        type=int,
        default=None,
        help="rollout.trajectories_per_batch of the RL runs only (the SFT start is shared); "
        "for GRPO, groups per update = this / G. Default: the config's",
    )
    ap.add_argument(
        "--tag",
        default=None,
        help="a variant's name: its runs live in <algo>_<tag>[_seed<s>] and its rows say it",
    )
    ap.add_argument(
        "--rl-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="section.field=value for the RL runs only (the SFT start stays shared); "
        "repeatable; needs --tag",
    )
    ap.add_argument("--num-eval-tasks", type=int, default=64)
    ap.add_argument("--out", default="runs/bench_stability")
    ap.add_argument("--write", action="store_true", help="update docs/BENCHMARKS.md")
    ap.add_argument("--section", default=SECTION, help="docs/BENCHMARKS.md section to write")
    ap.add_argument("override", nargs="*", help="extra section.field=value for every job")
    args = ap.parse_args(argv)
    if args.seeds < 1 or args.first_seed < 0:
        ap.error("--seeds must be >= 1 and --first-seed >= 0")
    if args.rl_override and not args.tag:
        ap.error(
            "--rl-override needs --tag NAME: the variant's runs need their own folders (an "
            "untagged folder holds the runs without the override)"
        )
    if args.tag and not args.tag.replace("-", "").replace("_", "").isalnum():
        ap.error(f"--tag {args.tag!r}: use letters, digits, '-' and '_' (it names folders)")
    batch = args.trajectories_per_batch
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    seeded = seeds != [0]  # a lone seed 0 keeps the single-seed row labels

    from sao_megatron.configs import load_config
    from sao_megatron.trainer.job import JobConfig

    base = load_config(JobConfig, str(REPO / args.config), args.override)
    has_vp = base.value_pretrain.steps > 0
    if batch is not None:
        # trajectories each algorithm samples per task, asked of its run's resolved config
        groups = {
            a: benchlib.job_algorithm(
                args.config, [*args.override, *algo_overrides(a, args.group_size, has_vp, base)]
            ).group_size
            for a in args.algorithms
        }
        if batch < 1 or any(batch % g for g in groups.values()):
            sizes = ", ".join(f"{NAMES[a]} {g}" for a, g in groups.items())
            ap.error(
                f"--trajectories-per-batch {batch}: must be >= 1 and a multiple of every "
                f"algorithm's group size (whole groups per update; {sizes})"
            )
    out = (REPO / args.out).resolve()
    start_info = benchlib.machine_info()
    sft = shared_sft(args.config, args.override, out / "sft")
    runs = {}
    for k in args.max_staleness:
        for seed in seeds:
            for algo in args.algorithms:
                run_dir = run_folder(out, algo, k, seed, batch, args.tag)
                seed_from_sft(sft, run_dir)
                ov = [
                    *args.override,
                    *seed_overrides(seed),
                    f"rl.steps={args.steps}",
                    f"rollout.max_staleness={k}",
                    "rollout.deviation_target=null",
                    f"tasks.num_eval_tasks={args.num_eval_tasks}",
                    "checkpoint.save_interval=0",
                    "logging.console=false",
                    *([f"rollout.trajectories_per_batch={batch}"] if batch else []),
                    *args.rl_override,
                ]
                run_job(
                    args.config, ov + algo_overrides(algo, args.group_size, has_vp, base), run_dir
                )
                runs[label(algo, k, seed if seeded else None, batch, args.tag)] = {
                    **figures(run_dir),
                    "algo": algo,
                    "staleness": k,
                    "seed": seed,
                    "batch": batch,
                    "tag": args.tag,
                }
    info = benchlib.measured_machine_info(out, start_info, "stability")
    bounds = [str(k) for k in args.max_staleness]
    body_table = table(runs)
    if len(seeds) > 1:
        body_table += "\n\nOver seeds (mean ± standard error):\n\n" + seeds_table(runs)
    print(body_table)
    title = (
        f"{args.config}, max_staleness {' / '.join(bounds)}, "
        f"{args.steps} updates, "
        + (f"seeds {seeds[0]}-{seeds[-1]} " if len(seeds) > 1 else f"seed {seeds[0]} ")
        + f"(GRPO G={args.group_size}"
        + (f", {batch} trajectories per update)" if batch else ")")
    )
    img_name = (
        "bench_stability.png"
        if args.section == SECTION
        else f"bench_{benchlib.section_slug(args.section)}.png"
    )
    img = REPO / "docs" / "img" / img_name
    plot(runs, out / "stability.png", title)
    (out / "figures.json").write_text(json.dumps(runs, indent=1))
    if args.write:
        img.write_bytes((out / "stability.png").read_bytes())
        cmd = command_line(args)
        body = (
            f"Command:\n\n    {cmd}\n\n{benchlib.machine_line(info)}\n\n"
            f"Config `{args.config}`, one run per algorithm, staleness bound and seed "
            f"(seeds {', '.join(map(str, seeds))}) from the same SFT start, "
            + (
                f"{batch} trajectories per policy update (GRPO: {batch // args.group_size} groups "
                f"of {args.group_size}), "
                if batch
                else ""
            )
            + (
                f"variant '{args.tag}' (RL runs only: {', '.join(args.rl_override)}), "
                if args.tag
                else ""
            )
            + "`rollout.max_staleness` = "
            f"{' and '.join(bounds)} (fixed bound, deviation controller "
            f"off), {args.steps} policy updates; figures are means over each quarter of the "
            "run. 'Dropped / clipped': SAO's DIS-band drops, GRPO's share outside the band "
            "(the same metric). Collapse rule: last-quarter reward below half the best mean "
            f"of {WINDOW} consecutive updates, and last-quarter entropy moved > 50% from that of "
            f"the first {WINDOW} updates.\n\n"
            f"{body_table}\n\n![stability](img/{img.name})\n\n{benchlib.READING}\n"
        )
        benchlib.write_section(args.section, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
