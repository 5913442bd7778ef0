"""What the ``megatron.training`` patch calls: HDET inside Megatron-LM's own training loop.

``patches/megatron-core-0.19.2/`` patches the ``megatron/training/`` package that ships in the
megatron-core 0.19.2 wheel. The patch only *calls* the functions here (one line per call site);
all logic lives in this module:

============================================  ==================================================
patched site (``megatron/training/...``)      call
============================================  ==================================================
``arguments.add_megatron_arguments``          :func:`add_arguments` (the ``--hdet-*`` flags of
                                              :mod:`hdet_megatron.args`)
``training.pretrain`` (first statement)       :func:`on_pretrain_start` (validates the flags)
``training.get_optimizer_param_scheduler``    :func:`make_opt_param_scheduler` (an
                                              :class:`HDETOptimizerParamScheduler`)
``training.setup_model_and_optimizer``        :func:`on_setup` (builds :class:`HDET` before the
                                              checkpoint is loaded)
``training.train_step`` (first statement)     :func:`on_train_step_start` (what the probe runs
                                              with: ``train_step``'s own arguments)
``training.train_step`` (after the LR step)   :func:`on_train_step` (per-microbatch losses,
                                              before Megatron's DP reduction)
``checkpointing.save_checkpoint`` (start)     :func:`before_save_checkpoint` (converge first)
============================================  ==================================================

The controller/window state travels inside ``opt_param_scheduler.state_dict()["hdet"]``, which
Megatron saves and loads itself (legacy ``torch`` checkpoints and the common state of
``torch_dist`` checkpoints). The probe signals (``--hdet-signal probe``, ``line``, ``average``)
score the arms on the next training batches, read ahead of the training stream and run through
Megatron's own ``forward_backward_func(forward_only=True)``
(:class:`~hdet_megatron.megatron.training_probe.TrainingLoopProbe`). Per-arm metrics (and the
line fit of ``line``/``average``) are printed on rank 0 at every converge and written to
Megatron's TensorBoard and W&B writers (``hdet/...``).

With ``--no-hdet`` every hook is a no-op and the loop is Megatron's own (a plain
``OptimizerParamScheduler``).

Importing this module must stay cheap and must not import ``megatron.training`` (the patched
``megatron.training`` modules import it while they load).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from hdet_megatron.args import add_hdet_args, hdet_config_from_args
from hdet_megatron.config import HDETConfig, HDETConfigError, short_run_caution

logger = logging.getLogger(__name__)

#: The megatron-core release whose ``megatron/training`` the patch targets.
PATCH_TARGET_VERSION = "0.19.2"
#: Prefix of every log line (tests and users grep for it).
LOG_PREFIX = "[HDET]"


class _State:
    config: HDETConfig | None = None
    runtime: Any = None  # hdet_megatron.megatron.runtime.HDET
    scheduler: Any = None
    probe: Any = None  # hdet_megatron.megatron.training_probe.TrainingLoopProbe
    announced: bool = False  # the current window's per-arm values were printed


_STATE = _State()


def runtime():
    """The :class:`~hdet_megatron.megatron.runtime.HDET` of this process (None with ``--no-hdet``
    or before ``setup_model_and_optimizer``)."""
    return _STATE.runtime


def reset() -> None:
    """Forget this process's HDET objects (tests; a second ``pretrain`` in one process)."""
    if _STATE.runtime is not None:
        _STATE.runtime.close()
    _STATE.config = _STATE.runtime = _STATE.scheduler = _STATE.probe = None
    _STATE.announced = False


def _args():
    from megatron.training.global_vars import get_args

    return get_args()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _print0(message: str) -> None:
    if _rank() == 0:
        print(f"{LOG_PREFIX} {message}", flush=True)


# -- arguments -----------------------------------------------------------------------------------
def add_arguments(parser):
    """``--hdet-*`` flags (``add_megatron_arguments``). Same flags as ``hdet_megatron.args``."""
    return add_hdet_args(parser)


