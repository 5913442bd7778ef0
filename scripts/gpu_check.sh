#!/usr/bin/env bash
# The GPU check: one prepared script for a machine with one (or more) NVIDIA GPUs and an
# NGC-like Python (torch, and ideally Transformer Engine, preinstalled). See docs/gpu.md.
#
#   bash scripts/gpu_check.sh             # set up, then run every stage (about 6-8 minutes)
#   bash scripts/gpu_check.sh --dry-run   # print every command and its environment; run nothing
#
# Setup installs only what is missing and never touches an installed torch:
#   megatron-core==0.19.2 (--no-deps) if absent, einops/psutil/pytest if absent, then
#   `pip install --no-deps --no-build-isolation -e .`. With WHEELS=DIR (default: .gpu-wheels if
#   it exists) pip works offline from that directory (--no-index --find-links DIR).
# Stages, in this order (each time-boxed; the whole run stays within GPU_CHECK_BUDGET_S, default
# 480 s; the measurements first, the tests last with what is left):
#   1. converge         benchmarks/gpu_converge.py: 1 and 4 GB of fp32 main params, the
#                       averager's memory passes vs a device-to-device copy measured in the run
#   2. example_1rank    examples/pretrain_gpt/pretrain_gpt.py, 1 rank, NCCL, Transformer Engine
#                       layer spec, bf16, distributed optimizer, plain Megatron (--no-hdet)
#   3. example_hdet     the same model on 2 ranks sharing the GPU: gloo with CUDA tensors
#                       (NCCL refuses two ranks on one device), HDET with 2 arms, DistOpt
#                       with one instance per arm
#   4. example_plain    stage 3 without HDET (--no-hdet): tokens/s with vs without HDET
#   5. overhead         benchmarks/overhead.py --device cuda: HDET's step overhead (2 ranks on
#                       the GPU over gloo, bf16, DistOpt, TE spec)
#   6. gpu_tests        pytest -m gpu (the CUDA-path tests; skipped ones are listed)
# Results: JSON under $OUT (default: ./gpu-check-results): gpu_check.json (environment, every
# stage's command, exit code, seconds and status, tokens/s of the example runs), the stages'
# own JSON (gpu_converge.json, overhead.json, example metrics), logs/<stage>.log.
set -uo pipefail

DRY_RUN=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY_RUN=1 ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument '$arg' (use --dry-run or --help)" >&2; exit 2 ;;
    esac
done

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
PY=${PYTHON:-python}
command -v "$PY" >/dev/null 2>&1 || PY=python3
OUT_DIR=${OUT:-$ROOT/gpu-check-results}
BUDGET=${GPU_CHECK_BUDGET_S:-480}
ITERS=${GPU_CHECK_ITERS:-300}
WHEELS=${WHEELS:-}
if [ -z "$WHEELS" ] && [ -d "$ROOT/.gpu-wheels" ]; then WHEELS=$ROOT/.gpu-wheels; fi
NGPU=${GPU_CHECK_NGPU:-}
if [ -z "$NGPU" ]; then
    if [ "$DRY_RUN" = 1 ]; then NGPU=1; else NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true); fi
fi
[ "${NGPU:-0}" -ge 1 ] 2>/dev/null || NGPU=1

# Environment of every stage.
STAGE_ENV=(
    "PYTHONUNBUFFERED=1"
    "OMP_NUM_THREADS=4"
    "GLOO_SOCKET_IFNAME=lo"
    "TORCH_NCCL_ASYNC_ERROR_HANDLING=1"
    "NVTE_FLASH_ATTN=${NVTE_FLASH_ATTN:-1}"
)
TORCHRUN=("$PY" -m torch.distributed.run --standalone)
PIP=("$PY" -m pip install --no-input --disable-pip-version-check)
if [ -n "$WHEELS" ]; then PIP+=(--no-index --find-links "$WHEELS"); fi

# The example's model: small enough for a few hundred iterations per stage.
MODEL=(--mock-data --num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 512
       --micro-batch-size 4 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 20
       --hidden-dropout 0.0 --attention-dropout 0.0 --log-interval 50 --eval-interval 100000
       --eval-iters 0 --quiet)
GPU_FLAGS=(--transformer-impl transformer_engine --bf16 --use-distributed-optimizer)

START=$(date +%s)
mkdir_out() { [ "$DRY_RUN" = 1 ] || mkdir -p "$OUT_DIR/logs"; }
elapsed() { echo $(( $(date +%s) - START )); }

say() { echo "[gpu_check] $*"; }

