"""Throughput, trainer-bound vs rollout-bound: where does one rollout per task (SAO) beat GRPO?

Issue 14.7. When the trainer is the bottleneck GRPO trains more trajectories per second, because
its step is cheaper (no critic: SAO / GRPO step time 2.45 on the quickstart model, docs/
BENCHMARKS.md "Training MFU"). When the rollout is the bottleneck — environment steps that are
tool calls or sandbox commands with a heavy-tailed latency, and episodes of heavy-tailed length —
a GRPO group of G episodes holds its G rollout slots until its slowest member ends, while SAO
frees each slot as soon as its own episode ends. This benchmark measures both regimes.

What runs: the real `RolloutManager` (admission with the AReaL capacity rule, staleness buffer,
GRPO groups, router, weight-sync protocol) against the in-process fake engines of
``tests/rollout/fakes.py`` (a coroutine that samples 1-6 tokens per action at
``--token-latency-s`` per token; no vLLM, so an engine never saturates and the rollout's cost is
the environment's), and a trainer thread that sleeps its step time after every batch, then
publishes the next weight version. Environments: `LengthEnv` (below; an episode of N actions, N
drawn per episode from a heavy-tailed distribution), wrapped in the registered latency wrapper
(`sao_megatron.envs.latency.LatencyEnv`: a seeded heavy-tailed delay before each step, awaited
with ``asyncio.sleep`` through the runner's ``astep`` path, so it blocks nothing). Each episode
draws its own length and delays (GRPO members included: seeds (task seed, member index)),
as sampled rollouts of one task differ in turns and tool-call times.

Regimes (same task stream, batch and concurrency for both algorithms):

* ``trainer_bound``: no step latency, every episode ``--short-length`` actions;
* ``rollout_bound``: lognormal step latency (median ``--latency-median-s``, sigma
  ``--latency-shape``, capped at ``--latency-max-s``) and lognormal episode length (median
  ``--length-median`` actions, sigma ``--length-shape``, capped at ``--length-max``);
* ``rollout_bound_timeouts``: the same with ``rollout.step_timeout_s = --step-timeout-s``: a step
  slower than that ends its episode (status ``timeout``, not requeued by default), and
  `RolloutManager` drops the episode's whole group.

Algorithms: ``sao`` (group size 1, trainer step ``--sao-step-s``) and ``grpo`` (group size
``--group-size``, step ``--grpo-step-s``), both ``--batch`` trajectories per batch. The defaults,
0.49 s and 0.2 s, are the measured 16-row steps (1.9 s and 0.77 s; ratio 2.45) scaled by 1/4 so
a cell takes seconds; the latencies are scaled with them.

Per cell, over ``--budget-s`` seconds after ``--warmup-steps`` steps: trained trajectories/s,
distinct tasks/s (distinct task ids among them), the trainer's idle fraction (time blocked in
``get_batch`` / wall), tokens the engines generated, the tokens trained, dropped (groups that
failed or went stale: `RolloutManager` counters ``discarded_tokens`` and
``stale_dropped_tokens``) and, among the trained, the stale tokens the trainer masks out of the
policy loss (``train_version - policy_version > max_staleness``,
`sao_megatron.rollout.staleness`), the mean version lag of a trained trajectory's oldest token,
and the mean wall time of a trained episode and of its group (the slowest member: how long a
GRPO member holds its rollout slot). Each cell is repeated ``--repeats`` times (seeds
``--seed + repeat``), cells interleaved so load drifts hit both algorithms; the table gives
mean ± standard error.

Usage::

    python tools/bench_regimes.py --repeats 3 --budget-s 20 --write   # ~8 min
    python tools/bench_regimes.py --from-json runs/bench_regimes.json --write   # re-render
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

import benchlib  # noqa: E402
import torch  # noqa: E402

from sao_megatron.algorithm import registry  # noqa: E402
from sao_megatron.algorithm.base import Algorithm  # noqa: E402
from sao_megatron.algorithm.config import AlgorithmConfig, GRPOConfig  # noqa: E402
from sao_megatron.envs.base import StepResult  # noqa: E402
from sao_megatron.envs.heavy_tail import sample_heavy_tailed  # noqa: E402
from sao_megatron.envs.latency import LatencyConfig, LatencyEnv  # noqa: E402
from sao_megatron.rollout.config import RolloutConfig  # noqa: E402
from sao_megatron.rollout.manager import RolloutManager, Task  # noqa: E402
from tests.rollout.fakes import FakeEngine, FakeEngineClient, make_formatter  # noqa: E402

SECTION = "Throughput: trainer-bound vs rollout-bound"
REGIMES = ("trainer_bound", "rollout_bound", "rollout_bound_timeouts")


# ---------------------------------------------------------------------------- environment
@dataclass
class Regime:
    """Environment settings of one regime."""

    name: str
    latency: str = "none"  # sao_megatron.envs.heavy_tail distribution of the step delay
    latency_median_s: float = 0.0
    latency_shape: float = 1.0
    latency_max_s: float = 0.0
    length: str = "constant"  # distribution of the episode length (actions)
    length_median: float = 2.0
    length_shape: float = 1.0
    length_max: int = 2
    step_timeout_s: float | None = None


def regimes(args: argparse.Namespace) -> dict[str, Regime]:
    heavy = dict(
        latency="lognormal",
        latency_median_s=args.latency_median_s,
        latency_shape=args.latency_shape,
        latency_max_s=args.latency_max_s,
        length="lognormal",
        length_median=args.length_median,
        length_shape=args.length_shape,
        length_max=args.length_max,
    )
    return {
        "trainer_bound": Regime(
            "trainer_bound", length_median=args.short_length, length_max=args.short_length
        ),
        "rollout_bound": Regime("rollout_bound", **heavy),
        "rollout_bound_timeouts": Regime(
            "rollout_bound_timeouts", step_timeout_s=args.step_timeout_s, **heavy
        ),
    }


class LengthEnv:
    """An episode of N actions, N drawn at reset from `regime`'s length distribution with the
    episode's own seed (task seed, member); reward 1 on the last action. The last step's info
    carries the episode's wall time since reset (``episode_wall_s``)."""

    name = "length"

    def __init__(self, regime: Regime, member_seed: str) -> None:
        self.regime = regime
        self.member_seed = member_seed
        self.max_steps = regime.length_max

    def reset(self, seed: int) -> str:
        r = self.regime
        rng = random.Random(f"length:{self.member_seed}:{seed}")
        x = sample_heavy_tailed(rng, r.length, r.length_median, r.length_shape, r.length_max)
        self.steps = max(1, min(r.length_max, round(x)))
        self.t = 0
        self.t0 = time.monotonic()
        return f"count {self.steps} steps"

    def step(self, action: str) -> StepResult:
        self.t += 1
        done = self.t >= self.steps
        info = {"episode_wall_s": time.monotonic() - self.t0, "length": self.steps}
        return StepResult(
            observation="" if done else f"state={self.t}",
            reward=1.0 if done else 0.0,
            done=done,
            info=info,
        )


