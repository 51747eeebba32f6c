"""`sao-train` reports checkpoint errors as one line and exit code 2, like config errors.

Runs the real CLI in a subprocess (1 rank, SFT stage only, no rollout engine): a tiny job whose
SFT checkpoint folder holds a damaged checkpoint, and one whose checkpoint.resume path does not
exist. Each run trains a small tokenizer first (a few seconds).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "configs" / "quickstart.yaml"
TINY = [
    "stages=[sft]",
    "sft.steps=1",
    "sft.batch_size=2",
    "sft.micro_batch_size=2",
    "model.hidden_size=64",
    "model.num_hidden_layers=1",
    "model.num_attention_heads=1",
    "model.num_key_value_heads=1",
    "model.num_experts=2",
    "model.moe_intermediate_size=32",
    "model.max_position_embeddings=256",
    "tokenizer.vocab_size=400",
    "demonstrations.num_episodes=4",
    "logging.console=false",
    "logging.tensorboard=false",
]


def _sao_train(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "sao_megatron.cli.train", str(CONFIG), f"run_dir={run_dir}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run(
        [*cmd, *TINY, *overrides],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _damaged_checkpoint(run_dir: Path, damage: str) -> Path:
    """A step folder under run_dir/checkpoints/sft that ``latest`` names, damaged."""
    root = run_dir / "checkpoints" / "sft"
    step = root / "step_00000001"
    (step / "policy").mkdir(parents=True)
    (step / "policy" / "metadata.json").write_text("{}")
    if damage == "corrupted":  # the manifest records another size for the file
        manifest = {
            "format": "sao_megatron.checkpoint",
            "format_version": 1,
            "parts": ["policy"],
            "files": {"policy/metadata.json": {"size": 999, "sha256": None}},
        }
        (step / "manifest.json").write_text(json.dumps(manifest))
    (root / "latest").write_text("step_00000001\n")
    return step


@pytest.mark.integration
@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        ("partial", "is partial: manifest.json is missing"),
        ("corrupted", "is corrupted: policy/metadata.json: size 2 != 999 in manifest"),
    ],
)
def test_damaged_checkpoint_is_one_line_exit_2(tmp_path, damage, expected):
    step = _damaged_checkpoint(tmp_path / "run", damage)
    p = _sao_train(tmp_path / "run")
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = [line for line in p.stderr.splitlines() if line.startswith("sao-train:")]
    assert len(lines) == 1, p.stderr[-3000:]
    assert lines[0].startswith(f"sao-train: checkpoint error: checkpoint {step} {expected}")
    assert "checkpoint.resume=" in lines[0]  # what to do


@pytest.mark.integration
def test_missing_resume_path_is_one_line_exit_2(tmp_path):
    missing = tmp_path / "nope"
    p = _sao_train(tmp_path / "run", f"checkpoint.resume={missing}")
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1] == (
        f"sao-train: checkpoint error: checkpoint.resume={missing}: not a step_NNNNNNNN folder nor"
        " a folder with a 'latest' file or step folders; give an existing checkpoint path, 'auto'"
        " or 'none'"
    )
