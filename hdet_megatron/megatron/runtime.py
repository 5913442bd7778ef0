"""``HDET``: the run-time object that drives fan-out, converge and the controller on Megatron.

Call order per iteration (as in Megatron-LM's ``train_step``)::

    losses = forward_backward_func(...)          # per-microbatch loss-function outputs
    update_successful, *_ = optimizer.step()
    scheduler.step(increment)                    # HDETOptimizerParamScheduler
    hdet.step(losses)                            # accumulates; converges every `period` steps

Per step HDET adds device-side tensor adds only (no host sync). Every ``period`` steps the
window engine (:mod:`hdet_megatron.window`, shared with every other runtime) does one tiny
all-reduce of the arms' window losses over the world (so every TP/PP rank computes the same
controller update), runs the controller, averages the optimizer's main params across the
cross-arm group with a :class:`BucketedAverager` and refreshes the model params from them; HDET
then moves the scheduler to the next window's permutation. This module holds Megatron's adapter
to the engine: main params, the reduction over the loss reporters, the model refresh.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hdet_megatron.averaging import (
    AverageStats,
    BucketedAverager,
    GroupedAverager,
    Homer,
    own_storage,
    protect_module_state_dicts,
)
from hdet_megatron.config import HDETConfig
from hdet_megatron.controller import AutoController, ControllerUpdate
from hdet_megatron.line_search import LineSearch
from hdet_megatron.megatron import cpu as _cpu  # noqa: F401
from hdet_megatron.megatron.ckpt import state as ckpt_state
from hdet_megatron.megatron.grad_sync import ArmGradSync
from hdet_megatron.megatron.layout import ArmLayout, HDETSetupError
from hdet_megatron.megatron.module_axes import ModuleAxes
from hdet_megatron.megatron.scheduler import HDETOptimizerParamScheduler
from hdet_megatron.probe import PROBE_RECIPE, BatchProbe, as_probe
from hdet_megatron.window import (
    PROBE_SIGNALS,
    RollbackStore,
    WindowAdapter,
    WindowEnd,
    WindowEngine,
    zero_non_finite_state,
)
from hdet_megatron.window_losses import WindowLosses, reduce_window

from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer

logger = logging.getLogger(__name__)

#: The refusal of Megatron's precision-aware optimizer (one line, says what to do).
PRECISION_AWARE_UNSUPPORTED = (
    "use_precision_aware_optimizer (--use-precision-aware-optimizer) is not supported by HDET yet: "
    "TE's FusedAdam keeps the fp32 master weights in its own state, so a converge would average "
    "only the bf16 copies and the next step would undo it; train without it, or with --no-hdet"
)

#: Keys tried, in order, to find the loss in a loss function's reporting dict.
DEFAULT_LOSS_KEYS = ("lm loss", "loss")


def _window_metrics(end: WindowEnd, scales: dict[str, float], grad_bytes: int | None) -> WindowMetrics:
    """The window engine's record of one window's end, as Megatron's logs show it."""
    return WindowMetrics(
        window=end.window,
        iteration=end.step,
        steps=end.steps,
        arm_losses=end.arm_losses,
        arm_values=end.arm_values,
        excluded=end.excluded,
        update=end.update.to_dict() if end.update is not None else None,
        scales=dict(scales),
        converge_seconds=end.converge_seconds,
        converge_bytes=end.stats.bytes if end.stats is not None else 0,
        forced=end.forced,
        rolled_back=end.rolled_back,
        arm_train_losses=end.train_losses,
        grad_bytes_per_step=None if end.rolled_back else grad_bytes,
        line=end.line.to_dict() if end.line is not None else None,
        probe_seconds=end.probe_seconds,
    )


