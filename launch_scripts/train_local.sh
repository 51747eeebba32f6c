#!/usr/bin/env bash
# Train on one machine: torchrun starts NPROC ranks of `sao-train CONFIG [dotted.overrides]`.
#
# Sizes come from the environment (defaults in brackets):
#   NPROC     [1]                                  ranks on this machine (GPUs, or CPU ranks)
#   CONFIG    [examples/configs/quickstart.yaml]   job config (YAML)
#   PYTHON    [python]                             interpreter of the environment with sao_megatron
#   OMP_NUM_THREADS [cores / NPROC]                CPU threads per rank
#   DRY_RUN   [0]                                  1 = print the command, do not run it
# Every argument is passed through as a config override, e.g.
#   NPROC=2 launch_scripts/train_local.sh parallel.tensor_model_parallel_size=2 checkpoint.resume=none
# Checkpoints resume from `latest` by default (checkpoint.resume=auto).
set -euo pipefail

NPROC="${NPROC:-1}"
CONFIG="${CONFIG:-examples/configs/quickstart.yaml}"
PYTHON="${PYTHON:-python}"
DRY_RUN="${DRY_RUN:-0}"

if ! [[ "$NPROC" =~ ^[1-9][0-9]*$ ]]; then
    echo "train_local.sh: NPROC=$NPROC must be a positive integer" >&2
    exit 2
fi
if [[ ! -f "$CONFIG" ]]; then
    echo "train_local.sh: CONFIG=$CONFIG not found (ls examples/configs/ for the shipped configs)" >&2
    exit 2
fi
if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
    cores="$(nproc 2>/dev/null || echo 1)"
    OMP_NUM_THREADS=$(( cores / NPROC > 0 ? cores / NPROC : 1 ))
fi
export OMP_NUM_THREADS

# --standalone: single-node rendezvous on a free local port (no MASTER_ADDR/PORT to pick).
cmd=("$PYTHON" -m torch.distributed.run --standalone --nnodes=1 --nproc_per_node="$NPROC"
     -m sao_megatron.cli.train "$CONFIG" "$@")

printf 'OMP_NUM_THREADS=%s' "$OMP_NUM_THREADS"
printf ' %q' "${cmd[@]}"
printf '\n'
if [[ "$DRY_RUN" == "1" ]]; then
    exit 0
fi
exec "${cmd[@]}"
