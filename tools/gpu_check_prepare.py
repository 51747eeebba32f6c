"""Prepare tools/gpu_check.py for the lent GPU machine: wheels of what it lacks, the call to make.

The lent machine (one H200; Python 3.12, torch 2.11+cu130, no network) has neither Megatron-Core
nor omegaconf (`CARRY`: what the check's imports reach beyond the image). Run here, on a
machine with a package index, this script:

1. reads the versions ``.venv`` uses (``pip freeze``) for every package of `CARRY`;
2. puts their wheels for CPython 3.12 manylinux x86_64 in ``.whl/`` (``pip download
   --only-binary=:all:``); those with no wheel on the index (`FROM_SDIST`) are built here from
   their sdist with a CPython 3.12 (``pip wheel --no-deps``); wheels already there are reused,
   and wheels of other versions removed (two versions of one package stop the install);
3. adds ``/.whl/`` to ``.git/info/exclude`` (it travels only as a carried path);
4. checks that the working tree that travels (tracked and untracked-not-ignored files) plus the
   wheels fit the 64 MiB a call carries;
5. prints the device call: the command (installs the wheels under /tmp/site, then runs the
   check with its JSON and log under $OUT), ``carry: [".whl"]`` and the timeout.

``--dry-run`` prints what it would fetch (from the pins) and the call, and writes nothing.

    tools/gpu_check_prepare.sh            # or: .venv/bin/python tools/gpu_check_prepare.py
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: packages the check needs that the lent image lacks, and what needs them
CARRY = {
    "megatron-core": "the models, parallel state and optimiser",
    "omegaconf": "sao_megatron/configs.py, the job config loader",
}
#: packages of `CARRY` with no wheel on the index at the pinned version, built here from the
#: sdist (``pip wheel --no-deps``, with a CPython 3.12 for a C extension). None today: the last
#: ones (cellpylib, pycosat, zss) came with reasoning-gym, which the check's imports no longer
#: load (`sao_megatron.envs` imports it on a reasoning-gym task's first use).
FROM_SDIST: tuple[str, ...] = ()
#: the image's own packages that the check's imports reach (its package list as read on
#: 2026-11-17): not carried. tests/tools/test_gpu_check.py checks that every distribution the
#: import path loads is here or in `CARRY`.
ON_IMAGE = (
    "absl-py", "attrs", "cycler", "filelock", "fonttools", "fsspec", "jinja2", "kiwisolver",
    "markupsafe", "matplotlib", "mpmath", "networkx", "numpy", "packaging", "pillow",
    "protobuf", "pyparsing", "python-dateutil", "pyyaml", "rich", "safetensors",
    "sentencepiece", "setuptools", "six", "sympy", "tabulate", "tensorboard", "torch", "tqdm",
    "typing-extensions",
)  # fmt: skip
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
WHEEL_DIR = ".whl"
LIMIT_BYTES = 64 * 2**20  # what one device call carries (working tree + carried paths)
DEADLINE_S = 420  # tools/gpu_check.py --deadline: no check starts after it
PROCESS_TIMEOUT_S = 450  # `timeout` around the check: its JSON and log still come back
CALL_TIMEOUT_S = 480  # the device call's timeout_s: the whole run in 8 minutes


def normalize(name: str) -> str:
    """PEP 503 name: lower case, runs of ``-_.`` as one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(freeze: str) -> dict[str, str]:
    """{normalized name: version} of the ``name==version`` lines of ``pip freeze`` output."""
    pins = {}
    for line in freeze.splitlines():
        name, sep, version = line.strip().partition("==")
        if sep and not name.startswith("#"):
            pins[normalize(name)] = version.strip()
    return pins