@dataclass
class WindowMetrics:
    """What happened at one converge (for logging)."""

    window: int
    """Index of the window that just ended."""
    iteration: int
    """HDET iterations done when it ended."""
    steps: int
    """Iterations in the window (``period``, or fewer for a forced converge)."""
    arm_losses: list[float]
    """What the controller compared: with ``signal="train"`` each arm's mean training loss over
    the window (before any DP reduction); with ``"probe"`` each arm's loss on the shared probe
    batch."""
    arm_values: dict[str, list[float]]
    """Per axis: the spread value (multiplier/offset) each arm used in the window."""
    excluded: list[int]
    """Arms excluded from the converge (non-finite loss)."""
    update: dict | None
    """The controller update (``ControllerUpdate.to_dict()``)."""
    scales: dict[str, float]
    """Controller scales after the update."""
    converge_seconds: float
    """Host wall time of the parameter average + model refresh."""
    converge_bytes: int
    """Bytes this rank all-reduced for the average."""
    forced: bool = False
    """Converge requested by :meth:`HDET.converge` (e.g. before a checkpoint save)."""
    rolled_back: bool = False
    """Every arm diverged and the last converged state was restored (``rollback=True``)."""
    arm_train_losses: list[float] | None = None
    """Mean training loss of each arm over the window (equal to ``arm_losses`` with
    ``signal="train"``)."""
    grad_bytes_per_step: int | None = None
    """Bytes of gradients this rank reduces per step in Megatron DDP's data-parallel gradient
    sync (its grad buffers: all-reduce, or reduce-scatter with DistOpt), for comparison with
    ``converge_bytes / steps``; None when the chunks have no Megatron grad buffers (FSDP2)."""
    line: dict | None = None
    """With ``signal="line"``: the window's line search (``LineFit.to_dict()``): the points, the
    mean loss at each, the fitted slope and curvature, the persistence and the pseudo-losses
    (which are ``arm_losses``)."""
    probe_seconds: float = 0.0
    """Host wall time of the window's probes (the line points' forward passes and restores)."""

    @property
    def converge_bytes_per_step(self) -> float:
        """Converge traffic of this rank amortized over the window's steps."""
        return self.converge_bytes / max(self.steps, 1)


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def main_params(optimizer) -> list[torch.Tensor]:
    """The tensors the optimizer updates: fp32 masters (or DistOpt shards), else the params.

    Read from the inner torch optimizer's param groups of every (chained) Megatron optimizer:
    ``Float16OptimizerWithFloat16Params`` puts ``fp32_from_float16_groups`` there,
    ``DistributedOptimizer`` its ``shard_fp32_*`` groups, ``FP32Optimizer`` the params.
    """
    tensors: list[torch.Tensor] = []
    for sub in _sub_optimizers(optimizer):
        if getattr(sub, "is_stub_optimizer", False):
            continue
        for group in sub.optimizer.param_groups:
            tensors.extend(group["params"])
    return tensors


@torch.no_grad()
def main_param_is_expert(optimizer) -> list[bool]:
    """For each tensor of :func:`main_params` (same order): is it an expert-parallel (MoE
    expert) param? ``get_megatron_optimizer`` puts expert params in their own param groups,
    marked ``is_expert_parallel`` (``_get_param_groups``, from ``param.allreduce == False``),
    and builds a separate (chained) optimizer for them; the groups keep the key."""
    flags: list[bool] = []
    for sub in _sub_optimizers(optimizer):
        if getattr(sub, "is_stub_optimizer", False):
            continue
        for group in sub.optimizer.param_groups:
            flags.extend([bool(group.get("is_expert_parallel", False))] * len(group["params"]))
    return flags


def _inner_states(optimizer) -> list:
    """The per-param states of the torch optimizers inside every (chained) Megatron optimizer."""
    return [
        state
        for sub in _sub_optimizers(optimizer)
        for state in getattr(getattr(sub, "optimizer", None), "state", {}).values()
    ]


def _grad_buffer_bytes(chunks) -> int | None:
    """Bytes of Megatron DDP's gradient buffers on this rank (``DistributedDataParallel.buffers``
    and ``expert_parallel_buffers``, each a ``_ParamAndGradBuffer`` with ``grad_data``): what
    its data-parallel gradient sync reduces per step. None without such buffers."""
    total, found = 0, False
    for chunk in chunks:
        # Megatron DDP's attributes are lists; on any other nn.Module ``buffers`` is the method.
        bufs = [
            b
            for name in ("buffers", "expert_parallel_buffers")
            if isinstance(getattr(chunk, name, None), (list, tuple))
            for b in getattr(chunk, name)
        ]
        for buf in bufs:
            grad = getattr(buf, "grad_data", None)
            if isinstance(grad, torch.Tensor):
                total += grad.numel() * grad.element_size()
                found = True
    return total if found else None


