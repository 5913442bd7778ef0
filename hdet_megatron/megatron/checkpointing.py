"""Checkpoints of HDET runs: converge-on-save, HDET state in both Megatron checkpoint kinds, resume.

Megatron writes replicated tensors from one DP rank (legacy ``torch.save`` checkpoints) or spreads
them over the DP ranks (``dist_checkpointing``), so a checkpoint written during a fan-out window
would mix diverged replicas. :func:`prepare_save` (``HDET.prepare_save()``) therefore converges
first when ``HDETConfig.converge_on_save`` (the default): the saved model is the averaged one.

HDET's own state (controller scales and velocities, window index = position of the counter-based
permutation generator, iteration, steps in the window, the partial window's per-arm loss sums,
the checkpoint's DP size and arm count, and the config fingerprint) is plain data under the key
``"hdet"`` of the scheduler state (``HDETOptimizerParamScheduler.state_dict()``). It is the same
on every rank, so it travels

* in legacy checkpoints inside ``opt_param_scheduler`` (Megatron-LM's own ``save_checkpoint``
  picks it up from ``opt_param_scheduler.state_dict()`` unchanged), and
* in ``dist_checkpointing`` (torch_dist) checkpoints as part of the common state (every
  non-tensor entry is common state; rank 0 writes it, every rank reads it).

Resume rules (:func:`load_scheduler_state`, used by ``HDETOptimizerParamScheduler.load_state_dict``):

* HDET checkpoint -> HDET run: continues exactly (bit-identical on CPU).
* plain Megatron checkpoint (no ``"hdet"``) -> HDET run: controller at scale 1, window 0, from
  the checkpoint's iteration.
* HDET checkpoint -> plain ``OptimizerParamScheduler``: Megatron ignores the extra key;
  :func:`load_checkpoint` / :func:`strip_hdet_state` warn once.
* different DP size or arm count: controller scales (and velocities) kept, the partial window is
  discarded and a new window starts at the resume iteration (logged); the window counter goes on.
* changed HDET config: the checkpoint's values win (Megatron's default
  ``use_checkpoint_opt_param_scheduler=True``) unless overridden (``override_opt_param_scheduler``
  or ``override_hdet_config=True``: this run's values win); with neither flag a mismatch is an
  error, as in Megatron. ``arms``, ``grad_sync`` and ``bucket_mb`` always come from this run
  (they are tied to the process groups and optimizer instances already built).
* corrupted or partial HDET state: :class:`HDETCheckpointError` naming what is wrong, raised
  before anything (scheduler, controller, runtime, model, optimizer) is modified.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import random
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from hdet_megatron.config import HDETConfig, HDETConfigError
from hdet_megatron.controller import AutoController
from hdet_megatron.megatron import cpu as _cpu  # noqa: F401  (shims before megatron.core)
from megatron.core import parallel_state as ps

logger = logging.getLogger(__name__)

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

#: Key of HDET's state inside the scheduler state (``opt_param_scheduler``).
HDET_STATE_KEY = "hdet"
HDET_STATE_VERSION = 1
#: Config fields that always come from the running job: they are tied to process groups, grad
#: hooks and optimizer instances that already exist when a checkpoint is loaded.
STRUCTURAL_FIELDS = ("arms", "grad_sync", "bucket_mb")
#: The ``DistributedOptimizer`` sharding type that megatron-core 0.19.2 saves and loads (with
#: partial instances too). The default ``fully_sharded_model_space`` fails with
#: "ShardedTensor.flattened_range is not supported"; ``fully_reshardable`` and
#: ``dp_zero_gather_scatter`` gather through CUDA-only code on CPU machines.
DISTOPT_SHARDING_TYPE = "dp_reshardable"
TRACKER_FILE = "latest_checkpointed_iteration.txt"
LEGACY_FILE = "model_optim_rng.pt"
CHECKPOINT_VERSION = 3.0


class HDETCheckpointError(ValueError):
    """A checkpoint's HDET state is corrupted, partial or incompatible; the message names the
    entry. Raised before anything is modified."""


# ---------------------------------------------------------------------------------------------
# HDET state: build, validate (plan), apply
# ---------------------------------------------------------------------------------------------


def hdet_state_dict(scheduler) -> dict:
    """HDET's checkpoint state of ``scheduler`` (an ``HDETOptimizerParamScheduler``): plain data,
    identical on every rank."""
    cfg = scheduler.hdet_config
    state = {
        "version": HDET_STATE_VERSION,
        "window": int(scheduler.window),
        "num_arms": int(scheduler.layout.num_arms),
        "dp_size": int(scheduler.layout.dp_size),
        "controller": scheduler.controller.state_dict(),
        "config": cfg.fingerprint(),
        # Permutations are counter-based, keyed by (seed, window, axis): the window index *is*
        # the generator position.
        "generator": {"seed": int(cfg.seed), "window": int(scheduler.window)},
        "runtime": None,
    }
    runtime = scheduler.hdet_runtime
    if runtime is not None:
        state["runtime"] = runtime.runtime_state_dict()
    elif getattr(scheduler, "_hdet_pending_runtime", None) is not None:
        # Loaded before the HDET runtime was built: pass the loaded position on unchanged.
        state["runtime"] = dict(scheduler._hdet_pending_runtime)
    return state


@dataclass
class HDETLoadPlan:
    """Everything a load will set, computed and validated before anything is modified."""

    config: HDETConfig
    controller: AutoController
    """A fresh controller with the checkpoint's state already loaded (becomes the live one)."""
    window: int
    runtime: Optional[dict]
    """``iteration``, ``steps_in_window``, ``arm_loss_sums`` (validated), or None when the
    checkpoint has no runtime state (scheduler saved without an HDET runtime)."""
    config_changed: bool = False
    layout_changed: bool = False
    messages: list[str] = field(default_factory=list)