# stage NAME TIMEOUT_S CMD...: run CMD with STAGE_ENV under `timeout`, log to logs/NAME.log and
# append a JSON line to stages.jsonl. Skipped when less than 30 s of the budget would remain.
stage() {
    local name=$1 limit=$2
    shift 2
    if [ "$DRY_RUN" = 1 ]; then
        printf '[dry-run] stage %-14s timeout %4ss: env %s \\\n    %s\n' "$name" "$limit" \
            "${STAGE_ENV[*]}" "$(printf '%q ' "$@")"
        return 0
    fi
    local left=$(( BUDGET - $(elapsed) ))
    if [ "$left" -lt 30 ]; then
        say "$name: skipped (budget of ${BUDGET}s spent)"
        printf '{"stage": "%s", "status": "skipped", "reason": "budget"}\n' "$name" >> "$OUT_DIR/stages.jsonl"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    say "$name (timeout ${limit}s): $*"
    local t0 rc status
    t0=$(date +%s)
    env "${STAGE_ENV[@]}" timeout --kill-after=10 "$limit" "$@" > "$OUT_DIR/logs/$name.log" 2>&1
    rc=$?
    status=ok
    [ "$rc" -ne 0 ] && status=failed
    { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; } && status=timeout
    say "$name: $status (rc $rc, $(( $(date +%s) - t0 )) s); log $OUT_DIR/logs/$name.log"
    [ "$status" = ok ] || tail -n 25 "$OUT_DIR/logs/$name.log" | sed 's/^/    | /'
    "$PY" - "$name" "$rc" "$status" "$(( $(date +%s) - t0 ))" "$*" >> "$OUT_DIR/stages.jsonl" <<'EOF'
import json, sys
name, rc, status, seconds, cmd = sys.argv[1:6]
print(json.dumps({"stage": name, "status": status, "rc": int(rc), "seconds": int(seconds), "cmd": cmd}))
EOF
}

# -- setup --------------------------------------------------------------------------------------
setup() {
    if [ "$DRY_RUN" = 1 ]; then
        echo "[dry-run] setup (installs only what is missing; torch is never installed or replaced):"
        echo "    $PY -c 'import torch; assert torch.cuda.is_available()'   # else stop: no CUDA torch"
        echo "    if megatron-core is not installed: $(printf '%q ' "${PIP[@]}") --no-deps megatron-core==0.19.2"
        echo "    for each of einops psutil pytest not importable: $(printf '%q ' "${PIP[@]}") --no-deps NAME"
        echo "    $(printf '%q ' "${PIP[@]}") --no-deps --no-build-isolation -e ."
        echo "    $PY -c '<versions of python, torch, CUDA, NCCL, GPU, Transformer Engine, megatron-core>' > $OUT_DIR/environment.json"
        return 0
    fi
    if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
        say "error: $PY has no CUDA-enabled torch (this script never installs torch); stopping"
        return 1
    fi
    if ! "$PY" -c 'import importlib.metadata as m; m.version("megatron-core")' 2>/dev/null; then
        say "installing megatron-core==0.19.2 (--no-deps)"
        "${PIP[@]}" --no-deps "megatron-core==0.19.2" || return 1
    fi
    for mod in einops psutil pytest; do
        if ! "$PY" -c "import $mod" 2>/dev/null; then
            say "installing $mod"
            "${PIP[@]}" --no-deps "$mod" || return 1
        fi
    done
    "${PIP[@]}" --no-deps --no-build-isolation -e . > "$OUT_DIR/logs/setup_pip.log" 2>&1 || {
        tail -n 20 "$OUT_DIR/logs/setup_pip.log"; return 1; }
    "$PY" - > "$OUT_DIR/environment.json" <<'EOF'
import importlib.metadata as md, json, platform, subprocess, torch
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
te = None
try:
    import transformer_engine
    te = getattr(transformer_engine, "__version__", None) or version("transformer-engine")
except Exception as exc:  # noqa: BLE001
    te = f"not importable: {exc!r}"[:200]
smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip().splitlines()
print(json.dumps({
    "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
    "cudnn": torch.backends.cudnn.version(), "nccl": str(torch.cuda.nccl.version()),
    "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    "nvidia_smi": smi, "transformer_engine": te, "megatron_core": version("megatron-core"),
    "hdet_megatron": version("hdet-megatron"),
}, indent=2))
EOF
    cat "$OUT_DIR/environment.json"
}

# Transformer Engine present? (decided at run time; the dry run shows the TE commands)
te_flags() {
    if [ "$DRY_RUN" = 1 ] || "$PY" -c 'import transformer_engine.pytorch' 2>/dev/null; then
        echo transformer_engine
    else
        echo local
    fi
}