class MemberEnvs:
    """`Task.make_env` of one task: the k-th call (GRPO member k, or attempt) builds a
    `LengthEnv` wrapped in `LatencyEnv`, both seeded by (run seed, k), so the members of a group
    draw their own lengths and delays. The manager builds a group's members in member order."""

    def __init__(self, regime: Regime, run_seed: int) -> None:
        self.regime, self.run_seed, self.calls = regime, run_seed, 0

    def __call__(self) -> LatencyEnv:
        r, k = self.regime, self.calls
        self.calls += 1
        config = LatencyConfig(
            distribution=r.latency,
            median_s=r.latency_median_s,
            shape=r.latency_shape,
            max_s=r.latency_max_s,
            seed=self.run_seed * 1000 + k,
        )
        return LatencyEnv(LengthEnv(r, f"{self.run_seed}:{k}"), config)


def task_stream(regime: Regime, run_seed: int):
    """Endless tasks ``task/<i>`` (seed i), each with its own `MemberEnvs`."""
    i = 0
    while True:
        yield Task(task_id=f"task/{i}", make_env=MemberEnvs(regime, run_seed), seed=i)
        i += 1


# ---------------------------------------------------------------------------- one cell
def build_algorithm(name: str, group_size: int) -> Algorithm:
    """The registered algorithm `name` with its defaults and, if it reads ``algorithm.grpo``,
    groups of `group_size`: the cell asks it how many trajectories it samples per task
    (``group_size``) and whether its trainer step updates a critic (``needs_value_model``)."""
    config = AlgorithmConfig(name=name)
    if "grpo" in registry.get(name).config_sections(config):
        config = AlgorithmConfig(name=name, grpo=GRPOConfig(group_size=group_size))
    return registry.build(config)


