"""``HDETOptimizerParamScheduler``: Megatron's ``OptimizerParamScheduler`` with per-arm values.

Megatron's scheduler (``megatron/core/optimizer_param_scheduler.py``) rewrites every param
group's ``lr`` from its ``max_lr/min_lr`` and ``weight_decay`` from ``wd_mult`` in ``step()``.
We let it do exactly that, then multiply by this rank's arm factor ``scale * rho`` for the
current window. ``lr_mult`` is set on groups by ``get_megatron_optimizer`` but never read by the
0.19.2 scheduler; we do not read it either, so that HDET with a neutral spread stays bit-identical
to plain Megatron.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from hdet_megatron.config import HDETConfig
from hdet_megatron.controller import AutoController
from hdet_megatron.megatron import cpu as _cpu  # noqa: F401
from hdet_megatron.megatron.layout import ArmLayout, HDETSetupError
from hdet_megatron.spread import arm_axis_value, arm_spread
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

logger = logging.getLogger(__name__)

#: Axes this scheduler applies to optimizer param groups.
SCHEDULER_AXES = ("lr", "weight_decay")


class HDETOptimizerParamScheduler(OptimizerParamScheduler):
    """Drop-in for Megatron's ``OptimizerParamScheduler`` that applies HDET's per-arm factors.

    Same constructor as the parent plus keyword ``hdet`` (an :class:`HDETConfig`) and optionally
    ``layout`` (an :class:`ArmLayout`; built from ``parallel_state`` when omitted, which is a
    collective call). ``state_dict()`` returns Megatron's keys plus ``"hdet"``;
    ``load_state_dict`` accepts plain Megatron states (no ``"hdet"``: the controller starts at
    scale 1 from that iteration).
    """

    def __init__(
        self,
        optimizer,
        *args: Any,
        hdet: Optional[HDETConfig] = None,
        layout: Optional[ArmLayout] = None,
        **kwargs: Any,
    ) -> None:
        if hdet is None:
            hdet = HDETConfig()
        if not isinstance(hdet, HDETConfig):
            raise HDETSetupError(f"hdet must be an HDETConfig, got {type(hdet).__name__}")
        unsupported = [a.name for a in hdet.axes if a.name not in SCHEDULER_AXES]
        if unsupported:
            raise HDETSetupError(
                f"HDETOptimizerParamScheduler applies axes {SCHEDULER_AXES}; "
                f"axes {unsupported} are applied by the HDET runtime or are not supported yet"
            )
        self.hdet_config = hdet
        self.layout = layout if layout is not None else ArmLayout.from_parallel_state(hdet.arms)
        self.controller = AutoController(hdet, self.layout.num_arms)
        self.window = 0
        self._spread = arm_spread(hdet, self.layout.num_arms, 0)
        # Set by HDET (the runtime object) so that its window state travels with this state.
        self.hdet_runtime = None
        super().__init__(optimizer, *args, **kwargs)

    # -- the per-arm factors -------------------------------------------------------------------
    def set_window(self, window: int) -> None:
        """Use window ``window``'s permutation (and the controller's current scales) from now on,
        re-applying the param group values at the current step."""
        self.window = window
        self._spread = arm_spread(self.hdet_config, self.layout.num_arms, window)
        self.step(0)

    def arm_spread_values(self) -> dict[str, list[float]]:
        """Per axis, the spread value (multiplier or offset) of every arm in this window."""
        return {name: list(values) for name, values in self._spread.items()}

    def arm_factor(self, axis_name: str, arm: Optional[int] = None) -> float:
        """``scale * rho`` of ``arm`` (default: this rank's) on a multiplicative axis."""
        axis = self.hdet_config.axis(axis_name)
        if axis is None:
            return 1.0
        arm = self.layout.arm if arm is None else arm
        return self.controller.scale(axis_name) * self._spread[axis_name][arm]

    def _apply(self, name: str, base: float) -> float:
        axis = self.hdet_config.axis(name)
        if axis is None:
            return base
        return arm_axis_value(
            axis, base, self.controller.scale(name), self._spread[name][self.layout.arm]
        )

    def base_lr(self) -> float:
        """The un-spread base learning rate of the first (default) param group now."""
        groups = self.optimizer.param_groups
        return self.get_lr(groups[0]) if groups else self.get_lr({})

    def step(self, increment: int) -> None:
        """Megatron's step, then this arm's factors on ``lr`` and ``weight_decay``."""
        super().step(increment)
        if not hasattr(self, "_spread"):
            return
        for group in self.optimizer.param_groups:
            lr = group["lr"]
            if isinstance(lr, torch.Tensor):
                lr.fill_(self._apply("lr", self.get_lr(group)))
            else:
                group["lr"] = self._apply("lr", lr)
            group["weight_decay"] = self._apply("weight_decay", group["weight_decay"])

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        state = super().state_dict()
        state["hdet"] = self.hdet_state_dict()
        return state

    def hdet_state_dict(self) -> dict:
        state = {
            "version": 1,
            "window": self.window,
            "num_arms": self.layout.num_arms,
            "dp_size": self.layout.dp_size,
            "controller": self.controller.state_dict(),
            "config": self.hdet_config.fingerprint(),
        }
        if self.hdet_runtime is not None:
            state["runtime"] = self.hdet_runtime.runtime_state_dict()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        hdet_state = state_dict.pop("hdet", None)
        super().load_state_dict(state_dict)
        if hdet_state is None:
            logger.info("HDET: checkpoint has no HDET state; controller starts at scale 1")
            self.set_window(self.window)
            return
        self.load_hdet_state_dict(hdet_state)

    def load_hdet_state_dict(self, state: dict) -> None:
        for key in ("window", "num_arms", "controller"):
            if key not in state:
                raise ValueError(f"HDET checkpoint state is missing {key!r}")
        self.controller.load_state_dict(state["controller"])
        self.set_window(int(state["window"]))
        if self.hdet_runtime is not None and "runtime" in state:
            self.hdet_runtime.load_runtime_state_dict(state["runtime"])
