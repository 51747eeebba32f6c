"""`sao-convert hf-to-megatron --tp 2` without --ep (2 local processes), and output permissions."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import torch
from safetensors.torch import load_file

from sao_megatron.convert.cli import main
from tests.convert.tiny_hf import save_hf


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_tp2_alone_converts_and_outputs_are_readable_by_others(tmp_path):
    old = os.umask(0o022)
    try:
        hf_model = save_hf("qwen2_moe", tmp_path / "hf")
        mg = tmp_path / "mg"
        assert (
            main(["hf-to-megatron", "--hf", str(tmp_path / "hf"), "--out", str(mg), "--tp", "2"])
            == 0
        )
        assert _mode(mg) == 0o755  # mkdtemp's 0o700 would hide it from others
        assert (mg / "policy" / "metadata.json").is_file()
        out = tmp_path / "export"
        assert main(["megatron-to-hf", "--ckpt", str(mg), "--out", str(out)]) == 0
        assert _mode(out) == 0o755
    finally:
        os.umask(old)
    exported = {}
    for f in out.glob("*.safetensors"):
        exported |= load_file(f)
    source = hf_model.state_dict()
    assert set(exported) == set(source)
    for name, tensor in source.items():
        assert torch.equal(exported[name], tensor), name
