#!/usr/bin/env bash
# The GPU check: one prepared script for a machine with one (or more) NVIDIA GPUs and an
# NGC-like Python (torch, and ideally Transformer Engine, preinstalled). See docs/gpu.md.
#
#   bash scripts/gpu_check.sh             # set up, then run the stages (at most 9 minutes)
#   bash scripts/gpu_check.sh --dry-run   # print every command and its environment; run nothing
#
# Setup installs only what is missing and never touches an installed torch:
#   megatron-core==0.19.2 (--no-deps) if absent, einops/psutil/pytest if absent, then
#   `pip install --no-deps --no-build-isolation -e .`. With WHEELS=DIR (default: .gpu-wheels if
#   it exists) pip works offline from that directory (--no-index --find-links DIR).
# Stages, most valuable first (each time-boxed; the whole run stays within GPU_CHECK_BUDGET_S,
# default 540 s, so that it fits one 10-minute command; a stage that no longer fits is skipped
# and recorded as such):
#   1. converge         benchmarks/gpu_converge.py: 1 and 4 GB of fp32 main params, the
#                       averager's memory passes vs a device-to-device copy measured in the run
#                       (the copying path, and the per-segment code it replaced, side by side)
#   2. quality_*        auto-LR quality on the device: the example (4 ranks sharing the GPU over
#                       gloo, bf16, DistOpt, hidden 256, 250 iterations, the default corpus) as
#                       a 5-point peak-LR sweep of plain runs (quality_plain_0..4, --no-hdet),
#                       then HDET with the auto-LR defaults from best/4, best and 4x best
#                       (quality_auto_low/best/high), best being the sweep's lowest validation
#                       loss; table in quality.json (about 40 s a run on an H200)
#   3. gpu_tests        pytest -m gpu (the CUDA-path tests; skipped ones are listed)
#   4. example_hdet     examples/pretrain_gpt/pretrain_gpt.py on 2 ranks sharing the GPU: gloo
#                       with CUDA tensors (NCCL refuses two ranks on one device), HDET with 2
#                       arms, Transformer Engine layer spec, bf16, DistOpt (one instance per arm)
#   5. example_plain    stage 4 without HDET (--no-hdet): tokens/s with vs without HDET
#   6. overhead         benchmarks/overhead.py --device cuda: HDET's step overhead (2 ranks on
#                       the GPU over gloo, bf16, DistOpt, TE spec)
#   7. example_1rank    the example on 1 rank, NCCL, plain Megatron (--no-hdet)
# Knobs: GPU_CHECK_BUDGET_S (540), GPU_CHECK_ITERS (iterations of stages 4, 5 and 7: 150);
#   for the quality stage GPU_CHECK_QUALITY_ITERS (250), GPU_CHECK_QUALITY_PERIOD (HDET's period,
#   20), GPU_CHECK_QUALITY_LRS (the sweep, "1e-3 2e-3 4e-3 8e-3 1.6e-2"), GPU_CHECK_QUALITY_RANKS
#   (4), GPU_CHECK_QUALITY_MODEL and GPU_CHECK_QUALITY_DEVICE (the runs' model and device flags),
#   GPU_CHECK_QUALITY_DATA (a --data-path prefix instead of the default corpus) and
#   GPU_CHECK_QUALITY_RUN_MIN_S (45: a run starts only with this much of the budget left).
# Results: JSON under $OUT (default: ./gpu-check-results): gpu_check.json (environment, every
# stage's command, exit code, seconds and status, tokens/s of the example runs, the quality
# table), the stages' own JSON (gpu_converge.json, quality.json, overhead.json, example and
# quality runs' metrics), logs/<stage>.log.
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
BUDGET=${GPU_CHECK_BUDGET_S:-540}
ITERS=${GPU_CHECK_ITERS:-150}
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

