"""train_slurm.sbatch runs sao-plan before srun and refuses a job that cannot fit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    srun = bin_dir / "srun"  # records that it was started, starts nothing
    srun.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/srun_calls\n')
    srun.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SAO_"))}
    env |= {
        "PATH": f"{bin_dir}:{env['PATH']}",
        "SLURM_JOB_ID": "7",
        "SLURM_NNODES": "1",
        "SLURM_JOB_NODELIST": "n1",
        "SLURM_GPUS_ON_NODE": "2",
        "SLURM_CPUS_ON_NODE": "4",
        "GPU_MEMORY_GIB": "80",
        "MASTER_PORT": "29511",
        "PYTHON": sys.executable,
        "RUN_DIR": str(tmp_path / "run"),
        "CONFIG": "examples/configs/quickstart.yaml",
    }
    return subprocess.run(
        ["bash", "launch_scripts/train_slurm.sbatch", *overrides],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_a_layout_that_cannot_run_is_refused_before_srun(tmp_path):
    out = _run(tmp_path, "parallel.tp=2")
    assert out.returncode == 2, out.stderr
    assert "set parallel.sequence_parallel=true" in out.stdout
    assert "cannot run on this allocation" in out.stderr
    assert not (tmp_path / "srun_calls").exists()


def test_a_fitting_job_reaches_srun(tmp_path):
    out = _run(tmp_path, "parallel.tp=2", "parallel.sequence_parallel=true")
    assert out.returncode == 0, out.stderr
    assert "fits: peak" in out.stdout
    assert "sao_megatron.cli.train" in (tmp_path / "srun_calls").read_text()