TOKEN_COUNTERS = ("generated_tokens", "consumed_tokens", "discarded_tokens", "stale_dropped_tokens")


def run_cell(
    regime: Regime,
    algorithm: str,
    seed: int,
    args: argparse.Namespace,
    formatter=None,
) -> dict:
    """Run one (regime, algorithm, seed) cell; return its figures (see the module docstring)."""
    algo = build_algorithm(algorithm, args.group_size)
    g = algo.group_size
    # the trainer's step: value and policy updates with a critic, the policy's alone without
    step_s = args.sao_step_s if algo.needs_value_model else args.grpo_step_s
    eta = args.max_staleness
    engines = {
        f"http://fake{i}": FakeEngine(f"engine{i}", args.token_latency_s)
        for i in range(args.engines)
    }
    FakeEngineClient.registry = engines
    formatter = formatter or make_formatter()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = RolloutConfig(
                engine_urls=list(engines),
                max_model_len=64 + 40 * regime.length_max,
                max_tokens_per_action=16,
                trajectories_per_batch=args.batch,
                max_concurrent_episodes=args.concurrency,
                max_staleness=eta,
                max_episode_attempts=3,
                request_timeout_s=120.0,
                step_timeout_s=regime.step_timeout_s,
                seed=seed,
            )
            trained, wait_s, step = [], 0.0, 0
            with RolloutManager(
                cfg,
                formatter,
                task_stream(regime, seed),
                client_factory=FakeEngineClient,
                run_dir=tmp,
                group_size=g,
            ) as m:
                t_start = time.monotonic()
                while True:
                    if step == args.warmup_steps:
                        t0 = time.monotonic()
                        before = {k: m.counters[k] for k in (*TOKEN_COUNTERS, "failed_groups")}
                        before["requeued_stale"] = m.counters["requeued_stale"]
                        pending_start = m.stats()["rollout/pending_tokens"]
                        wait_s, trained = 0.0, []
                    tw = time.monotonic()
                    batch = m.get_batch(train_version=step, timeout=args.batch_timeout_s)
                    wait_s += time.monotonic() - tw
                    trained += [_summary(t, step, eta) for t in batch]
                    time.sleep(step_s)  # the trainer's step
                    m.publish_weights({"w": torch.zeros(1)}, version=step + 1)
                    step += 1
                    if step > args.warmup_steps and time.monotonic() - t0 >= args.budget_s:
                        break
                wall = time.monotonic() - t0
                after = dict(m.counters)
                pending = m.stats()["rollout/pending_tokens"]
            total_wall = time.monotonic() - t_start
    finally:
        FakeEngineClient.registry = {}
    delta = {k: after.get(k, 0) - before[k] for k in before}
    n = len(trained)
    tokens = sum(t["tokens"] for t in trained)
    masked = sum(t["stale_tokens"] for t in trained)
    dropped = delta["discarded_tokens"] + delta["stale_dropped_tokens"]
    groups: dict[str, list[dict]] = {}
    for t in trained:
        groups.setdefault(t["task_id"], []).append(t)
    hold = [max(x["wall_s"] for x in grp) for grp in groups.values() for _ in grp]
    return {
        "regime": regime.name,
        "algorithm": algorithm,
        "seed": seed,
        "group_size": g,
        "trainer_step_s": step_s,
        "steps_measured": step - args.warmup_steps,
        "wall_s": wall,
        "total_wall_s": total_wall,
        "trained": n,
        "distinct_tasks": len(groups),
        "trained_per_s": n / wall,
        "tasks_per_s": len(groups) / wall,
        "trainer_idle_fraction": wait_s / wall,
        "generated_tokens": delta["generated_tokens"],
        "trained_tokens": tokens,
        "trained_tokens_counter": delta["consumed_tokens"],
        "dropped_tokens": dropped,
        "discarded_tokens": delta["discarded_tokens"],
        "stale_dropped_tokens": delta["stale_dropped_tokens"],
        "failed_groups": delta["failed_groups"],
        "requeued_stale": delta["requeued_stale"],
        "pending_tokens_start": pending_start,  # in flight or buffered, not yet trained
        "pending_tokens_end": pending,
        "generated_tokens_per_s": delta["generated_tokens"] / wall,
        "trained_tokens_per_s": tokens / wall,
        "dropped_tokens_per_s": dropped / wall,
        "dropped_fraction_of_generated": dropped / max(delta["generated_tokens"], 1),
        "stale_masked_fraction_of_trained": masked / max(tokens, 1),
        "policy_loss_tokens_per_s": (tokens - masked) / wall,
        "lag_mean": statistics.fmean(t["lag"] for t in trained),
        "token_lag_mean": sum(t["token_lag_sum"] for t in trained) / max(tokens, 1),
        "length_mean": statistics.fmean(t["length"] for t in trained),
        "episode_wall_s_mean": statistics.fmean(t["wall_s"] for t in trained),
        "slot_hold_s_mean": statistics.fmean(hold),
        "loadavg_1min_end": os.getloadavg()[0],
    }