def config_from_args(args) -> HDETConfig | None:
    """The run's :class:`HDETConfig` (None with ``--no-hdet`` or without the flags)."""
    if not hasattr(args, "hdet_period"):
        return None
    config = hdet_config_from_args(args)
    if config is not None and getattr(args, "use_precision_aware_optimizer", False):
        # The runtime refuses it too (HDET._check_optimizer); here it is one line before anything
        # is built.
        raise HDETConfigError(
            "--use-precision-aware-optimizer is not supported by HDET yet (TE's FusedAdam keeps the "
            "fp32 master weights in its own state, which a converge does not reach): drop it, or "
            "train with --no-hdet"
        )
    return config


def on_pretrain_start() -> None:
    """First statement of ``pretrain``: validate the HDET flags before anything is built, and
    make the wheel's dataset-helper build step work (see :func:`use_prebuilt_dataset_helpers`)."""
    reset()
    use_prebuilt_dataset_helpers()
    from hdet_megatron.window import show_notices

    show_notices(LOG_PREFIX)  # HDET's startup notice beside the hook's own lines
    try:
        args = _args()
    except AssertionError:  # args are parsed inside initialize_megatron by older entry points
        return
    _STATE.config = config_from_args(args)


def use_prebuilt_dataset_helpers() -> bool:
    """``initialize_megatron`` runs ``compile_helpers()`` = ``make -C megatron/core/datasets``, but
    the megatron-core wheel ships the built ``helpers_cpp`` extension and no Makefile, so ``make``
    fails and Megatron exits (on GPU machines too). When the extension imports, compiling is
    skipped. Returns True when the wheel's extension is used. Idempotent."""
    from megatron.core.datasets import utils as dataset_utils

    if getattr(dataset_utils.compile_helpers, "_hdet_prebuilt", False):
        return True
    makefile = os.path.join(os.path.dirname(dataset_utils.__file__), "Makefile")
    if os.path.exists(makefile):
        return False  # a source checkout: let Megatron build its helpers as usual
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return False
    upstream = dataset_utils.compile_helpers

    def compile_helpers():
        """Megatron's compile_helpers, skipped: the wheel's prebuilt helpers_cpp is used."""
        return None

    # Markers on the function object (read above and by tests); typeshed's function type has no
    # such attributes.
    compile_helpers._hdet_prebuilt = True  # type: ignore[attr-defined]
    compile_helpers._hdet_upstream = upstream  # type: ignore[attr-defined]
    dataset_utils.compile_helpers = compile_helpers
    return True


# -- setup ---------------------------------------------------------------------------------------
def make_opt_param_scheduler(optimizer, **kwargs):
    """``get_optimizer_param_scheduler``: Megatron's scheduler, or the HDET one (same arguments
    plus the per-arm factors) unless ``--no-hdet``."""
    config = config_from_args(_args())
    _STATE.config = config
    if config is None:
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        return OptimizerParamScheduler(optimizer, **kwargs)
    from hdet_megatron.megatron.scheduler import HDETOptimizerParamScheduler

    scheduler = HDETOptimizerParamScheduler(optimizer, hdet=config, **kwargs)
    _STATE.scheduler = scheduler
    return scheduler


