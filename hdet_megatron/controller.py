"""The HDET auto controller: a zero-order hypergradient step per converge window.

Pure module (plain Python floats and ``math``): every process that feeds it the same window
losses computes a bit-identical update, with no collective and no global RNG.

At each converge the arms' mean window losses ``L_r`` are turned into softmax weights
``w = softmax((L_bar - L_r) / sigma)`` and, per explored axis (paper Remark 1: axes are
independent, each with its own velocity and scale),

* ``rule="relative"`` (default, dimensionless): multiplicative axes
  ``Delta = sum_r w_r rho_r - mean_r rho_r`` (``= sum_r w_r rho_r - 1`` for the paper's linear
  spread), ``v <- beta v + (1-beta) Delta``, ``c <- clamp(c (1 + lambda v))``; additive axes
  ``Delta = sum_r w_r d_r - mean_r d_r``, ``shift <- shift + lambda v``.
* ``rule="paper"``: the paper's absolute update with ``h_r = base * c * rho_r``,
  ``Delta = sum_r w_r h_r - mean_r h_r``, ``v <- beta v + (1-beta) Delta``,
  ``h_bar_new = base * c + lambda v`` and ``c = h_bar_new / base``. The paper's decay term
  ``h_bar (1 - gamma)`` is *not* applied here: the decay is the base schedule's own (``base`` is
  the schedule's value at this step and the next windows use ``base(t) * c``), so the LR decays
  exactly as the base schedule does and the sign of the decay is right by construction (the
  reference code's ``gamma = log(div/final_div)``-style constant had the wrong sign and grew
  the LR ~400x over a run: paper-code defect 3).

* ``rule="newton"``: fit ``L(x) ~ a + g x + q x^2 / 2`` to the finite arms' losses over their
  values ``x_r``, take its minimiser ``x*`` (the descent end of the arms' range when ``q <= 0``),
  bounded per window to a factor :data:`NEWTON_MAX_STEP` of the arms' centre ``x_bar`` (an
  offset of one arm range for additive axes); ``Delta = log(x* / x_bar)`` (additive:
  ``x* - x_bar``), ``v <- beta v + (1-beta) Delta``, ``c <- clamp(c exp(lambda v))`` (additive:
  ``shift <- shift + lambda v``). Softmax weights are still reported but not used: the step
  follows the fitted curve, so a low-noise signal (``signal="line"``) moves the scale as far as
  the evidence says in one window instead of at most ``lambda * spread``.

A neutral controller (all arm losses equal, or all weights equal) yields ``Delta == 0``
exactly, so the scale never drifts on its own (regression for defect 3).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Optional

from hdet_megatron.config import LINE_SIGNALS, HDETConfig
from hdet_megatron.line_signal import fit_quadratic

__all__ = [
    "AllArmsNonFinite",
    "NonFiniteArm",
    "ControllerUpdate",
    "AutoController",
    "softmax_weights",
]

STATE_VERSION = 1

#: ``rule="newton"``: the most a multiplicative axis' target may differ from the arms' centre in
#: one window (a factor; 2 = one octave), since a quadratic fitted on the arms' range says little
#: about values far outside it.
NEWTON_MAX_STEP = 2.0


class AllArmsNonFinite(RuntimeError):
    """Every arm's window loss is NaN/inf: nothing healthy to average or learn from."""


class NonFiniteArm(RuntimeError):
    """An arm's window loss is NaN/inf and ``HDETConfig.nonfinite == "raise"``."""


@dataclass
class ControllerUpdate:
    """What one converge did to the controller (plain data, for logs and reports)."""

    window: int
    """Index of the window that just ended (0-based)."""
    moved: bool
    """Whether scales/velocities were updated (False before ``auto_start`` or with auto off)."""
    arm_losses: list[float]
    weights: list[float]
    """Softmax weights per arm; 0 for non-finite arms."""
    excluded: list[int]
    """Indices of the arms whose loss was non-finite."""
    sigma: float
    """Temperature used (the std of the finite losses for ``temperature="auto"``)."""
    deltas: dict[str, float]
    """Per-axis zero-order hypergradient Delta (computed even when not moved)."""
    velocities: dict[str, float]
    """Per-axis velocity after the update."""
    scales: dict[str, float]
    """Per-axis scale (multiplicative) or shift (additive) after the update."""
    step: int = -1
    """Optimizer step the update was made at."""

    def to_dict(self) -> dict:
        """JSON-ready view (NaN/inf losses become strings ``"nan"``/``"inf"``/``"-inf"``)."""
        out = asdict(self)
        out["arm_losses"] = [x if math.isfinite(x) else repr(x) for x in self.arm_losses]
        return out