def _copying_state_dict(method, homed_ids: set[int]):
    """``Float16OptimizerWithFloat16Params.state_dict`` returning copies of homed masters."""

    def state_dict(*args, **kwargs):
        state = method(*args, **kwargs)
        groups = state.get("fp32_from_fp16_params")
        if groups is not None:
            state["fp32_from_fp16_params"] = [
                [own_storage(p) if id(p) in homed_ids else p for p in group] for group in groups
            ]
        return state

    # What functools.wraps sets (the original, for tests and unwrapping); typeshed's function
    # type does not declare it.
    state_dict.__wrapped__ = method  # type: ignore[attr-defined]
    return state_dict


def _copying_param_state(method, homed_ids: set[int]):
    """``DistributedOptimizer.get_parameter_state_dp_reshardable`` with copies of homed shards."""

    def get_parameter_state_dp_reshardable(*args, **kwargs):
        state = method(*args, **kwargs)
        for dtype_state in state.values():
            if not isinstance(dtype_state, dict):
                continue
            for buckets in dtype_state.values():
                for bucket in buckets:
                    for tensors in bucket:
                        param = tensors.get("param") if isinstance(tensors, dict) else None
                        if param is not None and id(param) in homed_ids:
                            tensors["param"] = own_storage(param)
        return state

    # __wrapped__: as in _copying_state_dict.
    get_parameter_state_dp_reshardable.__wrapped__ = method  # type: ignore[attr-defined]
    return get_parameter_state_dp_reshardable


