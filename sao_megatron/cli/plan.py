"""`sao-plan CONFIG [section.field=value ...] --nodes N --gpus-per-node G --gpu-memory-gib M`.

Before a job queues: resolves the config exactly as `sao-train` does, checks every parallel
layout rule on the target world and prints the memory of every kind of GPU at its peak
(parameters, gradients, optimiser state with and without the distributed optimiser,
activations, the vLLM engines beside it); ``--json`` prints the same as JSON. No model is built
and no GPU is needed. The model of the memory: `sao_megatron.plan.memory`.

Exit codes: 0 it fits; 2 a config error or a layout rule broken (each printed with its fix);
3 it does not fit (which GPU and by how much).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import warnings
from collections.abc import Sequence

from sao_megatron.plugins import add_import_argument

EXAMPLE = (
    "example:\n  sao-plan examples/configs/cluster/qwen3_30b_a3b_2x8_h100.yaml --nodes 2 "
    "--gpus-per-node 8 --gpu-memory-gib 80 --rollout-nodes 1"
)
FITS, ERROR, DOES_NOT_FIT = 0, 2, 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sao-plan",
        description=textwrap.dedent(__doc__).strip().splitlines()[0],
        epilog=textwrap.dedent(__doc__).split("\n\n", 1)[1] + "\n" + EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("config", help="YAML job config (as for sao-train)")
    parser.add_argument("overrides", nargs="*", help="section.field=value overrides")
    parser.add_argument("--nodes", type=int, required=True, help="nodes of the allocation")
    parser.add_argument(
        "--gpus-per-node", type=int, required=True, help="GPUs per node (one rank per GPU)"
    )
    parser.add_argument(
        "--gpu-memory-gib", type=float, required=True, help="memory of one GPU (H100 80, H200 141)"
    )
    parser.add_argument(
        "--rollout-nodes",
        type=int,
        default=0,
        help="nodes for the vLLM engines (ROLLOUT_NODES of train_slurm.sbatch; default 0: "
        "beside rank 0)",
    )
    parser.add_argument(
        "--headroom-gib",
        type=float,
        default=2.0,
        help="per-GPU memory kept for the CUDA context, NCCL and fragmentation (default 2)",
    )
    parser.add_argument(
        "--attention",
        choices=("flash", "unfused"),
        default="flash",
        help="activation model of attention: flash (Transformer Engine, GPU; default) or "
        "unfused (Megatron local specs, CPU)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_import_argument(
        parser,
        "import a plug-in module before the config is read (as sao-train --import)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed")
    from sao_megatron.configs import load_config
    from sao_megatron.plan import ClusterTarget, format_plan, make_plan, plan_json
    from sao_megatron.plugins import PluginError, import_plugins
    from sao_megatron.trainer.job import JobConfig

    try:
        import_plugins(args.imports, origin="--import")
        job = load_config(JobConfig, args.config, args.overrides)
        target = ClusterTarget(
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            gpu_memory_gib=args.gpu_memory_gib,
            rollout_nodes=args.rollout_nodes,
            headroom_gib=args.headroom_gib,
        )
    except PluginError as e:
        parser.exit(ERROR, f"sao-plan: plug-in error: {e}\n")
    except (ValueError, FileNotFoundError) as e:
        parser.exit(ERROR, f"sao-plan: config error: {e}\n")
    plan = make_plan(job, target, attention=args.attention)
    print(plan_json(plan) if args.json else format_plan(plan, args.config))
    if plan.errors:
        return ERROR
    return FITS if plan.fits else DOES_NOT_FIT


if __name__ == "__main__":
    sys.exit(main())