def softmax_weights(
    losses: Sequence[float], temperature: float | str
) -> tuple[list[float], list[int], float]:
    """Softmax weights ``softmax((L_bar - L_r) / sigma)`` over the finite arms.

    Returns ``(weights, excluded, sigma)``. Non-finite arms get weight 0 (the limit of the
    softmax for an infinitely bad loss) and are listed in ``excluded``. ``temperature="auto"``
    uses the population std of the finite losses; when that std is 0 or only one arm is
    finite, the weights are uniform over the finite arms (no information, so no preference).
    Raises :class:`AllArmsNonFinite` if no arm is finite.
    """
    losses = [float(x) for x in losses]
    excluded = [r for r, x in enumerate(losses) if not math.isfinite(x)]
    finite = [r for r, x in enumerate(losses) if math.isfinite(x)]
    if not finite:
        raise AllArmsNonFinite(
            f"all {len(losses)} arms have non-finite window losses {losses}; nothing healthy to "
            "average. Lower the LR scale or spread, or set HDETConfig.rollback=True to restore "
            "the last converged state and cut the scale"
        )
    weights = [0.0] * len(losses)
    if temperature == "auto":
        sigma = _pstdev([losses[r] for r in finite])
        if len(finite) < 2 or not sigma > 0:
            for r in finite:
                weights[r] = 1.0 / len(finite)
            return weights, excluded, sigma
    else:
        sigma = float(temperature)
    # Max-subtraction: s_r - max_r s_r = (L_min - L_r) / sigma, computed directly (L_bar
    # cancels), so huge-but-finite losses cannot overflow to inf - inf; the best arm gets
    # exp(0) = 1 and equal losses give exactly equal weights.
    best = min(losses[r] for r in finite)
    exps = [math.exp((best - losses[r]) / sigma) for r in finite]
    total = math.fsum(exps)
    for r, e in zip(finite, exps):
        weights[r] = e / total
    return weights, excluded, sigma


def _newton_delta(values: Sequence[float], losses: Sequence[float], center: float, additive: bool) -> float:
    """``rule="newton"``'s Delta from the finite arms' ``(value, loss)`` pairs, relative to the
    centre of all arms' values (0 with fewer than 3 distinct values: no quadratic)."""
    if len(set(values)) < 3:
        return 0.0
    lo, hi = min(values), max(values)
    _, g, q = fit_quadratic([x - center for x in values], losses)
    if q > 0:
        target = center - g / q
    else:  # no minimum inside: go to the descent end of the arms' range
        target = hi if g < 0 else lo if g > 0 else center
    if additive:
        span = hi - lo
        return min(max(target - center, -span), span)
    if center <= 0:
        return 0.0
    factor = target / center if target > 0 else 0.0
    factor = min(max(factor, 1.0 / NEWTON_MAX_STEP), NEWTON_MAX_STEP)
    return math.log(factor)


