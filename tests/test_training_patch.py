"""The megatron.training patch (patches/megatron-core-0.19.2): applies, reverses, refuses, runs.

Nothing here modifies the shared environment: the patch is applied to a temporary copy of the
installed ``megatron/training`` ("overlay"), which the subprocesses import first through
``PYTHONPATH`` (``megatron`` is a namespace package, so ``megatron.core`` still comes from the
installed wheel).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as md
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
APPLY = REPO / "patches" / "apply.sh"
TARGET = "0.19.2"
PATCH_DIR = REPO / "patches" / f"megatron-core-{TARGET}"
PATCHES = sorted(PATCH_DIR.glob("*.patch"))
EXAMPLE = REPO / "examples" / "pretrain_gpt" / "pretrain_gpt_hdet.py"


def _installed_training() -> Path:
    dist = md.distribution("megatron-core")
    return Path(str(dist.locate_file("megatron/training"))).resolve()


def patched_files() -> list[str]:
    """``megatron/training/...`` paths the patch files touch."""
    files = []
    for patch in PATCHES:
        files += re.findall(r"^\+\+\+ b/(\S+)", patch.read_text(), flags=re.M)
    return files


def run_apply(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    return subprocess.run(
        ["bash", str(APPLY), *args], capture_output=True, text=True, timeout=120, env=full_env
    )


def make_copy(root: Path) -> Path:
    """``root/megatron/training``: a byte copy of the installed package (no caches)."""
    dest = root / "megatron" / "training"
    shutil.copytree(_installed_training(), dest, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def snapshot(root: Path) -> dict[str, bytes]:
    base = root / "megatron" / "training"
    return {str(p.relative_to(base)): p.read_bytes() for p in sorted(base.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def overlay(tmp_path_factory) -> Path:
    """A patched copy of the installed megatron/training, importable via PYTHONPATH."""
    root = make_copy(tmp_path_factory.mktemp("overlay"))
    proc = run_apply("--target", str(root))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return root


# -- version and provenance ----------------------------------------------------------------------
def test_installed_megatron_core_is_the_patch_target():
    """Fails when the installed megatron-core is not the release the patch was made against."""
    installed = md.version("megatron-core").split("+")[0]
    assert PATCHES, f"no patches in {PATCH_DIR}"
    assert installed == TARGET, (
        f"megatron-core {installed} is installed but patches/ targets {TARGET}: make a patch for "
        f"{installed} (and update the CPU shims) or install megatron-core=={TARGET}"
    )
    # The same release everywhere it is named (read as text: importing hdet_megatron.megatron
    # would import megatron.core, which is slow).
    megatron_dir = REPO / "hdet_megatron" / "megatron"
    assert f'PATCH_TARGET_VERSION = "{TARGET}"' in (megatron_dir / "training_hooks.py").read_text()
    assert f'MEGATRON_CORE_VERSION = "{TARGET}"' in (megatron_dir / "cpu.py").read_text()
    assert f'TARGET_VERSION="{TARGET}"' in APPLY.read_text()
    assert f'"megatron-core=={TARGET}"' in (REPO / "pyproject.toml").read_text()


def test_installed_files_are_the_pristine_wheel_files():
    """The files the patch touches are byte-identical to the wheel's RECORD: the shared
    environment was never left patched, and the patch context is the 0.19.2 release's."""
    dist = md.distribution("megatron-core")
    record = {str(f): f.hash for f in dist.files or []}
    files = patched_files()
    assert set(files) == {
        "megatron/training/arguments.py",
        "megatron/training/training.py",
        "megatron/training/checkpointing.py",
    }
    for rel in files:
        entry = record[rel]
        assert entry is not None and entry.mode == "sha256"
        digest = hashlib.sha256(Path(str(dist.locate_file(rel))).read_bytes()).digest()
        assert base64.urlsafe_b64encode(digest).rstrip(b"=").decode() == entry.value, (
            f"{rel} differs from the megatron-core {TARGET} wheel (patched in place? run "
            "`bash patches/apply.sh --reverse`)"
        )


def test_patch_only_calls_into_hdet_megatron():
    """Small patch: every added line is a comment, blank, or a call/import of hdet_megatron."""
    added = [
        line[1:].strip()
        for patch in PATCHES
        for line in patch.read_text().splitlines()
        if line.startswith("+") and not line.startswith("+++")
    ]
    assert 0 < len(added) <= 25
    for line in added:
        assert not line or line.startswith("#") or "hdet" in line, (
            f"patch line does not call into hdet_megatron: {line!r}"
        )