# The quality stage: the setup of the auto-LR runs made on an H200 on 2026-12-04 (BENCHMARKS.md,
# "GPU"), now with a sweep beside them. The peak LR and --min-lr (LR / 10) are per run.
QUALITY_ITERS=${GPU_CHECK_QUALITY_ITERS:-250}
read -r -a QUALITY_LRS <<< "${GPU_CHECK_QUALITY_LRS:-1e-3 2e-3 4e-3 8e-3 1.6e-2}"
read -r -a QUALITY_MODEL <<< "${GPU_CHECK_QUALITY_MODEL:---num-layers 4 --hidden-size 256 \
    --num-attention-heads 4 --seq-length 256 --micro-batch-size 8 --global-batch-size 64 \
    --lr-decay-style cosine --lr-warmup-iters 15 --split 90,5,5 --eval-iters 10 --log-interval 50}"
QUALITY_RANKS=${GPU_CHECK_QUALITY_RANKS:-4}
read -r -a QUALITY_DEVICE <<< "${GPU_CHECK_QUALITY_DEVICE:---distributed-backend gloo --device cuda}"
QUALITY_PERIOD=${GPU_CHECK_QUALITY_PERIOD:-20}
QUALITY_DATA=${GPU_CHECK_QUALITY_DATA:-}  # empty: the default corpus, prepared by the stage
QUALITY_RUN_MIN_S=${GPU_CHECK_QUALITY_RUN_MIN_S:-45}

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
    if [ "$left" -lt "${STAGE_MIN_S:-30}" ]; then
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
    # Most valuable first: what only a device can tell, then the checks, then the repeats.
    stage converge 120 "${TORCHRUN[@]}" --nproc-per-node "$NGPU" benchmarks/gpu_converge.py \
        --gb 1 4 --reps 7 --out "$OUT_DIR"
    quality
    stage gpu_tests 240 "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider \
        --continue-on-collection-errors --junitxml "$OUT_DIR/gpu_tests.xml" tests
    stage example_hdet 150 "${TORCHRUN[@]}" --nproc-per-node 2 "$ex" "${MODEL[@]}" "${GPU_FLAGS[@]}" \
        --distributed-backend gloo --device cuda --hdet-period 25 --train-iters "$ITERS" \
        --run-dir "$OUT_DIR/example_hdet"
    stage example_plain 120 "${TORCHRUN[@]}" --nproc-per-node 2 "$ex" "${MODEL[@]}" "${GPU_FLAGS[@]}" \
        --distributed-backend gloo --device cuda --no-hdet --train-iters "$ITERS" \
        --run-dir "$OUT_DIR/example_plain"
    stage overhead 150 "${TORCHRUN[@]}" --nproc-per-node 2 benchmarks/overhead.py --device cuda \
        --backend gloo --tp 1 --bf16 --dist-opt --transformer-impl "$impl" --layers 4 --hidden 512 \
        --seq 512 --blocks 10 --block 5 --converges 5 --out "$OUT_DIR"
    stage example_1rank 120 "${TORCHRUN[@]}" --nproc-per-node 1 "$ex" "${MODEL[@]}" "${GPU_FLAGS[@]}" \
        --distributed-backend nccl --no-hdet --train-iters "$ITERS" --run-dir "$OUT_DIR/example_1rank"
    summarize
}

summarize() {
    if [ "$DRY_RUN" = 1 ]; then
        echo "[dry-run] summary: $PY - > $OUT_DIR/gpu_check.json  (environment, stages.jsonl, example tokens/s, converge, quality and overhead JSON)"
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
    "examples": examples, "converge": load("gpu_converge.json"), "quality": load("quality.json"),
    "overhead": load("overhead.json"),
}
with open(os.path.join(out, "gpu_check.json"), "w") as f:
    json.dump(summary, f, indent=2)
print(f"[gpu_check] {sum(s.get('status') == 'ok' for s in stages)}/{len(stages)} stages ok in {seconds} s; "
      f"summary {os.path.join(out, 'gpu_check.json')}")
for s in stages:
    print(f"    {s['stage']:18s} {s['status']:8s} {s.get('seconds', '-')} s")
for run, e in examples.items():
    print(f"    {run:14s} {e['tokens_per_s']:,.0f} tokens/s over {e['steps']} iterations, final loss {e['train_loss']:.3f}")
EOF
}

