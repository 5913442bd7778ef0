"""What in a run directory the project wrote, and the only things it may remove or overwrite.

Nothing a user made is ever removed: the demo clears its ``RUN_DIR`` only when it is recognisably
a previous run of the demo (its marker file, and nothing but the files a ``pretrain_gpt.py`` run
and ``hdet report`` write there), and ``hdet report`` replaces a PNG only when ``hdet report``
wrote it (a text chunk in the PNG says so). Anything else is refused with one line that says
what to do (:class:`~hdet_megatron.preflight.InputError`).

Standard library only: the demo runs it before ``torchrun``.

    python -m hdet_megatron.run_dirs check-demo RUN_DIR   # exit 2 + one line when not clearable
    python -m hdet_megatron.run_dirs clear-demo RUN_DIR   # remove a previous demo run, mark it
    python -m hdet_megatron.run_dirs check-report DIR     # DIR/report.png absent or ours
"""

from __future__ import annotations

import os
import re
import struct
import sys
from collections.abc import Sequence

from hdet_megatron.preflight import InputError, fail
from hdet_megatron.run_files import ITER_DIR, ITERATION_RULES, TRACKER_NAMES, Rules, remove_files, walk

__all__ = [
    "DEMO_MARKER",
    "REPORT_PNG_KEY",
    "demo_run_files",
    "clear_demo_run",
    "is_hdet_report_png",
    "check_report_output",
]

#: Written by ``examples/pretrain_gpt/demo_cpu.sh`` into its RUN_DIR: the next demo run may clear
#: a directory that holds it and nothing but a run's own files.
DEMO_MARKER = ".hdet-demo-run"
_MARKER_TEXT = (
    "Written by examples/pretrain_gpt/demo_cpu.sh: this directory holds a demo run; the next demo "
    "run with the same RUN_DIR replaces it (it refuses when anything else is in here).\n"
)
#: PNG text-chunk keyword that ``hdet report`` writes into its plots.
REPORT_PNG_KEY = "hdet-report"

#: Top-level files of a pretrain_gpt.py run directory plus the demo's report and marker
#: (``write_tracker`` leaves ``TRACKER.tmp<pid>`` when killed mid-write).
_TOP_FILES = re.compile(rf"^(?:{re.escape(DEMO_MARKER)}|metrics\.jsonl|report\.png|{TRACKER_NAMES})$")
_TB_FILES = re.compile(r"^events\.out\.tfevents\..+$")
_RUN: Rules = (_TOP_FILES, ((ITER_DIR, ITERATION_RULES), (re.compile(r"^tensorboard$"), (_TB_FILES, ()))))


def _run_files(run_dir: str) -> tuple[list[str], list[str], str | None]:
    """(files, directories) of ``run_dir`` that a run wrote, deepest first, and the first entry
    it did not write (None when there is none)."""

    def foreign_plot(path: str) -> bool:  # a plot of someone else's under the report's name
        return os.path.basename(path) == "report.png" and not is_hdet_report_png(path)

    return walk(run_dir, _RUN, refuse=foreign_plot)


def _shared_dir(run_dir: str) -> str | None:
    """What ``run_dir`` is when it holds more than a run: the root directory, the home directory
    or one above it, the current directory (the checkout the demo runs in) or one above it."""
    real = os.path.realpath(run_dir)
    if real == os.path.realpath(os.sep):
        return "the root directory"
    home = os.path.realpath(os.path.expanduser("~"))
    if real == home:
        return "your home directory"
    cwd = os.path.realpath(os.getcwd())
    if real == cwd:
        return f"the checkout the demo runs in ({cwd})"
    if cwd.startswith(real.rstrip(os.sep) + os.sep):
        return f"a parent of the checkout the demo runs in ({cwd})"
    if home.startswith(real.rstrip(os.sep) + os.sep):
        return "a parent of your home directory"
    return None


