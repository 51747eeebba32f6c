"""Long episodes under bounded staleness: are they trained in proportion to the task mix?

Issue 19.1: with ``max_staleness=1`` and a slow trainer, episodes that outlived
``max_staleness + 1`` trainer steps used to be aborted as stale, restarted and finally dropped,
so a mix of short and long tasks trained only the short ones. This benchmark runs the real
`RolloutManager` (admission, buffer, router, weight-sync protocol) against the in-process fake
engines of ``tests/rollout/fakes.py`` (no vLLM: the engine is a coroutine that emits a few
tokens per action with a fixed per-token latency) and a trainer that sleeps
``--trainer-step-s`` per step, then reports:

* the fraction of long tasks in the task stream and among trained trajectories (with the
  binomial standard error of the latter and the gap in standard errors);
* the fraction of trained action tokens older than the bound, which the trainer drops from the
  policy loss (`sao_megatron.rollout.staleness.stale_token_mask`), overall and on long
  trajectories;
* the rollout's stale requeues and failed groups.

A trained set is the batches of the run; long tasks started in the last few steps cannot have
finished, so the trained fraction sits slightly below the task fraction by about
(episode length / run length); long runs (``--steps``) shrink that.

Usage::

    python tools/bench_staleness.py --steps 60 --trainer-step-s 1.0
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from sao_megatron.rollout.config import RolloutConfig  # noqa: E402
from sao_megatron.rollout.manager import RolloutManager  # noqa: E402
from sao_megatron.rollout.staleness import stale_token_mask  # noqa: E402
from tests.rollout.fakes import (  # noqa: E402
    FakeEngine,
    FakeEngineClient,
    make_formatter,
    short_long_tasks,
)


def run(args: argparse.Namespace) -> dict:
    """One benchmark run; returns its figures."""
    engines = {f"http://fake{i}": FakeEngine(f"engine{i}", args.token_latency_s) for i in range(2)}
    FakeEngineClient.registry = engines
    tasks = short_long_tasks(10**6, long_every=args.long_every, long_steps=args.long_steps)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = RolloutConfig(
            engine_urls=list(engines),
            max_model_len=args.long_steps * 40 + 64,
            max_tokens_per_action=16,
            trajectories_per_batch=args.batch,
            max_concurrent_episodes=args.concurrency,
            max_staleness=args.max_staleness,
            max_episode_attempts=3,
            request_timeout_s=60.0,
            seed=0,
        )
        trained, stale_tokens, tokens, long_stale, long_tokens = [], 0, 0, 0, 0
        t0 = time.monotonic()
        with RolloutManager(
            cfg, make_formatter(), tasks, client_factory=FakeEngineClient, run_dir=tmp
        ) as m:
            for step in range(args.steps):
                batch = m.get_batch(train_version=step, timeout=600)
                for t in batch:
                    v = torch.tensor([x for n in t.nodes for x in n.policy_versions])
                    s = int(stale_token_mask(v, step, args.max_staleness).sum())
                    stale_tokens, tokens = stale_tokens + s, tokens + v.numel()
                    if t.task_id.startswith("long/"):
                        long_stale, long_tokens = long_stale + s, long_tokens + v.numel()
                trained += batch
                time.sleep(args.trainer_step_s)  # the trainer's step
                m.publish_weights({"w": torch.zeros(1)}, version=step + 1)
            counters = dict(m.counters)
        wall = time.monotonic() - t0
    FakeEngineClient.registry = {}
    n = len(trained)
    n_long = sum(t.task_id.startswith("long/") for t in trained)
    f_tasks = 1.0 / args.long_every
    f_trained = n_long / n
    se = math.sqrt(f_tasks * (1 - f_tasks) / n)
    long_trajs = [t for t in trained if t.task_id.startswith("long/")]
    spans = [t.max_policy_version - t.min_policy_version for t in long_trajs]
    return {
        "steps": args.steps,
        "trainer_step_s": args.trainer_step_s,
        "max_staleness": args.max_staleness,
        "long_steps": args.long_steps,
        "wall_s": round(wall, 1),
        "trained": n,
        "trained_long": n_long,
        "long_fraction_tasks": round(f_tasks, 4),
        "long_fraction_trained": round(f_trained, 4),
        "standard_error": round(se, 4),
        "gap_in_standard_errors": round((f_trained - f_tasks) / se, 2),
        "stale_token_fraction": round(stale_tokens / max(tokens, 1), 4),
        "stale_token_fraction_long": round(long_stale / max(long_tokens, 1), 4),
        "long_versions_spanned_mean": round(sum(spans) / max(len(spans), 1), 2),
        "requeued_stale": counters.get("requeued_stale", 0),
        "failed_groups": counters.get("failed_groups", 0),
        "episodes_started": counters.get("episodes_started", 0),
        "loadavg_1min": round(os.getloadavg()[0], 1),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60, help="trainer steps")
    p.add_argument("--trainer-step-s", type=float, default=1.0, help="seconds per trainer step")
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--batch", type=int, default=4, help="rollout.trajectories_per_batch")
    p.add_argument("--concurrency", type=int, default=16, help="max_concurrent_episodes")
    p.add_argument("--long-every", type=int, default=4, help="every k-th task is long")
    p.add_argument("--long-steps", type=int, default=500, help="actions of a long episode")
    p.add_argument("--token-latency-s", type=float, default=0.001, help="fake engine latency")
    args = p.parse_args(argv)
    print(json.dumps(run(args), indent=1))


if __name__ == "__main__":
    main()
