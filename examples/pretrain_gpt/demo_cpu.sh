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
# Extra arguments go to pretrain_gpt.py and replace the demo's default for the same flag
# (e.g. --no-hdet, --hdet-period 50, --hdet-axis lr:0.3 instead of the demo's --hdet-spread).
# They are checked for the 4-rank world before anything starts: a bad one is one error line,
# exit code 2.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VENV:-.venv}
STEPS=${STEPS:-400}
RUN_DIR=${RUN_DIR:-runs/demo}
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

start=$(date +%s)
[[ -x "$VENV/bin/python" ]] || { echo "demo_cpu.sh: error: no virtual environment at $VENV: run \`make setup\` (or set VENV=...)" >&2; exit 2; }
[[ "$STEPS" =~ ^[1-9][0-9]*$ ]] || { echo "demo_cpu.sh: error: STEPS=$STEPS: expected an integer >= 1 (e.g. STEPS=400)" >&2; exit 2; }
[[ -n "$RUN_DIR" && "$RUN_DIR" != "/" ]] || { echo "demo_cpu.sh: error: RUN_DIR='$RUN_DIR' is wiped before training: give a run directory such as runs/demo" >&2; exit 2; }
NPROC=4
# The demo's defaults; any flag you pass replaces its default (check_args.py merges them).
DEFAULTS=(
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128
    --hidden-dropout 0 --attention-dropout 0
    --micro-batch-size 4 --global-batch-size 8
    --train-iters "$STEPS" --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters 30
    --weight-decay 0.01 --clip-grad 1.0
    --data-path @default-corpus --split 90,5,5
    --eval-interval 100 --eval-iters 10
    --save "$RUN_DIR" --log-interval 25
    --hdet-period 25 --hdet-spread 0.2
)
# Check every flag for the 4-rank world once, before the corpus is prepared or a rank starts:
# a bad flag is one line and exit code 2.
FRESH=(--fresh)  # RUN_DIR is wiped below, so its old contents are not checked ...
for a in "$@"; do case "$a" in --save|--save=*|--run-dir|--run-dir=*) FRESH=() ;; esac; done  # ... unless you pick it
ARGS_FILE=$(mktemp)
"$VENV/bin/python" examples/pretrain_gpt/check_args.py --world-size "$NPROC" "${FRESH[@]}" --print0 \
    --prog demo_cpu.sh --defaults "${#DEFAULTS[@]}" -- "${DEFAULTS[@]}" "$@" > "$ARGS_FILE" \
    || { rc=$?; rm -f "$ARGS_FILE"; exit "$rc"; }
mapfile -d '' -t ARGS < "$ARGS_FILE"
rm -f "$ARGS_FILE"
SAVE_DIR=$RUN_DIR REPORT_DIR=""  # where metrics.jsonl goes: --run-dir, else --save
for i in "${!ARGS[@]}"; do
    case "${ARGS[$i]}" in
        @default-corpus) ARGS[$i]=$("$VENV/bin/python" examples/pretrain_gpt/prepare_data.py --default-corpus --print-prefix) ;;
        --save) SAVE_DIR=${ARGS[$((i + 1))]} ;;
        --save=*) SAVE_DIR=${ARGS[$i]#--save=} ;;
        --run-dir) REPORT_DIR=${ARGS[$((i + 1))]} ;;
        --run-dir=*) REPORT_DIR=${ARGS[$i]#--run-dir=} ;;
    esac
done
REPORT_DIR=${REPORT_DIR:-$SAVE_DIR}
[[ ${#FRESH[@]} -eq 0 ]] || rm -rf "$RUN_DIR"

"$VENV/bin/torchrun" --standalone --nproc-per-node "$NPROC" examples/pretrain_gpt/pretrain_gpt.py "${ARGS[@]}" \
    2>&1 | grep --line-buffered -v -E "^(W[0-9]{4}|\*{5}|Setting OMP_NUM_THREADS|GPTModel IS DEPRECATED|MCore's async save)" || {
    echo "demo: training failed" >&2; exit 1; }

"$VENV/bin/hdet" report "$REPORT_DIR"
echo "demo: finished in $(( $(date +%s) - start )) s; plot $REPORT_DIR/report.png"