def _bad(what: str, why: str) -> HDETCheckpointError:
    return HDETCheckpointError(f"HDET checkpoint state {what}: {why}; nothing was loaded")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _require_int(state: Mapping, key: str, where: str, minimum: int) -> int:
    if key not in state:
        raise _bad(f"{where}[{key!r}]", "is missing (partial state)")
    value = state[key]
    if not _is_int(value) or value < minimum:
        raise _bad(f"{where}[{key!r}]={value!r}", f"must be an integer >= {minimum}")
    return value


def _override_mode(scheduler, override: Optional[bool]) -> str:
    """``current`` (this run's config wins), ``checkpoint`` or ``strict`` (must match)."""
    if override is None:
        override = getattr(scheduler, "override_hdet_config", None)
    if override is None:
        override = bool(getattr(scheduler, "override_opt_param_scheduler", False))
    if override:
        return "current"
    use_ckpt = getattr(scheduler, "use_checkpoint_hdet_config", None)
    if use_ckpt is None:
        use_ckpt = bool(getattr(scheduler, "use_checkpoint_opt_param_scheduler", True))
    return "checkpoint" if use_ckpt else "strict"


def _config_from_fingerprint(fingerprint: Any) -> tuple[HDETConfig, list[str]]:
    if not isinstance(fingerprint, Mapping):
        raise _bad(
            "['config']",
            f"must be a dict (HDETConfig.fingerprint()), got {type(fingerprint).__name__}",
        )
    known = set(HDETConfig().fingerprint())
    unknown = sorted(set(fingerprint) - known)
    data = {k: v for k, v in fingerprint.items() if k in known}
    try:
        return HDETConfig.from_fingerprint(data), unknown
    except (HDETConfigError, TypeError, ValueError) as exc:
        raise _bad("['config']", f"is not a valid HDETConfig ({exc})") from None


def _merge_config(current: HDETConfig, ckpt: HDETConfig, mode: str) -> tuple[HDETConfig, list[str]]:
    """The config the resumed run uses, and the fields that differ (excluding structural)."""
    cur_fp, ckpt_fp = current.fingerprint(), ckpt.fingerprint()
    changed = [k for k in cur_fp if k not in STRUCTURAL_FIELDS and cur_fp[k] != ckpt_fp[k]]
    if not changed or mode == "current":
        return current, changed
    if mode == "strict":
        diffs = ", ".join(f"{k}: checkpoint {ckpt_fp[k]!r} vs this run {cur_fp[k]!r}" for k in changed)
        raise HDETCheckpointError(
            f"HDET config differs from the checkpoint's ({diffs}) and neither "
            "use_checkpoint_opt_param_scheduler nor override_opt_param_scheduler (or "
            "use_checkpoint_hdet_config / override_hdet_config) is set; nothing was loaded"
        )
    ckpt_axes = [a.name for a in ckpt.axes]
    if sorted(ckpt_axes) != sorted(a.name for a in current.axes):
        raise HDETCheckpointError(
            f"the checkpoint explores axes {ckpt_axes}, this run {[a.name for a in current.axes]}; "
            "axes cannot change once HDET is built. Build with the checkpoint's config "
            "(hdet_megatron.megatron.checkpointing.checkpoint_hdet_config(path)) or pass "
            "override_hdet_config=True to keep this run's axes; nothing was loaded"
        )
    merged = ckpt_fp
    for key in STRUCTURAL_FIELDS:
        merged[key] = cur_fp[key]
    return HDETConfig.from_fingerprint(merged), changed


def _controller_state_for(config: HDETConfig, state: Mapping, dropped: list[str]) -> dict:
    """Controller state restricted to ``config``'s axes (new axes start fresh)."""
    out = dict(state)
    axes = state.get("axes")
    if not isinstance(axes, Mapping):
        return out
    new_axes = {}
    for axis in config.axes:
        if axis.name in axes:
            new_axes[axis.name] = axes[axis.name]
        else:
            new_axes[axis.name] = {"scale": 0.0 if axis.additive else 1.0, "velocity": 0.0}
    dropped.extend(sorted(set(axes) - set(new_axes)))
    out["axes"] = new_axes
    return out


