"""Which files in a Megatron-LM style run directory a run writes: names only, standard library.

The one place that knows the file names a checkpoint save writes (``iter_XXXXXXX`` with
dist_checkpointing shards or legacy ``mp_rank_*`` files, and what a save cut short leaves), so
that whatever removes files removes only those: :func:`hdet_megatron.megatron.checkpointing.save_checkpoint`
before saving an iteration again, the CPU demo (:mod:`hdet_megatron.run_dirs`) before replacing
its previous run. Nothing here removes a directory that still holds anything unlisted.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence

__all__ = [
    "TRACKER",
    "TRACKER_NAMES",
    "ITER_DIR",
    "ITERATION_RULES",
    "SAVE_DIR_RULES",
    "Rules",
    "walk",
    "checkpoint_files",
    "remove_files",
]

#: (file pattern, ((directory pattern, rules inside that directory), ...)).
Rules = tuple[re.Pattern, tuple]

#: Megatron-LM's tracker file: the iteration of the latest complete checkpoint.
TRACKER = "latest_checkpointed_iteration.txt"
#: The tracker and the file it is rewritten through (``.tmp<pid>``, then renamed:
#: :func:`hdet_megatron.megatron.checkpointing.write_tracker`), as a regular expression.
TRACKER_NAMES = rf"{re.escape(TRACKER)}(?:\.tmp\d+)?"
#: Megatron-LM's checkpoint directory of one iteration.
ITER_DIR = re.compile(r"^iter_\d{7}$")
#: Inside ``iter_XXXXXXX``: dist_checkpointing (torch_dist) files, and what a save killed midway
#: leaves (torch's FileSystemWriter writes ``.metadata.tmp`` / ``__R.metadata.tmp`` and renames it).
_CKPT_FILES = re.compile(r"^(?:metadata\.json|common\.pt|__\d+_\d+\.distcp|(?:__\d+)?\.metadata(?:\.tmp)?)$")
#: Legacy (torch) checkpoints: one directory per TP/PP(/EP) rank (``mp_rank_TT[_PPP][_EEE]``,
#: hdet_megatron.megatron.ckpt.files); ``.tmp`` is a file being written (renamed when complete).
_LEGACY_RANK_DIR = re.compile(r"^mp_rank_\d{2}(?:_\d{3}){0,2}$")
_LEGACY_FILES = re.compile(r"^(?:model_optim_rng|distrib_optim(?:_dp\d{3})?)\.pt(?:\.tmp)?$")
#: The rules for one ``iter_XXXXXXX`` directory.
ITERATION_RULES: Rules = (_CKPT_FILES, ((_LEGACY_RANK_DIR, (_LEGACY_FILES, ())),))
#: A ``--save`` directory of checkpoints only: the tracker (``.tmp<pid>`` while it is rewritten)
#: and the ``iter_XXXXXXX`` directories.
SAVE_DIR_RULES: Rules = (
    re.compile(rf"^{TRACKER_NAMES}$"),
    ((ITER_DIR, ITERATION_RULES),),
)


def _entries(path: str) -> list[os.DirEntry]:
    with os.scandir(path) as it:
        return sorted(it, key=lambda e: e.name)


def walk(
    path: str, rules: Rules, refuse: Callable[[str], bool] | None = None
) -> tuple[list[str], list[str], str | None]:
    """(files, directories) under ``path`` that ``rules`` accept, deepest first, and the first
    entry they do not (None when there is none). ``refuse(file)``: a file the patterns accept but
    its contents do not. Symbolic links are never accepted (nothing is removed through one)."""
    files: list[str] = []
    dirs: list[str] = []

    def visit(where: str, file_ok: re.Pattern, dir_rules: tuple) -> str | None:
        for entry in _entries(where):
            if entry.is_symlink():
                return entry.path
            if entry.is_dir():
                rule = next((sub for pattern, sub in dir_rules if pattern.match(entry.name)), None)
                if rule is None:
                    return entry.path
                found = visit(entry.path, *rule)
                if found is not None:
                    return found
                dirs.append(entry.path)
            elif entry.is_file() and file_ok.match(entry.name) and not (refuse and refuse(entry.path)):
                files.append(entry.path)
            else:
                return entry.path
        return None

    found = visit(path, *rules)
    return files, dirs, found


def checkpoint_files(ckpt_dir: str) -> tuple[list[str], list[str], str | None]:
    """(files, directories) in one ``iter_XXXXXXX`` directory that a checkpoint save writes
    (torch_dist or legacy, complete or cut short), deepest first, and the first entry no save
    writes (None when there is none): what may be removed to save that iteration again."""
    return walk(ckpt_dir, ITERATION_RULES)


def remove_files(files: Sequence[str], dirs: Sequence[str]) -> None:
    """Remove ``files``, then the directories ``dirs`` (deepest first; ``os.rmdir`` refuses one
    that is not empty, so nothing unlisted goes with them)."""
    for path in files:
        os.remove(path)
    for path in dirs:
        os.rmdir(path)
