"""`sao-serve CONFIG [--import MODULE] [section.field=value ...]`: a cluster's engine step.

Reads the trainer's job config and overrides (the same command line as ``sao-train``, so both
resolve the same ``rollout`` section and ``run_dir``) and serves ``rollout.num_engines`` vLLM
engines on this node for the trainer that finds them through ``rollout.engine_urls_file``
(`sao_megatron.rollout.serve`: the hand-off, the engines, the exit codes; docs/CLUSTERS.md).
The SLURM script runs it as its engine step (``python -m sao_megatron.cli.serve``), one task per
engine node; the task index and count come from ``SLURM_PROCID`` / ``SLURM_NTASKS``.

Exit codes: 0 released by the trainer or stopped by a signal; 1 the engines failed to start or
all died; 2 a config or plug-in error (one line, before any engine starts).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from collections.abc import Sequence

from sao_megatron.plugins import add_import_argument
from sao_megatron.rollout.serve import HOST_ENV, resolve_urls_file, serve

PROG = "sao-serve"


def build_parser() -> argparse.ArgumentParser:
    """The command line of `main` (the job's config and overrides, ``--host``, ``--import``)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Start rollout.num_engines vLLM engines on this node for a trainer that finds them "
            "through rollout.engine_urls_file (docs/CLUSTERS.md). Give the trainer's config and "
            "overrides."
        ),
    )
    parser.add_argument("config", help="the job's YAML config")
    parser.add_argument("overrides", nargs="*", help="section.field=value overrides")
    parser.add_argument(
        "--host",
        default=os.environ.get(HOST_ENV) or socket.gethostname(),
        help=f"address to listen on and advertise (default ${HOST_ENV}, else the hostname)",
    )
    add_import_argument(
        parser,
        "a plug-in module to import before the config is read (as sao-train --import)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``sao-serve``; returns the exit code (see the module docstring)."""
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)
    from sao_megatron.configs import load_config
    from sao_megatron.plugins import PluginError, import_plugins
    from sao_megatron.trainer.job import JobConfig

    try:
        import_plugins(args.imports, origin="--import")
        job = load_config(JobConfig, args.config, args.overrides)
        urls_file = resolve_urls_file(job.rollout, job.run_dir)
    except PluginError as e:
        parser.exit(2, f"{PROG}: plug-in error: {e}\n")
    except (ValueError, FileNotFoundError) as e:
        parser.exit(2, f"{PROG}: config error: {e}\n")
    task = int(os.environ.get("SLURM_PROCID", "0"))
    logging.basicConfig(
        level=logging.INFO,
        format=f"[engines {task}] %(asctime)s %(name)s %(levelname)s: %(message)s",
        stream=sys.stdout,
        force=True,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return serve(
        job.rollout,
        urls_file,
        host=args.host,
        task=task,
        num_tasks=int(os.environ.get("SLURM_NTASKS", "1")),
    )


if __name__ == "__main__":
    sys.exit(main())