def plan_hdet_load(scheduler, state: Any, override: Optional[bool] = None) -> HDETLoadPlan:
    """Validate a checkpoint's HDET state against ``scheduler`` and work out what loading it will
    set. Modifies nothing; raises :class:`HDETCheckpointError` naming what is wrong."""
    if not isinstance(state, Mapping):
        raise _bad("", f"must be a dict, got {type(state).__name__}")
    version = state.get("version")
    if version is None:
        raise _bad("['version']", "is missing (partial state)")
    if version != HDET_STATE_VERSION:
        raise _bad(f"['version']={version!r}", f"is not supported (expected {HDET_STATE_VERSION})")
    for key in ("window", "num_arms", "dp_size", "controller", "config"):
        if key not in state:
            raise _bad(f"[{key!r}]", "is missing (partial state)")
    window = _require_int(state, "window", "", 0)
    num_arms = _require_int(state, "num_arms", "", 1)
    dp_size = _require_int(state, "dp_size", "", 1)
    if dp_size % num_arms:
        raise _bad("", f"num_arms={num_arms} does not divide dp_size={dp_size}")
    ckpt_config, unknown = _config_from_fingerprint(state["config"])
    controller_state = state["controller"]
    if not isinstance(controller_state, Mapping):
        raise _bad("['controller']", f"must be a dict, got {type(controller_state).__name__}")
    for key in ("num_arms", "window"):
        if key in controller_state and controller_state[key] != (num_arms if key == "num_arms" else window):
            raise _bad(
                f"['controller'][{key!r}]={controller_state[key]!r}",
                f"disagrees with [{key!r}]={num_arms if key == 'num_arms' else window} (corrupted)",
            )
    generator = state.get("generator")
    if generator is not None:
        if not isinstance(generator, Mapping):
            raise _bad("['generator']", "must be a dict")
        if generator.get("window") != window or generator.get("seed") != ckpt_config.seed:
            raise _bad(
                f"['generator']={dict(generator)!r}",
                f"disagrees with window={window} / config seed={ckpt_config.seed} (corrupted)",
            )
    runtime = state.get("runtime")
    if runtime is not None:
        if not isinstance(runtime, Mapping):
            raise _bad("['runtime']", f"must be a dict or None, got {type(runtime).__name__}")
        iteration = _require_int(runtime, "iteration", "['runtime']", 0)
        steps = _require_int(runtime, "steps_in_window", "['runtime']", 0)
        if steps >= ckpt_config.period:
            raise _bad(
                f"['runtime']['steps_in_window']={steps}",
                f"must be < the checkpoint's period {ckpt_config.period} (corrupted)",
            )
        if steps > iteration:
            raise _bad(f"['runtime']['steps_in_window']={steps}", f"exceeds iteration={iteration}")
        if "arm_loss_sums" not in runtime:
            raise _bad("['runtime']['arm_loss_sums']", "is missing (partial state)")
        sums = runtime["arm_loss_sums"]
        if sums is not None:
            if (
                not isinstance(sums, (list, tuple))
                or len(sums) != num_arms
                or not all(_is_number(x) for x in sums)
            ):
                raise _bad(
                    f"['runtime']['arm_loss_sums']={sums!r}",
                    f"must be None or a list of {num_arms} numbers",
                )
            if steps == 0 and any(x != 0 for x in sums):
                raise _bad(f"['runtime']['arm_loss_sums']={list(sums)!r}", "must be 0 at a window start")
        runtime = {"iteration": iteration, "steps_in_window": steps,
                   "arm_loss_sums": None if sums is None else [float(x) for x in sums]}

    # The config the resumed run uses.
    mode = _override_mode(scheduler, override)
    current = scheduler.hdet_config
    config, changed = _merge_config(current, ckpt_config, mode)
    messages: list[str] = []
    if unknown:
        messages.append(f"ignored unknown config field(s) {unknown} from a newer hdet_megatron")
    if changed:
        winner = "this run's values (override)" if mode == "current" else "the checkpoint's values"
        messages.append(
            "HDET config differs from the checkpoint in "
            + ", ".join(f"{k} (checkpoint {ckpt_config.fingerprint()[k]!r}, this run "
                        f"{current.fingerprint()[k]!r})" for k in changed)
            + f": using {winner}"
        )
    structural = [
        k for k in STRUCTURAL_FIELDS if ckpt_config.fingerprint()[k] != current.fingerprint()[k]
    ]
    if structural:
        messages.append(f"{structural} differ from the checkpoint: kept this run's values")

    # The controller, loaded into a scratch object (validates everything it reads).
    dropped: list[str] = []
    ctl_state = controller_state
    if mode == "current" and sorted(a.name for a in config.axes) != sorted(a.name for a in ckpt_config.axes):
        ctl_state = _controller_state_for(config, controller_state, dropped)
        messages.append(
            f"override: axes {[a.name for a in config.axes]} replace the checkpoint's "
            f"{[a.name for a in ckpt_config.axes]}; new axes start at scale 1"
            + (f", dropped {dropped}" if dropped else "")
        )
    controller = AutoController(config, scheduler.layout.num_arms)
    try:
        controller.load_state_dict(ctl_state)
    except (ValueError, KeyError, TypeError) as exc:
        raise _bad("['controller']", str(exc)) from None
    if controller.window != window:
        raise _bad(f"['controller']['window']={controller.window}", f"disagrees with window={window}")

    plan = HDETLoadPlan(config=config, controller=controller, window=window, runtime=runtime,
                        config_changed=config is not current, messages=messages)
    layout = scheduler.layout
    if num_arms != layout.num_arms or dp_size != layout.dp_size:
        plan.layout_changed = True
        discarded = runtime["steps_in_window"] if runtime else 0
        messages.append(
            f"checkpoint has {num_arms} arm(s) over DP {dp_size}, this run {layout.num_arms} "
            f"arm(s) over DP {layout.dp_size}: controller scales kept "
            f"{controller.scales()}, windows restarted (window {window} starts now"
            + (f"; the {discarded} step(s) of the partial window are discarded" if discarded else "")
            + ")"
        )
        if runtime is not None:
            runtime.update(steps_in_window=0, arm_loss_sums=[0.0] * layout.num_arms)
    elif runtime is not None and runtime["arm_loss_sums"] is None:
        if runtime["steps_in_window"]:
            messages.append(
                f"the checkpoint was written mid-window without its window losses (no "
                f"prepare_save()): the partial window's {runtime['steps_in_window']} step(s) are "
                "discarded and a new window starts now"
            )
        runtime.update(steps_in_window=0, arm_loss_sums=[0.0] * layout.num_arms)
    return plan


