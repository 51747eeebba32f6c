"""Held-out success by horizon: Tower-of-Hanoi tasks H optimal moves from the goal, H = 50, 200,
500, for policies trained with SAO and with GRPO under the same budget (and their SFT start).

Each policy is a Hugging Face folder written by `sao-train` (`<run>/hf_policy_final` after RL,
`<run>/hf_policy` = the weights RL started from). One vLLM engine serves it; `--num-tasks`
held-out episodes per horizon run through the same episode loop and formatter as training
(the job config's `episode` and `rollout` sections: window context, sampling temperature).
Held-out seeds come from the job's eval stream, identical for every policy. An illegal or
malformed move ends an episode; the step budget is H (`max_steps_factor` 1), so success needs
H optimal moves in a row. The disk count of a horizon-H task goes up to the largest one the
training tasks used (extra_disks = train max disks - min disks(H)), so the observations at every
horizon use disk numbers the policy has seen.

Reported per policy and horizon: success rate (with its binomial standard error), mean progress
(fraction of the initial optimal distance removed when the episode ended, failures included)
and mean number of moves.

    python tools/eval_horizon.py --bench-dir runs/bench_long_horizon \\
        --config examples/configs/bench_long_horizon.yaml --horizons 50 200 500 --write

`--policy NAME=HF_DIR` (repeatable) evaluates other folders.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import time
from pathlib import Path

import benchlib
from benchlib import REPO


def eval_env_spec(job, horizon: int):
    """The held-out Hanoi task at `horizon`, built from the job's first Hanoi training task."""
    from sao_megatron.envs.base import EnvSpec
    from sao_megatron.envs.hanoi import HanoiConfig, min_disks

    train = next((e for e in job.tasks.train if e.name == "hanoi"), None)
    if train is None:
        raise ValueError("tasks.train has no hanoi task: eval_horizon evaluates Tower of Hanoi")
    base = HanoiConfig(**train.options)
    max_disks = min_disks(base.horizon) + base.extra_disks
    opts = dataclasses.asdict(base) | {
        "horizon": horizon,
        "extra_disks": max(0, max_disks - min_disks(horizon)),
        "max_steps_factor": 1.0,
        "reward_mode": "progress",
        "invalid_action_ends_episode": True,
        "horizon_distribution": "fixed",
        "max_horizon": None,
        # held-out: the other side of a train split (puzzle classes disjoint from training)
        "split": "eval" if base.split == "train" else base.split,
    }
    return EnvSpec(name="hanoi", options=opts)


def evaluate_policy(
    hf_dir: Path,
    job,
    horizons: list[int],
    num_tasks: int,
    work: Path,
    concurrency: int = 32,
    temperatures: list[float] | None = None,
) -> dict:
    """Serve `hf_dir` on one local vLLM engine and evaluate the Hanoi task at each horizon.

    With `temperatures` None: {horizon: {"success_rate", "success_se", "mean_progress",
    "mean_turns", "num_tasks", "num_errors", "wall_s"}} at the job's sampling temperature;
    otherwise {temperature: {horizon: {...}}} for each temperature (> 0: the engine samples).
    """
    if temperatures is not None:
        return _evaluate_many(hf_dir, job, horizons, num_tasks, work, concurrency, temperatures)
    return _evaluate_many(
        hf_dir, job, horizons, num_tasks, work, concurrency, [job.rollout.temperature]
    )[job.rollout.temperature]