def on_setup(model, optimizer, opt_param_scheduler) -> None:
    """``setup_model_and_optimizer``, right after the scheduler is built and before the checkpoint
    is loaded (so the loaded state reaches the runtime too): build :class:`HDET`."""
    from hdet_megatron.megatron.scheduler import HDETOptimizerParamScheduler

    if not isinstance(opt_param_scheduler, HDETOptimizerParamScheduler):
        return
    from hdet_megatron.megatron.runtime import HDET
    from hdet_megatron.megatron.training_probe import TrainingLoopProbe

    if _STATE.runtime is not None:
        _STATE.runtime.close()
    # A scheduler built with hdet=None has no config: HDET refuses it with an HDETSetupError.
    # Every run gets the probe (it reads nothing until a signal other than "train" calls it):
    # the next training batches through Megatron's forward_backward_func, bound by train_step.
    probe = TrainingLoopProbe(getattr(opt_param_scheduler.hdet_config, "signal", "train"))
    hdet = HDET(opt_param_scheduler.hdet_config, model, optimizer, opt_param_scheduler, probe_fn=probe)  # type: ignore[arg-type]
    _STATE.runtime = hdet
    _STATE.probe = probe
    config = hdet.config
    # HDET resolved the "auto" fields knowing it has a probe (HDETConfig.resolve): the signal the
    # probe serves is the resolved one.
    probe.signal = config.signal
    caution = short_run_caution(config, getattr(_args(), "train_iters", None) or 0)
    if caution:
        _print0(caution)
    layout = hdet.layout
    axes = ", ".join(f"{a.name}:{a.spread:g}" for a in config.resolved_axes)
    _print0(
        f"on: {layout.num_arms} arms over DP {layout.dp_size} ({layout.replicas_per_arm} "
        f"replica(s) per arm), period {config.period}, axes {axes}, grad_sync {config.grad_sync}, "
        f"signal {config.signal}, "
        f"auto {'on from iteration ' + str(config.auto_start) if config.auto else 'off'}, "
        f"converge on save {'on' if config.converge_on_save else 'off'}"
    )
    if layout.num_arms == 1:
        _print0("one arm (data-parallel size 1 or --hdet-arms 1): this is plain training")
    _STATE.announced = False


# -- per step ------------------------------------------------------------------------------------
def on_train_step_start(
    forward_step_func, data_iterator, model, forward_backward_func, p2p_communicator=None, pg_collection=None
) -> None:
    """First statement of ``train_step``, on every rank, with its own arguments: what a window's
    probe (:class:`~hdet_megatron.megatron.training_probe.TrainingLoopProbe`) runs with. Cheap."""
    if _STATE.probe is None:
        return
    _STATE.probe.bind(
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=model,
        forward_backward_func=forward_backward_func,
        p2p_communicator=p2p_communicator,
        pg_collection=pg_collection,
    )


def on_train_step(losses_reduced, iteration: int | None = None):
    """``train_step`` after the optimizer and LR-scheduler steps, on every rank, with what
    ``forward_backward_func`` returned (per-microbatch loss dicts, before the DP reduction).
    Collective once per window (with a probe signal: the probe's forward-only passes too).
    Returns the :class:`WindowMetrics` when a window ended."""
    hdet = _STATE.runtime
    if hdet is None:
        return None
    done = hdet.iteration + 1 if iteration is None else iteration + 1  # 1-based, as Megatron logs
    metrics = hdet.step(losses_reduced)
    if metrics is not None:
        log_window(metrics, done)
    if metrics is not None or not _STATE.announced:
        log_window_start(done + 1)
    return metrics


def before_save_checkpoint(iteration: int, opt_param_scheduler=None):
    """Start of ``save_checkpoint``, on every rank: converge (``converge_on_save``, the default)
    so that the saved model is the arms' average; the controller/window state then goes into the
    scheduler state that Megatron saves. Collective when a window is open."""
    hdet = _STATE.runtime
    if hdet is None or (opt_param_scheduler is not None and opt_param_scheduler is not hdet.scheduler):
        return None
    open_steps = hdet.steps_in_window
    prepare = getattr(hdet, "prepare_save", None)  # hdet_megatron.megatron.checkpointing
    if prepare is not None:
        metrics = prepare()
    else:
        metrics = hdet.converge() if hdet.config.converge_on_save else None
    if metrics is not None:
        log_window(metrics, iteration)
        log_window_start(iteration + 1)
    elif open_steps and not hdet.config.converge_on_save:
        _print0(
            f"save at iteration {iteration} without converge (--no-hdet-converge-on-save): "
            f"{open_steps} step(s) into window {hdet.scheduler.window}, the saved model mixes arms"
        )
    else:
        _print0(f"save at iteration {iteration}: arms already converged")
    return metrics


# -- logging -------------------------------------------------------------------------------------
def arm_lrs() -> list[float] | None:
    """The learning rate each arm's default param group uses now (None without an LR axis)."""
    hdet = _STATE.runtime
    if hdet is None or hdet.config.axis("lr") is None:
        return None
    sched = hdet.scheduler
    base = sched.base_lr()
    return [base * sched.arm_factor("lr", arm) for arm in range(hdet.layout.num_arms)]