def _summary(t, train_version: int, eta: int) -> dict:
    """What the benchmark keeps of one trained trajectory."""
    versions = [v for n in t.nodes for v in n.policy_versions]
    return {
        "task_id": t.task_id,
        "tokens": len(versions),
        "stale_tokens": sum(train_version - v > eta for v in versions),
        "token_lag_sum": sum(train_version - v for v in versions),
        "lag": train_version - t.min_policy_version,
        "length": len(t.nodes),
        "wall_s": float(t.info.get("episode_wall_s", 0.0)),
    }


# ---------------------------------------------------------------------------- report
COLUMNS = [  # (key, header, format)
    ("trained_per_s", "trained traj/s", "{:.2f}"),
    ("tasks_per_s", "distinct tasks/s", "{:.2f}"),
    ("trainer_idle_fraction", "trainer idle", "{:.2f}"),
    ("generated_tokens_per_s", "generated tok/s", "{:.0f}"),
    ("trained_tokens_per_s", "trained tok/s", "{:.0f}"),
    ("dropped_tokens_per_s", "dropped tok/s (failed/stale groups)", "{:.0f}"),
    ("stale_masked_fraction_of_trained", "stale tokens masked, of trained", "{:.2f}"),
    ("policy_loss_tokens_per_s", "policy-loss tok/s", "{:.0f}"),
    ("lag_mean", "version lag (oldest token)", "{:.2f}"),
    ("token_lag_mean", "version lag (per trained token)", "{:.2f}"),
    ("length_mean", "actions per trained episode", "{:.1f}"),
    ("episode_wall_s_mean", "episode wall s", "{:.2f}"),
    ("slot_hold_s_mean", "slot hold s (slowest of group)", "{:.2f}"),
]


def mean_se(values: list[float], fmt: str) -> str:
    """'mean ± standard error' (the mean alone for one value)."""
    m = statistics.fmean(values)
    if len(values) < 2:
        return fmt.format(m)
    se = statistics.stdev(values) / math.sqrt(len(values))
    return f"{fmt.format(m)} ± {fmt.format(se)}"


