"""`make test` runs `make lint` first, and `make lint` fails on a lint, format or type error.

The repository's own Makefile and pyproject.toml are copied into a temporary tree next to one
small module of the package (``hdet_megatron/schedule.py``, on the strict type-checked floor,
no torch import: mypy stays fast). The clean copy passes ``make lint``; each injected error makes
``make test`` stop at the lint step, before pytest starts. ``setup`` is not remade there
(``make -o setup``): the tools come from this interpreter's environment. Where they are not
installed there (pytest run with an image's own Python, without the ``dev`` extra), the tests
skip and say which tool is missing; ``make test`` installs them (``make setup``) and runs them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VENV = Path(sys.executable).parent.parent  # the environment running these tests (.venv)
MODULE = "hdet_megatron/schedule.py"


def missing_tools(tools: tuple[str, ...], bin_dir: Path = VENV / "bin") -> list[str]:
    """Which of ``tools`` are not installed: ``make`` on the PATH, the linters in ``bin_dir``
    (where the Makefile's ``$(VENV)/bin/...`` looks for them)."""
    return [t for t in tools if not (shutil.which(t) if t == "make" else (bin_dir / t).is_file())]


def _needs(*tools: str) -> pytest.MarkDecorator:
    missing = missing_tools(tools)
    return pytest.mark.skipif(
        bool(missing),
        reason=f"{', '.join(missing)} not installed for {sys.executable} "
        "(`make test` installs and runs them)",
    )


# (name, code appended to the module, text the failing step prints)
INJECTED = [
    (
        "zip without strict= (bugbear B905)",
        "\n\ndef _pairs(a: list[int], b: list[int]) -> list[tuple[int, int]]:\n    return list(zip(a, b))\n",
        "B905",
    ),
    ("unused import (pyflakes F401)", "\n\ndef _unused() -> None:\n    import os\n", "F401"),
    ("unformatted code (ruff format)", "\n\n_TABLE = {'a':1}\n", "would be reformatted"),
    ("wrong return type (mypy)", "\n\ndef _half(x: int) -> int:\n    return x / 2\n", "[return-value]"),
    (
        "unannotated function on the strict floor (mypy)",
        "\n\ndef _double(x):\n    return 2 * x\n",
        "[no-untyped-def]",
    ),
]


def _tree(root: Path) -> Path:
    for name in ("Makefile", "pyproject.toml", "scripts/setup_cpu_env.sh", MODULE):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, root / name)
    (root / "hdet_megatron/__init__.py").write_text(
        '"""A one-module copy of the package (tests/test_lint.py)."""\n'
    )
    return root


def _make(root: Path, target: str) -> subprocess.CompletedProcess:
    # A clean make environment (this may itself run under `make test`).
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    return subprocess.run(
        ["make", "-o", "setup", target, f"VENV={VENV}"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def clean_tree(tmp_path_factory) -> Path:
    return _tree(tmp_path_factory.mktemp("lint-tree"))


def test_missing_tools_are_named(tmp_path):
    (tmp_path / "ruff").write_text("")
    assert missing_tools(("ruff", "mypy"), bin_dir=tmp_path) == ["mypy"]
    assert missing_tools(("ruff",), bin_dir=tmp_path) == []


@_needs("make", "ruff", "mypy")
def test_make_lint_passes_on_the_clean_copy(clean_tree):
    r = _make(clean_tree, "lint")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    for step in ("ruff check .", "ruff format --check .", "mypy"):
        assert step in out, out  # each step ran
    assert "Success: no issues found in 2 source files" in out, out


@_needs("make", "ruff", "mypy")
@pytest.mark.parametrize("name,code,marker", INJECTED, ids=[case[0] for case in INJECTED])
def test_make_test_stops_at_lint_on_an_injected_error(clean_tree, tmp_path, name, code, marker):
    root = tmp_path / "tree"
    shutil.copytree(clean_tree, root)
    with open(root / MODULE, "a") as fh:
        fh.write(code)
    r = _make(root, "test")
    out = r.stdout + r.stderr
    assert r.returncode != 0, f"{name}: make test passed\n{out}"
    assert marker in out, f"{name}: expected {marker!r}\n{out}"
    assert "Makefile" in out and "lint] Error" in out, out  # the lint recipe failed...
    assert "-m pytest" not in out, out  # ...and pytest never started


@_needs("ruff")
def test_repository_passes_ruff():
    """The checkout itself is lint- and format-clean (ruff: under a second; `make lint` adds mypy),
    so ``make test-fast`` catches what ``make test`` would."""
    for args in (["check", "."], ["format", "--check", "."]):
        r = subprocess.run([str(VENV / "bin" / "ruff"), *args], cwd=REPO, capture_output=True, text=True)
        assert r.returncode == 0, f"ruff {' '.join(args)}: run `make format`\n{r.stdout}{r.stderr}"
