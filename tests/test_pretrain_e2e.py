"""End to end: examples/pretrain_gpt/pretrain_gpt.py under torchrun on 4 CPU ranks (TP2 x DP2,
HDET on) with real prepared data: train, validate, save mid-window, resume in new processes
(bit-identical continuation), JSONL metrics and the `hdet report` PNG."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from hdet_megatron.cli import main as hdet_main
from hdet_megatron.metrics import read_metrics

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "pretrain_gpt" / "pretrain_gpt.py"
PREPARE = REPO / "examples" / "pretrain_gpt" / "prepare_data.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")

WORDS = (
    "the model reads bytes and learns which byte comes next while arms train with "
    "different learning rates and converge every few steps into one averaged model"
).split()


def tiny_corpus(root: Path) -> list[str]:
    rng = random.Random(0)
    root.mkdir()
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(60, 160))) + ".\n" for _ in range(36)]
    with open(root / "part1.jsonl", "w") as fh:
        for d in docs[:30]:
            fh.write(json.dumps({"text": d}) + "\n")
    for i, d in enumerate(docs[30:]):
        (root / f"extra{i}.txt").write_text(d)
    return [str(root / "part1.jsonl"), str(root)]


def torchrun(args: list[str], cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "4", str(SCRIPT), *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def steps(run_dir: Path) -> dict[int, dict]:
    return {r["iteration"]: r for r in read_metrics(str(run_dir)) if r["type"] == "step"}


def test_train_save_resume_report(tmp_path, capsys):
    # Real data: a corpus of JSONL + text files -> Megatron indexed dataset.
    sys.path.insert(0, str(PREPARE.parent))
    try:
        import prepare_data
    finally:
        sys.path.pop(0)
    inputs = tiny_corpus(tmp_path / "corpus")
    assert (
        prepare_data.main(
            [
                "--input",
                inputs[0],
                str(Path(inputs[1]) / "extra*.txt"),
                "--output-prefix",
                str(tmp_path / "data" / "tiny"),
            ]
        )
        == 0
    )
    data = str(tmp_path / "data" / "tiny_text_document")

    common = [
        "--tensor-model-parallel-size",
        "2",
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "32",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "8",
        "--train-iters",
        "8",
        "--lr",
        "3e-3",
        "--min-lr",
        "3e-4",
        "--lr-decay-style",
        "cosine",
        "--lr-warmup-iters",
        "2",
        "--data-path",
        data,
        "--split",
        "80,10,10",
        "--eval-interval",
        "4",
        "--eval-iters",
        "2",
        "--log-interval",
        "2",
        "--hidden-dropout",
        "0.1",
        "--attention-dropout",
        "0.0",
        "--hdet-period",
        "3",
        "--hdet-spread",
        "0.3",
        "--hdet-temperature",
        "0.05",
    ]
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    # Run A: 8 iterations, checkpoint every 4 (iteration 4 is mid-window: converge-on-save).
    a = torchrun([*common, "--save", str(run_a), "--save-interval", "4"], cwd=tmp_path)
    assert a.returncode == 0, a.stdout[-3000:] + a.stderr[-5000:]
    out = a.stdout
    assert "HDET on: 2 arms over DP2, period 3" in out
    assert "converge w0 @ iter 3: arm0 lr" in out and "arm1 lr" in out and "tok/s" in out and "ETA" in out
    assert "valid @ iter 8: loss" in out and "saved checkpoint" in out
    assert (run_a / "latest_checkpointed_iteration.txt").read_text() == "8"
    assert (run_a / "iter_0000004").is_dir() and (run_a / "iter_0000008").is_dir()

    records = read_metrics(str(run_a))
    kinds = [r["type"] for r in records]
    assert kinds[0] == "run" and kinds[-1] == "final"
    a_steps = steps(run_a)
    assert sorted(a_steps) == list(range(1, 9))
    assert all(len(s["arm_losses"]) == 2 and len(s["arm_lrs"]) == 2 for s in a_steps.values())
    assert a_steps[5]["arm_lrs"][0] != a_steps[5]["arm_lrs"][1]  # the arms really use different LRs
    windows = [r for r in records if r["type"] == "window"]
    # windows end at 3, 4 (forced by the save), 7, and 8 (end of training)
    assert [(w["iteration"], w["forced"]) for w in windows] == [(3, False), (4, True), (7, False), (8, True)]
    assert all(w["converge_bytes"] > 0 and len(w["arm_losses"]) == 2 for w in windows)
    valid = [r for r in records if r["type"] == "valid"]
    assert [v["iteration"] for v in valid] == [4, 8] and all(v["converged"] for v in valid)
    final = records[-1]
    assert final["valid_loss"] < a_steps[1]["loss"]  # it learned something

    # Run B: new processes resume from the mid-run checkpoint and continue bit-identically.
    b = torchrun([*common, "--load", str(run_a), "--ckpt-step", "4", "--save", str(run_b)], cwd=tmp_path)
    assert b.returncode == 0, b.stdout[-3000:] + b.stderr[-5000:]
    assert "resumed from" in b.stdout and "at iteration 4" in b.stdout
    b_steps = steps(run_b)
    assert sorted(b_steps) == [5, 6, 7, 8]
    for it in range(5, 9):
        assert b_steps[it]["loss"] == a_steps[it]["loss"], it
        assert b_steps[it]["arm_losses"] == a_steps[it]["arm_losses"], it
        assert b_steps[it]["arm_lrs"] == a_steps[it]["arm_lrs"], it
    b_final = read_metrics(str(run_b))[-1]
    assert b_final["valid_loss"] == final["valid_loss"]
    assert (run_b / "latest_checkpointed_iteration.txt").read_text() == "8"

    # Run C: a resume at another peak LR is refused in one line (Megatron-Core keys the saved
    # optimizer param groups by max_lr / min_lr), not with a traceback.
    lr_at = common.index("--lr") + 1
    changed = [*common[:lr_at], "6e-3", *common[lr_at + 1 :]]
    c = torchrun(
        [*changed, "--load", str(run_a), "--ckpt-step", "4", "--override-opt-param-scheduler"],
        cwd=tmp_path,
        timeout=120,
    )
    assert c.returncode != 0
    assert c.stderr.count("pretrain_gpt.py: error: --load") == 1, c.stderr[-3000:]
    assert "saved with another --lr / --min-lr" in c.stderr
    assert "Traceback" not in c.stderr.split("pretrain_gpt.py: error")[0]  # (torchrun's own follows)

    # The report: text summary and a PNG.
    capsys.readouterr()
    assert hdet_main(["report", str(run_a)]) == 0
    text = capsys.readouterr().out
    assert "HDET 2 arms, period 3" in text and "validation loss" in text and "converges" in text
    png = run_a / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_world_not_divisible_under_torchrun(tmp_path):
    r = torchrun(["--mock-data", "--tensor-model-parallel-size", "3"], cwd=tmp_path, timeout=120)
    assert r.returncode != 0
    assert "pretrain_gpt.py: error: world size 4 is not divisible by TP x PP = 3 x 1 = 3" in r.stderr
    assert r.stderr.count("pretrain_gpt.py: error") == 1  # one message, not one per rank
    assert "Traceback" not in r.stderr.split("pretrain_gpt.py: error")[0]


def test_probe_signal_compares_arms_on_one_shared_batch(tmp_path):
    # --hdet-signal probe with identical arms (spread 0, no dropout, global grad sync): every arm
    # is probed on the same unseen batch, so the probe losses are bit-identical across arms while
    # the arms' window training losses (different data shards) are not. Auto-LR stays on (the
    # probe runs only when the controller reads it); equal losses move nothing.
    run = tmp_path / "probe"
    r = torchrun(
        [
            "--mock-data",
            "--tensor-model-parallel-size",
            "2",
            "--num-layers",
            "2",
            "--hidden-size",
            "32",
            "--num-attention-heads",
            "4",
            "--seq-length",
            "32",
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            "8",
            "--train-iters",
            "6",
            "--lr",
            "3e-3",
            "--min-lr",
            "3e-4",
            "--eval-iters",
            "0",
            "--log-interval",
            "3",
            "--hidden-dropout",
            "0",
            "--attention-dropout",
            "0",
            "--hdet-period",
            "3",
            "--hdet-spread",
            "0",
            "--hdet-signal",
            "probe",
            "--run-dir",
            str(run),
        ],
        cwd=tmp_path,
        timeout=180,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "converge w0 @ iter 3: arm0 lr" in r.stdout and "probe" in r.stdout
    # HDET's startup notice (what the "auto" fields resolved to, and why), once, in the output.
    assert r.stdout.count("[pretrain_gpt] HDET auto-LR defaults: rule 'relative'; start at the given LR") == 1
    windows = [w for w in read_metrics(str(run)) if w["type"] == "window"]
    assert [w["iteration"] for w in windows] == [3, 6]
    for w in windows:
        assert w["signal"] == "probe"
        assert len(set(w["arm_losses"])) == 1, w["arm_losses"]
        assert len(set(w["arm_train_losses"])) == 2, w["arm_train_losses"]
        assert w["scales"]["lr"] == 1.0


def test_mixture_of_experts_with_expert_parallelism(tmp_path):
    # DP4 x EP2, 4 experts top-2, alltoall dispatcher: the default arm count keeps EP groups
    # whole (2 arms, not 4), training converges each window and the checkpoint is written.
    run = tmp_path / "moe"
    args = ["--mock-data", "--num-experts", "4", "--expert-model-parallel-size", "2"]
    args += ["--moe-token-dispatcher-type", "alltoall", "--num-layers", "2", "--hidden-size", "32"]
    args += ["--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2"]
    args += ["--global-batch-size", "8", "--train-iters", "4", "--lr", "3e-3", "--min-lr", "3e-4"]
    args += ["--eval-iters", "0", "--log-interval", "2", "--hdet-period", "2"]
    r = torchrun([*args, "--run-dir", str(run), "--save", str(run), "--save-interval", "4"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "converge w1 @ iter 4: arm0 lr" in r.stdout and "arm2" not in r.stdout
    assert "CPU RNG state changed" not in r.stdout + r.stderr  # (spurious on CPU: filtered)
    windows = [w for w in read_metrics(str(run)) if w["type"] == "window"]
    assert [w["iteration"] for w in windows] == [2, 4] and all(len(w["arm_losses"]) == 2 for w in windows)
    assert (run / "iter_0000004").is_dir()