def _evaluate_many(hf_dir, job, horizons, num_tasks, work, concurrency, temperatures):
    from sao_megatron.data.episode import EpisodeFormatter
    from sao_megatron.data.tokenizer import load_tokenizer
    from sao_megatron.rollout.engine import EngineProcess
    from sao_megatron.trainer.evaluate import evaluate

    tok = load_tokenizer(str(hf_dir / "sao_tokenizer"))
    fmt = EpisodeFormatter(tok, job.episode)
    rcfg = dataclasses.replace(job.rollout, num_engines=1)
    engine = EngineProcess(rcfg, 0, hf_dir, work)
    engine.start()
    out: dict[float, dict[int, dict[str, float]]] = {}
    try:
        engine.wait_ready()
        for temp in temperatures:
            cfg_t = dataclasses.replace(rcfg, temperature=float(temp))
            out[temp] = {}
            for h in horizons:
                t0 = time.perf_counter()
                m = evaluate(
                    [engine.url],
                    [eval_env_spec(job, h)],
                    num_tasks=num_tasks,
                    base_seed=job.tasks.eval_seed,
                    formatter=fmt,
                    rollout=cfg_t,
                    max_concurrency=concurrency,
                )
                p = m["eval/hanoi/success_rate"]
                out[temp][h] = {
                    "success_rate": p,
                    "success_se": math.sqrt(p * (1 - p) / num_tasks),
                    "mean_progress": m.get("eval/hanoi/mean_progress", float("nan")),
                    "progress_se": m.get("eval/hanoi/progress_se", float("nan")),
                    "mean_turns": m["eval/hanoi/mean_turns"],
                    "illegal_move_rate": m.get("eval/hanoi/illegal_move_rate", float("nan")),
                    "non_optimal_move_rate": m.get(
                        "eval/hanoi/non_optimal_move_rate", float("nan")
                    ),
                    "num_tasks": float(num_tasks),
                    "num_errors": m["eval/num_errors"],
                    "wall_s": time.perf_counter() - t0,
                }
                print(f"[eval]   T={temp:g} H={h}: {out[temp][h]}", flush=True)
    finally:
        engine.stop()
    return out


