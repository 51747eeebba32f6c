"""One SAO train step split into its phases, on every shipped SAO config.

For each config: the job's policy and critic (its model, precision, freeze patterns, optimisers,
``rl.micro_batch_size``) on one rank, and an on-policy synthetic batch shaped like the config's
rollouts (`SHAPES`: ``rollout.trajectories_per_batch`` trajectories of that many action nodes,
observation and action tokens per node, the config's context mode). Each repeat times, in order:

* ``value_targets``: VALUE_TARGETS (a no-grad value forward only when the targets need values or
  a bootstrap value cannot come from the first update's forward);
* ``value_update_<k>``: each VALUE_UPDATE (forward + backward + optimiser step);
* ``advantages``: ADVANTAGES (the critic's forward after its updates + the advantage math);
* ``policy_update``: POLICY_UPDATE (forward + backward + optimiser step);
* ``weight_sync``: the policy gathered under HF names and written into a slot file (what the
  trainer does before the engines reload; the engines' pause is `tools/bench_rollout.py`'s);
* ``value_pretrain_step``: one value pre-training step (`RLStep.value_step`) on the same batch,
  and ``value_pretrain_step_fit_after`` the step as it was before issue 30 (``fit_after=True``:
  one value forward after the updates), interleaved for the before/after.

The table gives the median seconds of each phase over the repeats, the value phase (targets +
updates + advantages) over the policy update (its FLOP floor at lam_value = 1 is (3K + 1) / 3
value-forward units over 3 policy units: 2.33x at K = 2), and one value pre-training step over
its K value updates (1.0 = nothing besides them). ``--profile CONFIG`` also writes
torch.profiler's table of the value phase's top operators (self CPU time) to ``--out``.

    python tools/bench_phases.py --repeats 3 --json runs/bench_phases.json
    python tools/bench_phases.py --configs hanoi_plan --profile hanoi_plan --out runs/prof
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: config -> (nodes per trajectory, observation tokens per node, action tokens per node): the
#: shape of that config's rollouts (action tokens ~ half of rollout.max_tokens_per_action, the
#: observations of its environment's prompts; a windowed config's observation is its node's
#: whole context window).
SHAPES: dict[str, tuple[int, int, int]] = {
    "quickstart": (6, 24, 10),  # Hanoi H=7 / chain_sum, full history, <= 16 tokens an action
    "hanoi_plan": (50, 48, 28),  # H=50 plans, window 1 (one row a node), <= 48 tokens an action
    "smollm2_arithmetic": (1, 60, 12),  # one-digit sums: ~60-token chat prompt, one answer
    "agent_calculator_tiny": (2, 100, 40),  # tool call + answer, full history, ~220 tokens
}
PHASES = ("value_targets", "value_update", "advantages", "policy_update")


def synthetic_batch(job, policy, parallel, shape: tuple[int, int, int], seed: int):
    """``rollout.trajectories_per_batch`` on-policy trajectories of `shape` in the job's context
    mode, packed; behaviour log-probs are the policy's own (ratio 1), rewards 0/1 at random."""
    import torch

    from sao_megatron.data.batch import pack_trajectories
    from sao_megatron.data.trajectory import ActionNode, Trajectory
    from sao_megatron.models import ModelInputs, compute_policy_logprobs

    nodes, n_obs, n_act = shape
    window = job.episode.context_mode == "window"
    vocab = job.model.vocab_size
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(1, vocab, (n,), generator=g).tolist()

    trajs = []
    for r in range(job.rollout.trajectories_per_batch):
        node_list = []
        for _ in range(nodes):
            obs, act = ids(n_obs), ids(n_act)
            node_list.append(
                ActionNode(
                    observation_token_ids=obs,
                    action_token_ids=act,
                    behaviour_logprobs=[-1.0] * n_act,
                    policy_versions=[0] * n_act,
                    reward=float(torch.rand((), generator=g) < 0.5),
                    context_token_ids=obs if window else None,
                )
            )
        trajs.append(
            Trajectory(
                task_id=f"bench{r}",
                nodes=node_list,
                context_mode="window" if window else "full_history",
            )
        )
    seq_len = job.model.max_position_embeddings
    batch = pack_trajectories(trajs, pad_token_id=0, max_seq_len=seq_len)
    inputs = ModelInputs(batch.token_ids, batch.loss_mask, batch.position_ids)
    mbs = job.rl.micro_batch_size
    lp, _ = compute_policy_logprobs(policy.model, parallel, inputs, 1.0, mbs)
    # behaviour = the policy itself, row by row in pack order (a trajectory's rows are consecutive)
    flat = [
        lp[r, torch.nonzero(batch.action_mask[r]).flatten() - 1].tolist() for r in range(len(lp))
    ]
    row = 0
    for traj in trajs:
        stream = [] if window else flat[row]
        for node in traj.nodes:
            if window:
                node.behaviour_logprobs = flat[row]
                row += 1
            else:
                node.behaviour_logprobs, stream = stream[:n_act], stream[n_act:]
        row += 0 if window else 1
    return pack_trajectories(trajs, pad_token_id=0, max_seq_len=seq_len)


