"""The commands README.md, docs/CLUSTERS.md and the launch scripts' headers show run as written.

- Every launch-script command (``[VAR=x ...] [sbatch FLAGS | bash] launch_scripts/... ARGS``) runs
  in ``DRY_RUN=1`` mode with sbatch's ``--nodes``/``--gpus-per-node`` turned into the variables
  SLURM would set; the printed trainer command's config and overrides load, and the parallel
  layout fits the ranks the script would start (tp*pp and expert_tp*ep*pp divide the world size,
  ep divides the experts).
- Every ``tools/*.py`` and ``sao-convert`` command: each ``--flag`` it uses is one its
  ``--help`` lists (the tools take minutes to run; their own tests run them).
- Every ``make TARGET`` is a target of the Makefile; ``sao-train --help`` answers.
(``sao-train CONFIG overrides`` lines are loaded by tests/config/test_documented_keys.py.)
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from sao_megatron.configs import load_config
from sao_megatron.trainer.job import JobConfig

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "README.md", ROOT / "docs" / "CLUSTERS.md"]
SCRIPTS = [
    ROOT / "launch_scripts" / "train_local.sh",
    ROOT / "launch_scripts" / "train_slurm.sbatch",
]


def _fenced_commands(path: Path) -> list[str]:
    """Shell command lines of the ```bash blocks of a markdown file (continuations joined)."""
    out, fence, current = [], False, ""
    for line in path.read_text().splitlines():
        if line.strip().startswith("```"):
            fence = line.strip() in ("```bash", "```sh")
            continue
        if not fence:
            continue
        current += " " + line.strip().rstrip("\\")
        if not line.rstrip().endswith("\\"):
            out.append(current.strip())
            current = ""
    return [c for c in out if c]


def _header_commands(script: Path) -> list[str]:
    out, current = [], ""
    for line in script.read_text().splitlines()[1:]:
        if not line.startswith("#") or line.startswith("#SBATCH"):
            break
        text = line.lstrip("#").strip()
        if current or "launch_scripts/train_" in text:
            current += " " + text.rstrip("\\")
            if not text.endswith("\\"):
                out.append(current.strip())
                current = ""
    return out


def _all_commands() -> list[tuple[str, str]]:
    cmds = [(p.relative_to(ROOT).as_posix(), c) for p in SOURCES for c in _fenced_commands(p)]
    cmds += [(p.relative_to(ROOT).as_posix(), c) for p in SCRIPTS for c in _header_commands(p)]
    return cmds


COMMANDS = _all_commands()
LAUNCH = [(src, c) for src, c in COMMANDS if "launch_scripts/train_" in c]
TOOLS = [(src, c) for src, c in COMMANDS if re.search(r"tools/\w+\.py|sao-convert ", c)]


def _words(command: str) -> list[str]:
    return shlex.split(command, comments=True)


@pytest.mark.parametrize(
    ("source", "command"), LAUNCH, ids=[f"{s}:{i}" for i, (s, _) in enumerate(LAUNCH)]
)
def test_launch_commands_dry_run_and_their_layouts_fit(source, command):
    words = _words(command)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SAO_"))}
    env["DRY_RUN"] = "1"
    while re.match(r"^[A-Z_]+=", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    launcher = words.pop(0)
    nodes, gpus = 1, 0
    if launcher == "sbatch":  # what SLURM would set for these flags
        while words[0].startswith("--"):
            flag, _, value = words.pop(0).partition("=")
            if flag == "--nodes":
                nodes = int(value)
            elif flag == "--gpus-per-node":
                gpus = int(value)
            else:
                assert flag in ("--time", "--partition"), f"{source}: unexpected flag {flag}"
        env |= {"SLURM_NNODES": str(nodes), "SLURM_JOB_NODELIST": f"n[1-{nodes}]"}
        env |= {"SLURM_CPUS_ON_NODE": "64"} | ({"SLURM_GPUS_ON_NODE": str(gpus)} if gpus else {})
    elif launcher.startswith("launch_scripts/"):  # run directly: must be executable
        assert os.access(ROOT / launcher, os.X_OK), f"{source}: {launcher} is not executable"
        words.insert(0, launcher)
    else:
        assert launcher == "bash", f"{source}: {command}"
    script = words.pop(0)
    assert script.startswith("launch_scripts/"), command
    out = subprocess.run(
        ["bash", script, *words], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, f"{source}: `{command}` failed: {out.stderr}"
    lines = out.stdout.splitlines()
    train = next(shlex.split(x) for x in lines if "sao_megatron.cli.train" in x)
    args = train[train.index("sao_megatron.cli.train") + 1 :]
    job = load_config(JobConfig, ROOT / args[0], args[1:])
    # the ranks the printed command starts
    if train[0] == "srun":
        per_node = int(next(a for a in train if a.startswith("--ntasks-per-node=")).split("=")[1])
        trainer_nodes = int(next(a for a in train if a.startswith("--nodes=")).split("=")[1])
        world = per_node * trainer_nodes
    else:  # torchrun
        world = int(next(a for a in train if a.startswith("--nproc_per_node=")).split("=")[1])
    p = job.parallel
    assert job.parallel.data_parallel_size(world) >= 1, f"{source}: {command}"
    assert job.model.num_experts % p.ep == 0, f"{source}: ep={p.ep} vs experts"
    if launcher == "sbatch" and gpus:
        assert per_node == gpus  # one rank per GPU


@functools.cache
def _help(program: tuple[str, ...]) -> str:
    out = subprocess.run(
        [*program, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False
    )
    assert out.returncode == 0, f"{' '.join(program)} --help: {out.stderr[-2000:]}"
    return out.stdout


@pytest.mark.parametrize(
    ("source", "command"), TOOLS, ids=[f"{s}:{i}" for i, (s, _) in enumerate(TOOLS)]
)
def test_tool_commands_use_flags_their_help_lists(source, command):
    words = _words(command)
    if words[0].endswith("sao-convert"):
        program = (sys.executable, "-m", "sao_megatron.convert.cli", words[1])
        rest = words[2:]
    else:
        i = next(i for i, w in enumerate(words) if re.match(r"tools/\w+\.py$", w))
        program = (sys.executable, words[i])
        rest = words[i + 1 :]
    text = _help(program)
    flags = [w.split("=")[0] for w in rest if w.startswith("--")]
    missing = [f for f in flags if not re.search(rf"(^|[\s,\[]){re.escape(f)}\b", text)]
    assert not missing, f"{source}: `{command}` uses {missing}, not in its --help"


def test_make_targets_exist():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
    used = {w[1] for _, c in COMMANDS for w in [_words(c)] if len(w) >= 2 and w[0] == "make"}
    assert used and used <= targets, sorted(used - targets)


def test_sao_train_help_answers():
    text = _help((sys.executable, "-m", "sao_megatron.cli.train"))  # this checkout's
    assert "rollout.engine_urls_file" in text  # every field with its description


def test_commands_are_found():
    assert len(LAUNCH) >= 6 and len(TOOLS) >= 8
    assert any("ROLLOUT_NODES=1" in c for _, c in LAUNCH)
