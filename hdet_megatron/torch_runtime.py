"""The torch runtime of ``HDETOneCycleLR``: arms over data-parallel ranks, window losses, converge.

:class:`_Runtime` holds everything HDET keeps for a plain (DDP or single-process) torch model
besides torch's own scheduler state: the arm topology, which axis drives each param group's LR,
the controller, the per-window loss accumulators, the averager and the rollback snapshot.
:class:`hdet_megatron.fsdp.FSDPRuntime` subclasses it for FSDP2 (HSDP) models, and
:class:`hdet_megatron.torch_scheduler.HDETOneCycleLR` builds one of the two. Layering: this
module imports only the math (config, spread, controller, averaging), never the schedulers.
"""

from __future__ import annotations

import fnmatch
import logging
import math
from typing import Any, Optional

import torch
import torch.distributed as dist

from hdet_megatron.averaging import AverageStats, BucketedAverager, protect_module_state_dicts
from hdet_megatron.config import HDETConfig
from hdet_megatron.controller import AutoController, ControllerUpdate
from hdet_megatron.spread import arm_axis_value, arm_spread

logger = logging.getLogger(__name__)

__all__ = ["TorchRuntime"]

_SUPPORTED_AXES = "'lr' or 'lr:<param-group name pattern>'"


class _Runtime:
    """Everything HDET keeps besides torch's own scheduler state (excluded from ``state_dict``
    except for the plain-data parts written under ``"hdet"``)."""

    def __init__(self, config: HDETConfig, optimizer, model, process_group) -> None:
        if config.signal != "train":
            # Only the Megatron runtime runs probe passes (HDET(probe_fn=...)); here the
            # training loss is all there is, so say so instead of silently using it.
            raise ValueError(
                f"HDETConfig.signal={config.signal!r} needs a probe forward pass, which only the "
                "Megatron runtime (hdet_megatron.megatron.HDET with probe_fn) runs; use "
                "signal='train' here"
            )
        self.config = config
        self._init_topology(process_group)

        # Which axis drives the LR of each param group.
        self.group_axes: list[Any | None] = []
        for axis in config.axes:
            if axis.name != "lr" and axis.group is None:
                raise NotImplementedError(
                    f"HDETOneCycleLR explores only the learning rate ({_SUPPORTED_AXES}); axis "
                    f"{axis.name!r} needs model support (use the Megatron integration, or remove it)"
                )
        for g, group in enumerate(optimizer.param_groups):
            found = [a for a in config.axes if a.name == "lr"]
            name = group.get("name")
            if name is not None:
                found += [a for a in config.axes if a.group and fnmatch.fnmatchcase(str(name), a.group)]
            if len(found) > 1:
                raise ValueError(
                    f"param group {g} (name {name!r}) matches several axes "
                    f"{[a.name for a in found]}; make the lr:<group> patterns disjoint"
                )
            self.group_axes.append(found[0] if found else None)
        for axis in config.axes:
            if axis.group is not None and axis not in self.group_axes:
                raise ValueError(
                    f"axis {axis.name!r} matches no param group (names: "
                    f"{[g.get('name') for g in optimizer.param_groups]}); give the groups a "
                    "'name' entry or fix the pattern"
                )

        self.controller = AutoController(config, self.num_arms)
        self._init_params(optimizer, model)
        acc_dtype = torch.float32 if self.device.type == "mps" else torch.float64
        self.loss_sum = torch.zeros((), dtype=acc_dtype, device=self.device)
        self.host_loss_sum = 0.0
        self.loss_count = 0
        self.snapshot: list[torch.Tensor] | None = None
        if config.rollback:
            self.take_snapshot()
        self.spread_cache: tuple[int, dict[str, list[float]]] = (-1, {})
        self.last_update: ControllerUpdate | None = None
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

    def arm_losses(self) -> tuple[list[float], list[float]]:
        """(mean window loss, number of losses) per arm: one tiny all-reduce, one host sync."""
        table = torch.zeros(2, self.num_arms, dtype=self.loss_sum.dtype, device=self.device)
        table[0, self.arm] = self.loss_sum + self.host_loss_sum
        table[1, self.arm] = float(self.loss_count)
        if self.size > 1:
            dist.all_reduce(table, group=self.group)
        sums, counts = table.tolist()
        losses = [s / c if c else math.nan for s, c in zip(sums, counts)]
        return losses, counts

    # -- rollback -------------------------------------------------------------------------------
    @torch.no_grad()
    def take_snapshot(self) -> None:
        if self.snapshot is None:
            self.snapshot = [p.detach().clone() for p in self.params]
        else:
            for s, p in zip(self.snapshot, self.params):
                s.copy_(p.detach())

    @torch.no_grad()
    def restore_snapshot(self) -> None:
        for s, p in zip(self.snapshot, self.params):
            p.copy_(s)


#: The public name of the runtime class.
TorchRuntime = _Runtime
