"""scripts/gpu_check.sh --dry-run: prints every stage's command and environment, runs nothing,
and every flag it would pass exists in the script it calls. Cheap (no torch, no GPU)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
QUALITY = tuple(f"quality_plain_{k}" for k in range(5)) + (
    "quality_auto_low",
    "quality_auto_best",
    "quality_auto_high",
)
STAGES = ("converge", *QUALITY, "gpu_tests", "example_hdet", "example_plain", "overhead", "example_1rank")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_check")
    marker = tmp / "python-was-run"
    fake_python = tmp / "fake-python"
    # Any execution of "python" (setup probes, stages, summary) would leave the marker.
    fake_python.write_text(f"#!/bin/sh\ntouch {shlex.quote(str(marker))}\nexit 1\n")
    fake_python.chmod(0o755)
    out = tmp / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=str(fake_python))
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=60, cwd=REPO, env=env
    )
    return proc, marker, out, str(fake_python)


def test_dry_run_prints_every_stage_and_runs_nothing(dry_run):
    proc, marker, out, py = dry_run
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    for name in STAGES:
        assert re.search(rf"^\[dry-run\] stage {name}\s+timeout\s+\d+s: env ", text, re.M), name
    # Most valuable first: the order in which the stages would run.
    assert re.findall(r"^\[dry-run\] stage (\w+)", text, re.M) == list(STAGES)
    assert "PYTHONUNBUFFERED=1" in text and "GLOO_SOCKET_IFNAME=lo" in text
    assert "--no-deps megatron-core==0.19.2" in text and "--no-build-isolation -e ." in text
    assert "torch is never installed" in text
    assert not marker.exists(), "the dry run executed python"
    assert not out.exists(), "the dry run wrote results"


def _commands(text: str) -> dict[str, list[str]]:
    """Stage name -> argv of its command (the line after the stage header)."""
    lines = text.splitlines()
    cmds = {}
    for i, line in enumerate(lines):
        m = re.match(r"^\[dry-run\] stage (\w+)", line)
        if m:
            cmds[m.group(1)] = shlex.split(lines[i + 1])
    return cmds


def _script_flags(path: Path) -> set[str]:
    return set(re.findall(r'add_argument\(\s*"(--[a-z0-9-]+)"', path.read_text()))


def test_dry_run_commands_match_the_scripts_they_call(dry_run):
    proc, _marker, out, py = dry_run
    cmds = _commands(proc.stdout)
    assert set(cmds) == set(STAGES)
    assert cmds["gpu_tests"][:4] == [py, "-m", "pytest", "-m"] and cmds["gpu_tests"][4] == "gpu"
    for name in ("example_1rank", "example_hdet", "example_plain", "converge", "overhead"):
        assert cmds[name][:4] == [py, "-m", "torch.distributed.run", "--standalone"], name
    # The example: TE layer spec, bf16, distributed optimizer; the 2-rank runs share the GPU
    # over gloo with CUDA tensors; 1 rank over NCCL.
    example_flags = {"--no-hdet", "--hdet-period"}  # hdet_megatron/args.py
    for path in (REPO / "examples" / "pretrain_gpt").glob("*.py"):  # the entry and its modules
        example_flags |= _script_flags(path)
    for name in ("example_1rank", "example_hdet", "example_plain", *QUALITY):
        argv = cmds[name]
        script = argv.index("examples/pretrain_gpt/pretrain_gpt.py")
        flags = [a for a in argv[script + 1 :] if a.startswith("--")]
        assert set(flags) <= example_flags, set(flags) - example_flags
        joined = " ".join(argv)
        assert "--transformer-impl transformer_engine --bf16 --use-distributed-optimizer" in joined
        run_dir = f"{out}/quality/{name}" if name in QUALITY else f"{out}/{name}"
        assert f"--run-dir {run_dir}" in joined
    # The quality stage: the 2026-12-04 auto-LR setup (4 ranks sharing the GPU over gloo, hidden
    # 256, 250 iterations, default corpus) at 5 sweep LRs, then from best/4, best, 4x best
    # (the dry run's best: the middle sweep point).
    lrs = {name: cmds[name][cmds[name].index("--lr") + 1] for name in QUALITY}
    assert [lrs[f"quality_plain_{k}"] for k in range(5)] == ["1e-3", "2e-3", "4e-3", "8e-3", "1.6e-2"]
    assert [float(lrs[n]) for n in QUALITY[5:]] == [1e-3, 4e-3, 1.6e-2]
    for name in QUALITY:
        joined = " ".join(cmds[name])
        assert "--nproc-per-node 4" in joined and "--distributed-backend gloo --device cuda" in joined
        assert "--hidden-size 256" in joined and "--train-iters 250 --eval-interval 250" in joined
        assert "--data-path <default-corpus-prefix>" in joined
        lr = float(lrs[name])
        assert f"--min-lr {lr / 10:g}" in joined
        assert ("--no-hdet" in cmds[name]) == (name.startswith("quality_plain"))
        assert ("--hdet-period 20" in joined) == (name.startswith("quality_auto"))
    assert "--default-corpus --print-prefix" in proc.stdout
    assert "--nproc-per-node 1" in " ".join(cmds["example_1rank"])
    assert "--distributed-backend nccl" in " ".join(cmds["example_1rank"])
    for name in ("example_hdet", "example_plain"):
        joined = " ".join(cmds[name])
        assert "--nproc-per-node 2" in joined and "--distributed-backend gloo --device cuda" in joined
    assert "--no-hdet" in cmds["example_plain"] and "--no-hdet" not in cmds["example_hdet"]
    for name, path in (("converge", "benchmarks/gpu_converge.py"), ("overhead", "benchmarks/overhead.py")):
        argv = cmds[name]
        flags = {a for a in argv[argv.index(path) + 1 :] if a.startswith("--")}
        assert flags <= _script_flags(REPO / path), (name, flags - _script_flags(REPO / path))
        assert f"--out {out}" in " ".join(argv)
    assert "--gb 1 4" in " ".join(cmds["converge"])
    assert "--device cuda" in " ".join(cmds["overhead"])


def test_the_example_parser_accepts_the_dry_run_flags(dry_run):
    """Beyond flag names: the example's own parser takes the whole command line."""
    import importlib.util

    proc, *_ = dry_run
    spec = importlib.util.spec_from_file_location(
        "pretrain_gpt_for_gpu_check", REPO / "examples" / "pretrain_gpt" / "pretrain_gpt.py"
    )
    pg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pg)
    for name in ("example_1rank", "example_hdet", "example_plain", *QUALITY):
        argv = _commands(proc.stdout)[name]
        args = pg.build_parser().parse_args(argv[argv.index("examples/pretrain_gpt/pretrain_gpt.py") + 1 :])
        assert args.bf16 and args.use_distributed_optimizer and args.transformer_impl == "transformer_engine"
        if name in QUALITY:
            assert (args.hidden_size, args.num_layers, args.global_batch_size, args.train_iters) == (
                256,
                4,
                64,
                250,
            )