def apply_hdet_load(scheduler, plan: HDETLoadPlan) -> None:
    """Commit a validated :class:`HDETLoadPlan` (cannot fail half-way on bad data)."""
    runtime = scheduler.hdet_runtime
    if plan.config_changed:
        scheduler.hdet_config = plan.config
        if runtime is not None:
            runtime.config = plan.config
            module_axes = getattr(runtime, "module_axes", None)
            if module_axes is not None and isinstance(getattr(module_axes, "axes", None), dict):
                for name in list(module_axes.axes):
                    module_axes.axes[name] = plan.config.axis(name)
    scheduler.controller = plan.controller
    for message in plan.messages:
        logger.warning("HDET resume: %s", message)
    if plan.runtime is not None:
        if runtime is not None:
            _apply_runtime(runtime, plan.runtime)
            scheduler._hdet_pending_runtime = None
        else:
            scheduler._hdet_pending_runtime = dict(plan.runtime)
    scheduler.set_window(plan.window)  # also re-applies the module axes of the runtime


def _apply_runtime(runtime, values: Mapping) -> None:
    sums = values["arm_loss_sums"]
    layout = runtime.layout
    local = float(sums[layout.arm]) if (sums is not None and layout.is_last_stage) else 0.0
    runtime.iteration = int(values["iteration"])
    runtime.steps_in_window = int(values["steps_in_window"])
    runtime._loss_sum.fill_(local)
    # The loaded position can be saved again as is (until the next step).
    runtime._save_snapshot = (runtime.iteration, list(sums)) if sums is not None else None


def load_runtime_state(runtime, state: Any) -> None:
    """``HDET.load_runtime_state_dict``: validate, then set iteration and window position."""
    if not isinstance(state, Mapping):
        raise _bad("['runtime']", f"must be a dict, got {type(state).__name__}")
    iteration = _require_int(state, "iteration", "['runtime']", 0)
    steps = _require_int(state, "steps_in_window", "['runtime']", 0)
    if "arm_loss_sums" not in state:
        raise _bad("['runtime']['arm_loss_sums']", "is missing (partial state)")
    sums = state["arm_loss_sums"]
    num_arms = runtime.layout.num_arms
    if sums is not None and (
        not isinstance(sums, (list, tuple)) or len(sums) != num_arms or not all(_is_number(x) for x in sums)
    ):
        raise _bad(f"['runtime']['arm_loss_sums']={sums!r}", f"must be None or {num_arms} numbers")
    if sums is None:
        steps, sums = 0, [0.0] * num_arms
    _apply_runtime(runtime, {"iteration": iteration, "steps_in_window": steps, "arm_loss_sums": sums})


def runtime_state_dict(runtime) -> dict:
    """``HDET.runtime_state_dict``: iteration and window position, the same on every rank.

    ``arm_loss_sums`` holds, per arm, the partial window's loss sum: zeros at a window start, the
    values :func:`prepare_save` gathered at this iteration mid-window, else None (a resume then
    restarts the partial window).
    """
    steps = int(runtime.steps_in_window)
    sums = None
    if steps == 0:
        sums = [0.0] * runtime.layout.num_arms
    else:
        snapshot = getattr(runtime, "_save_snapshot", None)
        if snapshot is not None and snapshot[0] == runtime.iteration:
            sums = list(snapshot[1])
    return {"iteration": int(runtime.iteration), "steps_in_window": steps, "arm_loss_sums": sums}