def table(results: list[dict], args: argparse.Namespace) -> str:
    head = "| regime | algorithm | step s | " + " | ".join(h for _, h, _ in COLUMNS) + " |\n"
    head += "|---|---|---:|" + "---:|" * len(COLUMNS) + "\n"
    rows = []
    for regime in args.regimes:
        for algo in args.algorithms:
            cell = [r for r in results if r["regime"] == regime and r["algorithm"] == algo]
            if not cell:
                continue
            g = cell[0]["group_size"]  # the algorithm's, recorded by run_cell
            name = algo.upper() + (f" (G={g})" if g > 1 else "")
            vals = " | ".join(mean_se([r[k] for r in cell], f) for k, _, f in COLUMNS)
            rows.append(f"| {regime} | {name} | {cell[0]['trainer_step_s']:g} | {vals} |\n")
    return head + "".join(rows)


def report(results: list[dict], args: argparse.Namespace, machine: dict) -> str:
    cmd = machine["command"]
    r = regimes(args)["rollout_bound"]
    return (
        "What: the real `RolloutManager` (AReaL admission, staleness buffer, GRPO groups, router, "
        "weight-sync protocol) against the in-process fake engines of `tests/rollout/fakes.py` "
        f"({args.engines} engines, 1-6 tokens per action at {args.token_latency_s * 1e3:g} ms "
        "per token, never saturated) and a trainer that sleeps its step time per batch, then "
        "publishes a version (`tools/bench_regimes.py`, docstring). Both algorithms: "
        f"{args.batch} trajectories per batch, {args.concurrency} episodes in flight, "
        f"max_staleness {args.max_staleness}; SAO one episode per task, GRPO groups of "
        f"{args.group_size}. Trainer steps {args.sao_step_s:g} s (SAO) and {args.grpo_step_s:g} "
        's (GRPO): the measured 16-row steps of "Training MFU" (1.9 s and 0.77 s, ratio '
        "2.45) scaled by 1/4. Regimes: `trainer_bound`, no step latency and "
        f"{args.short_length}-action episodes; `rollout_bound`, each step waits a lognormal "
        f"delay (latency wrapper, median {r.latency_median_s:g} s, sigma {r.latency_shape:g}, "
        f"cap {r.latency_max_s:g} s) and each episode lasts a lognormal number of actions "
        f"(median {r.length_median:g}, sigma {r.length_shape:g}, cap {r.length_max}), drawn per "
        "episode (GRPO members draw their own); `rollout_bound_timeouts`, the same with "
        f"`rollout.step_timeout_s = {args.step_timeout_s:g}`, which ends an episode whose step "
        "is slower and drops its group. Figures over "
        f"{args.budget_s:g} s after {args.warmup_steps} warm-up steps, mean ± standard error "
        f"of {args.repeats} repeats (seeds {args.seed}..{args.seed + args.repeats - 1}). Trainer "
        "idle: time blocked in `get_batch` / wall. Dropped tokens: generated for groups that "
        "failed or were dropped stale (`rollout/discarded_tokens`, "
        "`rollout/stale_dropped_tokens`); stale tokens masked: trained tokens older than the "
        "bound, out of the policy loss; policy-loss tok/s = trained minus masked. Slot hold: "
        "the wall time of the slowest member of a trained episode's group, i.e. how long each "
        "member kept its rollout slot.\n\n"
        f"Command:\n\n    {cmd}\n\n"
        f"Machine: `nproc` = {machine['nproc']}, CPU '{machine['cpu']}', no GPU. Load average "
        f"(1/5/15 min) {machine['load_before']} before and {machine['load_after']} after (the "
        "benchmark itself is mostly asyncio sleeping; other jobs shared the cores). "
        f"Date: {machine['date']} (`date -u`), {machine['minutes']:.1f} min. "
        f"Commit: {machine['commit']}.\n\n" + table(results, args) + "\n" + benchlib.READING
    )


