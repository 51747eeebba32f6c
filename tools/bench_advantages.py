"""Time the advantage computations on long multi-node trajectories (a benchmark, not a test).

Batch: B trajectories of N action nodes; each node is an observation block of O tokens followed
by A action tokens (defaults B=64, N=500, O=A=20, so T = 20,000 tokens per row). Times
the algorithms' `advantages` for the three SAO granularities and GRPO (groups of 8), plus the naive
reverse scan over T (one vectorised step per token, what the chunked scan replaces) for
reference. Prints a markdown table of the median wall time over --repeats runs.

    python tools/bench_advantages.py [--batch 64] [--nodes 500] [--obs-tokens 20]
        [--action-tokens 20] [--repeats 5] [--naive-repeats 1] [--device cpu]
        [--threads N]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from sao_megatron.algorithm import registry
from sao_megatron.algorithm.base import AdvantageInputs
from sao_megatron.algorithm.config import AlgorithmConfig, SAOConfig


def make_batch(batch: int, nodes: int, obs: int, act: int, device: str):
    per_node = obs + act
    t_len = nodes * per_node
    pos = torch.arange(t_len, device=device)
    mask = ((pos % per_node) >= obs).expand(batch, t_len).contiguous()
    node_index = (pos // per_node).expand(batch, t_len).contiguous()
    g = torch.Generator(device=device).manual_seed(0)
    values = torch.randn(batch, t_len, generator=g, device=device)
    node_rewards = torch.zeros(batch, nodes, device=device)
    node_rewards[:, -1] = torch.randint(0, 2, (batch,), generator=g, device=device).float()
    truncated = torch.zeros(batch, dtype=torch.bool, device=device)
    truncated[::4] = True
    bootstrap = torch.randn(batch, generator=g, device=device)
    groups = torch.arange(batch, device=device) // 8
    return dict(
        node_rewards=node_rewards,
        node_index=node_index,
        action_mask=mask,
        values=values,
        truncated=truncated,
        bootstrap_values=bootstrap,
        group_ids=groups,
    )


def naive_token_scan(values, rewards_tok, mask, next_values, gamma: float, lam: float):
    """Reverse loop over T (vectorised over rows): the formulation the chunked scan replaces.

    Computes the same outputs as the action_token path: policy advantages (lambda = lam) and
    value targets (lambda = 1).
    """
    b, t_len = values.shape
    adv = torch.zeros_like(values)
    ret = torch.zeros_like(values)
    a_next = values.new_zeros(b)
    g_next = values.new_zeros(b)
    v_next = next_values.to(values.dtype).clone()
    for t in range(t_len - 1, -1, -1):
        m = mask[:, t]
        delta = rewards_tok[:, t] + gamma * v_next - values[:, t]
        a = delta + gamma * lam * a_next
        g = delta + gamma * g_next
        a_next = torch.where(m, a, a_next)
        g_next = torch.where(m, g, g_next)
        v_next = torch.where(m, values[:, t], v_next)
        adv[:, t] = torch.where(m, a, 0.0)
        ret[:, t] = torch.where(m, g + values[:, t], 0.0)
    return adv, ret


def timed(fn, repeats: int, device: str) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--nodes", type=int, default=500)
    p.add_argument("--obs-tokens", type=int, default=20)
    p.add_argument("--action-tokens", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--naive-repeats", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    bt = make_batch(args.batch, args.nodes, args.obs_tokens, args.action_tokens, args.device)
    b, t_len = bt["values"].shape
    print(
        f"# batch={b} nodes={args.nodes} T={t_len} action tokens/row="
        f"{int(bt['action_mask'][0].sum())} device={args.device} "
        f"torch={torch.__version__} threads={torch.get_num_threads()} "
        f"cpu={platform.processor() or platform.machine()} "
        f"loadavg_1min={os.getloadavg()[0]:.1f}"
    )
    rows = []
    for gran in ("action_token", "node_last_token", "node_mean"):
        sao = SAOConfig(advantage_granularity=gran, gamma=1.0, lam_policy=0.95)
        algo = registry.build(AlgorithmConfig(sao=sao))
        kw = AdvantageInputs(**{k: v for k, v in bt.items() if k != "group_ids"})
        rows.append(
            (
                f"sao {gran}",
                timed(lambda a=algo, k=kw: a.advantages(k), args.repeats, args.device),
                args.repeats,
            )
        )
    grpo = registry.build(AlgorithmConfig(name="grpo"))
    kw = AdvantageInputs(
        **{k: bt[k] for k in ("node_rewards", "node_index", "action_mask", "group_ids")}
    )
    rows.append(
        (
            "grpo (groups of 8)",
            timed(lambda: grpo.advantages(kw), args.repeats, args.device),
            args.repeats,
        )
    )
    if args.naive_repeats > 0:
        from sao_megatron.algorithm.advantages import final_next_values, token_rewards_from_nodes

        r_tok = token_rewards_from_nodes(bt["node_rewards"], bt["node_index"], bt["action_mask"])
        nxt = final_next_values(bt["truncated"], bt["bootstrap_values"], True)
        args_naive = (bt["values"], r_tok, bt["action_mask"], nxt, 1.0, 0.95)
        fn = lambda: naive_token_scan(*args_naive)  # noqa: E731
        # the fast path must agree with the plain loop on this very batch
        sao = SAOConfig(advantage_granularity="action_token", gamma=1.0, lam_policy=0.95)
        fast = registry.build(AlgorithmConfig(sao=sao)).advantages(
            AdvantageInputs(**{k: v for k, v in bt.items() if k != "group_ids"})
        )
        slow_adv, slow_ret = naive_token_scan(
            *(a.double() if torch.is_tensor(a) and a.is_floating_point() else a for a in args_naive)
        )
        err = max(
            float((fast.advantages.double() - slow_adv).abs().max()),
            float((fast.returns.double() - slow_ret).abs().max()),
        )
        scale = float(slow_ret.abs().max())
        print(f"# check: max |chunked - naive float64 loop| = {err:.2e} (max |value| {scale:.1f})")
        rows.append(
            (
                "naive reverse loop over T (action_token)",
                timed(fn, args.naive_repeats, args.device),
                args.naive_repeats,
            )
        )
    print("| computation | median wall time (ms) | repeats |")
    print("|---|---:|---:|")
    for name, sec, n in rows:
        print(f"| {name} | {sec * 1e3:.1f} | {n} |")


if __name__ == "__main__":
    main()