# -- apply.sh ------------------------------------------------------------------------------------
def test_apply_dry_run_apply_idempotent_reverse_restores_bytes(tmp_path):
    root = make_copy(tmp_path)
    original = snapshot(root)
    target = ("--target", str(root))

    status = run_apply("--status", *target)
    assert status.returncode == 1 and "not applied" in status.stdout

    dry = run_apply("--dry-run", *target)
    assert dry.returncode == 0 and "applies cleanly" in dry.stdout, dry.stdout + dry.stderr
    assert snapshot(root) == original  # a dry run changes nothing

    applied = run_apply(*target)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    after = snapshot(root)
    changed = {k for k in original if after[k] != original[k]}
    assert changed == {Path(f).name for f in patched_files()}
    assert not [k for k in after if k.endswith((".orig", ".rej"))]
    assert b"_hdet_hooks.on_train_step(losses_reduced, iteration)" in after["training.py"]
    assert b"_hdet_hooks.on_train_step_start(forward_step_func, data_iterator, model," in after["training.py"]

    again = run_apply(*target)  # idempotent
    assert again.returncode == 0 and "already applied" in again.stdout
    assert snapshot(root) == after
    assert run_apply("--status", *target).returncode == 0

    assert run_apply("--reverse", "--dry-run", *target).returncode == 0
    assert snapshot(root) == after
    reverse = run_apply("--reverse", *target)
    assert reverse.returncode == 0, reverse.stdout + reverse.stderr
    assert snapshot(root) == original  # the original bytes, every file
    again = run_apply("--reverse", *target)
    assert again.returncode == 0 and "nothing to reverse" in again.stdout


def test_apply_refuses_another_megatron_core_version(tmp_path):
    """A (fake) megatron-core 0.20.0 first on the path: refused with a clear message, untouched."""
    site = tmp_path / "site"
    make_copy(site)
    info = site / "megatron_core-0.20.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: megatron-core\nVersion: 0.20.0\n")
    (info / "RECORD").write_text("megatron/training/training.py,,\n")
    before = snapshot(site)
    for args in ((), ("--dry-run",), ("--target", str(site))):
        proc = run_apply(*args, env={"PYTHONPATH": str(site)})
        assert proc.returncode == 3, proc.stdout + proc.stderr
        assert "0.20.0" in proc.stderr and f"megatron-core=={TARGET}" in proc.stderr
        assert "refusing" in proc.stderr
    assert snapshot(site) == before


def test_apply_refuses_files_changed_by_something_else(tmp_path):
    root = make_copy(tmp_path)
    training = root / "megatron" / "training" / "training.py"
    text = training.read_text()
    anchor = "        opt_param_scheduler = get_optimizer_param_scheduler(optimizer)\n"
    assert anchor in text
    training.write_text(text.replace(anchor, anchor.replace("optimizer)", "optimizer)  # local edit")))
    before = snapshot(root)
    proc = run_apply("--target", str(root))
    assert proc.returncode == 4 and "modified by something else" in proc.stderr
    assert snapshot(root) == before


def test_apply_usage_errors():
    assert run_apply("--bogus").returncode == 2
    assert run_apply("--help").returncode == 0


# -- the patched modules -------------------------------------------------------------------------
_IMPORT_CHECK = r"""
import json, sys, torch
from hdet_megatron.megatron.cpu import apply_training_cpu_shims
apply_training_cpu_shims()
import megatron.training.arguments as arguments
import megatron.training.checkpointing as checkpointing
import megatron.training.training as training
from megatron.training.global_vars import set_args
from hdet_megatron.megatron import training_hooks
overlay = sys.argv[1]
mods = [arguments, checkpointing, training]
assert all(m.__file__.startswith(overlay) for m in mods), [m.__file__ for m in mods]
assert training._hdet_hooks is training_hooks
sys.argv = ["pretrain_gpt_hdet.py", "--hdet-period", "7", "--hdet-axis", "lr:0.2",
            "--hdet-axis", "weight_decay:0.1", "--no-hdet-auto", "--hdet-temperature", "auto"]
args = arguments.parse_args()
cfg = training_hooks.config_from_args(args)
signals = []
for signal in ("probe", "line", "average"):  # the loop provides the probe (training_probe.py)
    sys.argv = ["pretrain_gpt_hdet.py", "--hdet-signal", signal]
    signals.append(training_hooks.config_from_args(arguments.parse_args()).signal)
sys.argv = ["pretrain_gpt_hdet.py", "--no-hdet", "--train-iters", "10", "--lr", "0.1",
            "--micro-batch-size", "1", "--global-batch-size", "1"]
plain = arguments.parse_args()
plain.start_weight_decay = plain.end_weight_decay = plain.weight_decay  # as validate_args does
set_args(plain)
assert training_hooks.config_from_args(plain) is None
opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
sched = training.get_optimizer_param_scheduler(opt)
print(json.dumps({"period": cfg.period, "axes": [[a.name, a.spread] for a in cfg.axes],
                  "auto": cfg.auto, "temperature": cfg.temperature,
                  "plain_scheduler": type(sched).__name__, "signals": signals}))
"""


