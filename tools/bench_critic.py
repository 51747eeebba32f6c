"""Critic explained variance: which change lets SAO's value model learn (issue 14, item 3).

    python tools/bench_critic.py --steps 60 --write                 # every stage below
    python tools/bench_critic.py --only fit --variants "head init 0"  # one variant

Stages (each reuses what an earlier invocation left under --out; delete a file to redo it):

1. ``sft``: the config's SFT stage once (`benchlib.shared_sft`) -> <out>/sft.
2. ``collect``: rollouts of the frozen SFT policy through the real rollout stack (vLLM engine,
   `Controller.build_rl`), --batches batches of `rollout.trajectories_per_batch` trajectories,
   saved to <out>/rollouts.pt. They are sampled with the dense progress reward and
   ``budget_end: terminate``; both other modes follow exactly from each episode's last step
   info (`retarget`), so every variant sees the same episodes.
3. ``fit``: per variant, value pre-training as `sao-train` runs it (the trainer's own value model,
   optimiser and `RLStep.value_step`, built by `Controller.build_rl` from the SFT checkpoint
   with the variant's overrides), one fresh batch per step (batches 0..steps-1); every
   --eval-every steps the predictive explained variance on the last --heldout batches pooled
   (never trained on; `RLStep.value_fit`), against the variant's own targets and against the
   true returns (budget end = terminal, value 0). -> <out>/fit/<variant>.jsonl
4. ``ceiling``: the same held-out EV of a tabular Monte-Carlo critic (mean return of the
   training episodes through the same token prefix, backing off to the longest seen prefix): how
   much of the return variance this many episodes can explain at all.
5. ``rl``: `sao-train` with stages [value_pretrain, rl] from the SFT checkpoint for the
   variants in --rl-variants: the EV during value pre-training and RL from its metrics.jsonl.
6. ``plot`` (docs/img/bench_critic.png) and, with --write, the section "Critic explained
   variance" of docs/BENCHMARKS.md.

Single rank only (the fit and ceiling run in this process).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import time
from pathlib import Path

import benchlib
import torch
from benchlib import REPO, machine_info, machine_line, run_job, seed_from_sft, shared_sft

#: variant -> (job overrides, retarget (reward_mode, budget_end)); the base is the committed
#: quickstart critic before this study (head init std 0.02, critic lr 5e-4 with 2 warm-up steps,
#: value clip 0.2, attention and embeddings frozen, 0/1 success reward, budget end truncates)
BASE = ["value.head_init_std=0.02", "value_optim.lr=5.0e-4", "value_optim.warmup_steps=2"]
VARIANTS: dict[str, tuple[list[str], tuple[str, str]]] = {
    "before (quickstart critic)": ([], ("success", "truncate")),
    "head init 0": (["value.head_init_std=0"], ("success", "truncate")),
    "budget end terminates": ([], ("success", "terminate")),
    "progress reward": ([], ("progress", "truncate")),
    "critic lr 2e-3": (["value_optim.lr=2.0e-3"], ("success", "truncate")),
    "critic attention trainable": (["value.freeze_patterns=[embedding]"], ("success", "truncate")),
    "no value clip": (["algorithm.sao.value_clip=null"], ("success", "truncate")),
    "init 0 + terminate": (["value.head_init_std=0"], ("success", "terminate")),
    "init 0 + terminate + lr 2e-3": (
        ["value.head_init_std=0", "value_optim.lr=2.0e-3"],
        ("success", "terminate"),
    ),
    "attention trainable + lr 2e-3 + init 0 + terminate": (
        ["value.freeze_patterns=[embedding]", "value_optim.lr=2.0e-3", "value.head_init_std=0"],
        ("success", "terminate"),
    ),
    "value updates 8 per batch": (
        ["algorithm.sao.value_updates_per_policy_update=8"],
        ("success", "truncate"),
    ),
}
SECTION = "Critic explained variance"

#: the Hanoi plan study (`--study plan`, examples/configs/hanoi_plan.yaml): its base is the
#: config's critic before the study, explicitly (head init 0, lr 5e-4 with 10 warm-up steps,
#: value clip 0.2, attention and embeddings frozen: the library default patterns), the progress
#: reward and terminal budget end the config trains with. The config now trains the critic as
#: "attention trainable, lr 2e-3" (the study's result).
_FROZEN = "value.freeze_patterns=[embedding,self_attention.linear_qkv,self_attention.linear_proj]"
_TRAINABLE = "value.freeze_patterns=[embedding]"
PLAN_BASE = ["value_optim.lr=5.0e-4", _FROZEN]
PLAN_VARIANTS: dict[str, tuple[list[str], tuple[str, str]]] = {
    "config critic (attention frozen)": ([], ("progress", "terminate")),
    "attention trainable": ([_TRAINABLE], ("progress", "terminate")),
    "nothing frozen": (["value.freeze_patterns=[]"], ("progress", "terminate")),
    "attention trainable, lr 2e-3": (
        [_TRAINABLE, "value_optim.lr=2.0e-3"],
        ("progress", "terminate"),
    ),
    "attention frozen, lr 2e-3": (["value_optim.lr=2.0e-3"], ("progress", "terminate")),
    "attention trainable, value updates 8": (
        [_TRAINABLE, "algorithm.sao.value_updates_per_policy_update=8"],
        ("progress", "terminate"),
    ),
}

#: study -> (base overrides of every variant, variants, docs section, plot file)
STUDIES = {
    "quickstart": (BASE, VARIANTS, SECTION, "bench_critic.png"),
    "plan": (
        PLAN_BASE,
        PLAN_VARIANTS,
        "Critic explained variance (Hanoi plans)",
        "bench_critic_plan.png",
    ),
}


def study(args) -> tuple[list[str], dict, str, str]:
    """(base overrides, variants, section, plot file name) of ``--study``."""
    return STUDIES[args.study]


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")


# ---------------------------------------------------------------------------- episodes
def _hanoi_max_steps(info: dict, factor: float) -> int:
    return math.ceil(factor * info["horizon"])


def retarget(traj, reward_mode: str, budget_end: str, max_steps_factor: float):
    """A copy of a Hanoi trajectory sampled with ``reward_mode: progress, budget_end:
    terminate`` as the environment would have returned it in the given modes.

    The moves (tokens, observations) do not depend on either mode: only the node rewards and
    how an episode that spent its step budget ends. From the last step's info
    (`Trajectory.info`): success -> the success reward (1) on the last node in "success" mode;
    a budget-spent episode (last move legal, not solved, num_steps == max_steps) is
    ``truncated`` in "truncate" mode. Progress rewards are kept as sampled.
    """
    t = copy.deepcopy(traj)
    info = t.info
    if reward_mode == "success":
        for node in t.nodes:
            node.reward = 0.0
        t.nodes[-1].reward = 1.0 if info.get("success") else 0.0
    spent = (
        t.terminated
        and not info.get("success")
        and info.get("move") in ("optimal", "non_optimal")
        and info.get("num_steps") == _hanoi_max_steps(info, max_steps_factor)
    )
    if budget_end == "truncate" and spent:
        t.terminated, t.truncated = False, True
        t.status = "truncated"
    return t


def collect_overrides(config_job) -> list[str]:
    """tasks.train of the config with ``reward_mode: progress, budget_end: terminate``."""
    envs = []
    for e in config_job.tasks.train:
        if e.name != "hanoi":
            raise ValueError(f"tools/bench_critic.py needs Hanoi tasks, got tasks.train {e.name}")
        opts = dict(e.options) | {"reward_mode": "progress", "budget_end": "terminate"}
        envs.append({"name": e.name, "options": opts, "weight": e.weight})
    return [f"tasks.train={json.dumps(envs)}"]


# ---------------------------------------------------------------------------- in-process jobs
def _job(config: str, run_dir: Path, overrides: list[str]):
    from sao_megatron.configs import load_config
    from sao_megatron.trainer.job import JobConfig

    return load_config(
        JobConfig,
        config,
        [f"run_dir={run_dir}", "stages=[value_pretrain]", "tasks.num_eval_tasks=0", *overrides],
    )


def _parallel(job):
    from sao_megatron.parallel import initialize_parallel

    global _PARALLEL
    if _PARALLEL is None:
        _PARALLEL = initialize_parallel(job.parallel)
    return _PARALLEL


_PARALLEL = None


def collect(args, sft: Path, out: Path) -> Path:
    """<out>/rollouts.pt: {"batches": [[Trajectory]], "seconds": float}."""
    path = out / "rollouts.pt"
    if path.exists():
        return path
    from sao_megatron.trainer.controller import Controller

    run_dir = out / "collect"
    seed_from_sft(sft, run_dir)
    base = _job(args.config, run_dir, [])
    job = _job(args.config, run_dir, collect_overrides(base))
    c = Controller(job, _parallel(job))
    c.prepare()
    rl = c.build_rl(None, None)
    batches, t0 = [], time.perf_counter()
    rl.rollout.start()
    try:
        for i in range(args.batches):
            trajs = rl.rollout.get_batch(0, timeout=job.rl.batch_timeout_s)
            trajs.sort(key=lambda t: t.task_id)
            batches.append(trajs)
            print(f"[collect] batch {i + 1}/{args.batches}", flush=True)
    finally:
        rl.rollout.stop()
    seconds = time.perf_counter() - t0
    torch.save({"batches": batches, "seconds": seconds}, path)
    return path


def collect_in_trainer(args, sft: Path, out: Path) -> Path:
    """`collect` without a vLLM engine (``--sampler trainer``): the same episodes through the
    rollout's own `run_episode` (formatter, environment, token budget, stop tokens,
    temperature), with the SFT policy sampled in this process: one full no-grad forward per
    generated token (no KV cache) over every episode waiting for an action, the next token
    drawn from softmax(logits / rollout.temperature) over the served vocabulary (top_p = 1).
    Same weights as the engine would serve; only the sampling numerics differ."""
    import asyncio

    from sao_megatron.models.forward import causal_padding_mask
    from sao_megatron.rollout.engine import Generation
    from sao_megatron.rollout.runner import run_episode, stop_token_ids
    from sao_megatron.trainer.controller import Controller
    from sao_megatron.trainer.run_state import TaskStream

    path = out / "rollouts.pt"
    if path.exists():
        return path
    run_dir = out / "collect"
    seed_from_sft(sft, run_dir)
    job = _job(args.config, run_dir, collect_overrides(_job(args.config, run_dir, [])))
    c = Controller(job, _parallel(job))
    c.prepare()
    rl = c.build_rl(None, None)
    model = rl.step_fn.policy.unwrapped[0]
    model.eval()
    vocab, cfg = c.hf_config["vocab_size"], job.rollout
    stops = set(stop_token_ids(c.formatter, cfg))
    gen = torch.Generator().manual_seed(cfg.seed)
    if cfg.top_p != 1.0 or getattr(cfg, "top_k", 0):
        raise ValueError("--sampler trainer samples with top_p = 1, top_k = 0 only")

    @torch.no_grad()
    def decode(requests):
        rows = [list(p) for p, _ in requests]
        outs = [Generation([], [], [], "") for _ in requests]
        live = list(range(len(rows)))
        while live:
            n = max(len(rows[i]) for i in live)
            ids = torch.zeros(len(live), n, dtype=torch.long)
            am = torch.zeros(len(live), n, dtype=torch.bool)
            for j, i in enumerate(live):
                ids[j, : len(rows[i])] = torch.tensor(rows[i])
                am[j, : len(rows[i])] = True
            pos = (am.long().cumsum(1) - 1).clamp(min=0)
            logits = model(ids, pos, causal_padding_mask(am))
            last = am.sum(1) - 1
            z = logits[torch.arange(len(live)), last, :vocab].float() / cfg.temperature
            logp = torch.log_softmax(z, -1)
            tok = torch.multinomial(logp.exp(), 1, generator=gen)[:, 0]
            still = []
            for j, i in enumerate(live):
                t = int(tok[j])
                rows[i].append(t)
                g = outs[i]
                g.token_ids.append(t)
                g.logprobs.append(float(logp[j, t]))
                g.policy_versions.append(0)
                if t in stops:
                    g.finish_reason = "stop"
                elif len(g.token_ids) >= requests[i][1]:
                    g.finish_reason = "length"
                else:
                    still.append(i)
            live = still
        return outs

    async def episodes(tasks):
        pending: list = []
        active = [len(tasks)]
        wake = asyncio.Event()

        async def generate(episode_id, prompt, max_tokens, seed):
            fut = asyncio.get_running_loop().create_future()
            pending.append(((prompt, max_tokens), fut))
            wake.set()
            return await fut

        async def one(task):
            try:
                return await run_episode(
                    env=task.make_env(),
                    seed=task.seed,
                    task_id=task.task_id,
                    formatter=c.formatter,
                    generate=generate,
                    config=cfg,
                )
            finally:
                active[0] -= 1
                wake.set()

        async def server():
            while active[0]:
                await wake.wait()
                wake.clear()
                if pending and len(pending) >= active[0]:
                    batch = pending[:]
                    pending.clear()
                    for (_, fut), g in zip(batch, decode([r for r, _ in batch]), strict=True):
                        fut.set_result(g)

        srv = asyncio.create_task(server())
        trajs = await asyncio.gather(*(one(t) for t in tasks))
        await srv
        return list(trajs)

    stream, per, batches, t0 = TaskStream(job.tasks), cfg.trajectories_per_batch, [], time.time()
    group = 4  # batches sampled together (one forward per token over all their episodes)
    for start in range(0, args.batches, group):
        k = min(group, args.batches - start)
        trajs = asyncio.run(episodes([next(stream) for _ in range(k * per)]))
        batches += [trajs[i * per : (i + 1) * per] for i in range(k)]
        print(f"[collect] {len(batches)}/{args.batches} batches, {time.time() - t0:.0f} s")
    torch.save({"batches": batches, "seconds": time.time() - t0, "sampler": "trainer"}, path)
    return path


def _variant_batches(batches, mode, factor):
    return [[retarget(t, *mode, factor) for t in b] for b in batches]


def fit(args, out: Path, name: str, batches) -> Path:
    """Value pre-training of one variant on the collected batches; <out>/fit/<slug>.jsonl."""
    from sao_megatron.data.batch import pack_trajectories
    from sao_megatron.trainer.controller import Controller

    path = out / "fit" / f"{_slug(name)}.jsonl"
    if path.exists():
        return path
    base, variants, _, _ = study(args)
    overrides, mode = variants[name]
    job = _job(args.config, out / "collect", [*base, *overrides, *args.overrides])
    factor = float(job.tasks.train[0].options.get("max_steps_factor", 1.0))
    c = Controller(job, _parallel(job))
    c.prepare()
    rl = c.build_rl(None, None)
    step = rl.step_fn

    def pack(trajs):
        return pack_trajectories(
            trajs,
            pad_token_id=c.tokenizer.pad_id,
            max_seq_len=job.model.max_position_embeddings,
        )

    train = _variant_batches(batches[: args.steps], mode, factor)
    held_trajs = [t for b in batches[-args.heldout :] for t in b]
    held = pack([retarget(t, *mode, factor) for t in held_trajs])
    held_true = pack([retarget(t, mode[0], "terminate", factor) for t in held_trajs])
    records, t0 = [], time.perf_counter()

    def evaluate(k):
        own = step.value_fit(held)
        # a variant trained with the terminal budget end has the true returns as its targets
        true = own if mode[1] == "terminate" else step.value_fit(held_true)
        rec = {"step": k, "time_s": time.perf_counter() - t0}
        rec |= {f"heldout/{key.split('/')[1]}": v for key, v in own.items()}
        rec["heldout/explained_variance_true_returns"] = true["value/explained_variance"]
        return rec

    partial = path.with_suffix(".partial")
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_text("")

    def keep(rec):  # written as it goes: an interrupted variant still has its curve
        records.append(rec)
        with partial.open("a") as f:
            f.write(json.dumps(rec) + "\n")

    keep(evaluate(0))
    for k, trajs in enumerate(train, start=1):
        m = step.value_step(pack(trajs))
        rec = {"step": k, "time_s": time.perf_counter() - t0}
        rec |= {key: m[key] for key in sorted(m) if key.startswith(("value/", "loss/", "lr/"))}
        if k % args.eval_every == 0 or k == len(train):
            rec |= evaluate(k)
        keep(rec)
        print(
            f"[fit] {name} step {k}: EV before {m['value/explained_variance_before']:.3f} "
            f"held-out {rec.get('heldout/explained_variance', float('nan')):.3f}",
            flush=True,
        )
    partial.rename(path)
    return path


# ---------------------------------------------------------------------------- ceiling
def iid_ev_ceiling(p: float, horizon: int, reward_mode: str = "progress") -> float:
    """Explained variance of the *perfect* critic when every move fails independently with
    probability `p` (illegal or non-optimal: with a budget of H moves either loses the puzzle),
    exactly, in float64: the share of the return variance that any state value can explain.

    Model: a Hanoi episode of H optimal moves, one row per move played (the failing move
    included, none after it). With T the index of the first failing move (P(T=k) = (1-p)^k p,
    k < H; T = H with probability (1-p)^H), the return from move t is (min(T, H) - t) / H with
    the progress reward and 1[T = H] with the success reward; the perfect critic predicts its
    mean given that moves 0..t-1 succeeded (it sees the moves left). Rows are pooled over
    episodes as the trainer pools tokens (every row weighs the same here; the trainer weighs
    each move by its token count, constant for a plan of fixed disk count). Returns
    1 - E[(R - V)^2] / Var[R] over rows; 0 when Var[R] = 0. Checked against a simulation in
    tests/tools/test_bench_critic.py.
    """
    if not (0.0 <= p <= 1.0) or horizon < 1:
        raise ValueError(f"iid_ev_ceiling: p={p} must be in [0, 1] and horizon={horizon} >= 1")
    h, q = horizon, 1.0 - p
    prob_t = [q**k * p for k in range(h)] + [q**h]  # P(T = k), k = 0..H

    def ret(t: int, k: int) -> float:  # return from move t when the first failure is move k
        if reward_mode == "success":
            return 1.0 if k == h else 0.0
        return (min(k, h) - t) / h

    # rows: (t, k) for every k and t = 0..min(k, H-1); weight P(T = k)
    rows = [(t, k, prob_t[k]) for k in range(h + 1) for t in range(min(k, h - 1) + 1)]
    # V(t) = E[R_t | T >= t]
    value = []
    for t in range(h):
        mass = sum(prob_t[k] for k in range(t, h + 1))
        value.append(sum(prob_t[k] * ret(t, k) for k in range(t, h + 1)) / mass if mass else 0.0)
    total = sum(w for _, _, w in rows)
    mean = sum(w * ret(t, k) for t, k, w in rows) / total
    var = sum(w * (ret(t, k) - mean) ** 2 for t, k, w in rows) / total
    mse = sum(w * (ret(t, k) - value[t]) ** 2 for t, k, w in rows) / total
    return 0.0 if var <= 0 else 1.0 - mse / var


def tabular_ceiling(batches, heldout: int, mode, factor: float) -> float:
    """Held-out EV of a tabular Monte-Carlo critic on full-history token prefixes.

    V(prefix) = mean return of the training episodes' action tokens with exactly that prefix
    (the state in full-history context); a held-out prefix never seen backs off to its longest
    seen ancestor among its own earlier action-token prefixes (the root: the mean return).
    Returns: reward-to-go with gamma = 1 and 0 after a terminal (truncated rows excluded, their
    targets need a critic). Float64.
    """
    from sao_megatron.algorithm.metrics import explained_variance

    def rows(trajs):
        for t in trajs:
            t = retarget(t, mode[0], "terminate", factor)
            ids, out = [], []
            rewards = [n.reward for n in t.nodes]
            togo = [sum(rewards[i:]) for i in range(len(rewards))]
            for node, g in zip(t.nodes, togo, strict=True):
                ids += node.observation_token_ids
                for tok in node.action_token_ids:
                    out.append((tuple(ids), g))
                    ids.append(tok)
            yield out

    sums: dict[tuple, list[float]] = {}
    for row in rows([t for b in batches[:-heldout] for t in b]):
        for key, g in row:
            s = sums.setdefault(key, [0.0, 0.0])
            s[0] += g
            s[1] += 1
    root = sum(s[0] for s in sums.values()) / max(sum(s[1] for s in sums.values()), 1)
    v, r = [], []
    for row in rows([t for b in batches[-heldout:] for t in b]):
        last = root
        for key, g in row:
            if key in sums:
                last = sums[key][0] / sums[key][1]
            v.append(last)
            r.append(g)
    v64, r64 = torch.tensor([v], dtype=torch.float64), torch.tensor([r], dtype=torch.float64)
    return explained_variance(v64, r64, torch.ones_like(v64, dtype=torch.bool))


# ---------------------------------------------------------------------------- RL runs
def rl_run(args, sft: Path, out: Path, name: str) -> Path:
    base, variants, _, _ = study(args)
    overrides, mode = variants[name]
    run_dir = out / "rl" / _slug(name)
    seed_from_sft(sft, run_dir)
    env = json.loads(collect_overrides(_job(args.config, run_dir, []))[0].split("=", 1)[1])
    for e in env:
        e["options"] |= {"reward_mode": mode[0], "budget_end": mode[1]}
    job_overrides = [
        *base,
        *overrides,
        *args.overrides,
        "stages=[value_pretrain,rl]",
        f"value_pretrain.steps={args.rl_pretrain_steps}",
        f"rl.steps={args.rl_steps}",
        f"tasks.train={json.dumps(env)}",
        f"tasks.num_eval_tasks={args.num_eval_tasks}",
        "checkpoint.save_interval=0",
        "logging.console=false",
    ]
    return run_job(args.config, job_overrides, run_dir)


def rl_figures(run_dir: Path) -> dict[str, float]:
    from sao_megatron.trainer.metrics import read_metrics

    pre = read_metrics(run_dir / "value_pretrain")
    rl = read_metrics(run_dir / "rl")

    def mean(recs, key):
        xs = [r[key] for r in recs if r.get(key) is not None and r[key] == r[key]]
        return sum(xs) / len(xs) if xs else float("nan")

    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "pretrain_steps": len(pre),
        "ev_before_pretrain_last10": mean(pre[-10:], "value/explained_variance_before"),
        "ev_before_rl_all": mean(rl, "value/explained_variance_before"),
        "ev_before_rl_last10": mean(rl[-10:], "value/explained_variance_before"),
        "ev_after_rl_last10": mean(rl[-10:], "value/explained_variance"),
        "rl_steps": len(rl),
        "success_before": summary.get("before/eval/success_rate", float("nan")),
        "success_after": summary.get("after/eval/success_rate", float("nan")),
        "pre_curve": [r.get("value/explained_variance_before") for r in pre],
        "rl_curve": [r.get("value/explained_variance_before") for r in rl],
    }


# ---------------------------------------------------------------------------- report
def read_fit(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def plot(
    fits: dict[str, list[dict]],
    rls: dict[str, dict],
    ceiling: float,
    path: Path,
    batch_size: int = 16,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if rls else 1, figsize=(13 if rls else 7.5, 4.8), squeeze=False)
    axes = axes[0]
    ax = axes[0]
    for name, recs in fits.items():
        pts = [(r["step"], r["heldout/explained_variance"]) for r in recs if "heldout/mse" in r]
        ax.plot(*zip(*pts, strict=True), marker="o", ms=3, label=name)
    if ceiling == ceiling:
        ax.axhline(ceiling, color="k", ls="--", lw=1, label=f"tabular MC critic ({ceiling:.2f})")
    ax.axhline(0.3, color="grey", ls=":", lw=1)
    ax.set_ylim(-0.5, 1.0)
    ax.set_xlabel(f"value pre-training step (one fresh batch of {batch_size} episodes each)")
    ax.set_ylabel("held-out explained variance")
    ax.set_title("value pre-training on the same rollouts (held-out, pooled)")
    ax.legend(fontsize=7)
    for name, f in rls.items():
        ax = axes[1]
        pre, rl = f["pre_curve"], f["rl_curve"]
        xs = list(range(1, len(pre) + len(rl) + 1))
        ys = [float("nan") if y is None else y for y in pre + rl]
        ax.plot(xs, ys, lw=0.8, alpha=0.5)
        sm = benchlib.smooth(list(zip(xs, ys, strict=True)), 10)
        ax.plot(*sm, lw=2, label=f"{name} (10-step mean)")
        ax.axvline(len(pre) + 0.5, color="grey", lw=0.8)
        ax.axhline(0.3, color="grey", ls=":", lw=1)
        ax.set_ylim(-1.0, 1.0)
        ax.set_xlabel("sao-train step: value pre-training, then RL (vertical line)")
        ax.set_ylabel("explained variance before the step's updates")
        ax.set_title("sao-train: fresh batch each step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"[bench] wrote {path}", flush=True)


def _f(x, fmt="{:.2f}"):
    return "-" if x is None or x != x else fmt.format(x)


def section(args, info, fits, rls, ceiling, collect_s, n_traj) -> str:
    per = n_traj // max(args.batches, 1)
    plot_file = study(args)[3]
    cmd = (
        f"python tools/bench_critic.py --study {args.study} --config {args.config} "
        f"--sampler {args.sampler} "
        f"--batches {args.batches} --steps {args.steps} --heldout {args.heldout} "
        f"--eval-every {args.eval_every} --write"
    )
    lines = [
        "Command:",
        "",
        f"    {cmd}",
        "",
        machine_line(info),
        "",
        f"Config `{args.config}`. Rollouts: {n_traj} episodes of the frozen SFT policy "
        f"({args.batches} batches of {per}, sampled once in {collect_s:.0f} s with "
        f"`--sampler {args.sampler}`); value pre-training step k trains on batch k (K = 2 value "
        "updates, `RLStep.value_step`); "
        f"held-out EV: the last {args.heldout} batches pooled, never trained on. 'EV true "
        "returns': against the returns with the budget end as terminal (value 0).",
        "",
        "| variant | held-out EV, step 0 | step 10 | step 30 | last step | EV true returns, last |"
        " held-out MSE, last |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, recs in fits.items():
        ev = {r["step"]: r for r in recs if "heldout/mse" in r}
        last = ev[max(ev)]

        def at(k, ev=ev):
            return _f(ev[k]["heldout/explained_variance"]) if k in ev else "-"

        lines.append(
            f"| {name} | {at(0)} | {at(10)} | {at(30)} | "
            f"{_f(last['heldout/explained_variance'])} (step {last['step']}) | "
            f"{_f(last['heldout/explained_variance_true_returns'])} | "
            f"{_f(last['heldout/mse'], '{:.4f}')} |"
        )
    lines += [
        "",
        f"Tabular Monte-Carlo critic on the same episodes (predictive, held-out): EV "
        f"{_f(ceiling)}.",
        "",
    ]
    if rls:
        lines += [
            f"sao-train runs (stages [value_pretrain, rl], {args.rl_pretrain_steps} value "
            f"pre-training steps, {args.rl_steps} SAO steps; EV before each step's updates, on "
            "that step's fresh batch; means over steps):",
            "",
            "| variant | EV, last 10 pre-training steps | EV, all RL steps | EV, last 10 RL steps |"
            " EV after updates, last 10 RL steps | held-out success before -> after RL |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for name, f in rls.items():
            lines.append(
                f"| {name} | {_f(f['ev_before_pretrain_last10'])} | {_f(f['ev_before_rl_all'])} "
                f"| {_f(f['ev_before_rl_last10'])} | {_f(f['ev_after_rl_last10'])} | "
                f"{_f(f['success_before'], '{:.3f}')} -> {_f(f['success_after'], '{:.3f}')} |"
            )
        lines.append("")
    lines += [f"![critic explained variance](img/{plot_file})", "", benchlib.READING]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/configs/quickstart.yaml")
    ap.add_argument("--out", default="runs/bench_critic")
    ap.add_argument("--batches", type=int, default=70, help="rollout batches to collect")
    ap.add_argument("--heldout", type=int, default=8, help="last batches kept for evaluation")
    ap.add_argument("--steps", type=int, default=60, help="value pre-training steps per variant")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument(
        "--study",
        choices=list(STUDIES),
        default="quickstart",
        help="variant set: quickstart (the first study) or plan (hanoi_plan.yaml's critic)",
    )
    ap.add_argument("--variants", nargs="*", default=None, help="default: every variant")
    ap.add_argument("--rl-variants", nargs="*", default=[])
    ap.add_argument("--rl-pretrain-steps", type=int, default=50)
    ap.add_argument("--rl-steps", type=int, default=25)
    ap.add_argument("--num-eval-tasks", type=int, default=64)
    ap.add_argument(
        "--sampler",
        choices=["vllm", "trainer"],
        default="vllm",
        help="collect with a vLLM engine (the rollout stack) or in-process (no engine)",
    )
    ap.add_argument("--only", choices=["sft", "collect", "fit", "rl", "report"], default=None)
    ap.add_argument("--write", action="store_true", help="rewrite the docs/BENCHMARKS.md section")
    ap.add_argument("overrides", nargs="*", help="job overrides for every fit and RL run")
    args = ap.parse_args()
    _, variants, section_name, plot_file = study(args)
    if args.variants is None:
        args.variants = list(variants)
    unknown = [v for v in [*args.variants, *args.rl_variants] if v not in variants]
    if unknown:
        ap.error(f"--variants/--rl-variants {unknown}: --study {args.study} has {list(variants)}")
    if args.steps + args.heldout > args.batches:
        ap.error("--steps + --heldout must not exceed --batches (each step needs a fresh batch)")
    out = REPO / args.out
    out.mkdir(parents=True, exist_ok=True)
    os.chdir(REPO)
    info_path = out / "machine.json"
    if not info_path.exists() or args.only in (None, "fit", "rl"):
        info = machine_info()
        info_path.write_text(json.dumps(info, indent=1))
    info = json.loads(info_path.read_text())
    want = {args.only} if args.only else {"sft", "collect", "fit", "rl", "report"}
    sft = shared_sft(args.config, [], out / "sft") if want & {"sft", "collect", "rl"} else None
    if want & {"collect", "fit", "report"}:
        get = collect_in_trainer if args.sampler == "trainer" else collect
        data = torch.load(get(args, sft or out / "sft", out), weights_only=False)
    fits = {}
    if "fit" in want:
        for name in args.variants:
            fits[name] = read_fit(fit(args, out, name, data["batches"]))
    for name in args.rl_variants if "rl" in want else []:
        rl_run(args, sft, out, name)
    if "report" in want:
        fits = {}
        for n in variants:
            done, part = out / "fit" / f"{_slug(n)}.jsonl", out / "fit" / f"{_slug(n)}.partial"
            if done.exists():
                fits[n] = read_fit(done)
            elif part.exists() and part.stat().st_size:
                recs = read_fit(part)
                fits[f"{n} (stopped at step {recs[-1]['step']})"] = recs
        rls = {
            n: rl_figures(d)
            for n in variants
            if ((d := out / "rl" / _slug(n)) / "summary.json").exists()
        }
        job = _job(args.config, out / "collect", [])
        factor = float(job.tasks.train[0].options.get("max_steps_factor", 1.0))
        reward_mode = next(iter(variants.values()))[1][0]
        ceiling = tabular_ceiling(data["batches"], args.heldout, (reward_mode, "terminate"), factor)
        n_traj = sum(len(b) for b in data["batches"])
        plot(fits, rls, ceiling, REPO / "docs" / "img" / plot_file, n_traj // args.batches)
        body = section(args, info, fits, rls, ceiling, data["seconds"], n_traj)
        (out / "section.md").write_text(body)
        print(body)
        if args.write:
            benchlib.write_section(section_name, body)
    if _PARALLEL is not None:
        from sao_megatron.parallel import destroy_parallel

        destroy_parallel(destroy_process_group=True)
    shutil.rmtree(out / "collect" / "hf_policy", ignore_errors=True)


if __name__ == "__main__":
    main()