def plan(pins: dict[str, str]) -> list[tuple[str, str, str]]:
    """(name, version, how) for each package of `CARRY`; how is "wheel" or "sdist".

    Raises ValueError naming the packages ``.venv`` does not have (run ``make install``).
    """
    missing = [n for n in CARRY if normalize(n) not in pins]
    if missing:
        raise ValueError(
            f"not installed in the virtualenv: {', '.join(missing)}; run `make install` first "
            "(the wheels are pinned to the versions it uses)"
        )
    return [(n, pins[normalize(n)], "sdist" if n in FROM_SDIST else "wheel") for n in CARRY]


def device_command(deadline_s: float = DEADLINE_S, timeout_s: int = PROCESS_TIMEOUT_S) -> str:
    """The command of the device call (run from the repository root there)."""
    install = (
        "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
        f"--target /tmp/site {WHEEL_DIR}/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit"
    )
    check = (
        f"PYTHONUNBUFFERED=1 timeout -k 10 {timeout_s} python3 tools/gpu_check.py "
        f"--deadline {deadline_s:g} --out $OUT/gpu_check.json 2>&1 | tee $OUT/gpu_check.log"
    )
    return f"set -o pipefail; {install}; nvidia-smi -L; {check}"


def command_paths(command: str) -> list[str]:
    """The repository paths (relative, with a ``/``) that `command` names, globs included."""
    words = shlex.split(command.replace(";", " ").replace("|", " "))
    return [w for w in words if "/" in w and not w.startswith(("/", "$", "-")) and "=" not in w]


def missing_paths(command: str, root: Path) -> list[str]:
    """Paths of `command_paths` with no file under `root` (a glob: no match)."""
    return [p for p in command_paths(command) if not list(root.glob(p))]


