#!/usr/bin/env bash
# CPU demo (README main job): real Megatron-Core GPT training on 4 local gloo ranks (TP2 x DP2).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VENV:-.venv}
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}
exec "$VENV/bin/torchrun" --standalone --nproc-per-node 4 \
    examples/pretrain_gpt/toy_pretrain.py --tp 2 --steps "${STEPS:-60}" "$@"
