"""OneCycle base schedule, bit-identical to ``torch.optim.lr_scheduler.OneCycleLR``.

Pure module: no torch.distributed, no megatron (not even torch). Every float operation follows
torch's ``OneCycleLR`` in the same order, so ``OneCycleSchedule(...).lr(t)`` ``==`` (not just
close to) what ``OneCycleLR`` writes into ``param_group["lr"]`` after ``t`` scheduler steps,
and ``momentum(t)`` ``==`` its ``momentum`` (or Adam's ``beta1``).

Two layers:

* phase helpers (:func:`onecycle_phases`, :func:`phase_at`, :func:`onecycle_value`) that read
  the per-group values by key, exactly like torch reads them from ``optimizer.param_groups``
  (used by :class:`hdet_megatron.torch_scheduler.HDETOneCycleLR`);
* :class:`OneCycleSchedule`, a self-contained schedule with per-group ``max_lr`` and momenta.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "ANNEAL_STRATEGIES",
    "OneCycleSchedule",
    "anneal_cos",
    "anneal_linear",
    "onecycle_phases",
    "onecycle_value",
    "phase_at",
]

Number = int | float


def anneal_cos(start: float, end: float, pct: float) -> float:
    """Cosine anneal from ``start`` to ``end`` as ``pct`` goes 0 -> 1 (torch's formula)."""
    cos_out = math.cos(math.pi * pct) + 1
    return end + (start - end) / 2.0 * cos_out


def anneal_linear(start: float, end: float, pct: float) -> float:
    """Linear anneal from ``start`` to ``end`` as ``pct`` goes 0 -> 1 (torch's formula)."""
    return (end - start) * pct + start


ANNEAL_STRATEGIES: dict[str, Callable[[float, float, float], float]] = {
    "cos": anneal_cos,
    "linear": anneal_linear,
}


def onecycle_phases(
    total_steps: int, pct_start: float = 0.3, three_phase: bool = False
) -> list[dict[str, Any]]:
    """The phase table of torch's ``OneCycleLR`` (same keys, same float ``end_step`` values).

    Each phase is ``{"end_step", "start_lr", "end_lr", "start_momentum", "end_momentum"}``; the
    ``start_*``/``end_*`` entries name the per-group value to read: ``initial_lr``, ``max_lr``,
    ``min_lr``, ``max_momentum`` or ``base_momentum``.
    """
    if three_phase:
        return [
            {
                "end_step": float(pct_start * total_steps) - 1,
                "start_lr": "initial_lr",
                "end_lr": "max_lr",
                "start_momentum": "max_momentum",
                "end_momentum": "base_momentum",
            },
            {
                "end_step": float(2 * pct_start * total_steps) - 2,
                "start_lr": "max_lr",
                "end_lr": "initial_lr",
                "start_momentum": "base_momentum",
                "end_momentum": "max_momentum",
            },
            {
                "end_step": total_steps - 1,
                "start_lr": "initial_lr",
                "end_lr": "min_lr",
                "start_momentum": "max_momentum",
                "end_momentum": "max_momentum",
            },
        ]
    return [
        {
            "end_step": float(pct_start * total_steps) - 1,
            "start_lr": "initial_lr",
            "end_lr": "max_lr",
            "start_momentum": "max_momentum",
            "end_momentum": "base_momentum",
        },
        {
            "end_step": total_steps - 1,
            "start_lr": "max_lr",
            "end_lr": "min_lr",
            "start_momentum": "base_momentum",
            "end_momentum": "max_momentum",
        },
    ]


def phase_at(phases: Sequence[Mapping[str, Any]], step: int) -> tuple[Mapping[str, Any], float]:
    """The phase that ``step`` falls in and the fraction ``pct`` of it done (torch's loop).

    The last phase extends past its end (torch extrapolates there too). A zero-length phase
    that ``step`` lands in gives a :class:`ValueError` (torch divides 0 by 0).
    """
    start_step = 0.0
    last = len(phases) - 1
    for i, phase in enumerate(phases):
        end_step = phase["end_step"]
        if step <= end_step or i == last:
            try:
                pct = (step - start_step) / (end_step - start_step)
            except ZeroDivisionError:
                raise ValueError(
                    f"OneCycle phase {i} has zero length (it ends at step {end_step}, where the "
                    f"previous one ends); choose pct_start/total_steps so that every phase is at "
                    "least one step long"
                ) from None
            return phase, pct
        start_step = phase["end_step"]
    raise ValueError("a OneCycle schedule needs at least one phase")


def onecycle_value(
    values: Mapping[str, float],
    phases: Sequence[Mapping[str, Any]],
    step: int,
    kind: str = "lr",
    anneal: str | Callable[[float, float, float], float] = "cos",
) -> float:
    """The ``kind`` (``"lr"`` or ``"momentum"``) value at ``step`` for one group's ``values``
    (a mapping with ``initial_lr``, ``max_lr``, ``min_lr`` and, for momentum, ``max_momentum``
    and ``base_momentum``, e.g. a torch param group).
    """
    fn = ANNEAL_STRATEGIES[anneal] if isinstance(anneal, str) else anneal
    phase, pct = phase_at(phases, step)
    return fn(values[phase[f"start_{kind}"]], values[phase[f"end_{kind}"]], pct)


def _per_group(name: str, value: Any, num_groups: int | None) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if num_groups is not None and len(value) != num_groups:
            raise ValueError(
                f"{name} has {len(value)} values but num_groups={num_groups}; give one value per "
                "param group or a single number"
            )
        return list(value)
    return [value] * (1 if num_groups is None else num_groups)


class OneCycleSchedule:
    """OneCycle learning rate (and momentum) for ``num_groups`` param groups.

    ``lr(step, group)`` equals ``OneCycleLR(opt, max_lr, total_steps, ...)`` 's
    ``get_last_lr()[group]`` after ``step`` scheduler steps (step 0 = right after construction),
    bit for bit; ``momentum(step, group)`` equals the group's ``momentum`` / ``betas[0]``.
    ``max_lr``, ``base_momentum`` and ``max_momentum`` may be one number or one per group.
    ``step`` may go up to ``total_steps`` (one past the last, as torch allows).
    """

    def __init__(
        self,
        max_lr: Number | Sequence[Number],
        total_steps: int,
        pct_start: float = 0.3,
        anneal_strategy: str = "cos",
        div_factor: float = 25.0,
        final_div_factor: float = 1e4,
        three_phase: bool = False,
        base_momentum: Number | Sequence[Number] = 0.85,
        max_momentum: Number | Sequence[Number] = 0.95,
        num_groups: int | None = None,
    ) -> None:
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps <= 0:
            raise ValueError(f"Expected positive integer total_steps, but got {total_steps}")
        if isinstance(pct_start, bool) or not isinstance(pct_start, (int, float)) or not 0 <= pct_start <= 1:
            raise ValueError(f"Expected float between 0 and 1 pct_start, but got {pct_start}")
        if anneal_strategy not in ANNEAL_STRATEGIES:
            raise ValueError(
                f"anneal_strategy must be one of 'cos' or 'linear', instead got {anneal_strategy}"
            )
        if num_groups is None:
            lists = [v for v in (max_lr, base_momentum, max_momentum) if isinstance(v, (list, tuple))]
            num_groups = len(lists[0]) if lists else 1
        if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1:
            raise ValueError(f"num_groups={num_groups!r} must be an integer >= 1")
        self.total_steps = total_steps
        self.pct_start = float(pct_start)
        self.anneal_strategy = anneal_strategy
        self.div_factor = div_factor
        self.final_div_factor = final_div_factor
        self.three_phase = bool(three_phase)
        self.num_groups = num_groups
        self.phases = onecycle_phases(total_steps, pct_start, three_phase)
        self._anneal = ANNEAL_STRATEGIES[anneal_strategy]
        max_lrs = _per_group("max_lr", max_lr, num_groups)
        max_moms = _per_group("max_momentum", max_momentum, num_groups)
        base_moms = _per_group("base_momentum", base_momentum, num_groups)
        self.groups: list[dict[str, float]] = []
        for g in range(num_groups):
            initial_lr = max_lrs[g] / div_factor
            self.groups.append(
                {
                    "initial_lr": initial_lr,
                    "max_lr": max_lrs[g],
                    "min_lr": initial_lr / final_div_factor,
                    "max_momentum": max_moms[g],
                    "base_momentum": base_moms[g],
                }
            )

    def _check(self, step: int, group: int) -> None:
        if step < 0:
            raise ValueError(f"step={step} must be >= 0")
        if step > self.total_steps:
            raise ValueError(
                f"Tried to step {step} times. The specified number of total steps is {self.total_steps}"
            )
        if not 0 <= group < self.num_groups:
            raise IndexError(f"group={group} out of range (num_groups={self.num_groups})")

    def position(self, step: int) -> tuple[int, float]:
        """``(phase index, fraction of that phase done)`` at ``step``."""
        self._check(step, 0)
        phase, pct = phase_at(self.phases, step)
        return next(i for i, p in enumerate(self.phases) if p is phase), pct

    def lr(self, step: int, group: int = 0) -> float:
        """Learning rate of param group ``group`` at ``step``."""
        self._check(step, group)
        return onecycle_value(self.groups[group], self.phases, step, "lr", self._anneal)

    def momentum(self, step: int, group: int = 0) -> float:
        """Momentum (SGD ``momentum`` or Adam ``beta1``) of ``group`` at ``step``."""
        self._check(step, group)
        return onecycle_value(self.groups[group], self.phases, step, "momentum", self._anneal)

    def lrs(self, step: int) -> list[float]:
        """Learning rates of all groups at ``step``."""
        return [self.lr(step, g) for g in range(self.num_groups)]

    def momenta(self, step: int) -> list[float]:
        """Momenta of all groups at ``step``."""
        return [self.momentum(step, g) for g in range(self.num_groups)]

    @property
    def initial_lrs(self) -> list[float]:
        return [g["initial_lr"] for g in self.groups]

    @property
    def max_lrs(self) -> list[float]:
        return [g["max_lr"] for g in self.groups]

    @property
    def min_lrs(self) -> list[float]:
        return [g["min_lr"] for g in self.groups]

    def __repr__(self) -> str:
        return (
            f"OneCycleSchedule(max_lr={self.max_lrs}, total_steps={self.total_steps}, "
            f"pct_start={self.pct_start}, anneal_strategy={self.anneal_strategy!r}, "
            f"div_factor={self.div_factor}, final_div_factor={self.final_div_factor}, "
            f"three_phase={self.three_phase})"
        )
