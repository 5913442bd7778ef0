"""The torch runtime of ``HDETOneCycleLR``: arms over data-parallel ranks, and its window adapter.

:class:`_Runtime` holds everything HDET keeps for a plain (DDP or single-process) torch model
besides torch's own scheduler state: the arm topology, which axis drives each param group's LR,
the controller and the averager. It is the :class:`~hdet_megatron.window.WindowAdapter` of the
window engine (:mod:`hdet_megatron.window`), which owns everything that happens per window (loss
accumulation, probes, the reduction, the controller update, averaging and rollback).
:class:`hdet_megatron.fsdp.FSDPRuntime` subclasses it for FSDP2 (HSDP) models, and
:class:`hdet_megatron.torch_scheduler.HDETOneCycleLR` builds one of the two. Layering: this
module imports only the math (config, spread, controller, averaging, the window engine), never
the schedulers.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hdet_megatron.averaging import AverageStats, BucketedAverager, protect_module_state_dicts
from hdet_megatron.config import HDETConfig
from hdet_megatron.controller import AutoController
from hdet_megatron.probe import PROBE_RECIPE, as_probe, probe_scalar
from hdet_megatron.spread import arm_axis_value, arm_spread
from hdet_megatron.window import PROBE_SIGNALS, WindowAdapter, WindowEngine, zero_non_finite_state
from hdet_megatron.window_losses import WindowLosses, reduce_window

logger = logging.getLogger(__name__)

__all__ = ["TorchRuntime"]

_SUPPORTED_AXES = "'lr' or 'lr:<param-group name pattern>'"


class _Runtime(WindowAdapter):
    """Everything HDET keeps besides torch's own scheduler state (excluded from ``state_dict``
    except for the plain-data parts written under ``"hdet"``), and the window engine's adapter."""

    def __init__(
        self,
        config: HDETConfig,
        optimizer,
        model,
        process_group,
        probe_fn: Any = None,
    ) -> None:
        self.config = config
        self._init_topology(process_group)
        probe = as_probe(probe_fn)
        if probe is not None and model is None:
            # Not silently ignored (it would resolve the defaults to the train signal).
            raise ValueError(
                "probe_fn needs model=...: the probe runs with the model switched to eval() (and "
                "back), and the line search writes its points into the model's params"
            )
        # "auto"/None fields: the measured defaults for this run.
        resolution = config.resolve(probe is not None, self.num_arms)
        config = resolution.config
        if config.signal in PROBE_SIGNALS and probe is None:
            raise ValueError(f"HDETConfig.signal={config.signal!r} needs a probe; {PROBE_RECIPE}")
        self.model = model
        self.optimizer = optimizer
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

        self._controller = AutoController(config, self.num_arms)
        self._init_params(optimizer, model)
        self.acc_dtype = torch.float32 if self.device.type == "mps" else torch.float64
        self.base_lrs_at: Callable[[int], list[float]] | None = None
        """The scheduler's base LR of every param group at a step (set by ``HDETOneCycleLR``)."""
        self.total_steps = 0
        """The schedule's length (set by ``HDETOneCycleLR``)."""
        self.spread_cache: tuple[int, dict[str, list[float]]] = (-1, {})
        self.last_stats: AverageStats | None = None
        self.last_base_lrs: list[float] = []
        self.engine = WindowEngine(self, probe, note=resolution.note, acc_dtype=self.acc_dtype)

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

    # -- the window engine's adapter ------------------------------------------------------------
    @property
    def controller(self) -> AutoController:
        return self._controller

    def tensors(self) -> list[torch.Tensor]:
        """The averaged tensors (parameter objects: a replaced ``.data`` is seen through them)."""
        return self.params

    def probe_modules(self) -> list[torch.nn.Module]:
        return [self.model]

    def refresh(self) -> None:
        """Make the model compute with its params as they are now (after a line point was written
        into them, the restore, a converge or a rollback). Nothing to do for plain tensors;
        :class:`hdet_megatron.fsdp.FSDPRuntime` reshards FSDP2's modules."""

    def after_probe(self) -> None:
        """After a probe forward: the same as :meth:`refresh` (FSDP2 reshards what it gathered)."""
        self.refresh()

    def probe_value(self, raw: Any) -> torch.Tensor:
        """Every rank reports its own loss: the probe's result as a device scalar (no host sync)."""
        return probe_scalar(raw, self.device, self.acc_dtype)

    def reduce(
        self, *, train_sum, train_count, probe, points, num_points, finite, fingerprint
    ) -> WindowLosses:
        """The window's one small all-reduce over ``group`` (one host sync): every rank is a loss
        reporter (:func:`hdet_megatron.window_losses.reduce_window`)."""
        return reduce_window(
            num_arms=self.num_arms,
            num_rows=self.size,
            arm=self.arm,
            row=self.rank,
            group=self.group,
            reduce=self.size > 1,
            device=self.device,
            dtype=self.acc_dtype,
            train_sum=train_sum,
            train_count=float(train_count),
            probe=probe,
            points=points,
            num_points=num_points,
            finite=finite,
            fingerprint=fingerprint,
        )

    def _base_lrs(self, step: int) -> list[float]:
        assert self.base_lrs_at is not None  # set by HDETOneCycleLR before its first step
        return self.base_lrs_at(step)

    def horizon_lrs(self, step: int) -> tuple[float, float]:
        """Param group 0's OneCycle base LR at ``step`` (the next window's first) and at the end."""
        return self._base_lrs(step)[0], self._base_lrs(self.total_steps)[0]

    def _per_axis(self, group_lrs: list[float]) -> dict[str, float]:
        """Each LR axis's value from a list with one per param group (its first group's)."""
        return {
            axis.name: group_lrs[self.group_axes.index(axis)]
            for axis in self.config.resolved_axes
            if axis in self.group_axes
        }

    def base_values(self, step: int) -> dict[str, float]:
        return self._per_axis(self._base_lrs(step))  # the base schedule at the next window's first step

    def average(self, weight: float | None) -> AverageStats | None:
        if self.averager is None:
            return None
        self.last_stats = self.averager.average(weight)
        return self.last_stats

    def sanitize_optimizer_state(self) -> None:
        zero_non_finite_state(self.optimizer.state.values())

    # -- the window's state, read by the scheduler and the checkpoints ----------------------------
    @property
    def steps_in_window(self) -> int:
        return self.engine.steps_in_window

    @property
    def num_converges(self) -> int:
        return self.engine.num_converges

    @property
    def num_rollbacks(self) -> int:
        return self.engine.num_rollbacks


#: The public name of the runtime class.
TorchRuntime = _Runtime