def reset_for_plain_checkpoint(scheduler) -> None:
    """A checkpoint without HDET state: controller at scale 1, window 0, empty window."""
    scheduler.controller = AutoController(scheduler.hdet_config, scheduler.layout.num_arms)
    runtime = scheduler.hdet_runtime
    logger.warning(
        "HDET resume: the checkpoint has no HDET state (plain Megatron run): the controller "
        "starts at scale 1 with window 0 from the checkpoint's iteration"
    )
    if runtime is not None:
        runtime.steps_in_window = 0
        runtime._loss_sum.zero_()
        runtime._save_snapshot = None
    scheduler._hdet_pending_runtime = None
    scheduler.set_window(0)


def load_scheduler_state(
    scheduler, state_dict: Mapping, parent_load, override: Optional[bool] = None
) -> None:
    """``HDETOptimizerParamScheduler.load_state_dict``: validate HDET state, then Megatron's
    fields (``parent_load``), then commit HDET state."""
    if not isinstance(state_dict, Mapping):
        raise HDETCheckpointError(
            f"scheduler state must be a dict, got {type(state_dict).__name__}; nothing was loaded"
        )
    state_dict = dict(state_dict)
    hdet_state = state_dict.pop(HDET_STATE_KEY, None)
    plan = plan_hdet_load(scheduler, hdet_state, override) if hdet_state is not None else None
    parent_load(state_dict)
    if plan is None:
        reset_for_plain_checkpoint(scheduler)
    else:
        apply_hdet_load(scheduler, plan)


def attach_runtime(scheduler, runtime) -> None:
    """Called when an HDET runtime attaches to ``scheduler``: hands it a position that was loaded
    before it existed."""
    pending = getattr(scheduler, "_hdet_pending_runtime", None)
    if runtime is not None and pending is not None:
        _apply_runtime(runtime, pending)
        scheduler._hdet_pending_runtime = None


_WARNED: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key in _WARNED:
        return
    _WARNED.add(key)
    logger.warning(message)


def strip_hdet_state(scheduler_state: Mapping) -> dict:
    """The scheduler state without HDET's key, for a plain ``OptimizerParamScheduler`` (which
    would ignore it anyway). Warns once per process when there was one."""
    state = dict(scheduler_state)
    if state.pop(HDET_STATE_KEY, None) is not None:
        _warn_once(
            "plain-scheduler",
            "the checkpoint was written by an HDET run: its HDET state (key 'hdet' of "
            "opt_param_scheduler) is ignored by this plain OptimizerParamScheduler; the model is "
            "the converged (averaged) one and training continues without HDET",
        )
    return state


# ---------------------------------------------------------------------------------------------
# Save side
# ---------------------------------------------------------------------------------------------


def prepare_save(hdet) -> Optional[Any]:
    """Make ``hdet``'s state checkpointable. Collective: call on every rank before a save.

    With ``converge_on_save`` (default) and a partial window, converges now (a forced converge:
    the controller updates from the partial window and a new window starts) and returns its
    :class:`WindowMetrics`. Without it, replicas stay diverged (a warning says the saved model
    mixes arms) and the partial window's per-arm loss sums are gathered so that the checkpoint
    can carry them. Returns None when nothing had to be done.
    """
    if hdet is None or hdet.steps_in_window == 0:
        return None
    if hdet.config.converge_on_save:
        return hdet.converge()
    _warn_once(
        "mid-window-save",
        "HDET: saving mid-window with converge_on_save=False: the arms' replicas differ and "
        "Megatron stores replicated tensors from one DP rank (dist_checkpointing: spread over DP "
        "ranks), so the saved model mixes arms",
    )
    layout = hdet.layout
    buf = torch.zeros(2 * layout.num_arms, dtype=torch.float64, device=hdet._loss_sum.device)
    if layout.is_loss_reporter:
        buf[layout.arm] = hdet._loss_sum
        buf[layout.num_arms + layout.arm] = 1.0
    dist.all_reduce(buf, group=layout.loss_group)
    values = buf.tolist()
    sums = [s / c if c > 0 else 0.0 for s, c in zip(values[: layout.num_arms], values[layout.num_arms :])]
    hdet._save_snapshot = (hdet.iteration, sums)
    return None


def _save_warnings(hdet) -> None:
    if hdet is not None and hdet.config.grad_sync == "arm" and hdet.layout.num_arms > 1:
        _warn_once(
            "arm-optimizer-state",
            "HDET grad_sync='arm': each arm has its own optimizer moments, but a Megatron "
            "checkpoint keeps one DP replica's optimizer state; after a resume every arm "
            "continues from the same moments (the parameters are exact)",
        )


def checkpoint_dir(root: str, iteration: int) -> str:
    """Megatron-LM's layout: ``<root>/iter_0000010``."""
    return os.path.join(root, f"iter_{int(iteration):07d}")


def _legacy_file(ckpt_dir: str) -> str:
    tp = ps.get_tensor_model_parallel_rank()
    pp = ps.get_pipeline_model_parallel_rank()
    name = f"mp_rank_{tp:02d}"
    if ps.get_pipeline_model_parallel_world_size() > 1:
        name += f"_{pp:03d}"
    return os.path.join(ckpt_dir, name, LEGACY_FILE)


def _unwrap(chunk):
    """The module inside Megatron DDP (checkpoint keys without the ``module.`` prefix, as in
    Megatron-LM checkpoints)."""
    return getattr(chunk, "module", chunk)