@pytest.mark.slow
def test_patched_modules_import_and_parse_hdet_args(overlay):
    env = {**os.environ, "PYTHONPATH": str(overlay), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_CHECK, str(overlay)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {
        "period": 7,
        "axes": [["lr", 0.2], ["weight_decay", 0.1]],
        "auto": False,
        "temperature": "auto",
        "plain_scheduler": "OptimizerParamScheduler",
        "signals": ["probe", "line", "average"],
    }


@pytest.mark.slow
def test_example_refuses_unpatched_megatron_training():
    """The example, run against the installed (unpatched) megatron.training, stops at once with
    exit code 1 and one line naming the fix, before Megatron parses a flag."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "WORLD_SIZE": "1", "RANK": "0"}
    env.pop("PYTHONPATH", None)  # the shared environment's megatron.training, as installed
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--num-layers", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=REPO,
    )
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if "megatron.training" in ln]
    assert lines == [
        "megatron.training is not patched for HDET: run `bash patches/apply.sh` (megatron-core "
        "0.19.2), or `--python <venv>/bin/python` to pick the environment"
    ]
    assert "Traceback" not in proc.stderr and "building GPT model" not in proc.stdout


# -- end to end: the patched loop under torchrun --------------------------------------------------
CPU_FLAGS = [
    "--distributed-backend",
    "gloo",
    "--transformer-impl",
    "local",
    "--attention-backend",
    "local",
    "--spec",
    "local",
    "--no-persist-layer-norm",
    "--rerun-mode",
    "disabled",
    "--use-cpu-initialization",
    "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion",
    "--no-rope-fusion",
    "--tokenizer-type",
    "NullTokenizer",
    "--mock-data",
]
TINY_GPT = [
    "--vocab-size",
    "128",
    "--make-vocab-size-divisible-by",
    "64",  # padded to 128 for TP1 and 2
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--max-position-embeddings",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--train-iters",
    "8",
    "--lr-decay-iters",
    "12",
    "--lr",
    "1e-3",
    "--min-lr",
    "1e-4",
    "--lr-decay-style",
    "cosine",
    "--lr-warmup-iters",
    "2",
    "--seed",
    "1234",
    "--log-interval",
    "1",
    "--eval-iters",
    "0",
    "--eval-interval",
    "1000",
]
HDET_FLAGS = ["--hdet-period", "2", "--hdet-spread", "0.5"]


ENTRY = REPO / "tests" / "patched_loop_entry.py"


def torchrun(
    overlay: Path, ckpt: Path, layout: list[str], extra: list[str], log: Path, records: Path | None = None
) -> str:
    """The example under torchrun on 4 gloo ranks; with ``records``, through
    tests/patched_loop_entry.py, which writes each rank's HDET records there."""
    env = {
        **os.environ,
        "PYTHONPATH": str(overlay),
        "PYTHONWARNINGS": "ignore",
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
    }
    if records is not None:
        env["HDET_TEST_RECORD_DIR"] = str(records)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        str(EXAMPLE if records is None else ENTRY),
        *CPU_FLAGS,
        *TINY_GPT,
        *HDET_FLAGS,
        *layout,
        "--load",
        str(ckpt),
        *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=REPO)
    out = proc.stdout + proc.stderr
    log.write_text(out)
    assert proc.returncode == 0, f"torchrun failed ({log}):\n" + out[-6000:]
    return out


def load_records(records: Path) -> list[dict]:
    """The 4 ranks' records (tests/patched_loop_entry.py), in rank order."""
    return [json.loads((records / f"rank{r}.json").read_text()) for r in range(4)]


