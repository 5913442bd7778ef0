"""Checkpoints of HDET runs: save and load both Megatron checkpoint kinds, converge-on-save, resume.

Megatron writes replicated tensors from one DP rank (legacy ``torch.save`` checkpoints) or spreads
them over the DP ranks (``dist_checkpointing``), so a checkpoint written during a fan-out window
would mix diverged replicas. :func:`prepare_save` (``HDET.prepare_save()``) therefore converges
first when ``HDETConfig.converge_on_save`` (the default): the saved model is the averaged one.

HDET's own state is plain data under the key ``"hdet"`` of the scheduler state
(``HDETOptimizerParamScheduler.state_dict()``), the same on every rank, so it travels

* in legacy checkpoints inside ``opt_param_scheduler`` (Megatron-LM's own ``save_checkpoint``
  picks it up from ``opt_param_scheduler.state_dict()`` unchanged), and
* in ``dist_checkpointing`` (torch_dist) checkpoints as part of the common state (every
  non-tensor entry is common state; rank 0 writes it, every rank reads it).

This module holds the two entry points, :func:`save_checkpoint` and :func:`load_checkpoint`, and
re-exports the rest (this is the import path to use). The rooms behind it, one job each:

* :mod:`hdet_megatron.megatron.ckpt.state`: HDET's state (build, validate, runtime position,
  :func:`prepare_save`, :func:`strip_hdet_state`);
* :mod:`hdet_megatron.megatron.ckpt.resume`: the resume rules (:func:`plan_hdet_load`,
  :func:`load_scheduler_state`; what changes when DP size, arms or the config change);
* :mod:`hdet_megatron.megatron.ckpt.files`: Megatron-LM's directory layout, format detection,
  RNG and optimizer-state fixes;
* :mod:`hdet_megatron.megatron.ckpt.torch_dist` and :mod:`hdet_megatron.megatron.ckpt.legacy`:
  the two formats.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from hdet_megatron.megatron import cpu as _cpu  # noqa: F401  (shims before megatron.core)
from hdet_megatron.megatron.ckpt.files import (  # noqa: F401  (re-exported)
    CHECKPOINT_VERSION,
    DISTOPT_SHARDING_TYPE,
    LEGACY_FILE,
    TRACKER_FILE,
    _detect_format,
    _is_distopt,
    _layout_meta,
    _legacy_file,
    _model_key,
    _read_common,
    _resolve_dir,
    _rng_state,
    _set_rng_state,
    _sub_optimizers,
    _unwrap,
    checkpoint_dir,
    checkpoint_hdet_config,
    init_optimizer_state_for_load,
    read_checkpoint_hdet_state,
    restore_adam_steps,
)
from hdet_megatron.megatron.ckpt.legacy import _load_legacy_distopt, _save_legacy
from hdet_megatron.megatron.ckpt.resume import (  # noqa: F401  (re-exported)
    HDETLoadPlan,
    apply_hdet_load,
    attach_runtime,
    load_scheduler_state,
    plan_hdet_load,
    reset_for_plain_checkpoint,
)
from hdet_megatron.megatron.ckpt.state import (  # noqa: F401  (re-exported)
    _WARNED,
    HDET_STATE_KEY,
    HDET_STATE_VERSION,
    STRUCTURAL_FIELDS,
    HDETCheckpointError,
    _is_int,
    _save_warnings,
    _warn_once,
    hdet_state_dict,
    load_runtime_state,
    logger,
    prepare_save,
    runtime_state_dict,
    strip_hdet_state,
)
from hdet_megatron.megatron.ckpt.torch_dist import _load_dist_tensors, _save_dist
from hdet_megatron.megatron.scheduler import HDETOptimizerParamScheduler
from hdet_megatron.run_files import checkpoint_files, remove_files

from megatron.core import parallel_state as ps

__all__ = [
    "HDETCheckpointError",
    "HDET_STATE_KEY",
    "DISTOPT_SHARDING_TYPE",
    "prepare_save",
    "save_checkpoint",
    "load_checkpoint",
    "checkpoint_dir",
    "read_checkpoint_hdet_state",
    "checkpoint_hdet_config",
    "strip_hdet_state",
    "hdet_state_dict",
    "plan_hdet_load",
    "load_scheduler_state",
    "init_optimizer_state_for_load",
    "restore_adam_steps",
]


def save_checkpoint(
    root: str,
    iteration: int,
    model: Sequence,
    optimizer,
    scheduler,
    hdet=None,
    *,
    format: str = "torch_dist",
    distopt_sharding_type: str = DISTOPT_SHARDING_TYPE,
    save_rng: bool = True,
) -> Any | None:
    """Save a Megatron checkpoint of ``iteration`` under ``root`` (``root/iter_XXXXXXX`` plus
    Megatron-LM's tracker file). Collective: call on every rank.

    ``format``: ``"torch_dist"`` (``dist_checkpointing`` with the model's and optimizer's
    ``sharded_state_dict``; scheduler and HDET state in the common state) or ``"torch"`` (legacy:
    one ``torch.save`` file per TP/PP rank, written by DP rank 0, HDET state inside
    ``opt_param_scheduler``). ``hdet`` defaults to the runtime attached to ``scheduler``; it is
    converged first when ``converge_on_save`` (see :func:`prepare_save`), whose metrics are
    returned.
    """
    if format not in ("torch_dist", "torch"):
        raise ValueError(f"format={format!r} must be 'torch_dist' or 'torch' (legacy)")
    if hdet is None:
        hdet = getattr(scheduler, "hdet_runtime", None)
    metrics = prepare_save(hdet)
    _save_warnings(hdet)
    ckpt_dir = checkpoint_dir(root, iteration)
    # Every rank looks (read-only) before rank 0 removes anything, so that a directory that may
    # not be removed is the same clear error on every rank rather than one rank's.
    stale = _untracked_checkpoint(root, iteration, ckpt_dir)
    dist.barrier()
    if dist.get_rank() == 0:
        remove_files(*stale)
        os.makedirs(ckpt_dir, exist_ok=True)
    dist.barrier()
    common = {
        "iteration": int(iteration),
        "checkpoint_version": CHECKPOINT_VERSION,
        "opt_param_scheduler": scheduler.state_dict(),
        "hdet_checkpoint": {"format": format, "layout": _layout_meta()},
    }
    rng = _rng_state() if save_rng else None
    if format == "torch_dist":
        common["hdet_checkpoint"]["distopt_sharding_type"] = distopt_sharding_type
        _save_dist(ckpt_dir, model, optimizer, common, rng, distopt_sharding_type)
    else:
        _save_legacy(ckpt_dir, model, optimizer, common, rng)
    dist.barrier()
    if dist.get_rank() == 0:
        write_tracker(root, iteration)
    dist.barrier()
    return metrics


def write_tracker(root: str, iteration: int) -> None:
    """Point the tracker at ``iteration``, atomically (a temporary file renamed over it), after
    every rank wrote its part: a run that dies at any moment leaves the tracker naming the last
    complete checkpoint, which is what ``--load`` resumes from."""
    path = os.path.join(root, TRACKER_FILE)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(str(int(iteration)))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _untracked_checkpoint(root: str, iteration: int, ckpt_dir: str) -> tuple[list[str], list[str]]:
    """The files and directories to remove before saving ``iteration``: an ``iter_XXXXXXX``
    directory the tracker does not name is what a run that died while saving left behind (or an
    abandoned later run), and no stale file of it may mix into the new save. Only what a
    checkpoint save writes is removed (:func:`hdet_megatron.run_files.checkpoint_files`); anything
    else in there raises :class:`HDETCheckpointError` before any rank removes or writes a file."""
    if not os.path.lexists(ckpt_dir):
        return [], []
    if os.path.islink(ckpt_dir) or not os.path.isdir(ckpt_dir):
        raise HDETCheckpointError(
            f"cannot save iteration {iteration}: {ckpt_dir} exists and is not a checkpoint directory "
            "(a file or a symbolic link); nothing was saved: move it away, or save into another directory"
        )
    try:
        with open(os.path.join(root, TRACKER_FILE)) as f:
            tracked: int | None = int(f.read().strip())
    except (OSError, ValueError):
        tracked = None
    if tracked == int(iteration):
        return [], []  # the tracked checkpoint of this iteration: saved again in place
    files, dirs, stranger = checkpoint_files(ckpt_dir)
    if stranger is not None:
        raise HDETCheckpointError(
            f"cannot save iteration {iteration}: {ckpt_dir} is not the checkpoint the tracker names "
            f"(a save cut short, or an abandoned run) and would be replaced, but {stranger} is not "
            "a checkpoint file; nothing was removed or saved: move that directory away, or save "
            "into another directory"
        )
    return files, dirs + [ckpt_dir]


def _check_common(common: Any, ckpt_dir: str) -> dict:
    if not isinstance(common, Mapping):
        raise HDETCheckpointError(f"{ckpt_dir}: checkpoint state is {type(common).__name__}, not a dict")
    if "iteration" not in common or not _is_int(common["iteration"]):
        raise HDETCheckpointError(f"{ckpt_dir}: checkpoint has no integer 'iteration'; nothing was loaded")
    sched = common.get("opt_param_scheduler")
    if sched is not None and not isinstance(sched, Mapping):
        raise HDETCheckpointError(f"{ckpt_dir}: 'opt_param_scheduler' is not a dict; nothing was loaded")
    return dict(common)


#: Megatron scheduler fields its ``load_state_dict`` asserts equal when neither
#: ``override_opt_param_scheduler`` nor ``use_checkpoint_opt_param_scheduler`` is set.
_MEGATRON_CHECKED = (
    "max_lr",
    "min_lr",
    "lr_warmup_steps",
    "lr_decay_steps",
    "lr_decay_style",
    "start_wd",
    "end_wd",
    "wd_incr_steps",
    "wd_incr_style",
)


def _precheck_megatron_scheduler(scheduler, state: Mapping, ckpt_dir: str) -> None:
    """Megatron's scheduler load fails on a mismatch in strict mode; fail before any tensor is
    loaded instead of after."""
    if getattr(scheduler, "override_opt_param_scheduler", False) or getattr(
        scheduler, "use_checkpoint_opt_param_scheduler", True
    ):
        return
    diffs = [
        f"{k}: checkpoint {state[k]!r} vs this run {getattr(scheduler, k)!r}"
        for k in _MEGATRON_CHECKED
        if k in state and hasattr(scheduler, k) and state[k] != getattr(scheduler, k)
    ]
    if diffs:
        raise HDETCheckpointError(
            f"{ckpt_dir}: OptimizerParamScheduler values differ from the checkpoint's ({'; '.join(diffs)}) "
            "and neither use_checkpoint_opt_param_scheduler nor override_opt_param_scheduler is "
            "set; nothing was loaded"
        )


def load_checkpoint(
    root: str,
    model: Sequence,
    optimizer,
    scheduler,
    hdet=None,
    *,
    iteration: int | None = None,
    format: str | None = None,
    override_hdet_config: bool | None = None,
    load_optimizer: bool = True,
    load_rng: bool = True,
    strict: bool = True,
) -> int:
    """Load a checkpoint written by :func:`save_checkpoint` (or a Megatron checkpoint of the same
    layout) into ``model``/``optimizer``/``scheduler``; returns its iteration. Collective.

    ``iteration`` defaults to the tracker file's; ``format`` is detected. The scheduler may be an
    ``HDETOptimizerParamScheduler`` (HDET state restored per the module's resume rules) or a plain
    ``OptimizerParamScheduler`` (HDET state ignored, warned once). ``override_hdet_config``:
    True = this run's HDET config wins, False = the checkpoint's, None = follow the scheduler's
    ``override_opt_param_scheduler`` / ``use_checkpoint_opt_param_scheduler``.

    ``load_optimizer=False`` (``--no-load-optim``) loads the model only and refreshes the
    optimizer's main params from it (``reload_model_params()``, as Megatron-LM).

    HDET state is validated before anything is modified (:class:`HDETCheckpointError`).
    """
    ckpt_dir, iteration = _resolve_dir(root, iteration)
    fmt = format or _detect_format(ckpt_dir)
    if fmt not in ("torch_dist", "torch"):
        raise ValueError(f"format={format!r} must be 'torch_dist' or 'torch' (legacy)")
    common = _check_common(_read_common(ckpt_dir, fmt), ckpt_dir)
    sched_state = common.get("opt_param_scheduler")
    # An HDETOptimizerParamScheduler built with hdet=None is Megatron's scheduler.
    is_hdet = isinstance(scheduler, HDETOptimizerParamScheduler) and scheduler.hdet_config is not None
    if hdet is None and is_hdet:
        hdet = scheduler.hdet_runtime
    # 1. Validate HDET state first: a bad one must not leave a half-loaded model behind.
    if is_hdet and sched_state is not None and HDET_STATE_KEY in sched_state:
        plan_hdet_load(scheduler, sched_state[HDET_STATE_KEY], override_hdet_config)
    if scheduler is not None:
        if sched_state is None:
            raise HDETCheckpointError(
                f"{ckpt_dir}: checkpoint has no 'opt_param_scheduler'; nothing was loaded"
            )
        _precheck_megatron_scheduler(scheduler, sched_state, ckpt_dir)
    saved_layout = (common.get("hdet_checkpoint") or {}).get("layout")
    same_layout = saved_layout == _layout_meta()

    # 2. Tensors.
    with torch.no_grad():
        if fmt == "torch_dist":
            loaded = _load_dist_tensors(
                ckpt_dir,
                model,
                optimizer if load_optimizer else None,
                load_rng and same_layout and saved_layout is not None,
                (common.get("hdet_checkpoint") or {}).get("distopt_sharding_type", DISTOPT_SHARDING_TYPE),
            )
        else:
            loaded = common  # the legacy file was read whole
        for i, chunk in enumerate(model):
            key = _model_key(model, i)
            if key not in loaded:
                raise HDETCheckpointError(f"{ckpt_dir}: checkpoint has no {key!r}")
            _unwrap(chunk).load_state_dict(loaded[key], strict=strict)
        if load_optimizer and optimizer is not None:
            if "optimizer" not in loaded:
                raise HDETCheckpointError(f"{ckpt_dir}: checkpoint has no 'optimizer' state")
            optimizer.load_state_dict(loaded["optimizer"])
            if fmt == "torch" and _is_distopt(optimizer):
                _load_legacy_distopt(ckpt_dir, optimizer)
            restore_adam_steps(optimizer)
        elif optimizer is not None:
            # Without its state the optimizer's fp32 main params (bf16/fp16 runs) still hold the
            # initial weights, and its first step would copy them over the loaded model: refresh
            # them from the model, as Megatron-LM's load_checkpoint does under --no-load-optim
            # (megatron/training/checkpointing.py: optimizer.reload_model_params()). Before the
            # scheduler state, whose HDET part starts the update line at the main params.
            optimizer.reload_model_params()

    # 3. Scheduler (+ HDET state).
    if scheduler is not None:
        assert sched_state is not None  # refused in step 1 otherwise
        if is_hdet:
            previous = getattr(scheduler, "override_hdet_config", None)
            if override_hdet_config is not None:
                scheduler.override_hdet_config = override_hdet_config
            try:
                scheduler.load_state_dict(sched_state)
            finally:
                scheduler.override_hdet_config = previous
            if HDET_STATE_KEY not in sched_state and hdet is not None:
                hdet.iteration = iteration  # plain checkpoint: HDET counts from its iteration
        else:
            scheduler.load_state_dict(strip_hdet_state(sched_state))

    # 4. RNG (each rank its own, when the parallel layout is unchanged).
    if load_rng:
        rng = loaded.get("rng_state")
        if fmt == "torch" and isinstance(rng, list):
            # Gathered over DP x CP at save (ckpt.legacy._save_legacy): index by that rank.
            rng = rng[ps.get_data_parallel_rank(with_context_parallel=True)] if same_layout else None
        if rng is not None:
            _set_rng_state(rng)
        elif "rng_state" in common or fmt == "torch_dist":
            logger.info("RNG state not restored (parallel layout changed or not saved)")
    if hdet is not None and getattr(hdet, "rollback", None) is not None and hdet.steps_in_window == 0:
        hdet.rollback.save()  # the loaded (converged) params are the rollback point
    return iteration