def _model_key(model: Sequence, i: int) -> str:
    return "model" if len(model) == 1 else f"model{i}"


def _sub_optimizers(optimizer) -> list:
    return [s for s in (getattr(optimizer, "chained_optimizers", None) or [optimizer])
            if not getattr(s, "is_stub_optimizer", False)]


def _is_distopt(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(s, DistributedOptimizer) for s in _sub_optimizers(optimizer))


def _layout_meta() -> dict:
    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
    }


def _rng_state() -> dict:
    import numpy as np

    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "random": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)),
        "torch": torch.get_rng_state(),
        "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: Mapping) -> None:
    import numpy as np

    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["random"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(dict(state["tracker"]))


def _sharded_metadata(sharding_type: str) -> dict:
    return {
        "distrib_optim_sharding_type": sharding_type,
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True),
    }


def _model_sharded_state_dict(model: Sequence, metadata: dict) -> dict:
    return {
        _model_key(model, i): _unwrap(chunk).sharded_state_dict(metadata=metadata)
        for i, chunk in enumerate(model)
    }


def _rng_sharded_object(data) -> Any:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    meta = _layout_meta()
    return ShardedObject(
        "rng_state",
        data,
        (meta["pp"], meta["tp"], meta["dp"]),
        (
            ps.get_pipeline_model_parallel_rank(),
            ps.get_tensor_model_parallel_rank(),
            ps.get_data_parallel_rank(),
        ),
        replica_id=0,
    )


def _sync_write_queue() -> None:
    """dist_checkpointing's writer reports results through a ``multiprocessing.Manager`` queue,
    which a daemonic process (e.g. a multiprocessing worker rank) cannot start. A synchronous save
    only needs an in-process queue."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if multiprocessing.current_process().daemon and filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


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
) -> Optional[Any]:
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
    if dist.get_rank() == 0:
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
        with open(os.path.join(root, TRACKER_FILE), "w") as f:
            f.write(str(int(iteration)))
    dist.barrier()
    return metrics


def _save_dist(ckpt_dir, model, optimizer, common, rng, sharding_type) -> None:
    from megatron.core import dist_checkpointing

    metadata = _sharded_metadata(sharding_type)
    state = _model_sharded_state_dict(model, metadata)
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=False, metadata=metadata)
    state.update(common)
    if rng is not None:
        state["rng_state"] = _rng_sharded_object(rng)
    _sync_write_queue()
    dist_checkpointing.save(
        state, ckpt_dir, preprocess_common_before_consistancy_check=_without_arm_values
    )


#: Param-group entries HDET sets per arm: they differ across DP ranks by design (rank 0's copy is
#: written; the scheduler state rewrites them on load).
_ARM_GROUP_KEYS = ("lr", "weight_decay")


def _without_arm_values(common: Mapping) -> dict:
    """The common state as compared across ranks by dist_checkpointing's consistency check,
    without the per-arm ``lr``/``weight_decay`` of the optimizer's param groups."""
    out = dict(common)
    optim = out.get("optimizer")

    def strip(groups):
        return [{k: v for k, v in g.items() if k not in _ARM_GROUP_KEYS} if isinstance(g, Mapping) else g
                for g in groups]

    def walk(node):
        if isinstance(node, Mapping):
            return {k: (strip(v) if k == "param_groups" and isinstance(v, list) else walk(v))
                    for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    if optim is not None:
        out["optimizer"] = walk(optim)
    return out


def _distopt_param_state(optimizer) -> list:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return [
        s.get_parameter_state_dp_reshardable() if isinstance(s, DistributedOptimizer) else None
        for s in _sub_optimizers(optimizer)
    ]


def _distopt_file(ckpt_dir: str) -> str:
    return os.path.join(
        os.path.dirname(_legacy_file(ckpt_dir)), f"distrib_optim_dp{ps.get_data_parallel_rank():03d}.pt"
    )


def _save_legacy(ckpt_dir, model, optimizer, common, rng) -> None:
    dp_group = ps.get_data_parallel_group(with_context_parallel=True)
    rng_all = None
    if rng is not None:
        rng_all = [None] * dist.get_world_size(dp_group)
        dist.all_gather_object(rng_all, rng, group=dp_group)
    distopt = optimizer is not None and _is_distopt(optimizer)
    path = _legacy_file(ckpt_dir)
    if distopt:
        # Like Megatron-LM's distrib_optim.pt, but one file per DP rank (no gather to DP rank 0:
        # megatron-core's gather path needs CUDA); resumable with the same DP layout.
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save({"param_state": _distopt_param_state(optimizer),
                    "layout": _layout_meta()}, _distopt_file(ckpt_dir))
    if ps.get_data_parallel_rank(with_context_parallel=True) != 0:
        return
    state = dict(common)
    for i, chunk in enumerate(model):
        state[_model_key(model, i)] = _unwrap(chunk).state_dict_for_save_checkpoint()
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    if rng_all is not None:
        state["rng_state"] = rng_all
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# Load side
# ---------------------------------------------------------------------------------------------


def _resolve_dir(root: str, iteration: Optional[int]) -> tuple[str, int]:
    if iteration is None:
        tracker = os.path.join(root, TRACKER_FILE)
        if not os.path.exists(tracker):
            raise FileNotFoundError(f"no checkpoint in {root!r} ({TRACKER_FILE} is missing)")
        with open(tracker) as f:
            text = f.read().strip()
        try:
            iteration = int(text)
        except ValueError:
            raise HDETCheckpointError(f"{tracker} holds {text!r}, not an iteration") from None
    ckpt_dir = checkpoint_dir(root, iteration)
    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"checkpoint directory {ckpt_dir!r} does not exist")
    return ckpt_dir, iteration


