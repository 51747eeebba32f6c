"""Command line: list environments, their options, or one sample episode as the agent sees it.

    python -m sao_megatron.cli.envs list
    python -m sao_megatron.cli.envs options hanoi    # the options table (docs/ENVIRONMENTS.md)
    python -m sao_megatron.cli.envs show hanoi --seed 3 --horizon 20 [--epsilon 0.1]
    python -m sao_megatron.cli.envs show all --horizon 5       # every registered environment
    python -m sao_megatron.cli.envs show chain_sum --option difficulty='{"max_digits": 2}'
    python -m sao_megatron.cli.envs show hanoi --tokenizer ckpt/  # also count tokens
    python -m sao_megatron.cli.envs --import my_envs.py show my_env  # a plug-in's environment

The episode is played by the environment's gold policy (noisy-gold with --epsilon > 0, for
environments that support it) and printed in the episode text format of
`sao_megatron.data.episode` (markers included, bos omitted), followed by a summary line.
"""

from __future__ import annotations

import argparse
import json
import sys

from sao_megatron.data.demonstrations import run_demonstration
from sao_megatron.data.episode import EpisodeFormatConfig, EpisodeFormatter
from sao_megatron.envs import make_env, options_schema, registered_envs
from sao_megatron.envs.base import fixed_options
from sao_megatron.envs.options import options_table
from sao_megatron.plugins import PluginError, add_import_argument, import_plugins


def _parse_option(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--option {text!r}: use KEY=VALUE (VALUE parsed as JSON)")
    key, value = text.split("=", 1)
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m sao_megatron.cli.envs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_import_argument(
        parser, "a plug-in module (dotted name or .py path) that registers environments"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="print the registered environment names")
    opts = sub.add_parser("options", help="print an environment's options as a markdown table")
    opts.add_argument("name", help=f"an environment name, one of {registered_envs()}")
    show = sub.add_parser("show", help="print one sample episode of an environment")
    show.add_argument("name", help=f"'all' or an environment name, one of {registered_envs()}")
    show.add_argument("--seed", type=int, default=0, help="episode seed (default 0)")
    show.add_argument("--horizon", type=int, default=None, help="horizon H (Hanoi)")
    show.add_argument("--epsilon", type=float, default=0.0, help="noisy-gold wrong-move rate")
    show.add_argument(
        "--option",
        type=_parse_option,
        action="append",
        default=[],
        help="extra env option KEY=VALUE (JSON value), repeatable",
    )
    show.add_argument(
        "--window",
        type=int,
        default=None,
        help="also print the windowed context of the last action (K pairs)",
    )
    show.add_argument(
        "--tokenizer", default=None, help="tokenizer .model file or directory: report token counts"
    )
    args = parser.parse_args(argv)
    try:
        import_plugins(args.imports, origin="--import")
    except PluginError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    if args.command == "list":
        print("\n".join(registered_envs()))
        return 0
    if args.command == "options":
        try:
            schema = options_schema(args.name)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if schema is None:
            print(f"{args.name}: no options dataclass declared (its factory's keyword parameters)")
            return 0
        print(options_table(schema, fixed_options(args.name)))
        return 0
    if args.name == "all":
        rc = 0
        for name in registered_envs():
            if name == "agent":
                continue  # an agent function (needs agent=/task=), not a text-step environment
            if name == "reasoning_gym":
                continue  # generic wrapper: needs dataset=...; chain_sum/basic_arithmetic show it
            if name == "gem":
                continue  # generic wrapper: needs env_id=... (show gem --option env_id=...)
            print(f"===== {name}")
            rc = max(rc, main(["show", name, *_forwarded(args, name)]))
        return rc
    options = dict(args.option)
    if args.horizon is not None:
        options["horizon"] = args.horizon
    try:
        env = make_env(args.name, **options)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    demo = run_demonstration(env, args.seed, noise_epsilon=args.epsilon)
    print(demo.text())
    print(
        f"\n--- {demo.task_id}: {len(demo.actions)} actions "
        f"({demo.is_gold.count(False)} deliberate mistakes), total reward {demo.total_reward}, "
        f"terminated={demo.terminated} truncated={demo.truncated}, info={demo.info}"
    )
    if args.tokenizer or args.window is not None:
        from sao_megatron.data.tokenizer import load_tokenizer

        if not args.tokenizer:
            print("error: --window needs --tokenizer", file=sys.stderr)
            return 2
        tok = load_tokenizer(args.tokenizer)
        fmt = EpisodeFormatConfig(
            context_mode="window" if args.window is not None else "full_history",
            window_size=args.window or 0,
        )
        seqs = demo.to_sft_sequences(EpisodeFormatter(tok, fmt), train_on_noise=True)
        print(
            f"--- tokens: {[len(s) for s in seqs]} per sequence, {sum(len(s) for s in seqs)} total"
        )
        if args.window is not None:
            print("--- last windowed context + action:")
            print(tok.decode(seqs[-1].token_ids.tolist()))
    return 0


def _forwarded(args: argparse.Namespace, name: str) -> list[str]:
    """The `show all` options that apply to environment `name` (horizon only to hanoi)."""
    out = ["--seed", str(args.seed), "--epsilon", str(args.epsilon)]
    if args.horizon is not None and name == "hanoi":
        out += ["--horizon", str(args.horizon)]
    if args.tokenizer:
        out += ["--tokenizer", args.tokenizer]
    if args.window is not None:
        out += ["--window", str(args.window)]
    return out


if __name__ == "__main__":
    sys.exit(main())