# -- quality: a peak-LR sweep of plain runs, then the auto-LR defaults from best/4, best, 4x ------
# lr_times LR FACTOR: LR * FACTOR in %g notation (awk: the dry run executes no python).
lr_times() { awk -v x="$1" -v f="$2" 'BEGIN { printf "%g", x * f }'; }

# quality_run NAME LR FLAGS...: one run of the example under the stage runner, into
# $OUT_DIR/quality/NAME. It starts only with QUALITY_RUN_MIN_S of the budget left.
quality_run() {
    local name=$1 lr=$2
    shift 2
    STAGE_MIN_S=$QUALITY_RUN_MIN_S stage "$name" 150 "${TORCHRUN[@]}" --nproc-per-node "$QUALITY_RANKS" \
        examples/pretrain_gpt/pretrain_gpt.py "${QUALITY_MODEL[@]}" "${GPU_FLAGS[@]}" "${QUALITY_DEVICE[@]}" \
        --data-path "$QUALITY_DATA" --train-iters "$QUALITY_ITERS" --eval-interval "$QUALITY_ITERS" \
        --lr "$lr" --min-lr "$(lr_times "$lr" 0.1)" "$@" --run-dir "$OUT_DIR/quality/$name"
}

quality() {
    if [ -z "$QUALITY_DATA" ]; then
        if [ "$DRY_RUN" = 1 ]; then
            echo "[dry-run] quality data: $PY examples/pretrain_gpt/prepare_data.py --default-corpus --print-prefix"
            QUALITY_DATA='<default-corpus-prefix>'
        else
            # The default corpus (this Python's standard library, byte-level), cached.
            QUALITY_DATA=$(env "${STAGE_ENV[@]}" timeout 120 "$PY" examples/pretrain_gpt/prepare_data.py \
                --default-corpus --print-prefix 2> "$OUT_DIR/logs/quality_data.log")
            if [ -z "$QUALITY_DATA" ]; then
                say "quality: the default corpus could not be prepared (logs/quality_data.log); skipped"
                printf '{"stage": "quality", "status": "skipped", "reason": "no data"}\n' >> "$OUT_DIR/stages.jsonl"
                return 0
            fi
        fi
    fi
    local k=0 lr name best
    for lr in "${QUALITY_LRS[@]}"; do
        quality_run "quality_plain_$k" "$lr" --no-hdet
        k=$(( k + 1 ))
    done
    if [ "$DRY_RUN" = 1 ]; then
        best=${QUALITY_LRS[$(( ${#QUALITY_LRS[@]} / 2 ))]}
        echo "[dry-run] quality: best = the sweep's lowest validation loss (the middle point, $best, stands in here)"
    else
        best=$(quality_table best)
    fi
    if [ -z "$best" ]; then
        say "quality: no sweep run finished with a validation loss; the auto-LR runs are skipped"
        for name in quality_auto_low quality_auto_best quality_auto_high; do
            printf '{"stage": "%s", "status": "skipped", "reason": "no sweep result"}\n' "$name" >> "$OUT_DIR/stages.jsonl"
        done
    else
        [ "$DRY_RUN" = 1 ] || say "quality: the sweep's best peak LR is $best"
        quality_run quality_auto_low "$(lr_times "$best" 0.25)" --hdet-period "$QUALITY_PERIOD"
        quality_run quality_auto_best "$best" --hdet-period "$QUALITY_PERIOD"
        quality_run quality_auto_high "$(lr_times "$best" 4)" --hdet-period "$QUALITY_PERIOD"
    fi
    [ "$DRY_RUN" = 1 ] || quality_table table
}

# quality_table best|table: print the sweep's best peak LR (best), or write quality.json and
# print it as a table (table). Read from the runs' metrics.jsonl and stages.jsonl.
quality_table() {
    "$PY" - "$OUT_DIR" "$1" "$QUALITY_ITERS" <<'EOF'
import json, math, os, sys
out, what = sys.argv[1], sys.argv[2]
stages = {}
if os.path.exists(os.path.join(out, "stages.jsonl")):
    for line in open(os.path.join(out, "stages.jsonl")):
        if line.strip():
            stages[json.loads(line)["stage"]] = json.loads(line)
def finite(v):
    return isinstance(v, (int, float)) and math.isfinite(v)
def run(name, lr):
    path = os.path.join(out, "quality", name, "metrics.jsonl")
    records = [json.loads(l) for l in open(path) if l.strip()] if os.path.exists(path) else []
    final = next((r for r in reversed(records) if r.get("type") == "final"), None) or {}
    stage = stages.get(name, {})
    row = {"run": name, "kind": "plain" if name.startswith("quality_plain") else "auto", "lr": lr,
           "status": stage.get("status", "not run"), "reason": stage.get("reason"),
           "seconds": stage.get("seconds"), "valid_loss": final.get("valid_loss"),
           "test_loss": final.get("test_loss"), "train_loss": final.get("train_loss"),
           "tokens_per_s": final.get("tokens_per_s")}
    if row["kind"] == "auto":
        updates = [r["update"] for r in records if r.get("type") == "window" and r.get("update")]
        row.update(final_lr_scale=(final.get("scales") or {}).get("lr"),
                   windows=sum(1 for r in records if r.get("type") == "window"),
                   windows_scale_up=sum(1 for u in updates if (u.get("deltas") or {}).get("lr", 0) > 0),
                   brakes=sum(1 for u in updates if u.get("brake")))
    return row
def lr_of(name):
    cmd = stages.get(name, {}).get("cmd", "").split()
    return float(cmd[cmd.index("--lr") + 1]) if "--lr" in cmd else None
names = sorted((n for n in stages if n.startswith("quality_plain_")), key=lambda n: int(n.rsplit("_", 1)[1]))
plain = [run(n, lr_of(n)) for n in names]
done = [r for r in plain if r["status"] == "ok" and finite(r["valid_loss"])]
best = min(done, key=lambda r: r["valid_loss"]) if done else None
if what == "best":
    print(f"{best['lr']:g}" if best else "")
    sys.exit(0)
auto = [run(n, lr_of(n)) for n in ("quality_auto_low", "quality_auto_best", "quality_auto_high")]
for r in plain + auto:
    r["vs_best_plain"] = r["valid_loss"] / best["valid_loss"] - 1 if best and finite(r["valid_loss"]) else None
lrs = [r["lr"] for r in plain if r["lr"] is not None]
table = {
    "what": "validation loss at the end of each run (--eval-iters batches); plain: --no-hdet at each "
            "sweep LR; auto: HDET with the auto-LR defaults from best/4, best and 4x best; "
            "vs_best_plain: relative to the sweep's best",
    "iterations": int(sys.argv[3]) if len(sys.argv) > 3 else None,
    "best_lr": best["lr"] if best else None,
    "best_valid_loss": best["valid_loss"] if best else None,
    "best_at_sweep_edge": bool(best and best["lr"] in (min(lrs), max(lrs))),
    "sweep_complete": bool(plain) and len(done) == len(plain),
    "rows": plain + auto,
}
with open(os.path.join(out, "quality.json"), "w") as f:
    json.dump(table, f, indent=2)
print(f"[gpu_check] quality (quality.json): best peak LR {table['best_lr']}")
for r in plain + auto:
    v = f"{r['valid_loss']:.4f}" if finite(r["valid_loss"]) else "-"
    d = f"{100 * r['vs_best_plain']:+.1f}%" if r["vs_best_plain"] is not None else ""
    extra = (f", lr scale {r['final_lr_scale']:.2f}, up in {r['windows_scale_up']}/{r['windows']} windows"
             if r["kind"] == "auto" and finite(r.get("final_lr_scale")) else "")
    print(f"    {r['run']:18s} lr {r['lr'] if r['lr'] is not None else '-'!s:8s} {r['status']:8s} "
          f"valid {v} {d}{extra}")
EOF
}

# GPU_CHECK_SOURCE_ONLY=1: define the functions only (tests/test_gpu_check.py drives `stage`).
[ "${GPU_CHECK_SOURCE_ONLY:-0}" = 1 ] || main
