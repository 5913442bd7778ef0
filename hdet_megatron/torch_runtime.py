"""The torch runtime of ``HDETOneCycleLR``: arms over data-parallel ranks, window losses, converge.

:class:`_Runtime` holds everything HDET keeps for a plain (DDP or single-process) torch model
besides torch's own scheduler state: the arm topology, which axis drives each param group's LR,
the controller, the per-window loss accumulators, the probe (``probe_fn``) and the line-search
engine (:mod:`hdet_megatron.line_search`), the averager and the rollback snapshot.
:class:`hdet_megatron.fsdp.FSDPRuntime` subclasses it for FSDP2 (HSDP) models, and
:class:`hdet_megatron.torch_scheduler.HDETOneCycleLR` builds one of the two. Layering: this
module imports only the math (config, spread, controller, averaging, line search, window
losses), never the schedulers.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hdet_megatron.averaging import AverageStats, BucketedAverager, protect_module_state_dicts
from hdet_megatron.config import LINE_SIGNALS, HDETConfig
from hdet_megatron.controller import AutoController, ControllerUpdate
from hdet_megatron.line_search import LineSearch, probe_scalar, run_probe
from hdet_megatron.line_signal import LineFit
from hdet_megatron.spread import arm_axis_value, arm_spread
from hdet_megatron.window_losses import WindowLosses, params_finite, reduce_window

logger = logging.getLogger(__name__)

__all__ = ["TorchRuntime"]

_SUPPORTED_AXES = "'lr' or 'lr:<param-group name pattern>'"
#: Signals whose controller input comes from ``probe_fn``.
PROBE_SIGNALS = ("probe",) + LINE_SIGNALS


class _Runtime:
    """Everything HDET keeps besides torch's own scheduler state (excluded from ``state_dict``
    except for the plain-data parts written under ``"hdet"``)."""

    def __init__(
        self,
        config: HDETConfig,
        optimizer,
        model,
        process_group,
        probe_fn: Callable[[], Any] | None = None,
    ) -> None:
        self.config = config
        self._init_topology(process_group)
        # "auto"/None fields: the measured defaults for this run (a probe needs the model too).
        resolution = config.resolve(probe_fn is not None and model is not None, self.num_arms)
        config = resolution.config
        if resolution.note:
            log = logger.warning if config.auto and probe_fn is None else logger.info
            log("%s", resolution.note)
        if config.signal in PROBE_SIGNALS:
            if probe_fn is None:
                raise ValueError(
                    f"HDETConfig.signal={config.signal!r} needs probe_fn: a no-argument callable "
                    "returning this rank's loss on a batch it has not trained on (see "
                    "docs/python-api.md); pass HDETOneCycleLR(..., probe_fn=...) or use signal='train'"
                )
            if model is None:
                raise ValueError(
                    f"HDETConfig.signal={config.signal!r} needs model=...: the probe runs with the "
                    "model switched to eval() (and back), and the line search writes into its params"
                )
        elif probe_fn is not None and not callable(probe_fn):
            raise TypeError(f"probe_fn must be a no-argument callable, got {type(probe_fn).__name__}")
        self.probe_fn = probe_fn
        self.model = model
        self.config = config

        # Which axis drives the LR of each param group.
        self.group_axes: list[Any | None] = []
        for axis in config.resolved_axes:
            if axis.name != "lr" and axis.group is None:
                raise NotImplementedError(
                    f"HDETOneCycleLR explores only the learning rate ({_SUPPORTED_AXES}); axis "
                    f"{axis.name!r} needs model support (use the Megatron integration, or remove it)"
                )
        for g, group in enumerate(optimizer.param_groups):
            found = [a for a in config.resolved_axes if a.name == "lr"]
            name = group.get("name")
            if name is not None:
                found += [
                    a for a in config.resolved_axes if a.group and fnmatch.fnmatchcase(str(name), a.group)
                ]
            if len(found) > 1:
                raise ValueError(
                    f"param group {g} (name {name!r}) matches several axes "
                    f"{[a.name for a in found]}; make the lr:<group> patterns disjoint"
                )
            self.group_axes.append(found[0] if found else None)
        for axis in config.resolved_axes:
            if axis.group is not None and axis not in self.group_axes:
                raise ValueError(
                    f"axis {axis.name!r} matches no param group (names: "
                    f"{[g.get('name') for g in optimizer.param_groups]}); give the groups a "
                    "'name' entry or fix the pattern"
                )

        self.controller = AutoController(config, self.num_arms)
        self._init_params(optimizer, model)
        self.acc_dtype = torch.float32 if self.device.type == "mps" else torch.float64
        self.loss_sum = torch.zeros((), dtype=self.acc_dtype, device=self.device)
        self.host_loss_sum = 0.0
        self.loss_count = 0
        self.steps_in_window = 0
        """Optimizer steps since the last converge (the window's start)."""
        # The line signals' engine (window start, running sum, probing, restore).
        self.line_search = LineSearch(self.params, config.signal) if config.signal in LINE_SIGNALS else None
        self.mark_window_start()
        self.snapshot: list[torch.Tensor] | None = None
        if config.rollback:
            self.take_snapshot()
        self.spread_cache: tuple[int, dict[str, list[float]]] = (-1, {})
        self.last_update: ControllerUpdate | None = None
        self.last_line: LineFit | None = None
        self.last_losses: WindowLosses | None = None
        self.last_stats: AverageStats | None = None
        self.last_base_lrs: list[float] = []
        self.num_converges = 0
        self.num_rollbacks = 0

    def _init_topology(self, process_group) -> None:
        """Set ``group``/``size``/``rank`` (the loss-reduction group) and ``num_arms``/``arm``.
        Overridden by :class:`hdet_megatron.fsdp.FSDPRuntime` (arms = HSDP replicate dim)."""
        if dist.is_available() and dist.is_initialized():
            self.group = process_group
            self.size = dist.get_world_size(process_group)
            self.rank = dist.get_rank(process_group)
            if self.rank < 0:
                raise ValueError("this rank is not a member of the process_group given to HDETOneCycleLR")
        else:
            if process_group is not None:
                raise ValueError("process_group given but torch.distributed is not initialized")
            self.group, self.size, self.rank = None, 1, 0
        self.num_arms = self.config.arms if self.config.arms is not None else self.size
        if self.size % self.num_arms:
            raise ValueError(
                f"HDETConfig.arms={self.num_arms} must divide the number of data-parallel ranks "
                f"({self.size}); use a divisor of {self.size} or arms=None (one arm per rank)"
            )
        self.ranks_per_arm = self.size // self.num_arms
        self.arm = self.rank // self.ranks_per_arm

    def _init_params(self, optimizer, model) -> None:
        """Set ``params`` (the tensors converge averages), ``device`` and ``averager``.
        Overridden by :class:`hdet_megatron.fsdp.FSDPRuntime` (local DTensor shards)."""
        if model is not None:
            params = list(model.parameters())
        else:
            params = [p for group in optimizer.param_groups for p in group["params"]]
        self.params = list({id(p): p for p in params}.values())
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.averager: BucketedAverager | None = None
        if self.size > 1:
            # Homing moves the params' storage into the averager's buckets; their modules'
            # state dicts are then protected (own storage per tensor, as before) - which needs
            # the model: with only an optimizer, its params keep the copying path.
            home = self.config.home_main_params and model is not None
            if self.config.home_main_params and model is None:
                logger.warning(
                    "HDETOneCycleLR: pass model=... to converge in place (home the params in the "
                    "converge buckets); without it the copying path is used"
                )
            self.averager = BucketedAverager(
                self.params, group=self.group, bucket_mb=self.config.bucket_mb, home=home
            )
            if self.averager.homed_tensors:
                protect_module_state_dicts([model], self.averager.homed_tensors)

    def close(self) -> None:
        """Undo changes made to the model (nothing here; FSDP2 restores its gradient sync)."""

    # -- spread ---------------------------------------------------------------------------------
    def spreads(self, window: int) -> dict[str, list[float]]:
        if self.spread_cache[0] != window:
            self.spread_cache = (window, arm_spread(self.config, self.num_arms, window))
        return self.spread_cache[1]

    def factor_value(self, group_index: int, base: float, window: int) -> float:
        axis = self.group_axes[group_index]
        if axis is None:
            return base
        rho = self.spreads(window)[axis.name][self.arm]
        return arm_axis_value(axis, base, self.controller.scale(axis.name), rho)

    # -- losses ---------------------------------------------------------------------------------
    def add_loss(self, loss) -> None:
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                raise ValueError(
                    f"step(loss): loss must be a scalar (this rank's mean loss of the step), got "
                    f"shape {tuple(loss.shape)}"
                )
            self.loss_sum.add_(loss.detach().reshape(()).to(self.loss_sum.device, self.loss_sum.dtype))
        elif isinstance(loss, (int, float)) and not isinstance(loss, bool):
            self.host_loss_sum += float(loss)
        else:
            raise TypeError(f"step(loss): loss must be a tensor or a number, got {type(loss).__name__}")
        self.loss_count += 1

    def reset_losses(self) -> None:
        self.loss_sum.zero_()
        self.host_loss_sum = 0.0
        self.loss_count = 0

    def after_step(self) -> None:
        """One optimizer step done: ``"average"`` adds it to the running sum (device-side)."""
        if self.line_search is not None:
            self.line_search.accumulate()
        self.steps_in_window += 1

    # -- probes ---------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Make the model compute with its params as they are now (after a line point was written
        into them, the restore, a converge or a rollback). Nothing to do for plain tensors;
        :class:`hdet_megatron.fsdp.FSDPRuntime` reshards FSDP2's modules."""

    def probe_loss(self) -> torch.Tensor:
        """This rank's loss from ``probe_fn``, run under ``torch.no_grad()`` with the model in
        eval mode (its previous mode restored); a device scalar (no host sync). The model is
        refreshed after it (FSDP2: resharded, whatever the forward left gathered)."""
        assert self.probe_fn is not None  # __init__ requires it for the signals that probe
        loss = probe_scalar(run_probe(self.probe_fn, [self.model]), self.device, self.acc_dtype)
        self.refresh()
        return loss

    def mark_window_start(self) -> None:
        """The params are a window's start (after a converge; after a checkpoint load, valid for
        the line signals only at a window boundary)."""
        if self.line_search is not None:
            self.line_search.mark_window_start(self.steps_in_window)

    def reduce_window(self, probe: torch.Tensor | None, points: torch.Tensor | None, num_points: int):
        """The window's one small all-reduce over ``group`` (one host sync): every rank's loss
        sum and count, its probe loss or its losses at the line points, and whether its params
        are finite (:func:`hdet_megatron.window_losses.reduce_window`)."""
        self.last_losses = reduce_window(
            num_arms=self.num_arms,
            num_rows=self.size,
            arm=self.arm,
            row=self.rank,
            group=self.group,
            reduce=self.size > 1,
            device=self.device,
            dtype=self.acc_dtype,
            train_sum=self.loss_sum + self.host_loss_sum,
            train_count=float(self.loss_count),
            probe=probe,
            points=points,
            num_points=num_points,
            finite=params_finite(self.params),
        )
        return self.last_losses

    # -- rollback -------------------------------------------------------------------------------
    @torch.no_grad()
    def take_snapshot(self) -> None:
        if self.snapshot is None:
            self.snapshot = [p.detach().clone() for p in self.params]
        else:
            for s, p in zip(self.snapshot, self.params, strict=True):
                s.copy_(p.detach())

    @torch.no_grad()
    def restore_snapshot(self) -> None:
        assert self.snapshot is not None  # taken in __init__ when rollback is on
        for s, p in zip(self.snapshot, self.params, strict=True):
            p.copy_(s)


#: The public name of the runtime class.
TorchRuntime = _Runtime
