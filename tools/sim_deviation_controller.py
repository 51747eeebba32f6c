"""The deviation controller on a synthetic rollout (no engines, no trainer): a plot and a table.

A *model* of an asynchronous run, not a measurement: per train step the mean |1 - r| of the
trained tokens is ``d0 + s(t) * eta`` (a lag-0 floor d0 plus a per-version drift s(t) times the
admission staleness bound eta: each version of lag moves the ratio by s), and the engines are
busy ``min(1, n_max / n_sat, (eta + 1) / eta_sat)`` of the time (they idle when too few
episodes are in flight or when admission blocks on a tight bound). A perturbation (e.g. a
learning-rate spike or longer episodes) raises s from 0.01 to 0.04 between steps 30 and 60.
Three policies: the controller (`rollout.deviation_target=0.05`, ceilings eta 6, n_max 16) and
the fixed bounds eta = 6 and eta = 0.

    .venv/bin/python tools/sim_deviation_controller.py --out docs/img/deviation_controller_sim.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sao_megatron.algorithm.deviation_controller import (  # noqa: E402
    DeviationController,
    DeviationControllerConfig,
)

D0, S_LOW, S_HIGH, N_SAT, ETA_SAT, TARGET, STEPS = 0.004, 0.01, 0.04, 8, 2, 0.05, 90


def drift(t: int) -> float:
    return S_HIGH if 30 <= t < 60 else S_LOW


def busy(eta: int, n_max: int) -> float:
    return min(1.0, n_max / N_SAT, (eta + 1) / (ETA_SAT + 1))


def simulate(policy: str) -> list[tuple[float, float, int, int]]:
    ctl = DeviationController(
        DeviationControllerConfig(target=TARGET, max_staleness=6, max_inflight=16)
    )
    eta, n = (6, 16) if policy != "fixed0" else (0, 16)
    out = []
    for t in range(STEPS):
        d, b = D0 + drift(t) * eta, busy(eta, n)
        out.append((d, b, eta, n))
        if policy == "controller":
            ctl.update(deviation=d, deviation_lag0=D0, busy_fraction=b)
            eta, n = ctl.max_staleness, ctl.max_inflight
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "docs" / "img" / "deviation_controller_sim.png"))
    args = ap.parse_args()
    runs = {p: simulate(p) for p in ("controller", "fixed6", "fixed0")}
    print("| policy | steps over target | mean busy fraction | mean abs(1 - r) |")
    print("|---|---:|---:|---:|")
    for name, tr in runs.items():
        over = sum(d > TARGET for d, *_ in tr)
        print(
            f"| {name} | {over}/{STEPS} | {sum(b for _, b, *_ in tr) / STEPS:.2f} | "
            f"{sum(d for d, *_ in tr) / STEPS:.4f} |"
        )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(3, 1, figsize=(7, 7), sharex=True)
    for name, tr in runs.items():
        ax[0].plot([d for d, *_ in tr], label=name)
        ax[1].plot([b for _, b, *_ in tr], label=name)
        ax[2].plot([e for *_, e, _ in tr], label=name)
    ax[0].axhline(TARGET, color="k", ls="--", lw=0.8)
    ax[0].set_ylabel("mean |1 - r|")
    ax[1].set_ylabel("engine busy fraction")
    ax[2].set_ylabel("admission eta")
    ax[2].set_xlabel("train step (perturbation: steps 30-59)")
    ax[0].legend()
    ax[0].set_title("Deviation controller on a synthetic rollout model (not a measurement)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=90)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