def test_unknown_argument_is_refused():
    proc = subprocess.run(["bash", str(SCRIPT), "--bogus"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "unknown argument '--bogus'" in proc.stderr


def test_stage_records_status_exit_code_and_log(tmp_path):
    """The stage runner (sourced, with a real python for the JSON line): ok, failed, timeout,
    and a stage skipped once the budget is spent."""
    import json
    import sys

    out = tmp_path / "out"
    script = f"""
        GPU_CHECK_SOURCE_ONLY=1 OUT={shlex.quote(str(out))} PYTHON={shlex.quote(sys.executable)} \\
            source {shlex.quote(str(SCRIPT))}
        mkdir_out; : > "$OUT_DIR/stages.jsonl"
        stage good 10 bash -c 'echo hello; echo "$GLOO_SOCKET_IFNAME"'
        stage bad 10 bash -c 'exit 3'
        stage slow 1 sleep 20
        BUDGET=0
        stage late 10 true
    """
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    rows = {r["stage"]: r for r in map(json.loads, (out / "stages.jsonl").read_text().splitlines())}
    assert rows["good"]["status"] == "ok" and rows["good"]["rc"] == 0
    assert (out / "logs" / "good.log").read_text() == "hello\nlo\n"  # the stage environment
    assert rows["bad"]["status"] == "failed" and rows["bad"]["rc"] == 3
    assert rows["slow"]["status"] == "timeout" and rows["slow"]["seconds"] < 15
    assert rows["late"] == {"stage": "late", "status": "skipped", "reason": "budget"}


# -- the quality stage's logic: sweep, best, auto runs from best/4..4x, the table ----------------

# Stands in for torchrun + the example in the logic test (it runs no torch): writes the run's
# metrics.jsonl like the example would, with a validation loss that is a parabola in log2(LR)
# with its minimum at 4e-3, and fails (exit 3) at LR 8e-3. Its argv is kept for the test.
STAND_IN = r"""
import json, math, os, sys
argv = sys.argv[1:]
def flag(name, default=None):
    return argv[argv.index(name) + 1] if name in argv else default
lr, run_dir = float(flag("--lr")), flag("--run-dir")
os.makedirs(run_dir, exist_ok=True)
with open(os.path.join(run_dir, "argv.json"), "w") as f:
    json.dump(argv, f)
if lr == 8e-3:
    sys.exit(3)
hdet = "--no-hdet" not in argv
records = [{"type": "run", "iteration": 0, "args": {"lr": lr}}]
windows = int(flag("--train-iters")) // int(flag("--hdet-period", "1")) if hdet else 0
for w in range(windows):  # the scale goes up in every window but the last
    delta = 0.5 if w < windows - 1 else -0.1
    records.append({"type": "window", "window": w, "update": {"deltas": {"lr": delta}, "brake": None}})
valid = 2.0 + 0.1 * math.log2(lr / 4e-3) ** 2 - (0.05 if hdet else 0.0)
records.append({"type": "final", "valid_loss": valid, "test_loss": valid + 0.01, "train_loss": valid - 0.1,
                "tokens_per_s": 1000.0, "scales": {"lr": 1.5} if hdet else {}})
with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
    f.write("".join(json.dumps(r) + "\n" for r in records))
"""


def _quality(tmp_path, budget: int) -> tuple[subprocess.CompletedProcess, Path]:
    import sys

    out = tmp_path / "out"
    stand_in = tmp_path / "stand_in.py"
    stand_in.write_text(STAND_IN)
    script = f"""
        GPU_CHECK_SOURCE_ONLY=1 OUT={shlex.quote(str(out))} PYTHON={shlex.quote(sys.executable)} \\
            GPU_CHECK_QUALITY_DATA=prefix GPU_CHECK_QUALITY_ITERS=60 GPU_CHECK_QUALITY_RUN_MIN_S=1 \\
            source {shlex.quote(str(SCRIPT))}
        TORCHRUN=("$PY" {shlex.quote(str(stand_in))})
        BUDGET={budget}
        mkdir_out; : > "$OUT_DIR/stages.jsonl"
        quality
    """
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    return proc, out


def test_quality_stage_picks_the_best_sweep_point_and_tables_the_runs(tmp_path):
    """The sweep's lowest validation loss (a failed point left out) is the best LR; the auto runs
    start from best/4, best and 4x best with HDET on; quality.json tables every run."""
    import json

    proc, out = _quality(tmp_path, budget=600)
    assert proc.returncode == 0, proc.stderr
    assert "quality: the sweep's best peak LR is 0.004" in proc.stdout
    table = json.loads((out / "quality.json").read_text())
    assert table["best_lr"] == 4e-3 and table["best_valid_loss"] == 2.0
    assert table["sweep_complete"] is False and table["best_at_sweep_edge"] is False
    assert table["iterations"] == 60
    rows = {r["run"]: r for r in table["rows"]}
    assert list(rows) == list(QUALITY)
    assert [rows[f"quality_plain_{k}"]["lr"] for k in range(5)] == [1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2]
    assert rows["quality_plain_3"]["status"] == "failed" and rows["quality_plain_3"]["valid_loss"] is None
    assert rows["quality_plain_0"]["vs_best_plain"] == pytest.approx(0.4 / 2.0)  # 0.1 * log2(1/4)^2
    for name, lr in (("quality_auto_low", 1e-3), ("quality_auto_best", 4e-3), ("quality_auto_high", 1.6e-2)):
        r = rows[name]
        assert r["status"] == "ok" and r["lr"] == lr and r["kind"] == "auto"
        assert (r["windows"], r["windows_scale_up"], r["brakes"], r["final_lr_scale"]) == (3, 2, 0, 1.5)
        argv = json.loads((out / "quality" / name / "argv.json").read_text())
        assert "--no-hdet" not in argv and argv[argv.index("--hdet-period") + 1] == "20"
        assert argv[argv.index("--min-lr") + 1] == f"{lr / 10:g}"
    assert rows["quality_auto_best"]["vs_best_plain"] == pytest.approx(-0.05 / 2.0)
    argv = json.loads((out / "quality" / "quality_plain_0" / "argv.json").read_text())
    assert argv[:2] == ["--nproc-per-node", "4"] and "--no-hdet" in argv
    assert argv[argv.index("--data-path") + 1] == "prefix"
    assert "quality_auto_high  lr 0.016    ok       valid 2.3500 +17.5%" in proc.stdout


def test_quality_stage_records_what_the_budget_skipped(tmp_path):
    import json

    proc, out = _quality(tmp_path, budget=0)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in (out / "stages.jsonl").read_text().splitlines()]
    assert rows[:5] == [
        {"stage": f"quality_plain_{k}", "status": "skipped", "reason": "budget"} for k in range(5)
    ]
    assert rows[5:] == [
        {"stage": name, "status": "skipped", "reason": "no sweep result"} for name in QUALITY[5:]
    ]
    table = json.loads((out / "quality.json").read_text())
    assert table["best_lr"] is None and table["sweep_complete"] is False
    assert [(r["status"], r["reason"]) for r in table["rows"]] == [("skipped", "budget")] * 5 + [
        ("skipped", "no sweep result")
    ] * 3


@pytest.mark.slow
def test_quality_stage_on_cpu_with_the_real_example(tmp_path):
    """The quality stage end to end on CPU: the real example under torchrun (2 gloo ranks, a
    tiny model, 8 iterations, 2 sweep points), its default corpus, the table from its own
    metrics. Checks the plumbing, not the numbers (five launches: each costs the imports of every
    rank, so the sweep is as short as a sweep can be)."""
    import json
    import sys

    out = tmp_path / "out"
    env = dict(
        os.environ,
        GPU_CHECK_SOURCE_ONLY="1",
        OUT=str(out),
        PYTHON=sys.executable,
        GPU_CHECK_QUALITY_ITERS="8",
        GPU_CHECK_QUALITY_PERIOD="4",
        GPU_CHECK_QUALITY_LRS="1e-3 1.6e-2",
        GPU_CHECK_QUALITY_RANKS="2",
        GPU_CHECK_QUALITY_MODEL="--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 32 "
        "--micro-batch-size 2 --global-batch-size 4 --lr-decay-style cosine --lr-warmup-iters 2 "
        "--split 90,5,5 --eval-iters 2 --log-interval 4",
        GPU_CHECK_QUALITY_DEVICE="--distributed-backend gloo --device cpu",
        GPU_CHECK_QUALITY_RUN_MIN_S="1",
    )
    script = f"""
        source {shlex.quote(str(SCRIPT))}
        GPU_FLAGS=(--transformer-impl local --bf16 --use-distributed-optimizer)
        mkdir_out; : > "$OUT_DIR/stages.jsonl"
        quality
    """
    proc = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, timeout=900, cwd=REPO, env=env
    )
    assert proc.returncode == 0, proc.stderr
    table = json.loads((out / "quality.json").read_text())
    rows = table["rows"]
    assert [r["status"] for r in rows] == ["ok"] * 5, proc.stdout
    assert all(r["valid_loss"] > 0 for r in rows)
    best = table["best_lr"]
    assert best in (1e-3, 1.6e-2)
    assert best == min(rows[:2], key=lambda r: r["valid_loss"])["lr"]
    assert [r["lr"] for r in rows[2:]] == pytest.approx([best / 4, best, best * 4])
    assert all(r["windows"] == 2 and r["final_lr_scale"] > 0 for r in rows[2:])