def log_window_start(next_iteration: int) -> None:
    """Print (rank 0) the current window's per-arm values, with the LR each arm uses in iteration
    ``next_iteration`` (1-based; call after the scheduler step of ``next_iteration - 1``, where
    Megatron's own log line shows the last rank's arm LR: the same number)."""
    hdet = _STATE.runtime
    if hdet is None:
        return
    _STATE.announced = True
    sched = hdet.scheduler
    parts = [f"window {sched.window}"]
    lrs = arm_lrs()
    if lrs is not None:
        parts.append(
            f"lr per arm at iteration {next_iteration} [" + ", ".join(f"{lr:.6E}" for lr in lrs) + "]"
        )
    for name, per_arm in sched.arm_spread_values().items():
        parts.append(f"{name} spread per arm [" + ", ".join(f"{v:.4f}" for v in per_arm) + "]")
    scales = ", ".join(f"{k}={v:.6f}" for k, v in sched.controller.scales().items())
    parts.append(f"scale {scales}")
    _print0(" | ".join(parts))


def log_window(metrics, iteration: int) -> None:
    """Print one converge on rank 0 and write it to Megatron's TensorBoard / W&B writers."""
    kind = "forced converge (save)" if metrics.forced else "converge"
    losses = ", ".join(f"{x:.4f}" for x in metrics.arm_losses)
    scales = ", ".join(f"{k}={v:.6f}" for k, v in metrics.scales.items())
    line = (
        f"{kind} of window {metrics.window} at iteration {iteration} ({metrics.steps} steps) | "
        f"arm loss [{losses}] | scale {scales} | "
        f"{metrics.converge_seconds * 1e3:.1f} ms, {metrics.converge_bytes / 2**20:.2f} MiB"
    )
    if metrics.excluded:
        line += f" | excluded arms {metrics.excluded} (non-finite loss)"
    signal = _STATE.runtime.config.signal if _STATE.runtime is not None else None
    fit = metrics.line or {}
    if fit:
        # The line signals: arm loss above is each arm's pseudo-loss from this fit.
        line += (
            f" | {signal} line points [" + ", ".join(f"{p:g}" for p in fit.get("points", [])) + "] "
            "loss [" + ", ".join(f"{float(v):.4f}" for v in fit.get("losses", [])) + "] "
            f"slope {float(fit.get('slope', float('nan'))):.4g}"
        )
    elif signal == "probe":
        line += " | probe: arm loss is each arm's loss on the shared probe batch"
    _print0(line)
    scalars = {f"hdet/arm{a}/loss": loss for a, loss in enumerate(metrics.arm_losses)}
    if signal != "train":  # arm loss is the probe's; the window training losses too
        for a, loss in enumerate(metrics.arm_train_losses or []):
            scalars[f"hdet/arm{a}/train_loss"] = loss
    for k, value in enumerate(fit.get("losses", [])):
        scalars[f"hdet/line/point{k}_loss"] = float(value)
    for key in ("slope", "curvature"):
        if key in fit:
            scalars[f"hdet/line/{key}"] = float(fit[key])
    for name, per_arm in metrics.arm_values.items():
        for a, value in enumerate(per_arm):
            scalars[f"hdet/arm{a}/{name}_spread"] = value
    for name, value in metrics.scales.items():
        scalars[f"hdet/scale/{name}"] = value
    scalars["hdet/converge_ms"] = metrics.converge_seconds * 1e3
    _write_scalars(scalars, iteration)


def _write_scalars(scalars: dict, iteration: int) -> None:
    try:
        from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer
    except ImportError:  # pragma: no cover - megatron.training not importable
        return
    writer = get_tensorboard_writer()
    if writer is not None:
        for key, value in scalars.items():
            writer.add_scalar(key, value, iteration)
    wandb_writer = get_wandb_writer()
    if wandb_writer is not None:
        wandb_writer.log(scalars, iteration)
