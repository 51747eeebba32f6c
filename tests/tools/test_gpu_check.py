"""tools/gpu_check.py on a machine without CUDA: it stops at once, exit code 2 and one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_check.py"


def _run(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--out", str(tmp_path / "gpu.json")],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )


@pytest.mark.parametrize("mode", [["--dry-run"], []])
def test_fails_clearly_without_cuda(tmp_path, mode):
    proc = _run(*mode, tmp_path=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("gpu_check: CUDA is not available"), lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.stdout == ""
    assert not (tmp_path / "gpu.json").exists()  # nothing half-written


def test_plan_and_inputs():
    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_check

    assert gpu_check.CHECKS == (
        "environment",
        "nccl_1gpu",
        "te_bf16",
        "te_fp8",
        "sao_step",
        "mfu_bench",
    )
    job = gpu_check._job(["precision.params_dtype=bf16", "precision.fp8=true"])
    assert job.precision.params_dtype == "bf16" and job.precision.fp8
    batch = gpu_check._batch(job.model.vocab_size, 8, 64)
    assert batch.input_ids.shape == (8, 64)
    am = batch.attention_mask
    assert am[:4].all() and not am[4:, 48:].any() and am[4:, :48].all()  # right padding only
    import torch

    if torch.cuda.is_available():  # a GPU machine: the prerequisites are met and reported
        assert gpu_check._prerequisites()["num_gpus"] >= 1
    else:
        with pytest.raises(gpu_check.CheckUnavailable, match="CUDA is not available"):
            gpu_check._prerequisites()