def demo_run_files(run_dir: str) -> tuple[list[str], list[str]]:
    """The files and directories a previous demo run left in ``run_dir`` (empty lists when it is
    missing or empty). Raises :class:`InputError` when ``run_dir`` is not clearable: the root, home
    or current directory (or one above them; even when empty), not a directory, without the
    demo's marker, or holding anything a run did not write."""
    shared = _shared_dir(run_dir)
    if shared is not None:
        raise InputError(
            f"RUN_DIR={run_dir} is {shared}; the demo clears its RUN_DIR before training, so it "
            "takes a directory of its own: give one (e.g. RUN_DIR=runs/demo)"
        )
    if not os.path.lexists(run_dir):
        return [], []
    if os.path.islink(run_dir) or not os.path.isdir(run_dir):
        raise InputError(
            f"RUN_DIR={run_dir} is not a directory; the demo clears its RUN_DIR before training: "
            "give a directory (e.g. RUN_DIR=runs/demo)"
        )
    if not os.listdir(run_dir):
        return [], []
    files, dirs, stranger = _run_files(run_dir)
    if stranger is None and os.path.isfile(os.path.join(run_dir, DEMO_MARKER)):
        return files, dirs
    why = (
        f"{stranger} is not a file of a demo run"
        if stranger is not None
        else f"it has no {DEMO_MARKER} (not written by the demo)"
    )
    raise InputError(
        f"RUN_DIR={run_dir} is not empty and not a previous demo run ({why}); the demo clears "
        "its RUN_DIR before training and removes nothing it did not write: pick another RUN_DIR "
        "(e.g. RUN_DIR=runs/demo2), or move that directory away"
    )


def clear_demo_run(run_dir: str) -> int:
    """Remove a previous demo run from ``run_dir`` (only the files :func:`demo_run_files`
    recognised, then their directories), create ``run_dir`` if needed and mark it as the demo's.
    Returns the number of files removed. Raises :class:`InputError` when it is not clearable."""
    files, dirs = demo_run_files(run_dir)
    remove_files(files, dirs)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, DEMO_MARKER), "w") as fh:
        fh.write(_MARKER_TEXT)
    return len(files)


# --- the report's PNG ---------------------------------------------------------------------------


def is_hdet_report_png(path: str) -> bool:
    """Whether ``path`` is a PNG that ``hdet report`` wrote (its ``hdet-report`` text chunk)."""
    try:
        with open(path, "rb") as fh:
            if fh.read(8) != b"\x89PNG\r\n\x1a\n":
                return False
            while True:
                head = fh.read(8)
                if len(head) < 8:
                    return False
                length, kind = struct.unpack(">I4s", head)
                if kind == b"tEXt" and length < 1 << 16:
                    key = fh.read(length).split(b"\0", 1)[0]
                    if key == REPORT_PNG_KEY.encode("latin-1"):
                        return True
                    fh.seek(4, os.SEEK_CUR)
                elif kind == b"IEND":
                    return False
                else:
                    fh.seek(length + 4, os.SEEK_CUR)
    except OSError:
        return False


def check_report_output(path: str) -> None:
    """``hdet report`` may write ``path``: it does not exist, or ``hdet report`` wrote it. Raises
    :class:`InputError` otherwise."""
    if os.path.lexists(path) and not (os.path.isfile(path) and is_hdet_report_png(path)):
        raise InputError(
            f"{path} exists and was not written by hdet report, which never overwrites a file it "
            "did not write: move it away, or write the plot elsewhere (hdet report RUN_DIR -o PATH)"
        )


# --- command line (the demo) --------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    actions = {
        "check-demo": demo_run_files,
        "clear-demo": clear_demo_run,
        "check-report": lambda d: check_report_output(os.path.join(d, "report.png")),
    }
    if len(argv) != 2 or argv[0] not in actions:
        return fail("run_dirs", f"usage: python -m hdet_megatron.run_dirs {{{','.join(actions)}}} DIR")
    try:
        actions[argv[0]](argv[1])
    except InputError as exc:
        return fail(os.environ.get("HDET_PROG", "run_dirs"), str(exc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