def _detect_format(ckpt_dir: str) -> str:
    from megatron.core import dist_checkpointing

    if dist_checkpointing.check_is_distributed_checkpoint(ckpt_dir):
        return "torch_dist"
    if any(name.startswith("mp_rank_") for name in os.listdir(ckpt_dir)):
        return "torch"
    raise HDETCheckpointError(f"{ckpt_dir!r} is neither a torch_dist nor a legacy Megatron checkpoint")


def _read_common(ckpt_dir: str, fmt: str) -> dict:
    """The non-tensor part of a checkpoint (legacy: this rank's whole file)."""
    if fmt == "torch_dist":
        from megatron.core import dist_checkpointing

        return dist_checkpointing.load_common_state_dict(ckpt_dir)
    path = _legacy_file(ckpt_dir) if ps.model_parallel_is_initialized() else None
    if path is None or not os.path.exists(path):
        candidates = sorted(
            os.path.join(ckpt_dir, d, LEGACY_FILE) for d in os.listdir(ckpt_dir) if d.startswith("mp_rank_")
        )
        if path is not None or not candidates:
            raise FileNotFoundError(f"legacy checkpoint file {path or ckpt_dir!r} does not exist")
        path = candidates[0]
    return torch.load(path, map_location="cpu", weights_only=False)


def read_checkpoint_hdet_state(root: str, iteration: Optional[int] = None) -> Optional[dict]:
    """The HDET state stored in a checkpoint (None for a plain Megatron checkpoint)."""
    ckpt_dir, _ = _resolve_dir(root, iteration)
    common = _read_common(ckpt_dir, _detect_format(ckpt_dir))
    sched = common.get("opt_param_scheduler") or {}
    return sched.get(HDET_STATE_KEY) if isinstance(sched, Mapping) else None


def checkpoint_hdet_config(root: str, iteration: Optional[int] = None) -> Optional[HDETConfig]:
    """The HDETConfig a checkpoint was written with (None for a plain Megatron checkpoint): build
    the resumed run with it to change nothing (like Megatron-LM's ``--use-checkpoint-args``)."""
    state = read_checkpoint_hdet_state(root, iteration)
    if state is None:
        return None
    if not isinstance(state, Mapping) or "config" not in state:
        raise _bad("['config']", "is missing (partial state)")
    return _config_from_fingerprint(state["config"])[0]


_TORCH_ADAM = (torch.optim.Adam, torch.optim.AdamW)


def init_optimizer_state_for_load(optimizer) -> None:
    """A fresh ``DistributedOptimizer`` over torch's Adam/AdamW cannot build its loading sharded
    state dict (``state_dict()`` asserts one per-param ``step``): allocate the state first, as
    the first optimizer step would."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for sub in _sub_optimizers(optimizer):
        inner = sub.optimizer
        if not isinstance(sub, DistributedOptimizer) or not isinstance(inner, _TORCH_ADAM):
            continue
        if sub.init_state_fn is not None:
            sub.init_state_fn(inner, sub.config)
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                state.setdefault("exp_avg", torch.zeros_like(p))
                state.setdefault("exp_avg_sq", torch.zeros_like(p))
                state.setdefault("step", torch.tensor(0.0))


def restore_adam_steps(optimizer) -> None:
    """After ``DistributedOptimizer.load_state_dict`` torch Adam's per-param ``step`` is one
    tensor shared by every param (so each step adds n_params to it) and the ``dp_reshardable``
    param state then overwrites it with a stale value: give every param its own ``step`` from
    the loaded param groups (where megatron keeps the true value)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for sub in _sub_optimizers(optimizer):
        inner = sub.optimizer
        if not isinstance(sub, DistributedOptimizer) or not isinstance(inner, _TORCH_ADAM):
            continue
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for p in group["params"]:
                if "step" in inner.state[p]:
                    inner.state[p]["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)


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
_MEGATRON_CHECKED = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style",
                     "start_wd", "end_wd", "wd_incr_steps", "wd_incr_style")


