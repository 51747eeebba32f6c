"""`sao-train CONFIG.yaml [section.field=value ...]`: run a job (SFT -> value pre-training -> RL).

Launch with ``torchrun --nproc_per_node=N -m sao_megatron.cli.train CONFIG ...`` for several
ranks (see launch_scripts/). ``--help`` lists the example configs and every config field.
``--import MODULE`` (repeatable; a dotted module name or a .py path) imports a plug-in that
registers an algorithm or environment before the config is read, like the config's
``plugins:`` list, to which it is added (`sao_megatron.plugins`); every rank gets the same
command line, so every rank imports it.

Exit codes: 0 done; 2 a user error, printed as one line without a traceback: a config error
(``sao-train: config error: ...``), a plug-in that cannot be imported (``sao-train: plug-in
error: ...``) or a checkpoint that cannot be resumed from (``sao-train: checkpoint error:
<path> ...; <what to do>``, rank 0 prints it).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import logging
import os
import re
import sys
import textwrap
import typing
import warnings
from collections.abc import Sequence
from pathlib import Path

from sao_megatron.plugins import add_import_argument

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "configs"
USAGE_EXAMPLE = (
    "example:\n  sao-train examples/configs/quickstart.yaml rl.steps=5\n"
    "  torchrun --nproc_per_node=2 -m sao_megatron.cli.train "
    "examples/configs/multirank_tp2_ep2.yaml\n"
    "  sao-train examples/configs/quickstart.yaml --import examples/algorithms/rebn.py "
    "algorithm.name=rebn\n"
    "`sao-train --help` lists the example configs and every config field."
)


def _class_field_docs(cls: type) -> dict[str, str]:
    """Field -> one-line description of a config dataclass: the string literal after a field
    (attribute docstring) or its entry in a ``Fields:`` section of the class docstring."""
    docs: dict[str, str] = {}
    text = inspect.getdoc(cls) or ""
    match = re.search(r"^Fields:\n((?:[ \t]+.*\n?|\n)+)", text, flags=re.M)
    if match:
        name = None
        for line in match.group(1).splitlines():
            entry = re.match(r"^\s{2,8}(\w+)(?: \([^)]*\))?: (.*)$", line)
            if entry:
                name = entry.group(1)
                docs[name] = entry.group(2).strip()
            elif name and line.strip():
                docs[name] += " " + line.strip()
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return docs
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    for node, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def field_docs(schema: type, prefix: str = "") -> dict[str, str]:
    """Dotted field -> description for every documented field of a nested config dataclass."""
    out: dict[str, str] = {}
    own = _class_field_docs(schema)
    try:
        hints = typing.get_type_hints(schema)
    except Exception:  # noqa: BLE001 - a hint that does not resolve: no nested docs for it
        hints = {}
    for f in dataclasses.fields(schema):
        name = prefix + f.name
        if f.name in own:
            out[name] = own[f.name]
        hint = hints.get(f.name)
        if dataclasses.is_dataclass(hint):
            out |= field_docs(hint, name + ".")
    return out


def _help_epilog() -> str:
    with warnings.catch_warnings():  # Megatron/Apex import-time warnings are not for --help
        warnings.simplefilter("ignore")
        from sao_megatron.configs import describe
        from sao_megatron.trainer.job import JobConfig

        rows = describe(JobConfig)
        docs = field_docs(JobConfig)
    configs = sorted(p.name for p in EXAMPLES.glob("*.yaml")) if EXAMPLES.is_dir() else []
    sections: dict[str, list[str]] = {}
    for name, default in rows:
        head = name.split(".")[0] if "." in name else "(top level)"
        line = f"  {name} = {default}"
        if name in docs:
            line += "\n" + textwrap.fill(
                docs[name], width=96, initial_indent="      ", subsequent_indent="      "
            )
        sections.setdefault(head, []).append(line)
    body = "\n".join(f"[{s}]\n" + "\n".join(v) for s, v in sections.items())
    listing = "\n".join(f"  examples/configs/{c}" for c in configs) or "  (none found)"
    return (
        f"example configs:\n{listing}\n\n"
        "overrides: dotted fields, e.g. rl.steps=5 algorithm.name=grpo 'stages=[sft,rl]'\n\n"
        f"config fields and defaults (sections):\n{body}"
    )


def build_parser(with_fields: bool = True) -> argparse.ArgumentParser:
    """The argument parser; ``with_fields`` builds the config-field listing of ``--help`` (it
    imports the config classes, so it is left out when not asked for help)."""
    return argparse.ArgumentParser(
        prog="sao-train",
        description=textwrap.dedent(__doc__).strip().splitlines()[0],
        epilog=_help_epilog() if with_fields else USAGE_EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def _setup_logging(rank: int) -> None:
    """Rank 0 logs INFO to stdout; other ranks only WARNING and above, prefixed ``[rank r]``."""
    prefix = "" if rank == 0 else f"[rank {rank}] "
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"{prefix}%(asctime)s %(name)s %(levelname)s: %(message)s",
        stream=sys.stdout,
        force=True,
    )
    for noisy in ("httpx", "megatron", "megatron.core"):  # per-request / per-bucket INFO lines
        logging.getLogger(noisy).setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(with_fields=any(a in ("-h", "--help") for a in argv))
    parser.add_argument("config", help="YAML job config (see example configs below)")
    parser.add_argument("overrides", nargs="*", help="section.field=value overrides")
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config and exit"
    )
    add_import_argument(
        parser,
        "import a plug-in module (dotted name or .py path) before the config is read, so "
        "the algorithms/environments it registers can be named; repeatable; added to the "
        "config's plugins list",
    )
    if not argv:  # a bare `sao-train`: how to call it, not "the following arguments..."
        parser.print_usage(sys.stderr)
        parser.exit(2, f"sao-train: give a job config\n{USAGE_EXAMPLE}\n")
    args = parser.parse_intermixed_args(argv)  # flags may sit between config and overrides

    # Megatron warns at import that Apex / Transformer Engine are absent, once per module (six
    # lines): expected on CPU, and on GPUs the platform log says which kernels were chosen.
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed")
    from sao_megatron.configs import load_config, to_yaml
    from sao_megatron.plugins import PluginError, import_plugins
    from sao_megatron.trainer.job import JobConfig

    try:
        import_plugins(args.imports, origin="--import")
        job = load_config(JobConfig, args.config, args.overrides)
    except PluginError as e:
        parser.exit(2, f"sao-train: plug-in error: {e}\n")
    except (ValueError, FileNotFoundError) as e:
        parser.exit(2, f"sao-train: config error: {e}\n")
    # recorded in run_dir/config.yaml: `sao-train RUN_DIR/config.yaml` imports them again
    job.plugins += [m for m in dict.fromkeys(args.imports) if m not in job.plugins]
    if args.print_config:
        print(to_yaml(job))
        return 0
    _setup_logging(int(os.environ.get("RANK", "0")))
    from sao_megatron.parallel import destroy_parallel, initialize_parallel
    from sao_megatron.trainer.checkpoint import CheckpointError
    from sao_megatron.trainer.controller import Controller
    from sao_megatron.trainer.report import final_report
    from sao_megatron.trainer.signals import StoppedBySignal, install

    install()  # [signals] SIGTERM/SIGUSR1: finish the step, checkpoint, exit 0

    Path(job.run_dir).mkdir(parents=True, exist_ok=True)
    parallel = initialize_parallel(job.parallel)
    if parallel.rank == 0:
        pf = parallel.platform
        logging.getLogger("sao_megatron.trainer").info(
            "platform: %s, %s, %s layer specs, %d rank(s)",
            pf.device.type,
            pf.backend,
            "Transformer Engine" if pf.use_te else "Megatron-Core local",
            parallel.world_size,
        )
        from sao_megatron.platform import slow_bf16_warning

        if job.precision.auto_reason is not None:
            logging.getLogger("sao_megatron.trainer").info(
                "precision.params_dtype=auto -> %s (%s)",
                job.precision.params_dtype,
                job.precision.auto_reason,
            )
        if (slow := slow_bf16_warning(pf, job.precision.params_dtype)) is not None:
            logging.getLogger("sao_megatron.trainer").warning(slow)
        from sao_megatron.trainer.derived import engine_anchor_warning, log_overrides

        log_overrides(job.derived_settings)  # e.g. parallel.seed=7 set explicitly (derived ...)
        if (anchor := engine_anchor_warning(job)) is not None:
            logging.getLogger("sao_megatron.trainer").warning(anchor)
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
