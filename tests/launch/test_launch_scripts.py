"""The launch scripts in DRY_RUN=1 mode: the command lines they print, and the overrides in them
and in their headers' examples, load with `load_config` (no training is run)."""

from __future__ import annotations

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
LOCAL = ROOT / "launch_scripts" / "train_local.sh"
SLURM = ROOT / "launch_scripts" / "train_slurm.sbatch"
OVERRIDE = re.compile(r"^[a-z_]+(\.[a-z_]+)*=\S+$")
_SLURM_VARS = ("SLURM_JOB_ID", "SLURM_NNODES", "SLURM_JOB_NODELIST", "SLURM_GPUS_ON_NODE")


def _dry_run(script: Path, args: list[str], path: str | None = None, **env: str) -> list[str]:
    """Run `script` with DRY_RUN=1 from the repo root (PATH = `path` if given); return its
    stdout lines."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SAO_"))}
    full |= {"DRY_RUN": "1", "PATH": path or os.environ["PATH"]} | env
    out = subprocess.run(
        ["bash", str(script), *args],
        cwd=ROOT,
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def _train_command(lines: list[str]) -> tuple[list[str], list[str]]:
    """(the whole printed command line, the args after `-m sao_megatron.cli.train`)."""
    for line in lines:
        argv = shlex.split(line)
        if "sao_megatron.cli.train" in argv:
            i = argv.index("sao_megatron.cli.train")
            return argv, argv[i + 1 :]
    raise AssertionError(f"no sao_megatron.cli.train command in {lines}")


def _load(args: list[str]) -> JobConfig:
    config, overrides = args[0], args[1:]
    assert all(OVERRIDE.match(o) for o in overrides), overrides
    return load_config(JobConfig, ROOT / config, overrides)


def test_local_script_prints_runnable_command():
    lines = _dry_run(
        LOCAL,
        ["rl.steps=3", "checkpoint.resume=none"],
        NPROC="2",
        RUN_DIR="runs/dry",
        CONFIG="examples/configs/multirank_tp2_ep2.yaml",
    )
    argv, args = _train_command(lines)
    assert argv[0] == "OMP_NUM_THREADS=" + str(max((os.cpu_count() or 1) // 2, 1))
    assert argv[1] == "SAO_STOP_FILE=runs/dry/.stop_request"
    assert argv[2] == str(ROOT / ".venv" / "bin" / "python")  # the repo's venv by default
    assert "--nproc_per_node=2" in argv
    job = _load(args)
    assert job.run_dir == "runs/dry"
    assert (job.rl.steps, job.checkpoint.resume, job.parallel.tp) == (3, "none", 2)


def test_local_script_without_run_dir_keeps_the_configs():
    _, args = _train_command(_dry_run(LOCAL, []))
    assert args == ["examples/configs/quickstart.yaml"]
    assert _load(args).run_dir == "runs/quickstart"


@pytest.mark.parametrize(
    ("env", "ranks", "cpus", "gpu_flag"),
    [
        ({}, 1, None, None),  # a CPU node: one rank with every CPU
        ({"GPUS_PER_NODE": "8", "SLURM_CPUS_ON_NODE": "64"}, 8, 8, None),
        (
            {"SLURM_GPUS_ON_NODE": "4", "SLURM_CPUS_ON_NODE": "32", "SLURM_NNODES": "2"},
            4,
            8,
            "--gpus-per-node=4",
        ),
        ({"NPROC_PER_NODE": "2", "CPUS_PER_TASK": "3"}, 2, 3, None),
        # a submitting shell's OMP_NUM_THREADS=1 sets the ranks' threads, not the CPUs they get
        ({"OMP_NUM_THREADS": "1"}, 1, None, None),
    ],
)
def test_slurm_script_sizes_from_the_environment(env, ranks, cpus, gpu_flag):
    lines = _dry_run(SLURM, ["rl.steps=5", "parallel.tp=1"], RUN_DIR="/shared/runs/a", **env)
    argv, args = _train_command(lines)
    assert argv[0] == "srun"
    assert f"--ntasks-per-node={ranks}" in argv
    assert f"--nodes={env.get('SLURM_NNODES', '1')}" in argv
    want_cpus = cpus if cpus is not None else os.cpu_count()
    assert f"--cpus-per-task={want_cpus}" in argv
    assert (gpu_flag in argv) if gpu_flag else not any(a.startswith("--gpus") for a in argv)
    assert str(ROOT / ".venv" / "bin" / "python") in argv
    exports = shlex.split(next(line for line in lines if line.startswith("export ")))
    assert "SAO_STOP_FILE=/shared/runs/a/.stop_request" in exports
    job = _load(args)
    assert job.run_dir == "/shared/runs/a"  # RUN_DIR is honoured, not the config's run_dir
    assert (job.checkpoint.resume, job.rl.steps) == ("auto", 5)


def test_slurm_script_ckpt_dir_and_rank_environment():
    argv, args = _train_command(_dry_run(SLURM, [], CKPT_DIR="/shared/ckpt"))
    assert _load(args).checkpoint.save_dir == "/shared/ckpt"
    wrapper = argv[argv.index("-c") + 1]  # each srun task exports its rank for env://
    for var in ("RANK=$SLURM_PROCID", "WORLD_SIZE=$SLURM_NTASKS", "LOCAL_RANK=$SLURM_LOCALID"):
        assert var in wrapper


def test_slurm_script_refuses_to_run_outside_slurm():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    out = subprocess.run(
        ["bash", str(SLURM)], cwd=ROOT, env=env, capture_output=True, text=True, check=False
    )
    assert out.returncode == 2
    assert "submit with sbatch" in out.stderr


def _header_examples(script: Path) -> list[list[str]]:
    """The example command lines of a script's header comment (continuations joined)."""
    examples, current = [], ""
    for line in script.read_text().splitlines()[1:]:  # after the shebang
        if not line.startswith("#") or line.startswith("#SBATCH"):
            break
        text = line.lstrip("#").strip()
        if current or "launch_scripts/train_" in text:
            current += " " + text.rstrip("\\")
            if not text.endswith("\\"):
                examples.append(shlex.split(current.split("#")[0]))
                current = ""
    return examples