def _precheck_megatron_scheduler(scheduler, state: Mapping, ckpt_dir: str) -> None:
    """Megatron's scheduler load fails on a mismatch in strict mode; fail before any tensor is
    loaded instead of after."""
    if getattr(scheduler, "override_opt_param_scheduler", False) or getattr(
        scheduler, "use_checkpoint_opt_param_scheduler", True
    ):
        return
    diffs = [f"{k}: checkpoint {state[k]!r} vs this run {getattr(scheduler, k)!r}"
             for k in _MEGATRON_CHECKED if k in state and hasattr(scheduler, k)
             and state[k] != getattr(scheduler, k)]
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
    iteration: Optional[int] = None,
    format: Optional[str] = None,
    override_hdet_config: Optional[bool] = None,
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

    HDET state is validated before anything is modified (:class:`HDETCheckpointError`).
    """
    from hdet_megatron.megatron.scheduler import HDETOptimizerParamScheduler

    ckpt_dir, iteration = _resolve_dir(root, iteration)
    fmt = format or _detect_format(ckpt_dir)
    if fmt not in ("torch_dist", "torch"):
        raise ValueError(f"format={format!r} must be 'torch_dist' or 'torch' (legacy)")
    common = _check_common(_read_common(ckpt_dir, fmt), ckpt_dir)
    sched_state = common.get("opt_param_scheduler")
    is_hdet = isinstance(scheduler, HDETOptimizerParamScheduler)
    if hdet is None and is_hdet:
        hdet = scheduler.hdet_runtime
    # 1. Validate HDET state first: a bad one must not leave a half-loaded model behind.
    if is_hdet and sched_state is not None and HDET_STATE_KEY in sched_state:
        plan_hdet_load(scheduler, sched_state[HDET_STATE_KEY], override_hdet_config)
    if scheduler is not None and sched_state is None:
        raise HDETCheckpointError(f"{ckpt_dir}: checkpoint has no 'opt_param_scheduler'; nothing was loaded")
    if scheduler is not None:
        _precheck_megatron_scheduler(scheduler, sched_state, ckpt_dir)
    saved_layout = (common.get("hdet_checkpoint") or {}).get("layout")
    same_layout = saved_layout == _layout_meta()

    # 2. Tensors.
    with torch.no_grad():
        if fmt == "torch_dist":
            loaded = _load_dist_tensors(
                ckpt_dir, model, optimizer if load_optimizer else None,
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

    # 3. Scheduler (+ HDET state).
    if scheduler is not None:
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
            rng = rng[ps.get_data_parallel_rank()] if same_layout else None
        if rng is not None:
            _set_rng_state(rng)
        elif "rng_state" in common or fmt == "torch_dist":
            logger.info("RNG state not restored (parallel layout changed or not saved)")
    if hdet is not None and getattr(hdet, "rollback", None) is not None and hdet.steps_in_window == 0:
        hdet.rollback.save()  # the loaded (converged) params are the rollback point
    return iteration


def _load_dist_tensors(ckpt_dir, model, optimizer, load_rng: bool, sharding_type: str) -> dict:
    from megatron.core import dist_checkpointing

    metadata = _sharded_metadata(sharding_type)
    state = _model_sharded_state_dict(model, metadata)
    if optimizer is not None:
        init_optimizer_state_for_load(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=True, metadata=metadata)
    if load_rng:
        state["rng_state"] = _rng_sharded_object(None)
    return dist_checkpointing.load(state, ckpt_dir)


def _load_legacy_distopt(ckpt_dir: str, optimizer) -> None:
    path = _distopt_file(ckpt_dir)
    if not os.path.exists(path):
        raise HDETCheckpointError(
            f"{path} is missing: legacy distributed-optimizer checkpoints need the same DP layout "
            "(use format='torch_dist' to change it)"
        )
    data = torch.load(path, map_location="cpu", weights_only=False)
    if data.get("layout") != _layout_meta():
        raise HDETCheckpointError(
            f"{path} was written with layout {data.get('layout')}, this run is {_layout_meta()}: "
            "legacy distributed-optimizer checkpoints need the same layout (use torch_dist)"
        )
    subs = _sub_optimizers(optimizer)
    if len(data["param_state"]) != len(subs):
        raise HDETCheckpointError(
            f"{path} holds {len(data['param_state'])} optimizer states, this run has {len(subs)}"
        )
    for sub, param_state in zip(subs, data["param_state"]):
        if param_state is not None:
            _set_distopt_param_state(sub, param_state, path)


def _set_distopt_param_state(sub, state, path: str) -> None:
    """Inverse of ``DistributedOptimizer.get_parameter_state_dp_reshardable`` for this rank's own
    shards (``load_parameter_state_from_dp_reshardable`` expects the padded torch_dist layout)."""
    if state.get("per_bucket_numel_unpadded") != sub.per_bucket_numel_unpadded:
        raise HDETCheckpointError(f"{path}: optimizer buckets differ from this run's (model changed?)")
    for gbuf_idx, gbuf_range_maps in enumerate(sub.gbuf_ranges):
        for dtype, range_maps in gbuf_range_maps.items():
            for bucket_idx, range_map in enumerate(range_maps):
                bucket_state = state[gbuf_idx][dtype][bucket_idx]
                if len(bucket_state) != len(range_map["param_map"]):
                    raise HDETCheckpointError(f"{path}: bucket {bucket_idx} does not match this run's")
                for tensors, model_param in zip(bucket_state, range_map["param_map"]):
                    sub._set_main_param_and_optimizer_states(model_param, tensors)