def _pstdev(values: Sequence[float]) -> float:
    """Population std of finite values, robust to huge values (rescales on overflow and
    saturates at the largest float instead of returning inf)."""
    try:
        mean = math.fsum(values) / len(values)
        std = math.sqrt(math.fsum((x - mean) ** 2 for x in values) / len(values))
        if math.isfinite(std):
            return std
    except OverflowError:
        pass
    peak = max(abs(x) for x in values)
    std = _pstdev([x / peak for x in values]) * peak
    return std if math.isfinite(std) else sys.float_info.max


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class AutoController:
    """Learns one scale (multiplicative axes, starts at 1) or shift (additive axes, starts at 0)
    per axis of ``config`` from the arms' window losses; see the module docstring."""

    def __init__(self, config: HDETConfig, num_arms: int) -> None:
        if isinstance(num_arms, bool) or not isinstance(num_arms, int) or num_arms < 1:
            raise ValueError(f"num_arms={num_arms!r} must be an integer >= 1")
        if config.rule == "newton" and num_arms < 3 and (config.auto or config.signal in LINE_SIGNALS):
            raise ValueError(
                f"HDETConfig.rule='newton' fits a quadratic over the arms and needs >= 3 arms, "
                f"this run has {num_arms}; use rule='relative' or more data-parallel replicas"
            )
        if config.signal in LINE_SIGNALS and num_arms < 3:
            raise ValueError(
                f"HDETConfig.signal={config.signal!r} fits the update line at the arms' multipliers and needs "
                f">= 3 arms, this run has {num_arms}; use signal='probe' or 'train'"
            )
        self.config = config
        self.num_arms = num_arms
        self._axes = {axis.name: axis for axis in config.axes}
        self._scale: dict[str, float] = {
            name: (0.0 if axis.additive else 1.0) for name, axis in self._axes.items()
        }
        self._velocity: dict[str, float] = {name: 0.0 for name in self._axes}
        self.num_updates = 0
        """Number of updates that moved the scales."""
        self.window = 0
        """Index of the current (next to end) window = number of ``update`` calls so far; the
        arms of the current window use ``spread.arm_spread(config, n, controller.window)``."""

    # -- accessors ---------------------------------------------------------------------------
    @property
    def axis_names(self) -> list[str]:
        """Names of the explored axes, in config order."""
        return list(self._axes)

    def scale(self, axis_name: str) -> float:
        """Learned scale c (multiplicative axes, starts at 1.0) or shift (additive, starts 0.0)."""
        return self._scale[self._known(axis_name)]

    def velocity(self, axis_name: str) -> float:
        """The axis' controller velocity v."""
        return self._velocity[self._known(axis_name)]

    def scales(self) -> dict[str, float]:
        """All scales/shifts, keyed by axis name."""
        return dict(self._scale)

    def velocities(self) -> dict[str, float]:
        """All velocities, keyed by axis name."""
        return dict(self._velocity)

    def _known(self, axis_name: str) -> str:
        if axis_name not in self._axes:
            raise KeyError(f"unknown axis {axis_name!r}; this controller has {list(self._axes)}")
        return axis_name

    def _clamp(self, c: float) -> float:
        lo, hi = self.config.scale_bounds
        return min(max(c, float(lo)), float(hi))

    # -- the update --------------------------------------------------------------------------
    def update(
        self,
        arm_losses: Sequence[float],
        arm_spreads: Mapping[str, Sequence[float]],
        step: int,
        base_values: Mapping[str, float] | None = None,
    ) -> ControllerUpdate:
        """One converge: weigh the arms by their window losses and move every axis.

        ``arm_losses[r]``: arm r's mean training loss over the window. ``arm_spreads[axis][r]``:
        the multiplier (or additive offset) arm r used on that axis in the window.
        ``base_values[axis]``: the base schedule's value at ``step`` (needed by
        ``rule="paper"`` for multiplicative axes; with additive axes it also bounds the shift so
        that ``base + shift`` stays within ``[axis.min, axis.max]``).

        Nothing moves (but the weights and Deltas are reported) if ``config.auto`` is off or
        ``step < config.auto_start``. Raises :class:`AllArmsNonFinite` if no arm loss is finite,
        :class:`NonFiniteArm` if any is non-finite and ``config.nonfinite == "raise"``, and
        ``ValueError`` for malformed input. The controller is unchanged when it raises.
        """
        cfg = self.config
        losses = self._check_losses(arm_losses)
        spreads = self._check_spreads(arm_spreads)
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"step={step!r} must be an integer")
        weights, excluded, sigma = softmax_weights(losses, cfg.temperature)
        if excluded and cfg.nonfinite == "raise":
            raise NonFiniteArm(
                f"window {self.window} (step {step}): arm(s) {excluded} have non-finite losses "
                f"{[losses[r] for r in excluded]} (HDETConfig.nonfinite='raise'); use "
                "nonfinite='exclude' to drop such arms from the average instead"
            )
        move = cfg.auto and step >= cfg.auto_start
        bases = self._check_bases(base_values, need=move and cfg.rule == "paper")
        uniform = not excluded and all(w == weights[0] for w in weights)

        deltas: dict[str, float] = {}
        new_scale = dict(self._scale)
        new_velocity = dict(self._velocity)
        for name, axis in self._axes.items():
            values = spreads[name]
            c = self._scale[name]
            base = bases.get(name)
            paper_units = cfg.rule == "paper" and not axis.additive and base is not None
            if paper_units:
                # Absolute units: h_r = base * c * rho_r.
                values = [base * c * x for x in values]
            if uniform:
                # Equal weights carry no information: exactly 0 (no drift from rounding).
                delta = 0.0
            elif cfg.rule == "newton":
                delta = _newton_delta(
                    [values[r] for r in range(len(values)) if math.isfinite(losses[r])],
                    [losses[r] for r in range(len(values)) if math.isfinite(losses[r])],
                    center=math.fsum(values) / len(values),
                    additive=axis.additive,
                )
            else:
                center = math.fsum(values) / len(values)
                # sum_r w_r (x_r - mean): for the linear spread x_r - 1 is exact, so a neutral
                # controller gives exactly 0.
                delta = math.fsum(w * (x - center) for w, x in zip(weights, values))
            deltas[name] = delta
            if not move:
                continue
            v = cfg.momentum * self._velocity[name] + (1.0 - cfg.momentum) * delta
            new_velocity[name] = v
            if axis.additive:
                new_scale[name] = self._bound_shift(axis, c + cfg.meta_lr * v, base)
            elif cfg.rule == "newton":
                new_scale[name] = self._clamp(c * math.exp(cfg.meta_lr * v))
            elif cfg.rule == "paper":
                if base is None or base == 0.0:
                    # No base value to convert back (e.g. an LR of exactly 0): keep c.
                    new_scale[name] = c
                else:
                    new_scale[name] = self._clamp((base * c + cfg.meta_lr * v) / base)
            else:
                new_scale[name] = self._clamp(c * (1.0 + cfg.meta_lr * v))

        update = ControllerUpdate(
            window=self.window,
            moved=move,
            arm_losses=losses,
            weights=weights,
            excluded=excluded,
            sigma=sigma,
            deltas=deltas,
            velocities=dict(new_velocity),
            scales=dict(new_scale),
            step=step,
        )
        # Commit only after everything above succeeded.
        self._scale = new_scale
        self._velocity = new_velocity
        self.window += 1
        if move:
            self.num_updates += 1
        return update

    def cut_scale(self, factor: float = 0.5) -> None:
        """After a rollback: multiply every multiplicative scale by ``factor`` (clamped to
        ``scale_bounds``) and reset all velocities (their momentum led to the blow-up)."""
        if not _is_number(factor) or not math.isfinite(factor) or factor <= 0:
            raise ValueError(f"cut_scale factor={factor!r} must be a finite number > 0")
        for name, axis in self._axes.items():
            if not axis.additive:
                self._scale[name] = self._clamp(self._scale[name] * factor)
            self._velocity[name] = 0.0

    def _bound_shift(self, axis, shift: float, base: float | None) -> float:
        # Keep the centre base + shift inside the axis bounds, so the shift cannot wind up
        # (e.g. training loss always prefers less dropout) far past where arms are clipped.
        if base is None:
            return shift
        if axis.min is not None and base + shift < axis.min:
            shift = axis.min - base
        if axis.max is not None and base + shift > axis.max:
            shift = axis.max - base
        return shift

    # -- input validation --------------------------------------------------------------------
    def _check_losses(self, arm_losses: Sequence[float]) -> list[float]:
        try:
            losses = [float(x) for x in arm_losses]
        except (TypeError, ValueError):
            raise ValueError(f"arm_losses={arm_losses!r} must be a sequence of numbers") from None
        if len(losses) != self.num_arms:
            raise ValueError(f"got {len(losses)} arm losses for {self.num_arms} arms")
        return losses

    def _check_spreads(self, arm_spreads: Mapping[str, Sequence[float]]) -> dict[str, list[float]]:
        if set(arm_spreads) != set(self._axes):
            raise ValueError(
                f"arm_spreads has axes {sorted(arm_spreads)}, the config has {sorted(self._axes)}"
            )
        out = {}
        for name, axis in self._axes.items():
            values = [float(x) for x in arm_spreads[name]]
            if len(values) != self.num_arms:
                raise ValueError(f"arm_spreads[{name!r}] has {len(values)} values for {self.num_arms} arms")
            if not all(math.isfinite(x) for x in values):
                raise ValueError(f"arm_spreads[{name!r}]={values} contains non-finite values")
            if not axis.additive and not all(x > 0 for x in values):
                raise ValueError(f"arm_spreads[{name!r}]={values}: multipliers must be > 0")
            out[name] = values
        return out

    def _check_bases(self, base_values: Mapping[str, float] | None, need: bool) -> dict[str, float]:
        bases: dict[str, float] = {}
        for name, value in (base_values or {}).items():
            if name not in self._axes:
                raise ValueError(f"base_values has unknown axis {name!r}; axes: {list(self._axes)}")
            if not _is_number(value) or not math.isfinite(value):
                raise ValueError(f"base_values[{name!r}]={value!r} must be a finite number")
            if not self._axes[name].additive and value < 0:
                raise ValueError(f"base_values[{name!r}]={value!r} must be >= 0")
            bases[name] = float(value)
        if need:
            missing = [n for n, a in self._axes.items() if not a.additive and n not in bases]
            if missing:
                raise ValueError(
                    f"rule='paper' needs base_values for axes {missing} (the base schedule's "
                    "value at this step)"
                )
        return bases

    # -- checkpointing -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain-data state (ints, floats, strings, lists, dicts) for checkpoints."""
        return {
            "version": STATE_VERSION,
            "num_arms": self.num_arms,
            "window": self.window,
            "num_updates": self.num_updates,
            "axes": {
                name: {"scale": self._scale[name], "velocity": self._velocity[name]} for name in self._axes
            },
            "config": self.config.fingerprint(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output. Raises ``ValueError`` naming what is wrong.

        The explored axes must match this controller's config; the number of arms and other
        config fields may differ (a resume on a different DP size, or with a new meta LR).
        A scale outside the current ``scale_bounds`` is clamped to them.
        """
        if not isinstance(state, Mapping):
            raise ValueError(f"controller state must be a dict, got {type(state).__name__}")
        for key in ("version", "num_arms", "window", "num_updates", "axes"):
            if key not in state:
                raise ValueError(f"controller state is missing key {key!r}")
        if state["version"] != STATE_VERSION:
            raise ValueError(
                f"controller state version {state['version']!r} is not supported (expected {STATE_VERSION})"
            )
        for key in ("num_arms", "window", "num_updates"):
            value = state[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"controller state[{key!r}]={value!r} must be an integer >= 0")
        axes = state["axes"]
        if not isinstance(axes, Mapping):
            raise ValueError(f"controller state['axes'] must be a dict, got {type(axes).__name__}")
        if set(axes) != set(self._axes):
            raise ValueError(
                f"controller state axes {sorted(axes)} do not match the config's axes {sorted(self._axes)}"
            )
        scales, velocities = {}, {}
        for name, axis in self._axes.items():
            entry = axes[name]
            if not isinstance(entry, Mapping):
                raise ValueError(f"controller state['axes'][{name!r}] must be a dict")
            for key in ("scale", "velocity"):
                if key not in entry:
                    raise ValueError(f"controller state['axes'][{name!r}] is missing key {key!r}")
                value = entry[key]
                if not _is_number(value):
                    raise ValueError(
                        f"controller state['axes'][{name!r}][{key!r}]={value!r} must be a number"
                    )
                if not math.isfinite(value):
                    raise ValueError(f"controller state['axes'][{name!r}][{key!r}]={value!r} is not finite")
            scale = float(entry["scale"])
            if not axis.additive:
                if scale <= 0:
                    raise ValueError(f"controller state['axes'][{name!r}]['scale']={scale!r} must be > 0")
                scale = self._clamp(scale)
            scales[name] = scale
            velocities[name] = float(entry["velocity"])
        self._scale = scales
        self._velocity = velocities
        self.window = int(state["window"])
        self.num_updates = int(state["num_updates"])