@pytest.mark.parametrize("script", [LOCAL, SLURM], ids=lambda p: p.name)
def test_header_examples_use_valid_overrides(script):
    examples = _header_examples(script)
    assert len(examples) >= 1
    checked = 0
    for argv in examples:
        env = {t.split("=", 1)[0]: t.split("=", 1)[1] for t in argv if re.match(r"^[A-Z_]+=", t)}
        overrides = [t for t in argv if OVERRIDE.match(t)]
        config = env.get("CONFIG", "examples/configs/quickstart.yaml")
        load_config(JobConfig, ROOT / config, overrides)
        checked += len(overrides)
    assert checked >= 2  # the headers show real overrides (parallel.tp, rl.steps, ...)


def _serve_command(lines: list[str]) -> list[str]:
    """The engine step's printed srun command line (ROLLOUT_NODES > 0)."""
    for line in lines:
        argv = shlex.split(line)
        if "sao_megatron.cli.serve" in argv:
            return argv
    raise AssertionError(f"no sao_megatron.cli.serve command in {lines}")


# A fake `scontrol` that expands "n[1-3]" as a live SLURM does, and one that fails as it does
# where SLURM is installed without a usable configuration; the third case has none at all.
_SCONTROL = {
    "live": (
        "import re, sys\n"
        "m = re.fullmatch(r'(\\w+)\\[(\\d+)-(\\d+)\\]', sys.argv[3])\n"
        "print(*([f'{m[1]}{i}' for i in range(int(m[2]), int(m[3]) + 1)] if m else"
        " sys.argv[3].split(',')), sep='\\n')\n"
    ),
    "broken": "import sys\nsys.exit('scontrol: error: resolve_ctls_from_dns_srv: no address')\n",
}


@pytest.fixture(scope="module", params=["live", "broken", "absent"])
def scontrol_path(request, tmp_path_factory) -> str:
    """A PATH whose `scontrol` is live, broken or absent, whatever this machine has installed:
    the script's node list must not depend on it (CI installs a real SLURM mid-suite)."""
    bin_dir = tmp_path_factory.mktemp(f"bin-{request.param}")
    for d in os.environ["PATH"].split(os.pathsep):
        for exe in Path(d).glob("*") if Path(d).is_dir() else ():
            link = bin_dir / exe.name
            if exe.name != "scontrol" and not link.exists() and os.access(exe, os.X_OK):
                link.symlink_to(exe)
    if request.param != "absent":
        fake = bin_dir / "scontrol"
        fake.write_text(f"#!{sys.executable}\n{_SCONTROL[request.param]}")
        fake.chmod(0o755)
    return str(bin_dir)


