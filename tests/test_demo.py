"""The CPU demo's run directory and small runs (issue 27): nothing it did not write is removed, its
defaults follow STEPS, a STEPS=2 run trains for real.

The fast tests run ``demo_cpu.sh`` against a stand-in virtual environment: ``python`` is the real
interpreter (every check runs for real), ``torchrun`` and ``hdet`` only record their arguments.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from hdet_megatron import run_dirs
from hdet_megatron.preflight import InputError

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "pretrain_gpt" / "demo_cpu.sh"


def _png(text: dict[str, str]) -> bytes:
    """A 1x1 PNG with the given tEXt chunks."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0)
    texts = b"".join(
        chunk(b"tEXt", k.encode("latin-1") + b"\0" + v.encode("latin-1")) for k, v in text.items()
    )
    idat = zlib.compress(b"\0\0")
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + texts + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def previous_demo_run(root: Path) -> Path:
    """What a demo run leaves: marker, metrics, report, tracker, a torch_dist and a legacy
    checkpoint, TensorBoard events (contents are stand-ins)."""
    root.mkdir(parents=True)
    (root / run_dirs.DEMO_MARKER).write_text("demo\n")
    (root / "metrics.jsonl").write_text(json.dumps({"type": "run", "iteration": 0}) + "\n")
    (root / "report.png").write_bytes(_png({run_dirs.REPORT_PNG_KEY: "hdet_megatron.report"}))
    (root / "latest_checkpointed_iteration.txt").write_text("7")
    it = root / "iter_0000007"
    it.mkdir()
    for name in ("metadata.json", ".metadata", "__0_0.distcp", "__3_0.distcp", "common.pt"):
        (it / name).write_bytes(b"x")
    legacy = root / "iter_0000003" / "mp_rank_01"
    legacy.mkdir(parents=True)
    (legacy / "model_optim_rng.pt").write_bytes(b"x")
    (root / "tensorboard").mkdir()
    (root / "tensorboard" / "events.out.tfevents.1.host").write_bytes(b"x")
    return root


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# --- hdet_megatron.run_dirs --------------------------------------------------------------------


def test_previous_demo_run_is_cleared_and_marked(tmp_path):
    run = previous_demo_run(tmp_path / "demo")
    assert len(_tree(run)) == 11
    assert run_dirs.clear_demo_run(str(run)) == 11
    assert sorted(os.listdir(run)) == [run_dirs.DEMO_MARKER]
    assert run_dirs.clear_demo_run(str(tmp_path / "new" / "dir")) == 0  # created and marked
    assert os.listdir(tmp_path / "new" / "dir") == [run_dirs.DEMO_MARKER]
    (tmp_path / "empty").mkdir()
    assert run_dirs.clear_demo_run(str(tmp_path / "empty")) == 0


@pytest.mark.parametrize(
    "stranger",
    [
        "notes.txt",  # a file of the user's next to the demo's
        "iter_0000007/my_eval.json",  # inside a checkpoint directory
        "iter_0000003/mp_rank_01/extra.pt",
        "data",  # a directory of the user's
        "tensorboard/README",
        "no-marker",  # only a run's files, but not the demo's run (a pretrain_gpt.py run of yours)
        "report.png",  # a plot of the user's under the report's name
        "link",  # a symbolic link (never removed through)
    ],
)
def test_anything_else_is_refused_and_survives(tmp_path, stranger):
    run = previous_demo_run(tmp_path / "demo")
    if stranger == "no-marker":
        (run / run_dirs.DEMO_MARKER).unlink()
    elif stranger == "report.png":
        (run / "report.png").write_bytes(_png({"Software": "my plotting tool"}))
    elif stranger == "data":
        (run / "data").mkdir()
    elif stranger == "link":
        (run / "link").symlink_to(tmp_path)
    else:
        (run / stranger).write_text("mine")
    before = _tree(run)
    with pytest.raises(InputError) as info:
        run_dirs.clear_demo_run(str(run))
    message = str(info.value)
    assert f"RUN_DIR={run} is not empty and not a previous demo run" in message
    assert "pick another RUN_DIR" in message and "\n" not in message
    assert _tree(run) == before  # nothing removed, nothing written


