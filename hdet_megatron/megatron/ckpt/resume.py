"""The resume rules: validate a checkpoint's HDET state against this run, then apply it.

* HDET checkpoint -> HDET run: continues exactly (bit-identical on CPU).
* plain Megatron checkpoint (no ``"hdet"``) -> HDET run: controller at scale 1, window 0, from
  the checkpoint's iteration.
* HDET checkpoint -> plain ``OptimizerParamScheduler``: Megatron ignores the extra key;
  :func:`~hdet_megatron.megatron.checkpointing.load_checkpoint` /
  :func:`~hdet_megatron.megatron.ckpt.state.strip_hdet_state` warn once.
* different DP size or arm count: controller scales (and velocities) kept, the partial window is
  discarded and a new window starts at the resume iteration (logged); the window counter goes on.
* changed HDET config: the checkpoint's values win (Megatron's default
  ``use_checkpoint_opt_param_scheduler=True``) unless overridden (``override_opt_param_scheduler``
  or ``override_hdet_config=True``: this run's values win); with neither flag a mismatch is an
  error, as in Megatron. ``arms``, ``grad_sync`` and ``bucket_mb`` always come from this run
  (they are tied to the process groups and optimizer instances already built).
* corrupted or partial HDET state: :class:`HDETCheckpointError` naming what is wrong, raised
  before anything (scheduler, controller, runtime, model, optimizer) is modified.

Used by ``HDETOptimizerParamScheduler.load_state_dict``; imports neither the scheduler nor
megatron.core.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hdet_megatron.config import HDETConfig
from hdet_megatron.controller import AutoController
from hdet_megatron.megatron.ckpt.state import (
    HDET_STATE_KEY,
    HDET_STATE_VERSION,
    STRUCTURAL_FIELDS,
    HDETCheckpointError,
    _apply_runtime,
    _bad,
    _config_from_fingerprint,
    _is_number,
    _require_int,
    logger,
)


@dataclass
class HDETLoadPlan:
    """Everything a load will set, computed and validated before anything is modified."""

    config: HDETConfig
    controller: AutoController
    """A fresh controller with the checkpoint's state already loaded (becomes the live one)."""
    window: int
    runtime: dict | None
    """``iteration``, ``steps_in_window``, ``arm_loss_sums`` (validated), or None when the
    checkpoint has no runtime state (scheduler saved without an HDET runtime)."""
    config_changed: bool = False
    layout_changed: bool = False
    messages: list[str] = field(default_factory=list)


def _override_mode(scheduler, override: bool | None) -> str:
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
    ckpt_axes = [a.name for a in ckpt.resolved_axes]
    if sorted(ckpt_axes) != sorted(a.name for a in current.resolved_axes):
        raise HDETCheckpointError(
            f"the checkpoint explores axes {ckpt_axes}, this run {[a.name for a in current.resolved_axes]}; "
            "axes cannot change once HDET is built. Build with the checkpoint's config "
            "(hdet_megatron.megatron.checkpointing.checkpoint_hdet_config(path)) or pass "
            "override_hdet_config=True to keep this run's axes; nothing was loaded"
        )
    merged = ckpt_fp
    for key in STRUCTURAL_FIELDS:
        merged[key] = cur_fp[key]
    # Not in fingerprints (how the converge runs, not what it computes): always this run's.
    return dataclasses.replace(
        HDETConfig.from_fingerprint(merged), home_main_params=current.home_main_params
    ), changed


def _controller_state_for(config: HDETConfig, state: Mapping, dropped: list[str]) -> dict:
    """Controller state restricted to ``config``'s axes (new axes start fresh)."""
    out = dict(state)
    axes = state.get("axes")
    if not isinstance(axes, Mapping):
        return out
    new_axes = {}
    for axis in config.resolved_axes:
        if axis.name in axes:
            new_axes[axis.name] = axes[axis.name]
        else:
            new_axes[axis.name] = {"scale": 0.0 if axis.additive else 1.0, "velocity": 0.0}
    dropped.extend(sorted(set(axes) - set(new_axes)))
    out["axes"] = new_axes
    return out


def plan_hdet_load(scheduler, state: Any, override: bool | None = None) -> HDETLoadPlan:
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
        runtime = {
            "iteration": iteration,
            "steps_in_window": steps,
            "arm_loss_sums": None if sums is None else [float(x) for x in sums],
        }

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
            + ", ".join(
                f"{k} (checkpoint {ckpt_config.fingerprint()[k]!r}, this run {current.fingerprint()[k]!r})"
                for k in changed
            )
            + f": using {winner}"
        )
    structural = [k for k in STRUCTURAL_FIELDS if ckpt_config.fingerprint()[k] != current.fingerprint()[k]]
    if structural:
        messages.append(f"{structural} differ from the checkpoint: kept this run's values")

    # The controller, loaded into a scratch object (validates everything it reads).
    dropped: list[str] = []
    ctl_state = controller_state
    if mode == "current" and sorted(a.name for a in config.resolved_axes) != sorted(
        a.name for a in ckpt_config.resolved_axes
    ):
        ctl_state = _controller_state_for(config, controller_state, dropped)
        messages.append(
            f"override: axes {[a.name for a in config.resolved_axes]} replace the checkpoint's "
            f"{[a.name for a in ckpt_config.resolved_axes]}; new axes start at scale 1"
            + (f", dropped {dropped}" if dropped else "")
        )
    controller = AutoController(config, scheduler.layout.num_arms)
    try:
        controller.load_state_dict(ctl_state)
    except (ValueError, KeyError, TypeError) as exc:
        raise _bad("['controller']", str(exc)) from None
    if controller.window != window:
        raise _bad(f"['controller']['window']={controller.window}", f"disagrees with window={window}")

    plan = HDETLoadPlan(
        config=config,
        controller=controller,
        window=window,
        runtime=runtime,
        config_changed=config is not current,
        messages=messages,
    )
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
    elif runtime is not None:
        # No runtime state (saved by a scheduler without a runtime): the loaded params still start
        # the next update line (signal="line"/"average"), not the ones the runtime was built with.
        runtime.mark_window_start()
    scheduler.set_window(plan.window)  # also re-applies the module axes of the runtime


def reset_for_plain_checkpoint(scheduler) -> None:
    """A checkpoint without HDET state: controller at scale 1, window 0, empty window."""
    scheduler.controller = AutoController(scheduler.hdet_config, scheduler.layout.num_arms)
    runtime = scheduler.hdet_runtime
    logger.warning(
        "HDET resume: the checkpoint has no HDET state (plain Megatron run): the controller "
        "starts at scale 1 with window 0 from the checkpoint's iteration"
    )
    if runtime is not None:
        runtime._save_snapshot = None
        # The loaded params start the first window's update line (signal="line"/"average");
        # checkpoints load the model before the scheduler state, as Megatron's load_checkpoint.
        runtime.load_window(0, 0.0)
    scheduler._hdet_pending_runtime = None
    scheduler.set_window(0)


def load_scheduler_state(scheduler, state_dict: Mapping, parent_load, override: bool | None = None) -> None:
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
