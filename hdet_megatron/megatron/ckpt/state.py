"""HDET's checkpoint state: the ``"hdet"`` entry of the scheduler state, the runtime's window
position, save preparation.

HDET's own state (controller scales and velocities, window index = position of the counter-based
permutation generator, iteration, steps in the window, the partial window's per-arm loss sums,
the checkpoint's DP size and arm count, and the config fingerprint) is plain data under the key
``"hdet"`` of the scheduler state (``HDETOptimizerParamScheduler.state_dict()``). It is the same
on every rank. Importing this module does not import megatron.core.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from hdet_megatron.config import HDETConfig, HDETConfigError

logger = logging.getLogger("hdet_megatron.megatron.checkpointing")  # one logger for all of checkpointing

#: Key of HDET's state inside the scheduler state (``opt_param_scheduler``).
HDET_STATE_KEY = "hdet"


HDET_STATE_VERSION = 1


#: Config fields that always come from the running job: they are tied to process groups, grad
#: hooks and optimizer instances that already exist when a checkpoint is loaded.
STRUCTURAL_FIELDS = ("arms", "grad_sync", "bucket_mb")


class HDETCheckpointError(ValueError):
    """A checkpoint's HDET state is corrupted, partial or incompatible; the message names the
    entry. Raised before anything is modified."""


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


def _apply_runtime(runtime, values: Mapping) -> None:
    sums = values["arm_loss_sums"]
    layout = runtime.layout
    local = float(sums[layout.arm]) if (sums is not None and layout.is_last_stage) else 0.0
    runtime.iteration = int(values["iteration"])
    # The loaded position can be saved again as is (until the next step).
    runtime._save_snapshot = (runtime.iteration, list(sums)) if sums is not None else None
    # signal="line"/"average": the loaded params start the update line (checkpoints load the
    # model before the scheduler state, as Megatron's load_checkpoint does).
    runtime.load_window(int(values["steps_in_window"]), local)


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


def prepare_save(hdet) -> Any | None:
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
    buf = torch.zeros(2 * layout.num_arms, dtype=torch.float64, device=hdet.device)
    if layout.is_loss_reporter:
        buf[layout.arm] = hdet.engine.losses.total()
        buf[layout.num_arms + layout.arm] = 1.0
    dist.all_reduce(buf, group=layout.loss_group)
    values = buf.tolist()
    sums = [
        s / c if c > 0 else 0.0
        for s, c in zip(values[: layout.num_arms], values[layout.num_arms :], strict=True)
    ]
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
