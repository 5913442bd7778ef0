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
sys.argv = ["pretrain_gpt_hdet.py", "--hdet-signal", "probe"]
try:
    training_hooks.config_from_args(arguments.parse_args())
    probe_error = None
except ValueError as exc:
    probe_error = str(exc)
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
                  "plain_scheduler": type(sched).__name__, "probe_error": probe_error}))
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
        "probe_error": "--hdet-signal probe is not supported through megatron.training yet (it "
        "needs probe forward passes at each window's end): use --hdet-signal "
        "train, or examples/pretrain_gpt/pretrain_gpt.py which provides the probe",
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


def torchrun(overlay: Path, ckpt: Path, layout: list[str], extra: list[str], log: Path) -> str:
    env = {
        **os.environ,
        "PYTHONPATH": str(overlay),
        "PYTHONWARNINGS": "ignore",
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        str(EXAMPLE),
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
    """torchrun, 4 gloo ranks, --mock-data, HDET with 2 arms (alpha 0.5, period 2).

    Run A (TP2 x DP2): iterations 1-5, converges at 2 and 4, then ``--exit-interval 5`` saves a
    torch_dist checkpoint mid-window: the save converges first. Run B (PP2 x DP2, resharded from
    the same checkpoint) resumes at 6 with the controller state of A and converges again at 7.
    """
    ckpt = tmp_path / "ckpt"
    out_a = torchrun(
        overlay,
        ckpt,
        ["--tensor-model-parallel-size", "2"],
        ["--save", str(ckpt), "--save-interval", "100", "--exit-interval", "5"],
        tmp_path / "run_a.log",
    )
    assert "[HDET] on: 2 arms over DP 2" in out_a
    conv_a = hdet_converges(out_a)
    assert [(c["window"], c["iteration"], c["forced"]) for c in conv_a] == [
        (0, 2, False),
        (1, 4, False),
        (2, 5, True),
    ]
    assert all(len(c["losses"]) == 2 for c in conv_a)
    assert "successfully saved checkpoint from iteration       5" in out_a
    windows_a = hdet_windows(out_a)
    assert all(sorted(w["spread"]) == [0.5, 1.5] for w in windows_a)
    assert check_lr_matches_megatron(out_a) == 2
    iters_a = megatron_iterations(out_a)
    assert sorted(iters_a) == [1, 2, 3, 4, 5]
    last_scale = conv_a[-1]["scale"]

    out_b = torchrun(overlay, ckpt, ["--pipeline-model-parallel-size", "2"], [], tmp_path / "run_b.log")
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