def test_root_home_and_current_directory_are_refused_even_empty(tmp_path, monkeypatch):
    """RUN_DIR=/, =$HOME, =. and any directory above them hold more than a run: refused by name,
    even when empty or marked (a marker file there proves nothing), and nothing is written."""
    home, work = tmp_path / "users" / "me", tmp_path / "src" / "checkout"
    home.mkdir(parents=True)
    work.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    (work / run_dirs.DEMO_MARKER).write_text("demo\n")
    for run_dir, what in (
        ("/", "the root directory"),
        (str(home), "your home directory"),
        (".", f"the checkout the demo runs in ({work})"),
        (str(work) + "/", f"the checkout the demo runs in ({work})"),
        ("..", f"a parent of the checkout the demo runs in ({work})"),
        (str(tmp_path / "src"), f"a parent of the checkout the demo runs in ({work})"),
        (str(tmp_path / "users"), "a parent of your home directory"),
    ):
        with pytest.raises(InputError) as info:
            run_dirs.clear_demo_run(run_dir)
        assert str(info.value) == (
            f"RUN_DIR={run_dir} is {what}; the demo clears its RUN_DIR before training, so it takes "
            "a directory of its own: give one (e.g. RUN_DIR=runs/demo)"
        )
    assert os.listdir(home) == [] and os.listdir(work) == [run_dirs.DEMO_MARKER]
    assert run_dirs.clear_demo_run("runs/demo") == 0  # below the current directory: fine
    assert os.listdir(work / "runs" / "demo") == [run_dirs.DEMO_MARKER]


def test_run_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("mine")
    with pytest.raises(InputError, match="is not a directory"):
        run_dirs.clear_demo_run(str(tmp_path / "f"))
    assert (tmp_path / "f").read_text() == "mine"


# --- demo_cpu.sh ---------------------------------------------------------------------------------


@pytest.fixture()
def fake_venv(tmp_path) -> Path:
    """``bin/python``: the real interpreter; ``bin/torchrun`` / ``bin/hdet``: record their argv."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    scripts = {
        "python": f'#!/bin/bash\nexec "{sys.executable}" "$@"\n',
        "torchrun": (
            f'#!/bin/bash\nprintf "%s\\0" "$@" > "{tmp_path}/torchrun.args"\necho "(torchrun stand-in)"\n'
        ),
        "hdet": f'#!/bin/bash\nprintf "%s\\0" "$@" > "{tmp_path}/hdet.args"\n',
    }
    for name, text in scripts.items():
        (venv / "bin" / name).write_text(text)
        (venv / "bin" / name).chmod(0o755)
    return venv


def run_demo(venv: Path, run_dir: Path, *args: str, steps: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("STEPS", "RUN_DIR")}
    env.update(VENV=str(venv), RUN_DIR=str(run_dir), PYTHONWARNINGS="ignore")
    if steps is not None:
        env["STEPS"] = steps
    return subprocess.run(
        ["bash", str(DEMO), "--mock-data", *args], env=env, capture_output=True, text=True, timeout=120
    )


def _flags(argv: list[str]) -> dict[str, str]:
    return {
        a: b for a, b in zip(argv, argv[1:], strict=False) if a.startswith("--") and not b.startswith("--")
    }


def test_demo_keeps_a_strangers_directory(fake_venv, tmp_path):
    """RUN_DIR holding a file of someone else's (RUN_DIR=. or $HOME alike): one line, exit code 2,
    the file and everything else untouched, nothing started."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    (mine / "iter_0000001").mkdir()  # even with a run-like name next to it
    r = run_demo(fake_venv, mine)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"demo_cpu.sh: error: RUN_DIR={mine} is not empty")
    assert (mine / "thesis.tex").read_text() == "years of work" and sorted(os.listdir(mine)) == [
        "iter_0000001",
        "thesis.tex",
    ]
    assert not (tmp_path / "torchrun.args").exists()


