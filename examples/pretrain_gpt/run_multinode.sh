#!/usr/bin/env bash
# Multi-node HDET GPT pretraining: torchrun + NCCL, TP x PP x DP across nodes.
#
# Run the same command on every node (only NODE_RANK differs), e.g. 2 nodes x 8 GPUs,
# TP2 PP2 -> DP = 16 / 4 = 4 replicas -> 4 HDET arms (one per DP replica):
#
#   # node 0 (its address is MASTER_ADDR)          # node 1
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 \       NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 \
#   DATA_PATH=/data/my_text_document \             DATA_PATH=/data/my_text_document \
#   bash examples/pretrain_gpt/run_multinode.sh    bash examples/pretrain_gpt/run_multinode.sh
#
# Environment (defaults in brackets):
#   NNODES [1]  NODE_RANK [0]  GPUS_PER_NODE [8]  MASTER_ADDR [localhost]  MASTER_PORT [29500]
#   MAX_RESTARTS [0] (torchrun restarts, resuming from $LOAD)  RDZV_ID [hdet-gpt]  LOCAL_ADDR
#   TP [2]  PP [2]  ARMS [DP]  HDET_PERIOD [1000]  HDET_SPREAD [0.1111]
#   DATA_PATH (required; or MOCK=1)  SPLIT [969,30,1]  SAVE [checkpoints/gpt-hdet]  LOAD [$SAVE]
#   MODEL: NUM_LAYERS [24] HIDDEN [1024] HEADS [16] SEQ [2048]
#   BATCH: MBS [4] GBS [512]  LR [3e-4] MIN_LR [3e-5] TRAIN_ITERS [100000] WARMUP [2000]
#   TRANSFORMER_IMPL [transformer_engine, or local without TE]  PYTHON [python]  BACKEND [nccl]
#   NCCL_* / GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME: your cluster's network settings.
# Extra arguments are passed to pretrain_gpt.py and replace the default of the same flag (e.g.
# --no-hdet, --hdet-grad-sync arm, --hdet-axis lr:0.2). Everything is checked for the world
# NNODES x GPUS_PER_NODE before torchrun starts (examples/pretrain_gpt/check_args.py); a bad
# flag or file is one error line and exit code 2. CHECK_ONLY=1: check and stop.
set -euo pipefail
cd "$(dirname "$0")/../.."

NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
PYTHON=${PYTHON:-python}
TP=${TP:-2}
PP=${PP:-2}
for var in NNODES GPUS_PER_NODE TP PP; do
    [[ "${!var}" =~ ^[1-9][0-9]*$ ]] || { echo "run_multinode.sh: error: $var=${!var}: expected an integer >= 1" >&2; exit 2; }
done
[[ "$NODE_RANK" =~ ^[0-9]+$ && "$NODE_RANK" -lt "$NNODES" ]] \
    || { echo "run_multinode.sh: error: NODE_RANK=$NODE_RANK: expected an integer in [0, NNODES-1 = $((NNODES - 1))]" >&2; exit 2; }
WORLD=$(( NNODES * GPUS_PER_NODE ))
if (( WORLD % (TP * PP) )); then
    echo "run_multinode.sh: error: world size $WORLD (NNODES x GPUS_PER_NODE) is not divisible by TP x PP = $TP x $PP: change TP/PP or the GPU count" >&2
    exit 2
fi
DP=$(( WORLD / (TP * PP) ))
ARMS=${ARMS:-$DP}
SAVE=${SAVE:-checkpoints/gpt-hdet}
LOAD=${LOAD:-$SAVE}
if [[ -z "${TRANSFORMER_IMPL:-}" ]]; then
    if $PYTHON -c "import transformer_engine" 2>/dev/null; then TRANSFORMER_IMPL=transformer_engine; else TRANSFORMER_IMPL=local; fi
fi

if [[ "${MOCK:-0}" == 1 ]]; then
    DATA_ARGS=(--mock-data)
elif [[ -n "${DATA_PATH:-}" ]]; then
    # shellcheck disable=SC2206  # DATA_PATH may be "W1 PREFIX1 W2 PREFIX2"
    DATA_ARGS=(--data-path $DATA_PATH --split "${SPLIT:-969,30,1}")
