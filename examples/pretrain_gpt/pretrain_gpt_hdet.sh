#!/usr/bin/env bash
# GPT pretraining with HDET in Megatron-LM's own loop (patched megatron.training), on GPUs.
# The docker image's default command (docker/README.md). One invocation per node:
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash examples/pretrain_gpt/pretrain_gpt_hdet.sh   # node 0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 bash examples/pretrain_gpt/pretrain_gpt_hdet.sh   # node 1
#
# Environment (defaults in brackets): GPUS_PER_NODE [all visible], NNODES [1], NODE_RANK [0],
# MASTER_ADDR [localhost], MASTER_PORT [29500], TP [1], PP [1], DATA_PATH [unset: --mock-data],
# VOCAB_FILE/MERGE_FILE (GPT2BPETokenizer, with DATA_PATH), CKPT_DIR [/workspace/checkpoints],
# TRAIN_ITERS [10000], GLOBAL_BATCH [256], MICRO_BATCH [4], PYTHON [python], MAX_RESTARTS [0],
# RDZV_ID [hdet-gpt], LOCAL_ADDR (see run_multinode.sh). Extra arguments are
# passed on to pretrain_gpt_hdet.py and replace the default of the same flag (e.g. --hdet-period
# 500, --hdet-axis lr:0.2, --no-hdet); all are checked for the world before torchrun starts (one
# error line, exit code 2; CHECK_ONLY=1: check and stop). Exit code 3: megatron.training unpatched.
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python}
if [[ -z "${GPUS_PER_NODE:-}" ]]; then
    GPUS_PER_NODE=$(nvidia-smi -L 2>/dev/null | wc -l)
    [[ "$GPUS_PER_NODE" -gt 0 ]] || { echo "pretrain_gpt_hdet.sh: error: no GPU visible: set GPUS_PER_NODE" >&2; exit 2; }
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
TP=${TP:-1}
PP=${PP:-1}
for var in GPUS_PER_NODE NNODES TP PP; do
    [[ "${!var}" =~ ^[1-9][0-9]*$ ]] || { echo "pretrain_gpt_hdet.sh: error: $var=${!var}: expected an integer >= 1" >&2; exit 2; }
done
[[ "$NODE_RANK" =~ ^[0-9]+$ && "$NODE_RANK" -lt "$NNODES" ]] \
    || { echo "pretrain_gpt_hdet.sh: error: NODE_RANK=$NODE_RANK: expected an integer in [0, NNODES-1 = $((NNODES - 1))]" >&2; exit 2; }
CKPT_DIR=${CKPT_DIR:-/workspace/checkpoints}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

if [[ -n "${DATA_PATH:-}" ]]; then
    if [[ -z "${VOCAB_FILE:-}" || -z "${MERGE_FILE:-}" ]]; then
        echo "pretrain_gpt_hdet.sh: error: DATA_PATH needs the GPT-2 tokenizer files: set VOCAB_FILE and MERGE_FILE (or unset DATA_PATH for --mock-data)" >&2
        exit 2
    fi
    DATA_ARGS=(--data-path "$DATA_PATH" --split 969,30,1 --tokenizer-type GPT2BPETokenizer
               --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE")
else
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 50257)
fi

# bash patches/apply.sh --status exits 1 when the patch is missing: say so before 8 GPUs start.
if ! status=$(PYTHON="$PYTHON" bash patches/apply.sh --status 2>&1); then
    echo "pretrain_gpt_hdet.sh: error: megatron.training of $PYTHON: $(tail -n 1 <<<"$status" | sed 's/^apply.sh: //'): run \`bash patches/apply.sh\` (or set PYTHON=...)" >&2
    exit 3
fi

# Defaults; an extra argument replaces the default of the same flag (--hdet-axis replaces
# --hdet-spread, --no-hdet every --hdet-* default).
DEFAULTS=(
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
    --num-layers 12 --hidden-size 768 --num-attention-heads 12
    --seq-length 1024 --max-position-embeddings 1024
    --micro-batch-size "${MICRO_BATCH:-4}" --global-batch-size "${GLOBAL_BATCH:-256}"
    --train-iters "${TRAIN_ITERS:-10000}" --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine
    --lr-warmup-iters 500 --weight-decay 0.1 --clip-grad 1.0 --bf16
    --transformer-impl transformer_engine
    "${DATA_ARGS[@]}"
    --save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval 1000 --ckpt-format torch_dist
    --log-interval 10 --eval-interval 1000 --eval-iters 10
    --tensorboard-dir "$CKPT_DIR/tensorboard"
    --hdet-period 500 --hdet-spread 0.1111
)
# Megatron-LM's and HDET's checks for the whole world, once, before torchrun starts a rank: a bad
# flag or file is one error line and exit code 2.
ARGS_FILE=$(mktemp)
$PYTHON examples/pretrain_gpt/check_args.py --script pretrain_gpt_hdet.py --prog pretrain_gpt_hdet.sh \
    --world-size $(( NNODES * GPUS_PER_NODE )) --print0 --defaults "${#DEFAULTS[@]}" -- "${DEFAULTS[@]}" "$@" \
    > "$ARGS_FILE" || { rc=$?; rm -f "$ARGS_FILE"; exit "$rc"; }
mapfile -d '' -t ARGS < "$ARGS_FILE"
rm -f "$ARGS_FILE"
[[ "${CHECK_ONLY:-0}" != 1 ]] || { echo "pretrain_gpt_hdet.sh: flags OK for world $(( NNODES * GPUS_PER_NODE ))"; exit 0; }

# c10d rendezvous hosted by node 0; MAX_RESTARTS > 0: torchrun restarts the workers after a
# failure and Megatron resumes from the latest checkpoint in $CKPT_DIR (--load). LOCAL_ADDR: this
# node's address for the workers' store (default: its hostname).
export NODE_RANK
# Workers get a fresh store per rendezvous round (hosted by rank 0): the store torchrun shares by
# default keeps the previous round's keys, and a restarted group can read them (wrong addresses;
# pytorch/pytorch#135712).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
exec $PYTHON -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${RDZV_ID:-hdet-gpt}" \
    --rdzv-conf "is_host=$(( NODE_RANK == 0 ))" --max-restarts "${MAX_RESTARTS:-0}" \
    ${LOCAL_ADDR:+--local-addr "$LOCAL_ADDR"} \
    examples/pretrain_gpt/pretrain_gpt_hdet.py "${ARGS[@]}"