def build(config: str, parallel, overrides: list[str]):
    """(job, policy, value, RLStep, batch) for `config` on this rank."""
    from sao_megatron.algorithm import registry
    from sao_megatron.configs import load_config
    from sao_megatron.trainer.job import JobConfig
    from sao_megatron.trainer.rl_step import RLStep, StepConfig
    from sao_megatron.trainer.runtime import build_policy_state, build_value_state

    cwd = Path.cwd()
    os.chdir(ROOT)  # the configs' relative paths (init_from_hf) are the repository's
    try:
        job = load_config(JobConfig, ROOT / "examples" / "configs" / f"{config}.yaml", overrides)
    finally:
        os.chdir(cwd)
    if job.init_from_hf is not None:
        job.init_from_hf = str(ROOT / job.init_from_hf)  # a no-op on an absolute path
    if job.init_from_hf is None:  # a trained sentencepiece vocabulary: the model's rows it uses
        vocab = min(job.model.vocab_size, job.tokenizer.vocab_size)
        job.model = dataclasses.replace(job.model, vocab_size=vocab)
    policy = build_policy_state(job, parallel, job.policy_optim)
    value = build_value_state(job, parallel, policy.unwrapped)
    step = RLStep(
        registry.build(job.algorithm),
        parallel,
        policy,
        value,
        StepConfig(micro_batch_size=job.rl.micro_batch_size),
    )
    batch = synthetic_batch(job, policy, parallel, SHAPES[config], job.seed)
    return job, policy, value, step, batch


