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
STAGES = ("converge", "example_1rank", "example_hdet", "example_plain", "overhead", "gpu_tests")


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
    for name in ("example_1rank", "example_hdet", "example_plain"):
        argv = cmds[name]
        script = argv.index("examples/pretrain_gpt/pretrain_gpt.py")
        flags = [a for a in argv[script + 1 :] if a.startswith("--")]
        assert set(flags) <= example_flags, set(flags) - example_flags
        joined = " ".join(argv)
        assert "--transformer-impl transformer_engine --bf16 --use-distributed-optimizer" in joined
        assert f"--run-dir {out}/{name}" in joined
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
    for name in ("example_1rank", "example_hdet", "example_plain"):
        argv = _commands(proc.stdout)[name]
        args = pg.build_parser().parse_args(argv[argv.index("examples/pretrain_gpt/pretrain_gpt.py") + 1 :])
        assert args.bf16 and args.use_distributed_optimizer and args.transformer_impl == "transformer_engine"


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