main() {
    mkdir_out
    [ "$DRY_RUN" = 1 ] || : > "$OUT_DIR/stages.jsonl"
    say "root $ROOT | out $OUT_DIR | budget ${BUDGET}s | ${NGPU} GPU(s) | iterations $ITERS | python $PY"
    if ! setup; then
        [ "$DRY_RUN" = 1 ] || printf '{"stage": "setup", "status": "failed"}\n' >> "$OUT_DIR/stages.jsonl"
        summarize; return 1
    fi
    local impl
    impl=$(te_flags)
    if [ "$impl" != transformer_engine ]; then
        say "Transformer Engine is not importable: the example and overhead stages use the local spec"
        GPU_FLAGS=(--transformer-impl local --bf16 --use-distributed-optimizer)
    fi
    local ex=examples/pretrain_gpt/pretrain_gpt.py
    stage converge 120 "${TORCHRUN[@]}" --nproc-per-node "$NGPU" benchmarks/gpu_converge.py \
        --gb 1 4 --reps 7 --out "$OUT_DIR"
    stage example_1rank 120 "${TORCHRUN[@]}" --nproc-per-node 1 "$ex" "${MODEL[@]}" "${GPU_FLAGS[@]}" \
        --distributed-backend nccl --no-hdet --train-iters "$ITERS" --run-dir "$OUT_DIR/example_1rank"
    stage example_hdet 150 "${TORCHRUN[@]}" --nproc-per-node 2 "$ex" "${MODEL[@]}" "${GPU_FLAGS[@]}" \
        --distributed-backend gloo --device cuda --hdet-period 25 --train-iters "$ITERS" \
        --run-dir "$OUT_DIR/example_hdet"
    stage example_plain 120 "${TORCHRUN[@]}" --nproc-per-node 2 "$ex" "${MODEL[@]}" "${GPU_FLAGS[@]}" \
        --distributed-backend gloo --device cuda --no-hdet --train-iters "$ITERS" \
        --run-dir "$OUT_DIR/example_plain"
    stage overhead 150 "${TORCHRUN[@]}" --nproc-per-node 2 benchmarks/overhead.py --device cuda \
        --backend gloo --tp 1 --bf16 --dist-opt --transformer-impl "$impl" --layers 4 --hidden 512 \
        --seq 512 --blocks 10 --block 5 --converges 5 --out "$OUT_DIR"
    stage gpu_tests 240 "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider \
        --continue-on-collection-errors --junitxml "$OUT_DIR/gpu_tests.xml" tests
    summarize
}

summarize() {
    if [ "$DRY_RUN" = 1 ]; then
        echo "[dry-run] summary: $PY - > $OUT_DIR/gpu_check.json  (environment, stages.jsonl, example tokens/s, converge and overhead JSON)"
        return 0
    fi
    "$PY" - "$OUT_DIR" "$(elapsed)" <<'EOF'
import json, os, sys, datetime
out, seconds = sys.argv[1], int(sys.argv[2])
def load(name):
    path = os.path.join(out, name)
    try:
        with open(path) as f:
            return json.load(f)
    except Exception:  # noqa: BLE001
        return None
stages = []
if os.path.exists(os.path.join(out, "stages.jsonl")):
    stages = [json.loads(l) for l in open(os.path.join(out, "stages.jsonl")) if l.strip()]
examples = {}
for run in ("example_1rank", "example_hdet", "example_plain"):
    path = os.path.join(out, run, "metrics.jsonl")
    if os.path.exists(path):
        final = [r for r in map(json.loads, open(path)) if r.get("type") == "final"]
        if final:
            examples[run] = {k: final[-1].get(k) for k in ("tokens_per_s", "train_loss", "steps", "train_seconds")}
summary = {
    "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "seconds": seconds, "environment": load("environment.json"), "stages": stages,
    "examples": examples, "converge": load("gpu_converge.json"), "overhead": load("overhead.json"),
}
with open(os.path.join(out, "gpu_check.json"), "w") as f:
    json.dump(summary, f, indent=2)
print(f"[gpu_check] {sum(s.get('status') == 'ok' for s in stages)}/{len(stages)} stages ok in {seconds} s; "
      f"summary {os.path.join(out, 'gpu_check.json')}")
for s in stages:
    print(f"    {s['stage']:14s} {s['status']:8s} {s.get('seconds', '-')} s")
for run, e in examples.items():
    print(f"    {run:14s} {e['tokens_per_s']:,.0f} tokens/s over {e['steps']} iterations, final loss {e['train_loss']:.3f}")
EOF
}

# GPU_CHECK_SOURCE_ONLY=1: define the functions only (tests/test_gpu_check.py drives `stage`).
[ "${GPU_CHECK_SOURCE_ONLY:-0}" = 1 ] || main
