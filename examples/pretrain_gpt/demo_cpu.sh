#!/usr/bin/env bash
# CPU demo (README main job): HDET GPT pretraining with Megatron-Core on 4 local gloo ranks.
#
#   1. prepares the embedded default corpus (this interpreter's standard library, byte-level
#      tokens, Megatron indexed dataset; cached in .hdet-cache/data),
#   2. trains a small GPT, TP2 x DP2 = 2 HDET arms, through GPTDataset/BlendedMegatronDatasetBuilder,
#      with validation, converges every 25 iterations, a dist_checkpointing checkpoint at the end,
#   3. writes RUN_DIR/report.png and a summary with `hdet report`.
#
# Environment: STEPS (default 400), RUN_DIR (default runs/demo, wiped first), VENV (.venv).
# Extra arguments go to pretrain_gpt.py (e.g. --no-hdet, --hdet-period 50).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VENV:-.venv}
STEPS=${STEPS:-400}
RUN_DIR=${RUN_DIR:-runs/demo}
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

start=$(date +%s)
DATA=$("$VENV/bin/python" examples/pretrain_gpt/prepare_data.py --default-corpus --print-prefix)
rm -rf "$RUN_DIR"

"$VENV/bin/torchrun" --standalone --nproc-per-node 4 examples/pretrain_gpt/pretrain_gpt.py \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
    --hidden-dropout 0 --attention-dropout 0 \
    --micro-batch-size 4 --global-batch-size 8 \
    --train-iters "$STEPS" --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters 30 \
    --weight-decay 0.01 --clip-grad 1.0 \
    --data-path "$DATA" --split 90,5,5 \
    --eval-interval 100 --eval-iters 10 \
    --save "$RUN_DIR" --log-interval 25 \
    --hdet-period 25 --hdet-spread 0.2 \
    "$@" 2>&1 | grep --line-buffered -v -E "^(W[0-9]{4}|\*{5}|Setting OMP_NUM_THREADS|GPTModel IS DEPRECATED|MCore's async save)" || {
    echo "demo: training failed" >&2; exit 1; }

"$VENV/bin/hdet" report "$RUN_DIR"
echo "demo: finished in $(( $(date +%s) - start )) s; plot $RUN_DIR/report.png"