@pytest.mark.parametrize(
    ("nnodes", "nodelist", "engine_hosts", "train_hosts", "shared"),
    [
        ("3", "n[1-3]", "n3", "n1,n2", False),
        ("3", "n1,n2,n3", "n3", "n1,n2", False),
        ("1", "n1", "n1", "n1", True),
    ],
)
def test_slurm_script_gives_rollout_nodes_their_own_step(
    nnodes, nodelist, engine_hosts, train_hosts, shared, scontrol_path
):
    lines = _dry_run(
        SLURM,
        ["rl.steps=5", "rollout.num_engines=2"],
        path=scontrol_path,
        RUN_DIR="runs/remote",
        ROLLOUT_NODES="1",
        SLURM_NNODES=nnodes,
        SLURM_JOB_NODELIST=nodelist,
        SLURM_CPUS_ON_NODE="16",
    )
    run_dir = ROOT / "runs" / "remote"  # RUN_DIR made absolute: every node and step sees it
    urls_file = f"{run_dir}/rollout/engine_urls.json"
    serve = _serve_command(lines)
    train, args = _train_command(lines)
    assert serve[0] == train[0] == "srun"
    assert serve.pop() == "&"  # started in the background, before the trainer's step
    assert f"--nodelist={engine_hosts}" in serve and "--nodes=1" in serve
    assert "--ntasks-per-node=1" in serve and "--cpus-per-task=16" in serve
    assert f"--nodelist={train_hosts}" in train
    assert f"--nodes={int(nnodes) - 1 or 1}" in train
    assert ("--overlap" in serve and "--overlap" in train) == shared
    assert ("--overlap" not in serve and "--overlap" not in train) == (not shared)
    # Both steps get the same config and overrides; the trainer finds the engines by the file.
    i = serve.index("sao_megatron.cli.serve")
    assert serve[i + 1 :] == args
    job = _load(args)
    assert job.rollout.engine_urls_file == urls_file and not job.rollout.launches_engines
    assert job.run_dir == str(run_dir) and job.rollout.num_engines == 2
    assert lines[0].startswith("train_slurm.sbatch: job 0")
    assert f"rollout engines on 1 node(s) ({engine_hosts}" in lines[1]
    assert ("shared with the trainer" in lines[1]) == shared
    assert f"MASTER_ADDR={train_hosts.split(',')[0]}" in lines[2]


def test_slurm_script_without_rollout_nodes_has_one_step():
    lines = _dry_run(SLURM, [], SLURM_NNODES="2", SLURM_JOB_NODELIST="n[1-2]")
    assert not any("sao_megatron.cli.serve" in line for line in lines)
    train, args = _train_command(lines)
    assert "--nodes=2" in train and not any(a.startswith("--nodelist") for a in train)
    assert _load(args).rollout.launches_engines


def test_slurm_script_refuses_more_rollout_nodes_than_the_job_has():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SAO_"))}
    env |= {"DRY_RUN": "1", "ROLLOUT_NODES": "2", "SLURM_NNODES": "1"}
    out = subprocess.run(
        ["bash", str(SLURM)], cwd=ROOT, env=env, capture_output=True, text=True, check=False
    )
    assert out.returncode == 2
    assert "ROLLOUT_NODES=2 must be 0..1" in out.stderr


def test_slurm_script_refuses_a_node_list_that_does_not_match_the_node_count(scontrol_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SAO_"))}
    env |= {"DRY_RUN": "1", "ROLLOUT_NODES": "1", "SLURM_NNODES": "2", "PATH": scontrol_path}
    env |= {"SLURM_JOB_NODELIST": "n[1-3]"}
    out = subprocess.run(
        ["bash", str(SLURM)], cwd=ROOT, env=env, capture_output=True, text=True, check=False
    )
    assert out.returncode == 2, out.stdout
    assert "SLURM_JOB_NODELIST=n[1-3] gives 3 host(s) (n1 n2 n3) for SLURM_NNODES=2" in out.stderr
