#!/usr/bin/env bash
# CPU demo (README main job): HDET GPT pretraining with Megatron-Core on 4 local gloo ranks.
#
#   1. prepares the embedded default corpus (this interpreter's standard library, byte-level
#      tokens, Megatron indexed dataset; cached in .hdet-cache/data),
#   2. trains a small GPT, TP2 x DP2 = 2 HDET arms, through GPTDataset/BlendedMegatronDatasetBuilder,
#      with validation, converges every 25 iterations (at STEPS=400), a dist_checkpointing checkpoint
#      at the end,
#   3. writes RUN_DIR/report.png and a summary with `hdet report`.
#
# Environment: STEPS (default 400; the warm-up, window, validation and log intervals follow it),
# RUN_DIR (default runs/demo), VENV (.venv). RUN_DIR must be new, empty, or a previous run of
# this demo (which it replaces); anything else is refused (hdet_megatron/run_dirs.py): the demo
# removes nothing it did not write.
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
[[ -n "$RUN_DIR" ]] || { echo "demo_cpu.sh: error: RUN_DIR is empty: give a run directory such as runs/demo" >&2; exit 2; }
run_dirs() { HDET_PROG=demo_cpu.sh "$VENV/bin/python" -m hdet_megatron.run_dirs "$@"; }
NPROC=4
# The run length the defaults below follow: STEPS, or the --train-iters you pass.
ITERS=$STEPS
for ((i = 1; i <= $#; i++)); do
    case "${!i}" in
        --train-iters) j=$((i + 1)); ITERS=${!j:-$STEPS} ;;
        --train-iters=*) ITERS=${!i#--train-iters=} ;;
    esac
done
[[ "$ITERS" =~ ^[1-9][0-9]*$ ]] || ITERS=$STEPS  # a bad value: check_args.py names it below
clamp() { local v=$1; (( v < $2 )) && v=$2; (( v > $3 )) && v=$3; echo "$v"; }
# At STEPS=400: a window of 25, warm-up 30, validation every 100 iterations (10 batches), a log
# line every 25. Shorter runs scale them down (STEPS=5: window 1, no warm-up, validation of one
# batch after every iteration), so a quick smoke run works as is.
PERIOD=$(clamp $((ITERS / 16)) 1 25)
WARMUP=$(clamp $((ITERS * 3 / 40)) 0 30)
EVAL_INTERVAL=$(clamp $((ITERS / 4 / PERIOD * PERIOD)) "$PERIOD" 100)
EVAL_ITERS=$(clamp $((ITERS / 40)) 1 10)
# The demo's defaults; any flag you pass replaces its default (check_args.py merges them).
DEFAULTS=(
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128
    --hidden-dropout 0 --attention-dropout 0
    --micro-batch-size 4 --global-batch-size 8
    --train-iters "$STEPS" --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters "$WARMUP"
    --weight-decay 0.01 --clip-grad 1.0
    --data-path @default-corpus --split 90,5,5
    --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS"
    --save "$RUN_DIR" --log-interval "$PERIOD"
    --hdet-period "$PERIOD" --hdet-spread 0.2
)
# Check every flag for the 4-rank world once, before the corpus is prepared or a rank starts:
# a bad flag is one line and exit code 2.
FRESH=(--fresh)  # RUN_DIR is cleared below (a previous demo run only), so its old contents are not checked ...
for a in "$@"; do case "$a" in --save|--save=*) FRESH=() ;; esac; done  # ... unless you pick --save
[[ ${#FRESH[@]} -eq 0 ]] || run_dirs check-demo "$RUN_DIR" || exit $?
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
run_dirs check-report "$REPORT_DIR" || exit $?  # hdet report writes REPORT_DIR/report.png at the end
# Removes exactly the files of the previous demo run (checked again), then marks RUN_DIR as the demo's.
[[ ${#FRESH[@]} -eq 0 ]] || run_dirs clear-demo "$RUN_DIR" || exit $?

"$VENV/bin/torchrun" --standalone --nproc-per-node "$NPROC" examples/pretrain_gpt/pretrain_gpt.py "${ARGS[@]}" \
    2>&1 | grep --line-buffered -v -E "^(W[0-9]{4}|\*{5}|Setting OMP_NUM_THREADS|GPTModel IS DEPRECATED|MCore's async save)" || {
    echo "demo: training failed" >&2; exit 1; }

"$VENV/bin/hdet" report "$REPORT_DIR"
echo "demo: finished in $(( $(date +%s) - start )) s; plot $REPORT_DIR/report.png"