def check_probe_records(recs: list[dict], windows: int, shared: bool, microbatches: int) -> None:
    """What every probed window must show, on every rank of one torchrun world.

    * Identical controller decisions (the whole window record: arm losses, line fit, update,
      scales, exclusions) on all ranks, TP and PP ranks included.
    * Every line search left the main params, the model params and the RNG states (torch's and
      Megatron's model-parallel tracker) bit-identical.
    * The probe read the batches the next training step then took (read ahead, not consumed:
      the data order is the run's own): ``shared`` (``--hdet-signal probe``) DP rank 0's on
      every rank of its DP group, else each rank's own.
    """
    ref = recs[0]["windows"]
    assert len(ref) == windows
    for rec in recs[1:]:
        assert rec["windows"] == ref
    for rec in recs:
        for ev in rec["line_evals"]:
            assert ev["before"] == ev["after"]

    def position(rec):
        return rec["layout"]["tp_rank"], rec["layout"]["pp_rank"]

    dp0 = {position(rec): rec for rec in recs if rec["layout"]["dp_rank"] == 0}
    checked = 0
    for rec in recs:
        train = rec["train_batches"]
        for call in rec["probe_calls"]:
            probed = [d for stream in call["batches"] for d in stream]
            # The first probe of a window ran right after iteration ``window end``; training
            # then took the next iteration's batches (the probe's read-ahead).
            end = next(w["iteration"] for w in rec["windows"] if w["window"] == call["window"])
            source = dp0[position(rec)] if shared else rec
            taken = source["train_batches"].get(str(end + 1))
            if taken is None:  # the run stopped after this window (exit or last iteration)
                continue
            assert probed == taken, (call, end, taken)
            assert len(probed) == microbatches
            checked += 1
        assert train  # training read through the read-ahead iterator
        taken = [d for it in sorted(train, key=int) for d in train[it]]
        assert len(set(taken)) == len(taken)  # no batch trained on twice, none dropped for a probe
        assert sorted(map(int, train)) == list(range(min(map(int, train)), max(map(int, train)) + 1))
    assert checked > 0


_FLOAT = r"[-+0-9.eE]+"


def hdet_windows(out: str) -> list[dict]:
    """``[HDET] window ...`` lines: window index, iteration, per-arm LRs and spreads, scale."""
    rows = []
    pat = (
        rf"\[HDET\] window (\d+) \| lr per arm at iteration (\d+) \[([^\]]*)\] \| "
        rf"lr spread per arm \[([^\]]*)\] \| scale lr=({_FLOAT})"
    )
    for m in re.finditer(pat, out):
        rows.append(
            {
                "window": int(m[1]),
                "iteration": int(m[2]),
                "lrs": [float(x) for x in m[3].split(",")],
                "spread": [float(x) for x in m[4].split(",")],
                "scale": float(m[5]),
            }
        )
    return rows


def hdet_converges(out: str) -> list[dict]:
    pat = (
        rf"\[HDET\] (forced converge \(save\)|converge) of window (\d+) at iteration (\d+) "
        rf"\((\d+) steps\) \| arm loss \[([^\]]*)\] \| scale lr=({_FLOAT})"
    )
    return [
        {
            "forced": m[1] != "converge",
            "window": int(m[2]),
            "iteration": int(m[3]),
            "steps": int(m[4]),
            "losses": [float(x) for x in m[5].split(",")],
            "scale": float(m[6]),
        }
        for m in re.finditer(pat, out)
    ]


def megatron_iterations(out: str) -> dict[int, dict]:
    """Megatron's own log lines (printed by the last rank): learning rate and lm loss."""
    rows = {}
    pat = rf"iteration\s+(\d+)/\s*\d+ \|.*?learning rate: ({_FLOAT}) \|.*?lm loss: ({_FLOAT})"
    for m in re.finditer(pat, out):
        rows[int(m[1])] = {"lr": float(m[2]), "loss": float(m[3])}
    return rows


def check_lr_matches_megatron(out: str) -> int:
    """Each window announced after a regular converge at iteration N lists the LR of every arm;
    Megatron's line for iteration N shows the last rank's (arm 1's) LR: the same number."""
    megatron = megatron_iterations(out)
    windows = {w["iteration"]: w for w in hdet_windows(out)}
    checked = 0
    for conv in hdet_converges(out):
        if conv["forced"]:
            continue
        window = windows[conv["iteration"] + 1]
        assert window["window"] == conv["window"] + 1
        mlr = megatron[conv["iteration"]]["lr"]
        assert mlr == pytest.approx(window["lrs"][1], rel=1e-5), (conv, window, mlr)
        ratio = window["lrs"][0] / window["lrs"][1]
        assert ratio == pytest.approx(window["spread"][0] / window["spread"][1], rel=1e-5)
        checked += 1
    return checked


