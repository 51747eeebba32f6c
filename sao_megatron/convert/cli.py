"""``sao-convert``: HF safetensors checkpoints <-> sao_megatron Megatron checkpoints."""

from __future__ import annotations

import argparse
import math
import os
import re
import socket
import sys
from collections.abc import Sequence

_EPILOG = """\
examples:
  sao-convert hf-to-megatron --hf Qwen3-30B-A3B --out ckpt/qwen3 --tp 2 --ep 4
  torchrun --nproc_per_node 8 -m sao_megatron.convert.cli hf-to-megatron --hf H --out O --ep 8
  sao-convert megatron-to-hf --ckpt ckpt/qwen3 --out exported/qwen3

The Megatron checkpoint (dist_checkpointing) loads into any TP/PP/EP layout; --tp/--pp/--ep
only choose how the conversion itself is split (memory per process; experts are kept whole,
expert_tp=1). Without torchrun, hf-to-megatron starts pp*lcm(tp, ep) local processes itself.
See docs/CONVERSION.md.
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
    """The ``sao-convert`` argument parser (subcommands ``hf-to-megatron``, ``megatron-to-hf``)."""
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
        help="HF folder (config.json + safetensors) -> Megatron dist checkpoint",
        description="Read an HF safetensors checkpoint tensor by tensor and write a Megatron "
        "dist_checkpointing folder (policy/), its metadata (sao_convert.json) and the HF "
        "config/tokenizer (hf/). The output folder appears only when complete.",
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
        help="Megatron checkpoint made by hf-to-megatron (or trained from one) -> HF folder",
        description="Load the checkpoint at TP=PP=EP=1 in one process and write sharded "
        "safetensors with model.safetensors.index.json, config.json and the tokenizer files.",
    )
    to_hf.add_argument("--ckpt", required=True, help="converted Megatron checkpoint folder")
    to_hf.add_argument("--out", required=True, help="output HF folder")
    to_hf.add_argument(
        "--max-shard-size",
        type=_parse_size,
        default=_parse_size("5GB"),
        help="largest safetensors shard (default 5GB)",
    )
    to_hf.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    return parser


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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

    state = initialize_parallel(
        ParallelConfig(
            tp=args.tp, pp=args.pp, ep=args.ep, expert_tp=1, sequence_parallel=args.tp > 1
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
        mp.start_processes(
            _hf_to_megatron_rank,
            args=(args, world, _free_port()),
            nprocs=world,
            start_method="spawn",
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