def time_phases(step, batch, spec, parallel, slot_dir: Path) -> dict[str, float]:
    """Seconds of each phase of one SAO step, the weight sync and one value pre-training step."""
    from sao_megatron.weight_sync import gather_hf_weights
    from sao_megatron.weight_sync.publisher import WeightPublisher

    out: dict[str, float] = {}
    state = step.start(batch, train_version=0)
    k = 0
    for phase in step.algorithm.schedule:
        name = phase.value
        if name == "value_update":
            k += 1
            name = f"value_update_{k}"
        t0 = time.perf_counter()
        step.run(phase, state)
        out[name] = out.get(name, 0.0) + time.perf_counter() - t0
    step.finish(state)
    t0 = time.perf_counter()
    weights = gather_hf_weights(step.policy.unwrapped, spec, parallel)
    WeightPublisher(slot_dir).publish(weights, version=1)
    out["weight_sync"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    step.value_step(batch)
    out["value_pretrain_step"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    step.value_step(batch, fit_after=True)  # the step before issue 30: + 1 value forward
    out["value_pretrain_step_fit_after"] = time.perf_counter() - t0
    return out


def summarise(runs: list[dict[str, float]]) -> dict[str, float]:
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    updates = [k for k in med if k.startswith("value_update_")]
    value_phase = med.get("value_targets", 0.0) + sum(med[k] for k in updates) + med["advantages"]
    med["value_phase"] = value_phase
    med["value_phase_over_policy"] = value_phase / med["policy_update"]
    # a pre-training step is the K updates: its cost over theirs (1.0 = nothing besides them)
    den = sum(med[k] for k in updates) if updates else float("nan")
    med["pretrain_step_over_updates"] = med["value_pretrain_step"] / den
    med["pretrain_step_fit_after_over_updates"] = med["value_pretrain_step_fit_after"] / den
    return med


def profile_value_phase(step, batch, out_dir: Path, config: str) -> Path:
    """torch.profiler over one step's value phases (targets, updates, advantages): the top
    operators by self CPU time, as a text table."""
    from torch.profiler import ProfilerActivity, profile

    state = step.start(batch, train_version=0)
    value_phases = [p for p in step.algorithm.schedule if p.value != "policy_update"]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for phase in value_phases:
            step.run(phase, state)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"profile_value_phase_{config}.txt"
    path.write_text(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    return path


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=list(SHAPES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--override", action="append", default=[], help="config override, any config")
    ap.add_argument("--profile", nargs="*", default=[], help="configs to profile")
    ap.add_argument("--out", default="runs/bench_phases")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    for c in args.configs:
        if c not in SHAPES:
            ap.error(f"--configs {c}: not a shipped SAO config; choose from {sorted(SHAPES)}")
    sys.path.insert(0, str(ROOT / "tools"))
    sys.path.insert(0, str(ROOT))
    import bench_mfu

    from sao_megatron.convert.spec import ConversionSpec
    from sao_megatron.parallel import ParallelConfig, destroy_parallel, initialize_parallel
    from sao_megatron.trainer.runtime import job_hf_config

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29563")
    parallel = initialize_parallel(ParallelConfig())
    res: dict = {"machine": bench_mfu.machine_info(), "configs": {}}
    try:
        for config in args.configs:
            job, policy, value, step, batch = build(config, parallel, args.override)
            spec = ConversionSpec.from_hf_config(job_hf_config(job, _VocabOnly(job)))
            runs = []
            with tempfile.TemporaryDirectory() as slots:
                for i in range(args.warmup + args.repeats):
                    r = time_phases(step, batch, spec, parallel, Path(slots))
                    if i >= args.warmup:
                        runs.append(r)
            med = summarise(runs)
            res["configs"][config] = {
                "shape": dict(
                    zip(("nodes", "obs_tokens", "action_tokens"), SHAPES[config], strict=True)
                ),
                "rows": batch.num_rows,
                "seq_len": int(batch.token_ids.shape[1]),
                "tokens": int(batch.loss_mask.sum()),
                "micro_batch_size": job.rl.micro_batch_size,
                "dtype": str(job.precision.params_dtype),
                "median_s": med,
                "runs": runs,
            }
            print(row(config, res["configs"][config]), flush=True)
            if config in args.profile:
                path = profile_value_phase(step, batch, Path(args.out), config)
                res["configs"][config]["profile"] = str(path)
                print(f"  profile: {path}", flush=True)
            del policy, value, step
    finally:
        destroy_parallel()
    res["machine"]["loadavg_1min_end"] = os.getloadavg()[0]
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1))
    print(markdown(res))
    return res


class _VocabOnly:
    """What `job_hf_config` reads of a tokenizer (its special ids), without training one."""

    def __init__(self, job) -> None:
        self.vocab_size = job.model.vocab_size
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2


def row(config: str, c: dict) -> str:
    m = c["median_s"]
    ups = " ".join(f"{m[k]:.3f}" for k in sorted(m) if k.startswith("value_update_"))
    return (
        f"{config}: rows {c['rows']} x T {c['seq_len']}; targets {m.get('value_targets', 0):.3f} "
        f"updates {ups} advantages {m['advantages']:.3f} | policy {m['policy_update']:.3f} | "
        f"value phase / policy {m['value_phase_over_policy']:.2f}x | pretrain step / its updates "
        f"{m['pretrain_step_over_updates']:.2f}x (before: "
        f"{m['pretrain_step_fit_after_over_updates']:.2f}x) | sync {m['weight_sync']:.3f}"
    )


def markdown(res: dict) -> str:
    mi = res["machine"]
    lines = [
        f"# {mi['cpu']}, {mi['nproc']} cores, torch {mi['torch']}, {mi['threads']} threads, "
        f"{mi['date_utc']} UTC, commit {mi['commit']}, load average {mi['load_avg_1_5_15']} "
        f"at the start, {mi['loadavg_1min_end']:.2f} (1 min) at the end",
        "",
        "| config | rows x T (tokens) | targets | value updates | advantages | policy update "
        "| value phase / policy | pre-train step / its K updates (before) | weight sync |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, c in res["configs"].items():
        m = c["median_s"]
        ups = " + ".join(f"{m[k]:.2f}" for k in sorted(m) if k.startswith("value_update_"))
        lines.append(
            f"| {name} | {c['rows']} x {c['seq_len']} ({c['tokens']}) | "
            f"{m.get('value_targets', 0):.3f} | {ups} | {m['advantages']:.2f} | "
            f"{m['policy_update']:.2f} | {m['value_phase_over_policy']:.2f}x | "
            f"{m['pretrain_step_over_updates']:.2f}x "
            f"({m['pretrain_step_fit_after_over_updates']:.2f}x) | {m['weight_sync']:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