def _load() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--regimes", nargs="+", default=list(REGIMES), choices=REGIMES)
    p.add_argument("--algorithms", nargs="+", default=["sao", "grpo"], choices=["sao", "grpo"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="repeat r runs with seed + r")
    p.add_argument("--budget-s", type=float, default=20.0, help="measured seconds per cell")
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument(
        "--sao-step-s",
        type=float,
        default=0.49,
        help="trainer step of an algorithm with a critic (SAO), seconds",
    )
    p.add_argument(
        "--grpo-step-s",
        type=float,
        default=0.2,
        help="trainer step of an algorithm without a critic (GRPO), seconds",
    )
    p.add_argument("--group-size", type=int, default=8, help="group size G of grouped algorithms")
    p.add_argument("--batch", type=int, default=16, help="rollout.trajectories_per_batch")
    p.add_argument("--concurrency", type=int, default=16, help="max_concurrent_episodes")
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--token-latency-s", type=float, default=0.001, help="fake engine, per token")
    p.add_argument("--short-length", type=int, default=2, help="actions, trainer_bound")
    p.add_argument("--latency-median-s", type=float, default=0.05)
    p.add_argument("--latency-shape", type=float, default=1.0, help="lognormal sigma")
    p.add_argument("--latency-max-s", type=float, default=2.0)
    p.add_argument("--length-median", type=float, default=8.0, help="actions")
    p.add_argument("--length-shape", type=float, default=1.0, help="lognormal sigma")
    p.add_argument("--length-max", type=int, default=128, help="actions")
    p.add_argument("--step-timeout-s", type=float, default=0.5, help="rollout_bound_timeouts")
    p.add_argument("--batch-timeout-s", type=float, default=600.0)
    p.add_argument("--json", default=str(REPO / "runs" / "bench_regimes.json"))
    p.add_argument("--write", action="store_true", help=f"rewrite '{SECTION}' in BENCHMARKS.md")
    p.add_argument(
        "--from-json",
        default=None,
        help="render the report of a saved --json file (its command, machine, results) instead "
        "of measuring",
    )
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(argv)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        run_args = argparse.Namespace(**saved["args"])
        text = report(saved["results"], run_args, saved["machine"])
        print(text)
        if args.write:
            benchlib.write_section(SECTION, text)
        return saved["results"]
    # dropped groups (step timeouts) are counted in the table; one log line each is noise here
    logging.getLogger("sao_megatron.rollout").setLevel(logging.CRITICAL)

    machine = {
        "command": " ".join(["python tools/bench_regimes.py", *(argv or sys.argv[1:])]),
        "nproc": os.cpu_count(),
        "cpu": benchlib.cpu_model(),
        "load_before": _load(),
        "date": subprocess.run(["date", "-u"], capture_output=True, text=True).stdout.strip(),
        "commit": _commit(),
    }
    t0 = time.monotonic()
    formatter = make_formatter()
    by_name = regimes(args)
    results = []
    for rep in range(args.repeats):
        for regime in args.regimes:
            algos = args.algorithms if rep % 2 == 0 else args.algorithms[::-1]
            for algo in algos:
                r = run_cell(by_name[regime], algo, args.seed + rep, args, formatter)
                results.append(r)
                print(
                    f"[regimes] rep {rep} {regime} {algo}: {r['trained_per_s']:.2f} traj/s, "
                    f"{r['tasks_per_s']:.2f} tasks/s, idle {r['trainer_idle_fraction']:.2f}, "
                    f"dropped {r['dropped_tokens']} tok, masked "
                    f"{r['stale_masked_fraction_of_trained']:.2f}, lag {r['lag_mean']:.2f}",
                    flush=True,
                )
    machine["load_after"] = _load()
    machine["minutes"] = (time.monotonic() - t0) / 60
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "machine": machine, "results": results}, indent=1)
        )
    text = report(results, args, machine)
    print(text)
    if args.write:
        benchlib.write_section(SECTION, text)
    return results


def _commit() -> str:
    commit = benchlib._git("rev-parse", "--short", "HEAD")
    if benchlib._git("status", "--porcelain", "--untracked-files=no"):
        commit += " (+ uncommitted changes)"
    return commit


if __name__ == "__main__":
    main()