def tree_bytes(root: Path) -> int:
    """Bytes of what a device call sends: tracked and untracked-not-ignored files."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout
    files = {root / f for f in out.decode().split("\0") if f}
    return sum(f.lstat().st_size for f in files if f.is_file() or f.is_symlink())


def ensure_excluded(root: Path, entry: str = f"/{WHEEL_DIR}/") -> bool:
    """Add `entry` to the repository's ``info/exclude``; True if it was added."""
    rel = subprocess.run(
        ["git", "rev-parse", "--git-path", "info/exclude"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    path = root / rel
    lines = path.read_text().splitlines() if path.exists() else []
    if entry in lines:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(("\n" if lines and lines[-1] else "") + entry + "\n")
    return True


def wheel_of(dest: Path, name: str, version: str | None = None) -> list[Path]:
    """Wheels of `name` (at `version`, or any) in `dest`."""
    stem = re.sub(r"[-_.]+", "_", name).lower()
    found = []
    for w in dest.glob("*.whl"):
        dist, ver = w.name.split("-")[:2]
        if re.sub(r"[-_.]+", "_", dist).lower() == stem and version in (None, ver):
            found.append(w)
    return found


def _installable(wheel: Path) -> bool:
    """The wheel's tags fit CPython 3.12 on Linux x86_64 (pure Python or cp312)."""
    py, abi, plat = wheel.name[: -len(".whl")].split("-")[-3:]
    pure = abi == "none" and plat == "any" and "py3" in py.split(".")
    return pure or ("cp312" in py.split(".") and "linux" in plat and plat.endswith("x86_64"))


def fetch(items, dest: Path, pip: list[str], python312: str | None) -> list[Path]:
    """Download or build each (name, version, how) into `dest`; returns the wheels."""
    dest.mkdir(parents=True, exist_ok=True)
    wheels = []
    for name, version, how in items:
        for stale in set(wheel_of(dest, name)) - set(wheel_of(dest, name, version)):
            stale.unlink()
        have = wheel_of(dest, name, version)
        if not have:
            spec = f"{name}=={version}"
            if how == "wheel":
                plats = [a for p in PLATFORMS for a in ("--platform", p)]
                cmd = [*pip, "download", "--no-deps", "--only-binary=:all:", "--python-version"]
                cmd += ["3.12", "--implementation", "cp", *plats, "--platform", "any"]
            else:
                if python312 is None:
                    raise RuntimeError(
                        f"{spec} is built from its sdist and needs a CPython 3.12 here: put "
                        "python3.12 on PATH or pass --python312"
                    )
                cmd = [python312, "-m", "pip", "wheel", "--no-deps", "--no-binary", name]
            cmd += ["-d" if how == "wheel" else "-w", str(dest), spec]
            print(f"gpu_check_prepare: {shlex.join(cmd)}", flush=True)
            subprocess.run(cmd, check=True)
            have = wheel_of(dest, name, version)
        if len(have) != 1 or not _installable(have[0]):
            raise RuntimeError(f"{name}=={version}: expected one cp312/pure wheel, got {have}")
        wheels.append(have[0])
    return wheels


def find_python312() -> str | None:
    """A CPython 3.12 that runs here: ``python3.12`` on PATH, else one under pyenv's versions
    (a pyenv shim on PATH fails when 3.12 is not among its selected versions)."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    found = shutil.which("python3.12")
    candidates = [found] if found else []
    candidates += [str(p) for p in sorted(pyenv.glob("versions/3.12*/bin/python3.12"))]
    for exe in candidates:
        probe = [exe, "-c", "import sys; print(sys.version_info[:2] == (3, 12))"]
        try:
            ok = subprocess.run(probe, capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        if ok.strip() == "True":
            return exe
    return None


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="list what it would fetch; no writes")
    ap.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this one)")
    ap.add_argument("--venv", type=Path, default=None, help="virtualenv of the pins (root/.venv)")
    ap.add_argument("--python312", default=None, help="CPython 3.12 that builds the sdists")
    args = ap.parse_args(argv)
    root = args.root.resolve()
    venv_python = (args.venv or root / ".venv") / "bin" / "python"
    freeze = subprocess.run(
        [str(venv_python), "-m", "pip", "freeze"], capture_output=True, text=True, check=True
    ).stdout
    try:
        items = plan(read_pins(freeze))
    except ValueError as e:
        print(f"gpu_check_prepare: {e}", file=sys.stderr)
        return 2
    dest = root / WHEEL_DIR
    for name, version, how in items:
        src = "wheel, cp312 manylinux or pure" if how == "wheel" else "built here from its sdist"
        print(f"gpu_check_prepare: {name}=={version} ({src}; needed by {CARRY[name]})")
    command = device_command()
    if not args.dry_run:
        ensure_excluded(root)
        python312 = args.python312 or find_python312()
        try:
            wheels = fetch(items, dest, [str(venv_python), "-m", "pip"], python312)
        except (RuntimeError, subprocess.CalledProcessError) as e:
            print(f"gpu_check_prepare: {e}", file=sys.stderr)
            return 1
        carried, tree = sum(w.stat().st_size for w in wheels), tree_bytes(root)
        print(
            f"gpu_check_prepare: {len(wheels)} wheels in {WHEEL_DIR}/ ({_mib(carried)}), working "
            f"tree {_mib(tree)}: {_mib(carried + tree)} of the {_mib(LIMIT_BYTES)} a call carries"
        )
        for w in wheels:
            print(f"  {w.name} {_mib(w.stat().st_size)}")
        if carried + tree > LIMIT_BYTES:
            print("gpu_check_prepare: too large for one device call", file=sys.stderr)
            return 1
        missing = missing_paths(command, root)
        if missing:
            print(f"gpu_check_prepare: the command names missing {missing}", file=sys.stderr)
            return 1
    call = {"command": command, "carry": [WHEEL_DIR], "timeout_s": CALL_TIMEOUT_S}
    print(f"gpu_check_prepare: device call{' (dry run: nothing fetched)' if args.dry_run else ''}:")
    print(f"  command ({len(command)} characters): {command}")
    print(f'  carry: ["{WHEEL_DIR}"]')
    print(f"  timeout_s: {CALL_TIMEOUT_S}")
    print(json.dumps(call))
    return 0


if __name__ == "__main__":
    sys.exit(main())
