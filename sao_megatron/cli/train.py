"""`sao-train CONFIG.yaml [section.field=value ...]`: run a job (SFT -> value pre-training -> RL).

Launch with ``torchrun --nproc_per_node=N -m sao_megatron.cli.train CONFIG ...`` for several
ranks (see launch_scripts/). ``--help`` lists the example configs and every config field.

Exit codes: 0 done; 2 a user error, printed as one line without a traceback: a config error
(``sao-train: config error: ...``) or a checkpoint that cannot be resumed from
(``sao-train: checkpoint error: <path> ...; <what to do>``, rank 0 prints it).
"""

from __future__ import annotations

import argparse
import logging
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "configs"


def _help_epilog() -> str:
    from sao_megatron.configs import describe
    from sao_megatron.trainer.job import JobConfig

    configs = sorted(p.name for p in EXAMPLES.glob("*.yaml")) if EXAMPLES.is_dir() else []
    rows = describe(JobConfig)
    sections: dict[str, list[str]] = {}
    for name, default in rows:
        head = name.split(".")[0] if "." in name else "(top level)"
        sections.setdefault(head, []).append(f"  {name} = {default}")
    body = "\n".join(f"[{s}]\n" + "\n".join(v) for s, v in sections.items())
    listing = "\n".join(f"  examples/configs/{c}" for c in configs) or "  (none found)"
    return (
        f"example configs:\n{listing}\n\n"
        "overrides: dotted fields, e.g. rl.steps=5 algorithm.name=grpo 'stages=[sft,rl]'\n\n"
        f"config fields and defaults (sections):\n{body}"
    )


def build_parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog="sao-train",
        description=textwrap.dedent(__doc__).strip().splitlines()[0],
        epilog=_help_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    parser.add_argument("config", help="YAML job config (see example configs below)")
    parser.add_argument("overrides", nargs="*", help="section.field=value overrides")
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config and exit"
    )
    args = parser.parse_intermixed_args(argv)  # flags may sit between config and overrides

    from sao_megatron.configs import load_config, to_yaml
    from sao_megatron.trainer.job import JobConfig

    try:
        job = load_config(JobConfig, args.config, args.overrides)
    except (ValueError, FileNotFoundError) as e:
        parser.exit(2, f"sao-train: config error: {e}\n")
    if args.print_config:
        print(to_yaml(job))
        return 0
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s: %(message)s",
        stream=sys.stdout,
    )
    for noisy in ("httpx", "megatron", "megatron.core"):  # per-request / per-bucket INFO lines
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from sao_megatron.parallel import destroy_parallel, initialize_parallel
    from sao_megatron.trainer.checkpoint import CheckpointError
    from sao_megatron.trainer.controller import Controller
    from sao_megatron.trainer.report import final_report
    from sao_megatron.trainer.signals import StoppedBySignal, install

    install()  # [signals] SIGTERM/SIGUSR1: finish the step, checkpoint, exit 0

    Path(job.run_dir).mkdir(parents=True, exist_ok=True)
    parallel = initialize_parallel(job.parallel)
    checkpoint_error = None
    try:
        summary = Controller(job, parallel).run()
        if parallel.rank == 0:
            print(final_report(job, summary))
    except CheckpointError as e:  # raised on every rank together (the manager broadcasts it)
        checkpoint_error = str(e)
    except StoppedBySignal as stop:  # [signals] engines already stopped by the controller
        if parallel.rank == 0:
            logging.getLogger("sao_megatron.trainer").info("%s", stop)
    finally:
        destroy_parallel(destroy_process_group=True)
    if checkpoint_error is not None:
        parser.exit(
            2, f"sao-train: checkpoint error: {checkpoint_error}\n" if parallel.rank == 0 else None
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