def render(results: dict[str, dict[int, dict[str, float]]], horizons: list[int]) -> str:
    """One row per policy; per horizon: success ± SE, the per-move error rate (illegal or
    malformed / legal but not optimal, pooled over moves) and net optimal moves made (progress
    x H: optimal distance removed when the episode ended)."""
    head = "| policy | " + " | ".join(
        f"H={h} success | H={h} errors / move (illegal, non-optimal) | H={h} net moves"
        for h in horizons
    )
    lines = [head + " |", "|---" + "|---:" * (3 * len(horizons)) + "|"]
    for name, res in results.items():
        cells = []
        for h in horizons:
            r = res[h]
            cells.append(f"{r['success_rate']:.3f} ± {r['success_se']:.3f}")
            ill, non = (
                r.get("illegal_move_rate", math.nan),
                r.get("non_optimal_move_rate", math.nan),
            )
            cells.append(f"{ill:.4f}, {non:.4f}")
            cells.append(f"{r['mean_progress'] * h:.1f} ± {r.get('progress_se', 0.0) * h:.1f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def seed_groups(results: dict[str, dict]) -> dict[str, list[str]]:
    """Policies named "<algorithm> r<seed>" grouped by algorithm (in first-seen order); other
    names are groups of one."""
    groups: dict[str, list[str]] = {}
    for name in results:
        m = re.fullmatch(r"(.+) r(\d+)", name)
        groups.setdefault(m.group(1) if m else name, []).append(name)
    return groups


def render_over_seeds(results: dict[str, dict[int, dict[str, float]]], horizons) -> str:
    """One row per algorithm: per horizon the success rate and the per-move error rates
    (illegal, non-optimal), each the mean ± standard error over the algorithm's seeds (one
    evaluation per seed's final policy, the same held-out tasks for all)."""
    head = "| policy | seeds | " + " | ".join(
        f"H={h} success | H={h} illegal / move | H={h} non-optimal / move" for h in horizons
    )
    lines = [head + " |", "|---|---:" + "|---:" * (3 * len(horizons)) + "|"]
    for group, names in seed_groups(results).items():
        cells = []
        for h in horizons:
            for key, fmt in (
                ("success_rate", "{:.3f}"),
                ("illegal_move_rate", "{:.4f}"),
                ("non_optimal_move_rate", "{:.4f}"),
            ):
                m, se, n = benchlib.mean_se([results[x][h].get(key, math.nan) for x in names])
                cell = fmt.format(m)
                cells.append(cell + (f" ± {fmt.format(se)}" if n > 1 else ""))
        lines.append(f"| {group} | {len(names)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bench_policies(bench: Path) -> dict[str, str]:
    """The policies of a bench_sao_vs_grpo.py output folder: the RL start (the first run's
    hf_policy) and every run's final policy, named "<algorithm> r<seed>"."""
    from bench_sao_vs_grpo import NAMES as names

    runs = []
    for d in bench.iterdir() if bench.is_dir() else []:
        m = re.fullmatch(r"(\w+)_r(\d+)", d.name)  # <algorithm>_r<seed>
        if m and m.group(1) in names and (d / "hf_policy_final" / "config.json").exists():
            runs.append((list(names).index(m.group(1)), int(m.group(2)), m.group(1), d))
    runs.sort()
    if not runs:
        return {}
    out = {"SFT (RL start)": str(runs[0][3] / "hf_policy")}
    for _, r, algo, d in runs:
        out[f"{names[algo]} r{r}"] = str(d / "hf_policy_final")
    return out


def _cache_file(out_dir: Path, name: str) -> Path:
    return out_dir / "policies" / (re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_") + ".json")


def load_cached(out_dir: Path, name: str, key: dict) -> dict | None:
    """A policy's saved {temperature: {horizon: figures}} when it was evaluated with the same
    `key` (folder, config, overrides, horizons, task count, temperatures); else None."""
    path = _cache_file(out_dir, name)
    if not path.exists():
        return None
    saved = json.loads(path.read_text())
    if saved["key"] != key:
        return None
    return {float(t): {int(h): r for h, r in res.items()} for t, res in saved["results"].items()}


def save_cached(out_dir: Path, name: str, key: dict, by_t: dict) -> None:
    """Save one policy's result as soon as it is measured (a stopped run keeps it)."""
    path = _cache_file(out_dir, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": key, "results": by_t}, indent=1))


def plot(results, horizons, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, res in results.items():
        axes[0].errorbar(
            horizons,
            [res[h]["success_rate"] for h in horizons],
            yerr=[res[h]["success_se"] for h in horizons],
            marker="o",
            capsize=3,
            label=name,
        )
        axes[1].errorbar(
            horizons,
            [res[h]["mean_progress"] * h for h in horizons],
            yerr=[res[h].get("progress_se", 0.0) * h for h in horizons],
            marker="o",
            capsize=3,
            label=name,
        )
    axes[0].set(xlabel="horizon H (optimal moves)", ylabel="held-out success rate", xscale="log")
    axes[1].set(
        xlabel="horizon H (optimal moves)",
        ylabel="net optimal moves made (progress x H)",
        xscale="log",
    )
    for ax in axes:
        ax.minorticks_off()
        ax.set_xticks(horizons, [str(h) for h in horizons])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/configs/bench_long_horizon.yaml")
    ap.add_argument(
        "--bench-dir",
        default="runs/bench_long_horizon",
        help="where bench_sao_vs_grpo.py put its runs (<algo>_r<seed>/): every run's final "
        "policy and the RL start are evaluated",
    )
    ap.add_argument(
        "--policy",
        action="append",
        default=[],
        metavar="NAME=HF_DIR",
        help="evaluate these instead of the bench-dir's SFT/SAO/GRPO policies",
    )
    ap.add_argument("--horizons", type=int, nargs="+", default=[50, 200, 500])
    ap.add_argument("--num-tasks", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument(
        "--temperatures",
        type=float,
        nargs="+",
        help="sampling temperatures to evaluate at (default: the config's rollout.temperature)",
    )
    ap.add_argument("--write", action="store_true", help="update docs/BENCHMARKS.md")
    ap.add_argument("--section", default="Success by horizon", help="docs/BENCHMARKS.md section")
    ap.add_argument(
        "--fresh",
        action="store_true",
        help="evaluate every policy again (default: reuse a policy's saved result in "
        "<bench-dir>/eval_horizon/policies/ when its folder, horizons, task count, temperatures "
        "and overrides are the same)",
    )
    ap.add_argument(
        "--replot",
        action="store_true",
        help="redraw table and plot from <bench-dir>/eval_horizon/results.json (no evaluation)",
    )
    ap.add_argument("override", nargs="*", help="section.field=value overrides of the config")
    args = ap.parse_args(argv)

    from sao_megatron.configs import load_config
    from sao_megatron.trainer.job import JobConfig

    job = load_config(JobConfig, str(REPO / args.config), args.override)
    bench = (REPO / args.bench_dir).resolve()
    policies = dict(p.split("=", 1) for p in args.policy) or bench_policies(bench)
    if not policies and not args.replot:
        ap.error(f"--bench-dir {args.bench_dir}: no finished runs (<algo>_r<seed>/hf_policy_final)")
    out_dir = bench / "eval_horizon"
    results: dict[str, dict[int, dict[str, float]]] = {}
    if args.replot:
        saved = json.loads((out_dir / "results.json").read_text())
        results = {n: {int(h): r for h, r in res.items()} for n, res in saved.items()}
        policies = {}
        args.num_tasks = int(next(iter(next(iter(results.values())).values()))["num_tasks"])
    for i, (name, path) in enumerate(policies.items()):
        hf = Path(path)
        if not (hf / "config.json").exists():
            ap.error(f"--policy {name}={path}: no Hugging Face folder (config.json) there")
        temps = args.temperatures or [job.rollout.temperature]
        key = {
            "hf_dir": str(hf.resolve()),
            "config": args.config,
            "overrides": args.override,
            "horizons": args.horizons,
            "num_tasks": args.num_tasks,
            "temperatures": temps,
        }
        by_t = None if args.fresh else load_cached(out_dir, name, key)
        if by_t is None:
            print(f"[eval] {name}: {hf}", flush=True)
            by_t = evaluate_policy(
                hf,
                job,
                args.horizons,
                args.num_tasks,
                out_dir / f"engine{i}",
                args.concurrency,
                temps,
            )
            save_cached(out_dir, name, key, by_t)
        else:
            print(
                f"[eval] {name}: reusing its saved result (--fresh to evaluate again)", flush=True
            )
        for t, res in by_t.items():
            results[name if len(temps) == 1 else f"{name}, T={t:g}"] = res
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    table = render(results, args.horizons)
    if any(len(v) > 1 for v in seed_groups(results).values()):
        table = (
            "Mean ± standard error over seeds:\n\n"
            + render_over_seeds(results, args.horizons)
            + "\n\nEvery policy (± binomial standard error over tasks):\n\n"
            + table
        )
    print(table)
    png = out_dir / "success_by_horizon.png"
    plot(results, args.horizons, png, f"Held-out Hanoi by horizon ({args.num_tasks} tasks each)")
    if args.write:
        info = benchlib.machine_info()
        default = args.section == ap.get_default("section")
        name = "eval_horizon" if default else f"eval_{benchlib.section_slug(args.section)}"
        img = REPO / "docs" / "img" / f"{name}.png"
        img.write_bytes(png.read_bytes())
        temps = " --temperatures " + " ".join(f"{t:g}" for t in args.temperatures or [])
        cmd = (
            f"python tools/eval_horizon.py --bench-dir {args.bench_dir} --config {args.config} "
            f"--horizons {' '.join(map(str, args.horizons))} --num-tasks {args.num_tasks}"
            f"{temps if args.temperatures else ''}"
            + "".join(f' --policy "{p}"' for p in args.policy)
            + (f' --section "{args.section}"' if args.section != ap.get_default("section") else "")
            + " --write"
            + "".join(f" {o}" for o in args.override)
        )
        wall = sum(r["wall_s"] for res in results.values() for r in res.values())
        body = (
            f"Command:\n\n    {cmd}\n\n{benchlib.machine_line(info)} Evaluation wall time "
            f"{wall:.0f} s.\n\nSuccess rate ± binomial standard error, net optimal moves made "
            "(initial optimal distance minus the distance when the episode ended; a move away "
            "from the goal counts -1) and moves played, means over "
            f"{args.num_tasks} held-out tasks per horizon (the same tasks for every policy).\n\n"
            f"{table}\n\n![success by horizon](img/{img.name})\n\n<!-- reading -->\n"
        )
        benchlib.write_section(args.section, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
