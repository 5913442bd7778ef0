"""``HDETOptimizerParamScheduler``: Megatron's ``OptimizerParamScheduler`` with per-arm values.

Megatron's scheduler (``megatron/core/optimizer_param_scheduler.py``) rewrites every param
group's ``lr`` from its ``max_lr/min_lr`` and ``weight_decay`` from ``wd_mult`` in ``step()``.
We let it do exactly that, then multiply by this rank's arm factor ``scale * rho`` for the
current window. ``lr_mult`` is set on groups by ``get_megatron_optimizer`` but never read by the
0.19.2 scheduler; we do not read it either, so that HDET with a neutral spread stays bit-identical
to plain Megatron.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.distributed as dist

from hdet_megatron.config import HDETConfig
from hdet_megatron.controller import AutoController
from hdet_megatron.megatron import cpu as _cpu  # noqa: F401
from hdet_megatron.megatron.ckpt import resume as ckpt_resume
from hdet_megatron.megatron.ckpt import state as ckpt_state
from hdet_megatron.megatron.layout import ArmLayout, HDETSetupError
from hdet_megatron.spread import arm_axis_value, arm_spread

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

logger = logging.getLogger(__name__)

#: Axes this scheduler applies to optimizer param groups (``lr:<group>`` too).
SCHEDULER_AXES = ("lr", "weight_decay")
#: Axes the HDET runtime applies to live modules.
MODULE_AXES = ("dropout", "attention_temperature")

#: Built-in names of ``lr:<group>`` axes, matched against Megatron's param-group entries.
#: (``decoupled``: Megatron's embedding/output group with its own ``max_lr``, see
#: ``get_standard_config_overrides``.)
BUILTIN_GROUPS = {
    "no_wd": lambda g, max_lr: g.get("wd_mult", 1.0) == 0.0,
    "decoupled": lambda g, max_lr: bool(g.get("is_decoupled_lr", False)) or g.get("max_lr", max_lr) != max_lr,
    "expert": lambda g, max_lr: bool(g.get("is_expert_parallel", False)),
}
#: Param-group key a ``config_overrides`` entry can set to name a group (see
#: :func:`hdet_param_group_overrides`).
GROUP_KEY = "hdet_group"


def group_matches(selector: str, group: dict, max_lr: float) -> bool:
    """Whether param group ``group`` belongs to ``lr:<selector>`` (``default`` is handled by the
    caller: the groups no other ``lr:<group>`` axis selects)."""
    if group.get(GROUP_KEY) is not None:
        return group[GROUP_KEY] == selector
    test = BUILTIN_GROUPS.get(selector)
    return bool(test and test(group, max_lr))


def hdet_param_group_overrides(patterns: dict, **override) -> dict:
    """``config_overrides`` for ``get_megatron_optimizer`` that put params into named groups.

    ``patterns`` maps a group name to a parameter-name glob (or tuple of globs), e.g.
    ``{"embedding": "*word_embeddings*"}``; the group is then addressable as ``lr:embedding``.
    Extra keyword arguments (``max_lr=...``, ``wd_mult=...``) are applied to every such group.
    """
    from megatron.core.optimizer import ParamKey

    return {ParamKey(name=glob): {GROUP_KEY: name, **override} for name, glob in patterns.items()}


class HDETOptimizerParamScheduler(OptimizerParamScheduler):  # megatron-core is untyped: an Any base
    """Drop-in for Megatron's ``OptimizerParamScheduler`` that applies HDET's per-arm factors.

    Same constructor as the parent plus keyword ``hdet`` (an :class:`HDETConfig`) and optionally
    ``layout`` (an :class:`ArmLayout`; built from ``parallel_state`` when omitted, which is a
    collective call; a single process without torch.distributed gets one arm).
    ``state_dict()`` returns Megatron's keys plus ``"hdet"``; ``load_state_dict`` accepts plain
    Megatron states (no ``"hdet"``: the controller starts at scale 1 from that iteration).

    ``hdet=None`` (the default) is Megatron's ``OptimizerParamScheduler`` exactly: the same
    values at every step, the same ``state_dict``, no process group needed, no collective.
    """

    #: Megatron's step counter (set by the untyped parent; declared for the type checker only).
    num_steps: int

    def __init__(
        self,
        optimizer,
        *args: Any,
        hdet: HDETConfig | None = None,
        layout: ArmLayout | None = None,
        **kwargs: Any,
    ) -> None:
        if hdet is not None and not isinstance(hdet, HDETConfig):
            raise HDETSetupError(f"hdet must be an HDETConfig or None, got {type(hdet).__name__}")
        self.hdet_user_config = hdet
        """The config as given (``"auto"``/None fields unresolved); :attr:`hdet_config` is the
        resolved one this scheduler runs (see :meth:`adopt_probe`)."""
        self.hdet_config = hdet
        # Set by HDET (the runtime object) so that its window state travels with this state.
        self.hdet_runtime = None
        self.window = 0
        self._group_axes: list[str | None] | None = None
        self._bases: list[tuple[float, float]] = []
        if hdet is None:
            # HDET off: exactly Megatron's scheduler (same values, same state dict, no process
            # group needed, no collective).
            self.layout = layout
            self.controller = None
            self._spread = {}
            super().__init__(optimizer, *args, **kwargs)
            return
        if layout is None:
            if dist.is_initialized() or (hdet.arms or 1) != 1:
                layout = ArmLayout.from_parallel_state(hdet.arms)
            else:
                layout = ArmLayout.single()  # one process without torch.distributed: one arm
        self.layout = layout
        # Resolved without a probe; HDET(probe_fn=...) re-resolves through adopt_probe.
        self.controller = AutoController(hdet, self.layout.num_arms)
        self.hdet_config = self.controller.config
        self.resolution_note = self.controller.resolution_note
        self._spread = arm_spread(self.hdet_config, self.layout.num_arms, 0)
        super().__init__(optimizer, *args, **kwargs)
        # Group selection needs the parent's max_lr; the parent's step(0) ran without factors.
        self._group_axes = self._resolve_group_axes(optimizer)
        self.step(0)

    @property
    def hdet_enabled(self) -> bool:
        """False when built with ``hdet=None`` (then this is Megatron's scheduler, unchanged)."""
        return self.hdet_config is not None

    def _require_hdet(self, what: str) -> None:
        if self.hdet_config is None:
            raise HDETSetupError(
                f"{what} needs HDET: this scheduler was built with hdet=None (plain Megatron "
                "OptimizerParamScheduler); pass hdet=HDETConfig(...)"
            )

    def _resolve_group_axes(self, optimizer) -> list[str | None]:
        """For each param group, the name of the LR axis that scales it (or None)."""
        config = self.hdet_config
        assert config is not None  # called by __init__ with HDET on
        group_axes = [a for a in config.resolved_axes if a.group is not None]
        groups = optimizer.param_groups
        if not group_axes:
            has_lr = config.axis("lr") is not None
            return ["lr" if has_lr else None for _ in groups]
        named = [a for a in group_axes if a.group != "default"]
        default = next((a for a in group_axes if a.group == "default"), None)
        resolved: list[str | None] = []
        for index, group in enumerate(groups):
            # cast: group_axes holds only axes with a group.
            hits = [a.name for a in named if group_matches(cast(str, a.group), group, self.max_lr)]
            if len(hits) > 1:
                raise HDETSetupError(
                    f"param group {index} is selected by several LR axes {hits}; give each "
                    "param group at most one lr:<group> axis"
                )
            resolved.append(hits[0] if hits else (default.name if default else None))
        for axis in named:
            if axis.name not in resolved:
                known = sorted(
                    set(BUILTIN_GROUPS)
                    | {g[GROUP_KEY] for g in groups if g.get(GROUP_KEY) is not None}
                    | {"default"}
                )
                raise HDETSetupError(
                    f"axis {axis.name!r}: no optimizer param group {axis.group!r}; known groups: "
                    f"{known} (name groups with hdet_param_group_overrides(...) passed to "
                    "get_megatron_optimizer(config_overrides=...))"
                )
        return resolved

    def adopt_probe(self, probe_available: bool) -> None:
        """Resolve the user's config again now that HDET knows whether the training loop supplies
        a probe (the scheduler is built before HDET and the probe). A no-op when nothing changes;
        refused once the controller has seen a window (the defaults are chosen before the first)."""
        self._require_hdet("adopt_probe")
        # Set with the HDET config in __init__ (_require_hdet checked it).
        assert self.hdet_user_config is not None and self.layout is not None and self.controller is not None
        controller = AutoController(
            self.hdet_user_config, self.layout.num_arms, probe_available=probe_available
        )
        if controller.config == self.hdet_config:
            return
        if self.controller.window or self.controller.num_updates or self.window:
            raise HDETSetupError(
                "HDET's auto defaults depend on whether a probe_fn is given, and this scheduler has "
                "already run windows with other defaults; build HDET (with its probe_fn) before "
                "loading a checkpoint or stepping windows"
            )
        self.controller = controller
        self.hdet_config = controller.config
        self.resolution_note = controller.resolution_note
        self._spread = arm_spread(self.hdet_config, self.layout.num_arms, 0)
        self._group_axes = self._resolve_group_axes(self.optimizer)
        self._apply_factors()

    # -- the per-arm factors -------------------------------------------------------------------
    def set_window(self, window: int) -> None:
        """Use window ``window``'s permutation (and the controller's current scales) from now on,
        re-applying this arm's factors to the base values Megatron's last ``step`` wrote."""
        self._require_hdet("set_window")
        assert self.hdet_config is not None and self.layout is not None  # HDET on (just checked)
        self.window = window
        self._spread = arm_spread(self.hdet_config, self.layout.num_arms, window)
        self._apply_factors()
        if self.hdet_runtime is not None:
            self.hdet_runtime.on_window_change()

    def arm_spread_values(self) -> dict[str, list[float]]:
        """Per axis, the spread value (multiplier or offset) of every arm in this window ({}
        without HDET)."""
        return {name: list(values) for name, values in self._spread.items()}

    def arm_factor(self, axis_name: str, arm: int | None = None) -> float:
        """``scale * rho`` of ``arm`` (default: this rank's) on a multiplicative axis (1 without
        HDET or without that axis)."""
        axis = self.hdet_config.axis(axis_name) if self.hdet_config is not None else None
        if axis is None:
            return 1.0
        assert self.layout is not None and self.controller is not None  # HDET on (has an axis)
        arm = self.layout.arm if arm is None else arm
        return self.controller.scale(axis_name) * self._spread[axis_name][arm]

    def _apply(self, name: str | None, base: float) -> float:
        # Only with HDET on (after __init__ resolved the group axes).
        assert self.hdet_config is not None and self.layout is not None and self.controller is not None
        axis = self.hdet_config.axis(name) if name is not None else None
        if name is None or axis is None:
            return base
        return arm_axis_value(axis, base, self.controller.scale(name), self._spread[name][self.layout.arm])

    def base_lr(self) -> float:
        """The un-spread base learning rate of the first (default) param group now."""
        groups = self.optimizer.param_groups
        return self.get_lr(groups[0]) if groups else self.get_lr({})

    def horizon_lrs(self) -> tuple[float, float]:
        """``(base LR now, base LR at the end of the decay)`` of the first param group, from
        Megatron's ``OptimizerParamScheduler.get_lr`` (which reads ``self.num_steps``), for the
        ``line`` signal's persistence ``kappa``."""
        group = self.optimizer.param_groups[0] if self.optimizer.param_groups else {}
        with self._at_step(max(self.lr_decay_steps, self.num_steps)):
            end = self.get_lr(group)
        return self.get_lr(group), end

    @contextlib.contextmanager
    def _at_step(self, num_steps: int) -> Iterator[None]:
        """Megatron's ``get_lr``/``get_wd`` read ``self.num_steps``: evaluate them at another step,
        then put it back (nothing else changes)."""
        saved = self.num_steps
        self.num_steps = num_steps
        try:
            yield
        finally:
            self.num_steps = saved

    def base_values(self) -> dict[str, float]:
        """Base (un-spread, un-scaled) value of every scheduler axis now (for ``rule="paper"``)."""
        groups = self.optimizer.param_groups
        values = {}
        for axis in self.hdet_config.resolved_axes if self.hdet_config is not None else ():
            assert self._group_axes is not None  # resolved in __init__ with HDET on
            if axis.name == "weight_decay":
                values[axis.name] = self.get_wd(groups[0] if groups else None)
            elif axis.name.startswith("lr"):
                members = [g for g, a in zip(groups, self._group_axes, strict=True) if a == axis.name]
                values[axis.name] = self.get_lr(members[0] if members else {})
        return values

    def step(self, increment: int) -> None:
        """Megatron's step, then this arm's factors on ``lr`` and ``weight_decay``."""
        super().step(increment)
        if self._group_axes is None:  # inside the parent's __init__
            return
        self._check_groups()
        # What Megatron just wrote (the factors are applied to these until its next step, also
        # on a window change: so a load leaves exactly Megatron's values, whose weight decay
        # still follows the constructor's wd settings until the next step).
        self._bases = [
            (
                self.get_lr(group) if isinstance(group["lr"], torch.Tensor) else group["lr"],
                group["weight_decay"],
            )
            for group in self.optimizer.param_groups
        ]
        self._apply_factors()

    def _check_groups(self) -> None:
        assert self._group_axes is not None  # only once __init__ resolved them
        if len(self._group_axes) != len(self.optimizer.param_groups):
            raise HDETSetupError("the optimizer's param groups changed after the HDET scheduler was built")

    def _apply_factors(self) -> None:
        """This arm's ``lr`` and ``weight_decay`` from the base values of Megatron's last step."""
        self._check_groups()
        assert self._group_axes is not None  # (checked just above)
        for group, lr_axis, (lr, wd) in zip(
            self.optimizer.param_groups, self._group_axes, self._bases, strict=True
        ):
            value = self._apply(lr_axis, lr)
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(value)
            else:
                group["lr"] = value
            group["weight_decay"] = self._apply("weight_decay", wd)

    # -- checkpoints (state and resume rules: hdet_megatron/megatron/ckpt/) ---------------------
    #: On load, whose HDET config wins when it differs from the checkpoint's: True = this run's,
    #: False = the checkpoint's, None = follow Megatron's ``override_opt_param_scheduler`` /
    #: ``use_checkpoint_opt_param_scheduler`` (default: the checkpoint's).
    override_hdet_config: bool | None = None
    #: Like Megatron's ``use_checkpoint_opt_param_scheduler`` for the HDET config (None = follow
    #: it); with neither this nor an override, a config mismatch is an error.
    use_checkpoint_hdet_config: bool | None = None
    _hdet_pending_runtime: dict | None = None

    @property
    def hdet_runtime(self):
        """The attached :class:`HDET` runtime (set by ``HDET``); its window state travels with
        this scheduler's state. Attaching one hands it a position loaded before it existed."""
        return self.__dict__.get("_hdet_runtime")

    @hdet_runtime.setter
    def hdet_runtime(self, runtime) -> None:
        self.__dict__["_hdet_runtime"] = runtime
        if runtime is not None and self._hdet_pending_runtime is not None:
            ckpt_resume.attach_runtime(self, runtime)

    def state_dict(self) -> dict:
        """Megatron's state plus ``"hdet"`` (Megatron's state alone with ``hdet=None``)."""
        state = super().state_dict()
        if self.hdet_config is not None:
            state["hdet"] = self.hdet_state_dict()
        return state

    def hdet_state_dict(self) -> dict:
        """HDET's state (controller, window/generator position, runtime, config fingerprint)."""
        self._require_hdet("hdet_state_dict")
        return ckpt_state.hdet_state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Megatron's fields plus HDET state; a plain Megatron state (no ``"hdet"``) starts the
        controller at scale 1. HDET state is validated before anything is modified. With
        ``hdet=None``: Megatron's load (an HDET checkpoint's ``"hdet"`` entry is ignored, warned
        once)."""
        if self.hdet_config is None:
            super().load_state_dict(ckpt_state.strip_hdet_state(state_dict))
            return
        ckpt_resume.load_scheduler_state(self, state_dict, super().load_state_dict)

    def load_hdet_state_dict(self, state: dict, override: bool | None = None) -> None:
        self._require_hdet("load_hdet_state_dict")
        ckpt_resume.apply_hdet_load(self, ckpt_resume.plan_hdet_load(self, state, override))
