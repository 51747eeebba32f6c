"""The deviation controller on a synthetic rollout (no engines, no trainer): a plot and a table.

A *model* of an asynchronous run, not a measurement. The plant is the rollout's FIFO with
AReaL's capacity rule: per train step v the engines start up to 2 batches (they sample twice as
fast as the trainer trains) while batches started <= v + eta + 1 (eta the admission bound), and
the trainer trains the oldest finished batch, whose tokens lag v minus the version they were
sampled at. A change of eta therefore reaches the trained batches only after the batches already
queued have drained (about eta steps: the delay the controller must live with). Per step the mean
|1 - r| is ``d0 + s(t) * lag`` (a lag-0 floor d0 plus a per-version drift s: 0.01, raised to
0.04 between steps 30 and 59 by a perturbation such as a learning-rate spike). Wall time per
step: T when the trainer has a queued batch (eta >= 1), T + T/2 when it waits for sampling
(eta = 0, synchronous); the engines are busy (T/2 per batch started) / wall. Four policies: the
controller (`rollout.deviation_target=0.05`, ceilings eta 6, n_max 16), the same with the
per-step law of its first version (``wait_round_trip=False``), and the fixed bounds 6 and 0.

    .venv/bin/python tools/sim_deviation_controller.py --out docs/img/deviation_controller_sim.png
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sao_megatron.algorithm.deviation_controller import (  # noqa: E402
    DeviationController,
    DeviationControllerConfig,
)

D0, S_LOW, S_HIGH, RATE, TARGET, STEPS = 0.004, 0.01, 0.04, 2, 0.05, 90
POLICIES = {
    "controller": "controller",
    "controller_per_step": "controller, per-step law (first version)",
    "fixed6": "fixed eta = 6",
    "fixed0": "fixed eta = 0",
}


def drift(t: int) -> float:
    return S_HIGH if 30 <= t < 60 else S_LOW


def simulate(policy: str) -> list[tuple[float, float, int, int, float]]:
    """Per step: (mean |1 - r|, busy fraction, eta, n_max, wall time in units of T)."""
    ctl = DeviationController(
        DeviationControllerConfig(
            target=TARGET,
            max_staleness=6,
            max_inflight=16,
            wait_round_trip=policy != "controller_per_step",
        )
    )
    eta, n = (0, 16) if policy == "fixed0" else (6, 16)
    queue: collections.deque[int] = collections.deque()
    started, out = 0, []
    for v in range(STEPS):
        admitted = 0
        while admitted < RATE and started < v + eta + 1:
            queue.append(v)
            started += 1
            admitted += 1
        waited = len(queue) == admitted  # the batch trained now was sampled during this step
        lag = v - queue.popleft()
        wall = 1.0 + (0.5 if waited else 0.0)
        d, busy = D0 + drift(v) * lag, min(1.0, admitted * 0.5 / wall)
        out.append((d, busy, eta, n, wall))
        if policy.startswith("controller"):
            ctl.update(deviation=d, deviation_lag0=D0, busy_fraction=busy)
            eta, n = ctl.max_staleness, ctl.max_inflight
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "docs" / "img" / "deviation_controller_sim.png"))
    args = ap.parse_args()
    runs = {p: simulate(p) for p in POLICIES}
    print(
        "| policy | steps over target 0.05 | mean busy fraction | mean abs(1 - r) | "
        "wall time (units of a train step) | min eta |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, tr in runs.items():
        over = sum(d > TARGET for d, *_ in tr)
        print(
            f"| {POLICIES[name]} | {over}/{STEPS} | {sum(b for _, b, *_ in tr) / STEPS:.2f} | "
            f"{sum(d for d, *_ in tr) / STEPS:.4f} | {sum(w for *_, w in tr):.0f} | "
            f"{min(e for _, _, e, _, _ in tr)} |"
        )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(3, 1, figsize=(7, 7.5), sharex=True)
    for name, tr in runs.items():
        ax[0].plot([d for d, *_ in tr], label=POLICIES[name])
        ax[1].plot([b for _, b, *_ in tr], label=POLICIES[name])
        ax[2].step(range(STEPS), [e for _, _, e, _, _ in tr], where="post", label=POLICIES[name])
    ax[0].axhline(TARGET, color="k", ls="--", lw=0.8)
    ax[0].set_ylabel("mean |1 - r|")
    ax[1].set_ylabel("engine busy fraction")
    ax[2].set_ylabel("admission eta")
    ax[2].set_xlabel("train step (perturbation: steps 30-59)")
    ax[0].legend(fontsize=8)
    ax[0].set_title(
        "Deviation controller on a synthetic FIFO rollout model (not a measurement)", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(args.out, dpi=90)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
