#!/usr/bin/env bash
# Train on one machine: torchrun starts NPROC ranks of `sao-train CONFIG [dotted.overrides]`.
#
# Sizes come from the environment (defaults in brackets):
#   NPROC     [1]                                  ranks on this machine (GPUs, or CPU ranks)
#   CONFIG    [examples/configs/quickstart.yaml]   job config (YAML)
#   RUN_DIR   [the config's run_dir]               run_dir of the job (passed as run_dir=RUN_DIR)
#   PYTHON    [<repo>/.venv/bin/python]            interpreter of the environment with sao_megatron
#   OMP_NUM_THREADS [cores / NPROC]                CPU threads per rank
#   SAO_STOP_FILE [RUN_DIR/.stop_request if RUN_DIR is set]  `touch` it to stop cleanly
#   DRY_RUN   [0]                                  1 = print the command, do not run it
# Every argument is passed through as a config override, e.g.
#   NPROC=2 CONFIG=examples/configs/multirank_tp2_ep2.yaml launch_scripts/train_local.sh \
#       parallel.tp=2 parallel.ep=2 checkpoint.resume=none
# Checkpoints resume from `latest` by default (checkpoint.resume=auto). To stop and keep every
# step: `touch $SAO_STOP_FILE` (or SIGUSR1/SIGTERM to the rank processes, not to torchrun): the
# ranks finish the step, save a checkpoint at it and exit 0; running the script again resumes.
set -euo pipefail

NPROC="${NPROC:-1}"
CONFIG="${CONFIG:-examples/configs/quickstart.yaml}"
PYTHON="${PYTHON:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv/bin/python}"
RUN_DIR="${RUN_DIR:-}"
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
if [[ "$DRY_RUN" != "1" && ! -x "$PYTHON" ]]; then
    echo "train_local.sh: PYTHON=$PYTHON is not executable (run \`make install\`, or set PYTHON)" >&2
    exit 2
fi
overrides=()
if [[ -n "$RUN_DIR" ]]; then
    overrides+=("run_dir=$RUN_DIR")
    export SAO_STOP_FILE="${SAO_STOP_FILE:-$RUN_DIR/.stop_request}"
fi

# --standalone: single-node rendezvous on a free local port (no MASTER_ADDR/PORT to pick).
cmd=("$PYTHON" -m torch.distributed.run --standalone --nnodes=1 --nproc_per_node="$NPROC"
     -m sao_megatron.cli.train "$CONFIG" "${overrides[@]}" "$@")

printf 'OMP_NUM_THREADS=%q' "$OMP_NUM_THREADS"
[[ -n "${SAO_STOP_FILE:-}" ]] && printf ' SAO_STOP_FILE=%q' "$SAO_STOP_FILE"
printf ' %q' "${cmd[@]}"
printf '\n'
if [[ "$DRY_RUN" == "1" ]]; then
    exit 0
fi
exec "${cmd[@]}"