class HDET(WindowAdapter):
    """Hyperparameter-Divergent Ensemble Training on Megatron-Core.

    Args:
        config: the HDET settings (must be the scheduler's config).
        model: list of (Megatron-DDP-wrapped) model chunks on this rank.
        optimizer: the Megatron optimizer (``get_megatron_optimizer``).
        scheduler: an :class:`HDETOptimizerParamScheduler` over ``optimizer``.
        pg_collection: optional ``ProcessGroupCollection`` (else ``parallel_state``).
        loss_keys: keys looked up in each microbatch's loss dict.
        rollback_dir: with ``config.rollback``, where the last converged main params are kept:
            None = host memory, else a directory (one file per rank).
        probe_fn: a :class:`~hdet_megatron.probe.BatchProbe` ``(loss_fn, batches)`` (needed by
            the signals ``"probe"``, ``"line"`` and ``"average"``, and what gives the ``average``
            defaults): ``batches(window)`` returns this rank's held-out batch of the window (e.g.
            the microbatches of its shard of the next global batch), ``loss_fn(batch)`` runs a
            forward-only pass of this rank's model chunks on it and returns what
            ``forward_backward_func(forward_only=True)`` returned (per-microbatch losses; empty
            off the last pipeline stage). The engine fetches the batch once per window and
            scores it once (``"probe"``: the same batch on every replica, checked) or at every
            point of the update line (each replica its own). Collective (a pipeline forward).
            Not run with auto-LR off. A bare callable is refused.
    """

    def __init__(
        self,
        config: HDETConfig,
        model: Sequence[torch.nn.Module],
        optimizer,
        scheduler: HDETOptimizerParamScheduler,
        pg_collection=None,
        loss_keys: Sequence[str] = DEFAULT_LOSS_KEYS,
        rollback_dir: str | None = None,
        probe_fn: BatchProbe | None = None,
    ) -> None:
        probe = as_probe(probe_fn)
        if not isinstance(scheduler, HDETOptimizerParamScheduler):
            raise HDETSetupError(
                "HDET needs an HDETOptimizerParamScheduler (a drop-in for Megatron's "
                f"OptimizerParamScheduler), got {type(scheduler).__name__}"
            )
        if scheduler.hdet_config is None:
            raise HDETSetupError(
                "the scheduler was built with hdet=None (plain Megatron); build it with "
                "HDETOptimizerParamScheduler(..., hdet=config) to run HDET"
            )
        if config not in (scheduler.hdet_user_config, scheduler.hdet_config):
            raise HDETSetupError("HDET config differs from the scheduler's hdet config; pass the same one")
        if scheduler.optimizer is not optimizer:
            raise HDETSetupError("the scheduler was built for a different optimizer")
        # "auto"/None fields resolve to the measured defaults, which depend on the probe.
        scheduler.adopt_probe(probe is not None)
        config = scheduler.hdet_config
        if config.signal in PROBE_SIGNALS and probe is None:
            raise HDETSetupError(
                f"HDETConfig.signal={config.signal!r} needs a probe (a forward-only pass on "
                f"held-out batches; examples/pretrain_gpt builds one); {PROBE_RECIPE}; or use "
                "signal='train'"
            )
        self.config = config
        # Megatron's model chunks (DDP / FSDP wrappers): untyped, used through their own methods.
        self.model: list[Any] = list(model) if isinstance(model, (list, tuple)) else [model]
        self.optimizer = optimizer
        self.scheduler = scheduler
        assert scheduler.layout is not None  # set whenever the scheduler has HDET on (checked above)
        self.layout: ArmLayout = scheduler.layout
        self.loss_keys = tuple(loss_keys)
        self._check_optimizer()
        self._param_ids = [id(p) for p in main_params(optimizer)]
        # The tensors converge averages (subclasses: e.g. local shards of FSDP2 DTensors).
        self._main_params = self._converge_tensors(main_params(optimizer))
        averaged, homer = self._averaged_tensors()
        self.averager = self._build_averager(averaged, homer)
        # Homing may replace tensor objects (FSDP2 local shards): read them again.
        self._main_params = self._converge_tensors(main_params(optimizer))
        self._protect_state_dicts()
        self.grad_bytes_per_step = _grad_buffer_bytes(self.model)
        self.module_axes = ModuleAxes(self.model, config, self.layout.arm)
        self.grad_sync = self._make_grad_sync()
        self.grad_sync.install()

        self.arm = self.layout.arm
        self.num_arms = self.layout.num_arms
        self.device = self._main_params[0].device if self._main_params else torch.device("cpu")
        self.iteration = 0
        self.history: list[WindowMetrics] = []
        # The window engine: losses, probes, line search, rollback store, controller update.
        self.engine = WindowEngine(self, probe, rollback_dir=rollback_dir, note=scheduler.resolution_note)
        # Last: attaching applies a checkpoint's pending window state to the engine.
        scheduler.hdet_runtime = self
        self.on_window_change()

    @property
    def controller(self) -> AutoController:
        """The scheduler's controller (a resume replaces it; HDET's scheduler always has one)."""
        controller = self.scheduler.controller
        assert controller is not None
        return controller

    def on_window_change(self) -> None:
        """Apply this arm's module-axis values for the scheduler's current window."""
        self.module_axes.apply(self.controller.scales(), self.scheduler.arm_spread_values())

    # -- extension points (hdet_megatron.megatron.fsdp overrides them) --------------------------
    def _converge_tensors(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors converge averages across arms, from the optimizer's main params (checked
        once, at construction)."""
        return self._local_tensors(params)

    def _local_tensors(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors of ``params`` this rank holds, as they are now (cheap: read per step)."""
        return params

    def _after_probe(self) -> None:
        """After every probe forward (FSDP2 chunks reshard what it left gathered)."""

    def _build_averager(self, averaged: list[torch.Tensor], homer: Homer) -> GroupedAverager:
        """The converge's averager: dense main params across arms over the cross-arm subset of
        the data-parallel group, expert main params (MoE) over the cross-arm subset of the
        expert-data-parallel group, so every tensor is averaged only with copies of itself
        (ranks of one expert-parallel group hold different experts). Every rank of either group
        has tensors of its class or none (they share the pipeline stage), so the parts agree."""
        expert = main_param_is_expert(self.optimizer)
        home = homer if self.config.home_main_params else False
        if len(expert) != len(averaged):
            raise RuntimeError(f"internal: {len(averaged)} averaged tensors, {len(expert)} param classes")
        expert_group = self.layout.expert_cross_arm_group or self.layout.cross_arm_group
        parts = []
        for is_expert, group in ((False, self.layout.cross_arm_group), (True, expert_group)):
            tensors = [t for t, e in zip(averaged, expert, strict=True) if e == is_expert]
            if tensors:
                parts.append(
                    BucketedAverager(tensors, group=group, bucket_mb=self.config.bucket_mb, home=home)
                )
        return GroupedAverager(parts)

    def _make_grad_sync(self):
        """The object that installs ``config.grad_sync`` on the model chunks."""
        return ArmGradSync(self.model, self.layout, self.config.grad_sync, self._distopt)

    def _averaged_tensors(self) -> tuple[list[torch.Tensor], Homer]:
        """What the averager averages, and how it homes them (``config.home_main_params``).

        The default sets ``tensor.data``, which keeps every Python reference Megatron holds
        valid: ``Float16OptimizerWithFloat16Params.fp32_from_float16_groups``, the
        ``model_param.main_param`` handles, ``DistributedOptimizer.shard_fp32_from_float16_groups``
        (``shard_model_param.clone().float()``: own storage), the inner optimizer's
        ``param_groups`` and its ``state`` (keyed by these objects). DistOpt's fp32
        ``shard_fp32_groups`` are views of DDP's ``param_data`` (``model_param.view(-1)[range]``)
        and are refused by :func:`~hdet_megatron.averaging.home_reason` (copying path).
        """
        return self._main_params, Homer()

    def _protect_state_dicts(self) -> None:
        """Checkpoints write what they wrote before homing (own storage per tensor, not the
        averager's whole buffer): module state dicts get a copying post-hook, and the two
        Megatron methods that put main params themselves into a ``torch.save``-d structure
        return copies: ``Float16OptimizerWithFloat16Params.state_dict()`` (its
        ``fp32_from_fp16_params`` entry is ``self.fp32_from_float16_groups``) and
        ``DistributedOptimizer.get_parameter_state_dp_reshardable()`` (``"param"`` is the main
        param, via ``_get_main_param_and_optimizer_states``). Both are only read on load
        (``load_state_dict`` copies ``saved_param.data`` into the live main params,
        ``load_parameter_state_from_dp_reshardable`` goes through
        ``_set_main_param_and_optimizer_states``), so copies load the same."""
        homed = self.averager.homed_tensors
        if not homed:
            return
        ids = {id(t) for t in homed}
        self._state_dict_hooks = protect_module_state_dicts(self.model, homed)
        for sub in _sub_optimizers(self.optimizer):
            if getattr(sub, "is_stub_optimizer", False):
                continue
            if hasattr(sub, "fp32_from_float16_groups") and "state_dict" not in vars(sub):
                sub.state_dict = _copying_state_dict(sub.state_dict, ids)
            if isinstance(sub, DistributedOptimizer) and "get_parameter_state_dp_reshardable" not in vars(
                sub
            ):
                sub.get_parameter_state_dp_reshardable = _copying_param_state(
                    sub.get_parameter_state_dp_reshardable, ids
                )

    # -- setup checks ----------------------------------------------------------------------------
    def _check_optimizer(self) -> None:
        subs = _sub_optimizers(self.optimizer)
        if any(getattr(getattr(s, "config", None), "use_precision_aware_optimizer", False) for s in subs):
            # OptimizerConfig.use_precision_aware_optimizer: TE's FusedAdam keeps the fp32 masters in
            # its own state (master_weights=True) and the param groups hold the bf16 shards, so a
            # converge would average the bf16 copies and the next step would undo it.
            raise HDETSetupError(PRECISION_AWARE_UNSUPPORTED)
        self._distopt = any(isinstance(s, DistributedOptimizer) for s in subs)
        if self._distopt:
            ddp_config = next(s.ddp_config for s in subs if isinstance(s, DistributedOptimizer))
            self.layout.check_distributed_optimizer(ddp_config.num_distributed_optimizer_instances)
        if not main_params(self.optimizer):
            raise HDETSetupError("the optimizer has no parameters to converge")

    def _check_param_groups_unchanged(self) -> None:
        if [id(p) for p in main_params(self.optimizer)] != self._param_ids:
            raise HDETSetupError(
                "the optimizer's param groups changed after HDET was built (params added, "
                "removed or replaced); build HDET after the optimizer is final"
            )

    # -- per step --------------------------------------------------------------------------------
    def _step_loss(self, losses: Sequence[Any]) -> torch.Tensor:
        values = []
        for item in losses:
            value = item
            if isinstance(item, dict):
                key = next((k for k in self.loss_keys if k in item), None)
                if key is None:
                    raise HDETSetupError(
                        f"no loss key {self.loss_keys} in the loss function's dict "
                        f"(keys: {sorted(item)}); pass loss_keys=... to HDET"
                    )
                value = item[key]
            value = torch.as_tensor(value).detach()
            if value.numel() == 2:  # Megatron-LM style [loss_sum, num_tokens]
                value = value[0] / value[1].clamp(min=1)
            values.append(value.reshape(()).to(torch.float64))
        return torch.stack(values).mean()

    def step(self, losses: Sequence[Any] | None) -> WindowMetrics | None:
        """Account one iteration; converge at the end of a window. Collective every ``period``.

        ``losses`` is what ``forward_backward_func`` returned on this rank (per-microbatch loss
        dicts or tensors; empty on non-last pipeline stages).
        """
        if self.layout.is_last_stage:
            if not losses:
                raise HDETSetupError(
                    "HDET.step() got no losses on the last pipeline stage; pass the list that "
                    "forward_backward_func returned (per-microbatch loss outputs)"
                )
            self.engine.add_loss(self._step_loss(losses))
        self.engine.after_step()  # "average": one device-side _foreach add
        self.iteration += 1
        if self.engine.steps_in_window >= self.config.period:
            return self._end_window(forced=False)
        return None

    def converge(self) -> WindowMetrics | None:
        """Converge now (e.g. before saving a checkpoint) and start a new window.

        Collective. A no-op when the current window has no steps yet.
        """
        if self.engine.steps_in_window == 0:
            return None
        return self._end_window(forced=True)

    # -- the window engine's adapter -------------------------------------------------------------
    def tensors(self) -> list[torch.Tensor]:
        """The main params (or this rank's shards of them) as they are now: a framework may have
        replaced a tensor object since construction (FSDP2 local shards)."""
        return self._local_tensors(main_params(self.optimizer))

    def probe_modules(self) -> list[torch.nn.Module]:
        return self.model

    def refresh(self) -> None:
        self._refresh_model_params()

    def after_probe(self) -> None:
        self._after_probe()

    def probe_value(self, raw: Any) -> torch.Tensor | None:
        """This rank's probe loss (None off the last pipeline stage) from what the probe's
        ``loss_fn`` returned (``forward_backward_func``'s per-microbatch losses)."""
        if not self.layout.is_last_stage:
            return None
        if not raw:
            raise HDETSetupError(
                "the probe's loss_fn returned no losses on the last pipeline stage; return what "
                "forward_backward_func(forward_only=True) returned"
            )
        return self._step_loss(raw)

    def reduce(
        self, *, train_sum, train_count, probe, points, num_points, finite, fingerprint
    ) -> WindowLosses:
        """The window's one small all-reduce over the world (so every TP/PP rank computes the
        same controller update): each loss reporter's (one per DP replica) training-loss sum and
        count, its probe loss or its losses at the line points and its batch's fingerprint, and
        every rank's verdict on its own (shard of the) main params."""
        layout = self.layout
        reporter = layout.is_loss_reporter
        return reduce_window(
            num_arms=layout.num_arms,
            num_rows=layout.loss_rows,
            arm=layout.arm,
            row=layout.loss_row if reporter else None,
            group=layout.loss_group,
            device=self.device,
            train_sum=train_sum if reporter else 0.0,
            train_count=float(train_count) if reporter else 0.0,
            probe=probe if reporter else None,
            points=points if reporter else None,
            num_points=num_points,
            finite=finite,
            fingerprint=fingerprint if reporter else None,
        )

    def horizon_lrs(self, step: int) -> tuple[float, float]:
        return self.scheduler.horizon_lrs()

    def base_values(self, step: int) -> dict[str, float]:
        return {**self.scheduler.base_values(), **self.module_axes.base_values()}

    def average(self, weight: float | None) -> AverageStats:
        return self.averager.average(weights=weight)

    def sanitize_optimizer_state(self) -> None:
        zero_non_finite_state(_inner_states(self.optimizer))

    # -- the window's state -----------------------------------------------------------------------
    @property
    def steps_in_window(self) -> int:
        """Iterations since the last converge (the engine's count)."""
        return self.engine.steps_in_window

    @property
    def line_search(self) -> LineSearch | None:
        return self.engine.line_search

    @property
    def rollback(self) -> RollbackStore | None:
        return self.engine.rollback

    @property
    def rollbacks(self) -> int:
        return self.engine.num_rollbacks

    @property
    def last_update(self) -> ControllerUpdate | None:
        return self.engine.last_update

    def mark_window_start(self) -> None:
        """``signal="line"``/``"average"``: remember the main params as the start of the update
        line. Called after every converge and by checkpoint loading (the loaded model is a
        converged one); call it yourself if you change the main params between windows by other
        means. Mid-window (a resume without converge-on-save) the params are not the window's
        start: that window's line is unknown, and it does not steer the controller."""
        self.engine.mark_window_start()

    def load_window(self, steps_in_window: int, arm_loss_sum: float) -> None:
        """Continue a window from a checkpoint: its iterations and this arm's loss sum (kept on
        the last stage, where the losses are)."""
        last = self.layout.is_last_stage
        self.engine.load_window(
            steps_in_window, arm_loss_sum if last else 0.0, steps_in_window if last else 0
        )

    # -- the converge ---------------------------------------------------------------------------
    def _end_window(self, forced: bool) -> WindowMetrics:
        self._check_param_groups_unchanged()
        window = self.scheduler.window
        end = self.engine.end_window(
            window, self.iteration, self.scheduler.arm_spread_values(), forced=forced
        )
        metrics = _window_metrics(end, self.controller.scales(), self.grad_bytes_per_step)
        self.history.append(metrics)
        self.scheduler.set_window(window + 1)
        return metrics

    @property
    def replicas_identical(self) -> bool:
        """True right after a converge (and before the first step of a window): only then are
        all DP replicas bit-identical, so only then does a cross-DP weight-hash check hold
        (Megatron's ``check_param_hashes_across_dp_replicas``)."""
        return self.steps_in_window == 0

    @torch.no_grad()
    def _refresh_model_params(self) -> None:
        """Copy averaged main params into the model params (all-gather inside the arm)."""
        for sub in _sub_optimizers(self.optimizer):
            if getattr(sub, "is_stub_optimizer", False):
                continue
            if isinstance(sub, MixedPrecisionOptimizer):
                sub._copy_main_params_to_model_params()
        if self._distopt:
            # DistributedOptimizer.step_with_ready_grads gathers the updated shards the same way.
            for chunk in self.model:
                chunk.start_param_sync(force_sync=True)

    # -- state -----------------------------------------------------------------------------------
    def runtime_state_dict(self) -> dict:
        """Iteration, steps in the window and the partial window's per-arm loss sums; the same on
        every rank (see ``ckpt.state.runtime_state_dict``)."""
        return ckpt_state.runtime_state_dict(self)

    def load_runtime_state_dict(self, state: dict) -> None:
        ckpt_state.load_runtime_state(self, state)

    def prepare_save(self) -> WindowMetrics | None:
        """Call on every rank before writing a checkpoint: converges a partial window when
        ``config.converge_on_save`` (returns its metrics), else records the window's per-arm
        losses for the checkpoint. ``checkpointing.save_checkpoint`` calls it for you."""
        return ckpt_state.prepare_save(self)

    def state_dict(self) -> dict:
        """Controller + window + runtime state (also inside ``scheduler.state_dict()["hdet"]``)."""
        return self.scheduler.hdet_state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_hdet_state_dict(state)

    def close(self) -> None:
        """Restore Megatron's own gradient synchronisation and the modules' configured values."""
        self.grad_sync.uninstall()
        self.module_axes.restore()
        if self.scheduler.hdet_runtime is self:
            self.scheduler.hdet_runtime = None