def test_demo_refuses_the_checkout_and_home(fake_venv, tmp_path):
    """RUN_DIR=. (the demo runs in its checkout) and RUN_DIR=$HOME: one line, exit code 2, every
    file there kept. The demo runs from a copy of the checkout here: nothing real is at stake."""
    checkout = tmp_path / "checkout"
    (checkout / "examples" / "pretrain_gpt").mkdir(parents=True)
    demo = checkout / "examples" / "pretrain_gpt" / "demo_cpu.sh"
    demo.write_text(DEMO.read_text())
    (checkout / "README.md").write_text("the user's checkout")
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text("mine")
    env = {k: v for k, v in os.environ.items() if k not in ("STEPS", "RUN_DIR")}
    env.update(VENV=str(fake_venv), HOME=str(home), PYTHONWARNINGS="ignore")
    for run_dir, what in (
        (".", f"the checkout the demo runs in ({checkout})"),
        (str(home), "your home directory"),
    ):
        r = subprocess.run(
            ["bash", str(demo), "--mock-data"],
            env=dict(env, RUN_DIR=run_dir),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 2, r.stdout + r.stderr
        assert r.stderr.strip().splitlines() == [
            f"demo_cpu.sh: error: RUN_DIR={run_dir} is {what}; the demo clears its RUN_DIR before "
            "training, so it takes a directory of its own: give one (e.g. RUN_DIR=runs/demo)"
        ]
    assert _tree(checkout) == {
        "README.md": b"the user's checkout",
        "examples/pretrain_gpt/demo_cpu.sh": DEMO.read_bytes(),
    }
    assert _tree(home) == {".bashrc": b"mine"}
    assert not (tmp_path / "torchrun.args").exists()


def test_demo_replaces_its_previous_run_and_scales_with_steps(fake_venv, tmp_path):
    run = previous_demo_run(tmp_path / "demo")
    r = run_demo(fake_venv, run, steps="5")
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(os.listdir(run)) == [run_dirs.DEMO_MARKER]  # the old run is gone, the dir marked
    argv = (tmp_path / "torchrun.args").read_text().split("\0")[:-1]
    flags = _flags(argv)
    # STEPS=5: no warm-up, a window of 1, validation (1 batch) and a log line after every step.
    assert flags["--train-iters"] == "5" and flags["--lr-warmup-iters"] == "0"
    assert flags["--hdet-period"] == flags["--eval-interval"] == flags["--log-interval"] == "1"
    assert flags["--eval-iters"] == "1" and flags["--save"] == str(run)
    assert (tmp_path / "hdet.args").read_text().split("\0")[:-1] == ["report", str(run)]
    # STEPS=400 keeps the demo's documented defaults; a flag you pass wins over a scaled default,
    # and --train-iters sets the length the defaults follow.
    for steps, extra, want in (
        ("400", [], {"--lr-warmup-iters": "30", "--hdet-period": "25", "--eval-interval": "100"}),
        ("5", ["--hdet-period", "5"], {"--hdet-period": "5", "--lr-warmup-iters": "0"}),
        (
            "400",
            ["--train-iters", "20"],
            {"--train-iters": "20", "--lr-warmup-iters": "1", "--hdet-period": "1"},
        ),
    ):
        r = run_demo(fake_venv, run, *extra, steps=steps)
        assert r.returncode == 0, r.stdout + r.stderr
        argv = (tmp_path / "torchrun.args").read_text().split("\0")[:-1]
        assert {k: _flags(argv)[k] for k in want} == want, (steps, extra)
        assert argv.count("--hdet-period") == argv.count("--train-iters") == 1


def test_demo_refuses_a_foreign_report_png(fake_venv, tmp_path):
    """--run-dir of yours with a report.png you made: refused before training (the report at the end
    would overwrite it)."""
    mine = tmp_path / "plots"
    mine.mkdir()
    (mine / "report.png").write_bytes(_png({"Software": "my plotting tool"}))
    before = _tree(mine)
    r = run_demo(fake_venv, tmp_path / "demo", "--run-dir", str(mine))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "was not written by hdet report" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert _tree(mine) == before and not (tmp_path / "torchrun.args").exists()


@pytest.mark.slow
def test_demo_small_run_trains(tmp_path):
    """`STEPS=5 make demo` trains for real (the default corpus, 4 ranks), into a directory that held
    a previous demo run, writes its report, and leaves a directory the next demo run may clear
    (only files the demo knows: the run's real files checked against run_dirs' rules)."""
    run = previous_demo_run(tmp_path / "demo")
    env = {k: v for k, v in os.environ.items() if k not in ("STEPS", "RUN_DIR")}
    env.update(
        VENV=str(Path(sys.executable).parent.parent), RUN_DIR=str(run), STEPS="5", PYTHONWARNINGS="ignore"
    )
    r = subprocess.run(["bash", str(DEMO)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "done: 5 iterations" in r.stdout and "demo: finished" in r.stdout
    assert "5 converges" in r.stdout  # the window scaled down to 1 step
    assert not (run / "iter_0000007").exists() and (run / "iter_0000005").is_dir()
    assert (run / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    assert run_dirs.is_hdet_report_png(str(run / "report.png"))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["type"] for r in records].count("run") == 1  # only this run's records
    files, dirs = run_dirs.demo_run_files(str(run))  # the next demo run would clear exactly these
    assert sorted(files + dirs) == sorted(str(p) for p in run.rglob("*"))


def test_save_dir_rules_cover_a_checkpoint_directory_only(tmp_path):
    """run_files.SAVE_DIR_RULES (benchmarks/lr_switch.py clears its own --save with them): a
    directory of checkpoints and the tracker is all removable; a file of anyone else's is named."""
    from hdet_megatron.run_files import SAVE_DIR_RULES, remove_files, walk

    run = previous_demo_run(tmp_path / "ckpt")
    for name in (run_dirs.DEMO_MARKER, "metrics.jsonl", "report.png"):
        (run / name).unlink()
    (run / "tensorboard" / "events.out.tfevents.1.host").unlink()
    (run / "tensorboard").rmdir()
    files, dirs, stranger = walk(str(run), SAVE_DIR_RULES)
    assert stranger is None and len(files) == 7 and len(dirs) == 3
    (run / "notes.txt").write_text("mine")
    assert walk(str(run), SAVE_DIR_RULES)[2] == str(run / "notes.txt")
    remove_files(files, dirs)
    assert sorted(os.listdir(run)) == ["notes.txt"]
