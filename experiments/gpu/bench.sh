#!/usr/bin/env bash
# GPU benchmark: ViT-B/16, ViT-L/16 training and SigLIP-B/16 pair training, MFU against 989 TFLOP/s.
# Runs in a few minutes on one H100/H200 with the JAX/Flax/optax the machine has installed:
#   bash experiments/gpu/bench.sh [extra args for experiments/gpu/bench.py]
#   bash experiments/gpu/bench.sh --profile       # and where each step's device time goes (profile.md)
#   bash experiments/gpu/bench.sh --sweep         # ViT-B/16 under several XLA flags and model settings
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
python3 -m experiments.gpu.bench --out "${OUT:-.}/bench_gpu.json" "$@" 2>&1 | tee "${OUT:-.}/bench_gpu.log"