@pytest.mark.slow
def test_patched_loop_end_to_end_tp2dp2_save_then_pp2dp2_resume(overlay, tmp_path):
    """torchrun, 4 gloo ranks, --mock-data, HDET with 2 arms (alpha 0.5, period 2) and the
    ``probe`` signal (every arm scores DP rank 0's next batch through Megatron's
    forward_backward_func: over TP in run A, over the pipeline in run B).

    Run A (TP2 x DP2): iterations 1-5, converges at 2 and 4, then ``--exit-interval 5`` saves a
    torch_dist checkpoint mid-window: the save converges first (with a probe). Run B (PP2 x DP2,
    resharded from the same checkpoint) resumes at 6 with the controller state of A and
    converges again at 7.
    """
    ckpt = tmp_path / "ckpt"
    probe = ["--hdet-signal", "probe"]
    out_a = torchrun(
        overlay,
        ckpt,
        ["--tensor-model-parallel-size", "2", *probe],
        ["--save", str(ckpt), "--save-interval", "100", "--exit-interval", "5"],
        tmp_path / "run_a.log",
        records=tmp_path / "rec_a",
    )
    assert "[HDET] on: 2 arms over DP 2" in out_a and "signal probe" in out_a
    conv_a = hdet_converges(out_a)
    assert [(c["window"], c["iteration"], c["forced"]) for c in conv_a] == [
        (0, 2, False),
        (1, 4, False),
        (2, 5, True),
    ]
    assert all(len(c["losses"]) == 2 for c in conv_a)
    assert out_a.count("| probe: arm loss is each arm's loss on the shared probe batch") == 3
    assert "successfully saved checkpoint from iteration       5" in out_a
    windows_a = hdet_windows(out_a)
    assert all(sorted(w["spread"]) == [0.5, 1.5] for w in windows_a)
    assert check_lr_matches_megatron(out_a) == 2
    iters_a = megatron_iterations(out_a)
    assert sorted(iters_a) == [1, 2, 3, 4, 5]
    last_scale = conv_a[-1]["scale"]
    recs_a = load_records(tmp_path / "rec_a")
    check_probe_records(recs_a, windows=3, shared=True, microbatches=2)
    for w in recs_a[0]["windows"]:
        # The arms scored one batch each: two different finite losses, and they are the signal.
        assert w["arm_losses"] == w["update"]["arm_losses"]
        assert len(set(w["arm_losses"])) == 2 and all(math.isfinite(x) for x in w["arm_losses"])
    # 2 probe passes (windows 0 and 1) were followed by training: both checked on every rank.
    assert all(len(r["probe_calls"]) == 3 for r in recs_a)

    out_b = torchrun(
        overlay,
        ckpt,
        ["--pipeline-model-parallel-size", "2", *probe],
        [],
        tmp_path / "run_b.log",
        records=tmp_path / "rec_b",
    )
    assert "loading distributed checkpoint from" in out_b and "at iteration 5" in out_b
    windows_b = hdet_windows(out_b)
    # Resumed: the window counter and the controller's scale continue from A's checkpoint.
    assert windows_b[0]["window"] == 3 and windows_b[0]["iteration"] == 7
    assert windows_b[0]["scale"] == pytest.approx(last_scale, abs=1e-6)
    conv_b = hdet_converges(out_b)
    assert [(c["window"], c["iteration"], c["forced"]) for c in conv_b] == [(3, 7, False)]
    assert check_lr_matches_megatron(out_b) == 1
    iters_b = megatron_iterations(out_b)
    assert sorted(iters_b) == [6, 7, 8]
    # The trained model was restored (a fresh one starts near ln(128) = 4.85).
    assert abs(iters_b[6]["loss"] - iters_a[5]["loss"]) < 0.1
    assert iters_b[6]["loss"] < iters_a[1]["loss"] - 0.1
    recs_b = load_records(tmp_path / "rec_b")
    check_probe_records(recs_b, windows=1, shared=True, microbatches=2)
    # Both pipeline stages ran the probe (first stage: tokens in, last stage: the loss).
    assert all(len(r["probe_calls"]) == 1 for r in recs_b)
    assert {(r["layout"]["pp_rank"], r["layout"]["dp_rank"]) for r in recs_b} == {
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    }


