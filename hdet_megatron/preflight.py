"""Checks of a command line that run before any rank starts work (standard library only).

The entry points (``hdet``, ``examples/pretrain_gpt/pretrain_gpt.py``, ``pretrain_gpt_hdet.py``,
the launch scripts) turn every bad input into one line ``PROG: error: WHAT: FIX`` and exit code 2,
never a traceback. This module holds the pieces they share:

* :func:`integer` / :func:`number`: ``argparse`` types whose errors name the expected range;
* :class:`OneLineParser`: an ``ArgumentParser`` whose errors are one line (no usage block);
* :func:`merge_defaults`: a launcher's default flags give way to the user's flags;
* :func:`check_checkpoint` / :func:`check_run_dir` / :func:`check_save_dir`: ``--load`` is a
  readable checkpoint, a run directory is not another job's, ``--save`` holds no other run's
  checkpoints, checked from the files alone (no torch, no process group).

Importing it must stay cheap: the launch scripts run it once before ``torchrun``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import zipfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from hdet_megatron.run_files import TRACKER

__all__ = [
    "InputError",
    "OneLineParser",
    "integer",
    "number",
    "merge_defaults",
    "check_checkpoint",
    "check_run_dir",
    "check_save_dir",
    "check_metrics_file",
    "fresh_run_dir",
    "fail",
]

#: Exit code of every usage / bad-input error (argparse's).
USAGE = 2
METRICS_FILE = "metrics.jsonl"


class InputError(ValueError):
    """A bad flag or file; the message names it and says what to do."""


def fail(prog: str, message: str, stream=None) -> int:
    """Print ``PROG: error: MESSAGE`` as one line; return :data:`USAGE`."""
    line = " ".join(str(message).split())  # one line, whatever the message held
    print(f"{prog}: error: {line}", file=stream or sys.stderr, flush=True)
    return USAGE


# --- argparse types -----------------------------------------------------------------------------


def integer(minimum: int | None = None, maximum: int | None = None) -> Callable[[str], int]:
    """``type=`` for an integer flag in ``[minimum, maximum]``; errors say the range."""
    want = _range_text("an integer", minimum, maximum)

    def convert(text: str) -> int:
        try:
            value = int(text, 10)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"expected {want}, got {value}")
        return value

    convert.__name__ = "integer"
    return convert


def number(
    minimum: float | None = None,
    maximum: float | None = None,
    *,
    above: float | None = None,
    below: float | None = None,
) -> Callable[[str], float]:
    """``type=`` for a finite float flag; ``minimum``/``maximum`` inclusive, ``above``/``below``
    exclusive bounds. Errors say the range; ``nan`` and ``inf`` are refused."""
    parts = []
    if above is not None:
        parts.append(f"> {above:g}")
    if minimum is not None:
        parts.append(f">= {minimum:g}")
    if below is not None:
        parts.append(f"< {below:g}")
    if maximum is not None:
        parts.append(f"<= {maximum:g}")
    want = "a finite number" + (" " + " and ".join(parts) if parts else "")

    def convert(text: str) -> float:
        try:
            value = float(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        bad = (
            not math.isfinite(value)
            or (minimum is not None and value < minimum)
            or (maximum is not None and value > maximum)
            or (above is not None and value <= above)
            or (below is not None and value >= below)
        )
        if bad:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text}")
        return value

    convert.__name__ = "number"
    return convert


def _range_text(what: str, minimum, maximum) -> str:
    if minimum is not None and maximum is not None:
        return f"{what} in [{minimum}, {maximum}]"
    if minimum is not None:
        return f"{what} >= {minimum}"
    if maximum is not None:
        return f"{what} <= {maximum}"
    return what


class OneLineParser(argparse.ArgumentParser):
    """``argparse`` with one-line errors: ``PROG: error: MESSAGE (PROG --help lists the flags)``
    and exit code 2, instead of a usage block. Subparsers inherit it."""

    def error(self, message: str):
        fail(self.prog, f"{message} ({self.prog} --help lists the flags)")
        sys.exit(USAGE)


# --- launcher defaults --------------------------------------------------------------------------

#: An explicit user flag (key) also replaces these launcher defaults (values).
REPLACES: dict[str, tuple[str, ...]] = {
    "--hdet-axis": ("--hdet-spread",),
    "--hdet-spread": ("--hdet-axis",),
    "--mock-data": (
        "--data-path",
        "--split",
        "--tokenizer-type",
        "--vocab-file",
        "--merge-file",
        "--tokenizer-model",
    ),
    "--data-path": ("--mock-data", "--vocab-size"),
    "--lr-warmup-fraction": ("--lr-warmup-iters",),
    "--lr-warmup-iters": ("--lr-warmup-fraction",),
    "--no-tensorboard": ("--tensorboard-dir",),
    "--tensorboard-dir": ("--no-tensorboard",),
    "--no-hdet": ("--hdet-*",),
}


def _flag(token: str) -> str | None:
    return token.split("=", 1)[0] if token.startswith("--") and len(token) > 2 else None


def _groups(argv: Sequence[str]) -> list[list[str]]:
    """``argv`` as ``[flag, values...]`` groups (a value is any token not starting with ``--``)."""
    groups: list[list[str]] = []
    for token in argv:
        if _flag(token) or not groups:
            groups.append([token])
        else:
            groups[-1].append(token)
    return groups


def merge_defaults(defaults: Sequence[str], user: Sequence[str]) -> list[str]:
    """The launcher's ``defaults`` minus every flag the ``user`` gives (and the flags those
    replace, :data:`REPLACES`), followed by ``user``: the user's flags always win, even where
    argparse's "last one wins" does not help (``--hdet-axis`` vs. the default ``--hdet-spread``,
    ``--no-hdet`` vs. default ``--hdet-*`` flags, appending flags)."""
    given = {f for f in (_flag(t) for t in user) if f}
    drop = set(given)
    for flag in given:
        drop.update(REPLACES.get(flag, ()))
    out: list[str] = []
    for group in _groups(defaults):
        head = _flag(group[0])
        if head in drop or (head and head.startswith("--hdet-") and "--hdet-*" in drop):
            continue
        out += group
    return out + list(user)


# --- files --------------------------------------------------------------------------------------


def _iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def check_checkpoint(load: str, ckpt_step: int | None = None, flag: str = "--load") -> str | None:
    """Check that ``load`` holds a readable Megatron checkpoint (torch_dist or legacy) before any
    rank tries to load it. Returns the checkpoint directory, or None when ``load`` holds no
    checkpoint yet (a fresh run). Raises :class:`InputError` naming the file and the fix."""
    if not os.path.exists(load):
        if ckpt_step is not None:
            raise InputError(
                f"{flag} {load}: no such directory (needed by --ckpt-step {ckpt_step}); "
                "give the --save directory of an earlier run"
            )
        return None
    if not os.path.isdir(load):
        raise InputError(
            f"{flag} {load} is a file, not a checkpoint directory: give the --save "
            "directory of an earlier run"
        )
    if not os.access(load, os.R_OK | os.X_OK):
        raise InputError(f"{flag} {load}: permission denied; make it readable or use another directory")
    if ckpt_step is None:
        tracker = os.path.join(load, TRACKER)
        if not os.path.exists(tracker):
            if any(name.startswith("iter_") for name in os.listdir(load)):
                raise InputError(
                    f"{flag} {load} has iter_* directories but no {TRACKER} (an "
                    "interrupted save?): pass --ckpt-step N to pick one"
                )
            return None
        try:
            with open(tracker, "rb") as fh:
                text = fh.read(64).decode("utf-8", "replace").strip()
        except OSError as exc:
            raise InputError(f"{tracker}: cannot read ({exc.strerror}); fix its permissions") from None
        try:
            iteration = int(text)
        except ValueError:
            raise InputError(
                f"{tracker}: expected an iteration number, found {text[:40]!r}; "
                "write the number of the last complete iter_* directory into it, or "
                "pass --ckpt-step N"
            ) from None
        if iteration < 0:
            raise InputError(
                f"{tracker}: iteration {iteration} is negative; write the number of "
                "the last complete iter_* directory into it, or pass --ckpt-step N"
            )
        source = f"{tracker} points to"
    else:
        iteration = ckpt_step
        source = f"--ckpt-step {ckpt_step}:"
    ckpt_dir = _iteration_dir(load, iteration)
    if not os.path.isdir(ckpt_dir):
        have = sorted(n for n in os.listdir(load) if n.startswith("iter_"))
        raise InputError(
            f"{source} {ckpt_dir}, which does not exist; "
            + (
                f"present: {', '.join(have[-3:])}: pass --ckpt-step N"
                if have
                else "give the --save directory of an earlier run"
            )
        )
    _check_checkpoint_files(ckpt_dir)
    return ckpt_dir


def _check_checkpoint_files(ckpt_dir: str) -> None:
    names = os.listdir(ckpt_dir)
    fix = "use another --ckpt-step, or save it again"
    if "metadata.json" in names:  # dist_checkpointing (torch_dist)
        path = os.path.join(ckpt_dir, "metadata.json")
        try:
            with open(path) as fh:
                meta = json.load(fh)
        except (OSError, ValueError, UnicodeDecodeError):
            raise InputError(f"{path} is unreadable (not JSON): the checkpoint is damaged; {fix}") from None
        if not isinstance(meta, dict) or "sharded_backend" not in meta:
            raise InputError(f"{path} is not a dist_checkpointing metadata file; {fix}")
        if meta.get("sharded_backend") == "torch_dist":
            _check_torch_file(os.path.join(ckpt_dir, ".metadata"), pickled=True)  # torch DCP's index
        if "common.pt" in names:  # older layouts keep the common state apart
            _check_torch_file(os.path.join(ckpt_dir, "common.pt"), zipped=True)
        return
    ranks = sorted(n for n in names if n.startswith("mp_rank_"))
    if ranks:  # legacy torch format
        for rank in ranks:
            _check_torch_file(os.path.join(ckpt_dir, rank, "model_optim_rng.pt"), zipped=True)
        return
    raise InputError(
        f"{ckpt_dir} holds neither a torch_dist (metadata.json) nor a legacy "
        f"(mp_rank_*/) checkpoint (an interrupted save?); {fix}"
    )


def _check_torch_file(path: str, zipped: bool = False, pickled: bool = False) -> None:
    """``path`` exists and starts like what ``torch.save`` (a zip archive) or ``pickle`` writes."""
    fix = "the checkpoint is damaged (an interrupted save?): use another --ckpt-step, or save it again"
    if not os.path.isfile(path):
        raise InputError(f"{path} is missing: {fix}")
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            head = fh.read(2)
        ok = size > 0 and (not zipped or zipfile.is_zipfile(path)) and (not pickled or head[:1] == b"\x80")
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror}): {fix}") from None
    if not ok:
        kind = "a torch.save file" if zipped else "a pickled checkpoint index"
        raise InputError(f"{path} is {'empty' if size == 0 else 'not ' + kind}: {fix}")


#: Flags that fix the model's shape: a run directory whose last run had other values belongs to
#: another job (its checkpoint cannot be loaded into this model, its metrics would be mixed).
MODEL_FLAGS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "max_position_embeddings",
    "position_embedding_type",
    "swiglu",
    "untie_embeddings_and_output_weights",
    "disable_bias_linear",
)


def last_run_record(run_dir: str) -> dict | None:
    """The last ``{"type": "run"}`` record of ``RUN_DIR/metrics.jsonl`` (None when there is none)."""
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        return None
    last = None
    try:
        with open(path, "rb") as fh:
            for raw in fh:
                if b'"run"' not in raw[:40]:
                    continue
                try:
                    record = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(record, dict) and record.get("type") == "run":
                    last = record
    except OSError as exc:
        raise InputError(
            f"{path}: cannot read ({exc.strerror}); fix its permissions or use another --run-dir"
        ) from None
    return last


_FRESH = [False]


@contextlib.contextmanager
def fresh_run_dir(fresh: bool = True):
    """Inside: the launcher empties ``--save`` before the run starts (the demo: only a previous
    demo run, :mod:`hdet_megatron.run_dirs`), so :func:`check_run_dir` and :func:`check_save_dir`
    do not check what is in it now."""
    saved, _FRESH[0] = _FRESH[0], bool(fresh)
    try:
        yield
    finally:
        _FRESH[0] = saved


def check_run_dir(
    run_dir: str, args: Any, flag: str = "--run-dir", model_flags: Iterable[str] = MODEL_FLAGS
) -> None:
    """Refuse a run (or checkpoint) directory written by another job: its last run record has
    other model flags than ``args``. Raises :class:`InputError` naming the flags and the fix."""
    save = getattr(args, "save", None)
    if _FRESH[0] and save and run_dir and os.path.realpath(run_dir) == os.path.realpath(save):
        return
    if not run_dir or not os.path.isdir(run_dir):
        if run_dir and os.path.exists(run_dir):
            raise InputError(f"{flag} {run_dir} is a file, not a directory: give a directory")
        return
    record = last_run_record(run_dir)
    old = (record or {}).get("args")
    if not isinstance(old, Mapping):
        return
    diff = [
        (name, old[name], getattr(args, name))
        for name in model_flags
        if name in old and hasattr(args, name) and old[name] != getattr(args, name)
    ]
    if diff:
        what = ", ".join(f"--{n.replace('_', '-')} {a} there, {b} here" for n, a, b in diff[:3])
        raise InputError(
            f"{flag} {run_dir} belongs to another job ({what}): use a new directory for this "
            "model, or give the same model flags to continue that run"
        )


def check_metrics_file(run_dir: str, flag: str = "--run-dir", save: str | None = None) -> None:
    """The run appends its records to ``RUN_DIR/metrics.jsonl``: refuse when that file is another
    program's (not empty, and no HDET run record in it), so that no file of anyone else's is
    written to. Raises :class:`InputError` naming the file and the fix. Not checked when
    ``run_dir`` is the ``save`` directory a launcher clears first (:func:`fresh_run_dir`)."""
    if not run_dir or (_FRESH[0] and save and os.path.realpath(run_dir) == os.path.realpath(save)):
        return
    path = os.path.join(run_dir, METRICS_FILE)
    if os.path.lexists(path) and not os.path.isfile(path):
        raise InputError(f"{flag} {run_dir}: {path} is not a file: move it away, or use another {flag}")
    if not os.path.isfile(path) or os.path.getsize(path) == 0 or last_run_record(run_dir) is not None:
        return
    raise InputError(
        f"{flag} {run_dir}: {path} holds no HDET metrics records (another program's file?) and this "
        f"run would append to it: use another {flag}, or move that file away"
    )


def _iterations(path: str) -> list[int]:
    """The ``iter_XXXXXXX`` directories in ``path``, as iteration numbers, ascending."""
    out = []
    for name in os.listdir(path):
        if name.startswith("iter_") and name[5:].isdigit() and os.path.isdir(os.path.join(path, name)):
            out.append(int(name[5:]))
    return sorted(out)


def check_save_dir(save: str, load: str | None, ckpt_step: int | None = None) -> None:
    """``--save`` must not hold the checkpoints of another run: this run's saves would land among
    them (the tracker rewritten, a checkpoint of the same iteration replaced). Allowed: no
    checkpoint there, or ``--load`` names the same directory (this run continues that one), and
    then with ``--ckpt-step N`` no checkpoint after N (the run would overwrite it). Raises
    :class:`InputError` naming the directory and the fix."""
    if _FRESH[0] or not save or not os.path.isdir(save):
        return
    iterations = _iterations(save)
    has_tracker = os.path.isfile(os.path.join(save, TRACKER))
    if not iterations and not has_tracker:
        return
    same = bool(load and os.path.realpath(load) == os.path.realpath(save))
    if not same:
        held = f"iter_{iterations[-1]:07d}" if iterations else TRACKER
        raise InputError(
            f"--save {save} already holds checkpoints ({held}) of another run, which this run would "
            f"write among (and over): pass --load {save} to continue that run, or give a new --save "
            "directory"
        )
    later = [i for i in iterations if ckpt_step is not None and i > ckpt_step]
    if later:
        raise InputError(
            f"--save {save} holds iter_{later[-1]:07d}, after the checkpoint this run resumes "
            f"(--ckpt-step {ckpt_step}), and the run would overwrite it: save into a new directory "
            "(--save NEW), or resume from the latest checkpoint (drop --ckpt-step)"
        )


def main_guard(prog: str, body: Callable[[], int], errors: tuple = (InputError,)) -> int:
    """Run ``body``; an exception in ``errors`` becomes one error line and exit code 2."""
    try:
        return body()
    except errors as exc:
        return fail(prog, str(exc))