else
    echo "run_multinode.sh: error: no data: set DATA_PATH=PREFIX_text_document (examples/pretrain_gpt/prepare_data.py) or MOCK=1" >&2
    exit 2
fi

export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}

# Defaults; any flag given as an extra argument replaces its default (e.g. --hdet-axis lr:0.2
# replaces --hdet-spread, --no-hdet every --hdet-* default).
DEFAULTS=(
    --distributed-backend "${BACKEND:-nccl}" --transformer-impl "$TRANSFORMER_IMPL"
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
    --num-layers "${NUM_LAYERS:-24}" --hidden-size "${HIDDEN:-1024}"
    --num-attention-heads "${HEADS:-16}" --seq-length "${SEQ:-2048}"
    --micro-batch-size "${MBS:-4}" --global-batch-size "${GBS:-512}"
    --train-iters "${TRAIN_ITERS:-100000}" --lr "${LR:-3e-4}" --min-lr "${MIN_LR:-3e-5}"
    --lr-decay-style cosine --lr-warmup-iters "${WARMUP:-2000}" --weight-decay 0.1
    --adam-beta2 0.95 --clip-grad 1.0 --bf16 --use-distributed-optimizer
    --hidden-dropout 0 --attention-dropout 0
    "${DATA_ARGS[@]}"
    --eval-interval 1000 --eval-iters 50 --log-interval 50
    --save "$SAVE" --load "$LOAD" --save-interval 2000
    --hdet-arms "$ARMS" --hdet-period "${HDET_PERIOD:-1000}" --hdet-spread "${HDET_SPREAD:-0.1111}"
)
# Check every flag and file for the whole world once, before torchrun starts a rank: a bad one is
# one error line and exit code 2 (CHECK_ONLY=1: check and stop; the sbatch file does that first).
ARGS_FILE=$(mktemp)
$PYTHON examples/pretrain_gpt/check_args.py --world-size "$WORLD" --print0 --prog run_multinode.sh \
    --defaults "${#DEFAULTS[@]}" -- "${DEFAULTS[@]}" "$@" > "$ARGS_FILE" || { rc=$?; rm -f "$ARGS_FILE"; exit "$rc"; }
mapfile -d '' -t ARGS < "$ARGS_FILE"
rm -f "$ARGS_FILE"
[[ "${CHECK_ONLY:-0}" != 1 ]] || { echo "run_multinode.sh: flags OK for world $WORLD"; exit 0; }

export NODE_RANK  # the workers name nodes by it (a lost node's line)
# Workers get a fresh store per rendezvous round (hosted by rank 0): the store torchrun shares by
# default keeps the previous round's keys, and a restarted group can read them (wrong addresses;
# pytorch/pytorch#135712).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
# c10d rendezvous at MASTER_ADDR:MASTER_PORT, hosted by node 0 (torchrun numbers the nodes in
# rendezvous order). MAX_RESTARTS > 0: after a failure torchrun restarts every node's workers,
# which resume from the latest checkpoint in $LOAD. LOCAL_ADDR: this node's address for the
# workers' store (default: its hostname).
# The arm count the run uses: the merged flags' (yours win over ARMS), one per DP replica without.
HDET_TEXT="$DP HDET arms"
for i in "${!ARGS[@]}"; do
    case "${ARGS[$i]}" in
        --no-hdet) HDET_TEXT="HDET off"; break ;;
        --hdet-arms) HDET_TEXT="${ARGS[$((i + 1))]} HDET arms" ;;
        --hdet-arms=*) HDET_TEXT="${ARGS[$i]#--hdet-arms=} HDET arms" ;;
    esac
done
[[ "$HDET_TEXT" != "1 HDET arms" ]] || HDET_TEXT="1 HDET arm"
echo "run_multinode.sh: node $NODE_RANK/$NNODES, world $WORLD = TP$TP x PP$PP x DP$DP, $HDET_TEXT, master $MASTER_ADDR:$MASTER_PORT"
exec $PYTHON -m torch.distributed.run \
    --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${RDZV_ID:-hdet-gpt}" \
    --rdzv-conf "is_host=$(( NODE_RANK == 0 ))" --max-restarts "${MAX_RESTARTS:-0}" \
    ${LOCAL_ADDR:+--local-addr "$LOCAL_ADDR"} \
    examples/pretrain_gpt/pretrain_gpt.py "${ARGS[@]}"