@pytest.mark.slow
def test_patched_loop_average_signal_dp4(overlay, tmp_path):
    """``--hdet-signal average`` in Megatron-LM's loop: torchrun, 4 gloo ranks, DP4 = 4 arms
    (the line signals need >= 3), auto-LR from iteration 5, period 2, 8 iterations.

    Every window's end evaluates the update line at the 4 arms' multipliers on each replica's
    next batch (read ahead of training), the log and the records show the line, the controller
    moves the scale identically on every rank, and every line search restores the params and
    RNG bit-exactly. Training continues bit-identically: until the controller first moves the
    scale (the converge at 6), every rank's params and Megatron's losses equal those of a run
    with ``--hdet-signal train`` and auto-LR off, which never probes."""
    out = torchrun(
        overlay,
        tmp_path / "ckpt",
        # At the given LR from the start (no slow start) and without the brake, like the reference
        # run, which has auto-LR off.
        ["--hdet-signal", "average", "--hdet-auto-start", "5", "--hdet-start-scale", "1", "--no-hdet-brake"],
        [],
        tmp_path / "run.log",
        records=tmp_path / "rec",
    )
    assert "[HDET] on: 4 arms over DP 4" in out and "signal average" in out
    # HDET's startup notice (what "auto" resolved to), once, among the hook's own lines.
    assert out.count("[HDET] HDET auto-LR defaults: rule 'newton'") == 1, out[:3000]
    conv = hdet_converges(out)
    assert [(c["window"], c["iteration"], c["forced"]) for c in conv] == [
        (0, 2, False),
        (1, 4, False),
        (2, 6, False),
        (3, 8, False),
    ]
    lines = re.findall(r"\| average line points \[([^\]]*)\] loss \[([^\]]*)\] slope (\S+)", out)
    assert len(lines) == 4
    for points, losses, _ in lines:
        assert [float(p) for p in points.split(",")] == pytest.approx([0.5, 5 / 6, 7 / 6, 1.5], rel=1e-5)
        assert len(losses.split(",")) == 4
    iters = megatron_iterations(out)
    assert sorted(iters) == list(range(1, 9)) and all(math.isfinite(v["loss"]) for v in iters.values())
    recs = load_records(tmp_path / "rec")
    check_probe_records(recs, windows=4, shared=False, microbatches=1)
    for rec in recs:
        assert len(rec["line_evals"]) == 4  # one line search per window, each restored
        assert len(rec["probe_calls"]) == 16  # 4 points x 4 windows
    for w in recs[0]["windows"]:
        line = w["line"]
        assert len(line["losses"]) == 4 and len(set(line["losses"])) == 4
        assert all(isinstance(x, float) and math.isfinite(x) for x in line["losses"])
        assert w["arm_losses"] == w["update"]["arm_losses"]
        assert w["arm_losses"] == line["pseudo_losses"]
    # Auto-LR acted on the line from iteration 5 on: the scale moved (the same on every rank,
    # checked above).
    assert [w["scales"]["lr"] == 1.0 for w in recs[0]["windows"]] == [True, True, False, False]

    # The reference: no probe at all (train signal, auto-LR off, same seeds and data).
    ref_out = torchrun(
        overlay,
        tmp_path / "ckpt_ref",
        ["--hdet-signal", "train", "--no-hdet-auto"],
        [],
        tmp_path / "ref.log",
        records=tmp_path / "rec_ref",
    )
    ref = load_records(tmp_path / "rec_ref")
    assert all(not r["probe_calls"] and not r["line_evals"] for r in ref)
    for rec, ref_rec in zip(recs, ref, strict=True):
        # Windows ending at 2, 4, 6: after 2 probed windows (8 line points), the same bits.
        for it in ("2", "4", "6"):
            assert rec["params_at_end"][it] == ref_rec["params_at_end"][it], (it, rec["layout"])
        assert rec["params_at_end"]["8"] != ref_rec["params_at_end"]["8"]  # the new scale acted
    ref_iters = megatron_iterations(ref_out)
    # Iteration 7's forward still runs on the converged params of 6; 8 on those of a new LR.
    assert [iters[i]["loss"] for i in range(1, 8)] == [ref_iters[i]["loss"] for i in range(1, 8)]
    assert iters[8]["loss"] != ref_iters[8]["loss"]
    # Megatron logs the LR after the scheduler step (and the converge at 6 set the new scale).
    assert [iters[i]["lr"] for i in range(1, 6)] == [ref_iters[i]["lr"] for i in range(1, 6)]
    assert iters[6]["lr"] != ref_iters[6]["lr"]
