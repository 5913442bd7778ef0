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

Four guards make auto-LR safer to leave on (docs/auto-lr.md):

* **Slow start**: the LR scales start at ``config.start_scale`` (a quarter of the user's LR with
  the line signals) and climb only as the evidence says.
* **Brake**: a non-finite arm, the arms' mean training loss blowing up (x :data:`BLOW_UP`), the
  highest-LR arm's loss spiking above the other arms' trend over the multipliers by
  ``brake_spike`` of the median, or the upper half of the arms (by LR) rising ``brake_rise`` more
  than the lower half since the last window, each beyond :data:`BRAKE_Z` times the noise, cut
  every multiplicative LR scale by ``brake_factor``, zero its velocity and forbid a rise for
  ``brake_hold`` windows. A braked window does not enter the brake's noise and history (its own
  spike must not desensitize the brake).
* **Noise-aware steps** (line signals, ``noise_aware``): the step's jackknife standard error ``se``
  over the replicas' own line losses shrinks it by ``d^2 / (d^2 + se^2)``.
* **Warm-up hold** (``warmup_hold``): an LR scale may not rise in a converge at which the base
  schedule's LR is above its value at the previous converge (a warm-up).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from hdet_megatron.config import LINE_SIGNALS, Axis, HDETConfig
from hdet_megatron.line_signal import LineFit, fit_quadratic, jackknife_fits

__all__ = [
    "AllArmsNonFinite",
    "NonFiniteArm",
    "ControllerUpdate",
    "AutoController",
    "softmax_weights",
]

STATE_VERSION = 2
_LOADABLE_VERSIONS = (1, 2)

#: ``rule="newton"``: the most a multiplicative axis' target may differ from the arms' centre in
#: one window (a factor; 2 = one octave), since a quadratic fitted on the arms' range says little
#: about values far outside it.
NEWTON_MAX_STEP = 2.0

#: Issue 35's prototypes, off unless a benchmark switches them on in its own process (not API:
#: they are measured on the tuning tasks before any becomes a config field). None is open now:
#: the prototypes measured and rejected in BENCHMARKS 3e-3s were removed from the code (those
#: of 3e-3m rerun at commit b3a601d, ``hold_first`` of 3n and 3p at commit b32f5fe, the
#: unclipped jackknife of 3r at commit 6a105d6, ``decay_scaled_rise`` of 3s at commit
#: 3e7d803). The line scored wider than the arms train, measured as the prototype
#: ``"wide_line"`` (3j, 3l), is the config field ``HDETConfig.line_width``, and the defaults
#: before the warm-up hold are ``HDETConfig(warmup_hold=False)``.
PROTOTYPES: set[str] = set()
KNOWN_PROTOTYPES: frozenset[str] = frozenset()

#: The brake needs a spike or rise this many times the window's noise (the spread of the other
#: arms' training losses) besides its relative threshold: noise alone must not cut the LR.
BRAKE_Z = 6.0

#: The brake fires, whatever the noise, when the arms' mean training loss ends a window more than
#: this factor above the previous window's.
BLOW_UP = 4.0

#: The spike and the rise must also reach HISTORY_Z times their own RMS over the run's past
#: windows (once HISTORY_MIN windows are seen; EWMA weight HISTORY_EWMA): a model whose high-LR
#: arms always fluctuate that much is not becoming unstable.
HISTORY_Z = 4.0
HISTORY_MIN = 3
HISTORY_EWMA = 0.2


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
    raw_deltas: dict[str, float] = field(default_factory=dict)
    """Per-axis Delta before the noise-aware shrink (equal to :attr:`deltas` without it)."""
    confidence: dict[str, float] = field(default_factory=dict)
    """Per axis with a noise-aware step: ``d^2 / (d^2 + se^2)`` (1 = a clear signal)."""
    step_se: dict[str, float] = field(default_factory=dict)
    """Per axis with a noise-aware step: the jackknife standard error of Delta."""
    brake: str | None = None
    """Why the brake fired in this update (None: it did not)."""
    hold: int = 0
    """Windows left after this update in which the LR scales may not rise."""

    def to_dict(self) -> dict[str, Any]:
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
    for r, e in zip(finite, exps, strict=True):
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


def _newton_delta_of(values: Sequence[float], losses: Sequence[float], additive: bool) -> float:
    """:func:`_newton_delta` over the arms whose loss is finite, centred on all arms' values."""
    keep = [r for r in range(len(values)) if math.isfinite(losses[r])]
    return _newton_delta(
        [values[r] for r in keep],
        [losses[r] for r in keep],
        center=math.fsum(values) / len(values),
        additive=additive,
    )


def _is_lr(axis: Axis) -> bool:
    """A learning-rate axis (``lr`` or ``lr:<group>``): slow start and the brake act on these."""
    return axis.name == "lr" or axis.group is not None


def _extrapolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """The least-squares line through ``(xs, ys)`` at ``x`` (their mean with < 2 distinct xs)."""
    mean_x, mean_y = math.fsum(xs) / len(xs), math.fsum(ys) / len(ys)
    sxx = math.fsum((v - mean_x) ** 2 for v in xs)
    if not sxx > 0:
        return mean_y
    slope = math.fsum((u - mean_x) * (v - mean_y) for u, v in zip(xs, ys, strict=True)) / sxx
    return mean_y + slope * (x - mean_x)


def _halves(train: Sequence[float], order: Sequence[int]) -> tuple[float, float]:
    """Mean training loss of the lower and the upper half of ``order`` (>= 2 arms, by LR)."""
    half = len(order) // 2
    return (
        math.fsum(train[r] for r in order[:half]) / half,
        math.fsum(train[r] for r in order[half:]) / (len(order) - half),
    )


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2.0


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

    def __init__(self, config: HDETConfig, num_arms: int, *, probe_available: bool = False) -> None:
        if isinstance(num_arms, bool) or not isinstance(num_arms, int) or num_arms < 1:
            raise ValueError(f"num_arms={num_arms!r} must be an integer >= 1")
        resolution = config.resolve(probe_available, num_arms)
        config = resolution.config
        self.resolution_note = resolution.note
        """What the ``"auto"``/None fields resolved to and why (empty if nothing was left)."""
        if config.rule == "newton" and num_arms < 3 and (config.auto or config.signal in LINE_SIGNALS):
            raise ValueError(
                f"HDETConfig.rule='newton' fits a quadratic over the arms and needs >= 3 arms, "
                f"this run has {num_arms}; use rule='relative' or more data-parallel replicas"
            )
        if config.signal in LINE_SIGNALS and num_arms < 3:
            raise ValueError(
                f"HDETConfig.signal={config.signal!r} fits the update line at the arms' multipliers "
                f"and needs >= 3 arms, this run has {num_arms}; use signal='probe' or 'train'"
            )
        self.config = config
        self.num_arms = num_arms
        self._axes = {axis.name: axis for axis in config.resolved_axes}
        self._lr_axis = next((name for name, axis in self._axes.items() if _is_lr(axis)), None)
        """The first LR axis: its multipliers order the arms for the brake (None: no LR axis)."""
        self._scale: dict[str, float] = {name: self._initial(axis) for name, axis in self._axes.items()}
        self._velocity: dict[str, float] = {name: 0.0 for name in self._axes}
        self.num_updates = 0
        """Number of updates that moved the scales."""
        self.window = 0
        """Index of the current (next to end) window = number of ``update`` calls so far; the
        arms of the current window use ``spread.arm_spread(config, n, controller.window)``."""
        self.hold = 0
        """Windows left in which the LR scales may not rise (after a brake)."""
        self.last_mean_loss: float | None = None
        """The previous window's mean training loss over the finite arms (the brake's rise test)."""
        self.noise: float | None = None
        """EWMA over windows of the spread of the arms' training losses (the brake's noise level)."""
        self.history: dict[str, tuple[int, float]] = {}
        """Per brake statistic (``spike``, ``lift``): windows seen and the EWMA of its square."""
        self.last_bases: dict[str, float] = {}
        """The base schedule's values at the previous update (the warm-up hold's evidence)."""
        self.last_halves: tuple[float, float] | None = None
        """The previous window's mean training loss of the lower and the upper half of the arms
        by LR multiplier (the brake's rise test)."""

    def _initial(self, axis: Axis) -> float:
        if axis.additive:
            return 0.0
        start = self.config.start_scale
        assert start is not None  # resolve() filled it
        return self._clamp(start) if _is_lr(axis) else 1.0

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
        *,
        line: LineFit | None = None,
        train_losses: Sequence[float] | None = None,
    ) -> ControllerUpdate:
        """One converge: weigh the arms by their window losses and move every axis.

        ``line``: the window's line fit (line signals), whose replica rows give the noise-aware
        step its standard error. ``train_losses``: each arm's mean training loss over the window
        (the brake's evidence; ``arm_losses`` with ``signal="train"`` when not given).

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
        if train_losses is None:
            train_losses = losses if cfg.signal == "train" else [math.nan] * self.num_arms
        train = self._check_losses(train_losses)
        stats: dict[str, float] = {}  # the brake's statistics of this window (its history)
        brake = self._brake_reason(losses, train, spreads, stats) if move and cfg.brake else None
        jackknife = (
            jackknife_fits(line, spreads["lr"])
            if cfg.noise_aware and line is not None and cfg.rule == "newton" and "lr" in self._axes
            else []
        )

        # resolve() (in __init__) filled both.
        assert cfg.meta_lr is not None and cfg.momentum is not None
        meta_lr, momentum = cfg.meta_lr, cfg.momentum
        unknown = PROTOTYPES - KNOWN_PROTOTYPES
        if unknown:
            raise ValueError(
                f"unknown controller prototypes {sorted(unknown)}; known: {sorted(KNOWN_PROTOTYPES)}"
            )
        # Warm-up hold: the base LR rose since the last converge (none before a process's first).
        previous_bases = self.last_bases
        deltas: dict[str, float] = {}
        raw_deltas: dict[str, float] = {}
        confidence: dict[str, float] = {}
        step_se: dict[str, float] = {}
        new_scale = dict(self._scale)
        new_velocity = dict(self._velocity)
        for name, axis in self._axes.items():
            values = spreads[name]
            c = self._scale[name]
            base = bases.get(name)
            if cfg.rule == "paper" and not axis.additive and base is not None:
                # Absolute units: h_r = base * c * rho_r.
                values = [base * c * x for x in values]
            if uniform:
                # Equal weights carry no information: exactly 0 (no drift from rounding).
                delta = 0.0
            elif cfg.rule == "newton":
                delta = _newton_delta_of(values, losses, axis.additive)
            else:
                center = math.fsum(values) / len(values)
                # sum_r w_r (x_r - mean): for the linear spread x_r - 1 is exact, so a neutral
                # controller gives exactly 0.
                delta = math.fsum(w * (x - center) for w, x in zip(weights, values, strict=True))
            raw_deltas[name] = delta
            if name == "lr" and jackknife and not uniform:
                # Leave-one-replica-out steps; se^2 = (n-1)/n sum (d_i - mean)^2 (jackknife).
                ds = [_newton_delta_of(values, fit.pseudo_losses, False) for fit in jackknife]
                mean = math.fsum(ds) / len(ds)
                se = math.sqrt((len(ds) - 1) / len(ds) * math.fsum((d - mean) ** 2 for d in ds))
                conf = delta * delta / (delta * delta + se * se) if delta != 0.0 else 0.0
                step_se[name], confidence[name] = se, conf
                delta *= conf
            deltas[name] = delta
            if not move:
                continue
            if brake is not None and _is_lr(axis):
                # Cut now; the momentum that led here goes with it.
                new_velocity[name] = 0.0
                new_scale[name] = self._clamp(c * cfg.brake_factor)
                continue
            v = momentum * self._velocity[name] + (1.0 - momentum) * delta
            if self.hold and _is_lr(axis) and v > 0:
                v = 0.0  # held after a brake: no rise yet
            warming = name in bases and bases[name] > previous_bases.get(name, math.inf)
            if cfg.warmup_hold and _is_lr(axis) and warming and v > 0:
                v = 0.0
            new_velocity[name] = v
            if axis.additive:
                new_scale[name] = self._bound_shift(axis, c + meta_lr * v, base)
            elif cfg.rule == "newton":
                new_scale[name] = self._clamp(c * math.exp(meta_lr * v))
            elif cfg.rule == "paper":
                if base is None or base == 0.0:
                    # No base value to convert back (e.g. an LR of exactly 0): keep c.
                    new_scale[name] = c
                else:
                    new_scale[name] = self._clamp((base * c + meta_lr * v) / base)
            else:
                new_scale[name] = self._clamp(c * (1.0 + meta_lr * v))

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
            raw_deltas=raw_deltas,
            confidence=confidence,
            step_se=step_se,
            brake=brake,
        )
        # Commit only after everything above succeeded.
        self._scale = new_scale
        self._velocity = new_velocity
        self.last_bases = bases
        self.window += 1
        if move:
            self.num_updates += 1
            self.hold = cfg.brake_hold if brake is not None else max(self.hold - 1, 0)
        self._track_losses(train, spreads, stats, braked=brake is not None)
        update.hold = self.hold
        return update

    def _history_bar(self, name: str) -> float:
        """HISTORY_Z times the RMS of the brake statistic ``name`` over past windows (0 before
        HISTORY_MIN windows): what this run's own window-to-window variation reaches."""
        count, mean_square = self.history.get(name, (0, 0.0))
        return HISTORY_Z * math.sqrt(mean_square) if count >= HISTORY_MIN else 0.0

    def _track_losses(
        self,
        train: Sequence[float],
        spreads: Mapping[str, Sequence[float]],
        stats: Mapping[str, float],
        braked: bool = False,
    ) -> None:
        """Remember this window's mean training loss and fold its spread into the noise level
        (an EWMA over windows) for the brake's tests of the next window. A window the brake cut
        is left out: its spike would raise the bars it is judged by (the same spike two windows
        later would no longer brake), and the windows after it are compared with the last
        healthy one."""
        if braked:
            return
        for name, value in stats.items():
            count, mean_square = self.history.get(name, (0, 0.0))
            weight = max(1.0 / (count + 1), HISTORY_EWMA)
            self.history[name] = (count + 1, (1.0 - weight) * mean_square + weight * value * value)
        finite = [r for r in range(self.num_arms) if math.isfinite(train[r])]
        if not finite:
            return
        self.last_mean_loss = math.fsum(train[r] for r in finite) / len(finite)
        order = self._lr_order(train, spreads)
        if len(order) >= 2:
            self.last_halves = _halves(train, order)
            if len(order) >= 3:
                spread = _pstdev([train[r] for r in order[:-1]])
                self.noise = spread if self.noise is None else 0.5 * self.noise + 0.5 * spread

    def _lr_order(self, train: Sequence[float], spreads: Mapping[str, Sequence[float]]) -> list[int]:
        """The arms with a finite training loss, by their multiplier on the first LR axis."""
        if self._lr_axis is None:
            return []
        rho = spreads[self._lr_axis]
        return sorted((r for r in range(self.num_arms) if math.isfinite(train[r])), key=lambda r: rho[r])

    def _brake_reason(
        self,
        losses: Sequence[float],
        train: Sequence[float],
        spreads: Mapping[str, Sequence[float]],
        stats: dict[str, float],
    ) -> str | None:
        """Why this window shows instability of the LR (None: it does not); see the module doc.
        Writes the window's spike and rise statistics into ``stats``."""
        cfg = self.config
        if self._lr_axis is None:
            return None
        # The runtimes report an arm with non-finite params as an infinite loss.
        bad = [r for r in range(self.num_arms) if not math.isfinite(losses[r]) or math.isinf(train[r])]
        if bad:
            return f"arm(s) {bad} non-finite"
        rho = spreads[self._lr_axis]
        order = self._lr_order(train, spreads)
        if len(order) < 2:
            return None
        top, others = order[-1], order[:-1]
        median = _median([train[r] for r in order])
        # The noise: the spread of the arms' losses (besides the top arm's; it also holds their LR
        # differences, so it errs on the side of not braking) in the windows before this one, as
        # an instability inflates this window's own spread; a cut must beat BRAKE_Z of it.
        noise = self.noise
        if noise is None:
            noise = _pstdev([train[r] for r in others]) if len(others) >= 2 else 0.0
        prev = self.last_mean_loss
        mean = math.fsum(train[r] for r in order) / len(order)
        if prev is not None and prev > 0 and mean > BLOW_UP * prev and mean - prev > BRAKE_Z * noise:
            return f"the arms' mean loss blew up from {prev:.4g} to {mean:.4g}"
        # A spike is the top arm off the trend of the others (a loss that simply grows with the LR,
        # as a noise floor does, is no spike): the others' line over the multipliers, extrapolated.
        expected = _extrapolate([rho[r] for r in others], [train[r] for r in others], rho[top])
        resid = train[top] - expected
        stats["spike"] = resid
        if resid > max(cfg.brake_spike * abs(median), BRAKE_Z * noise, self._history_bar("spike")):
            return (
                f"the highest-LR arm {top}'s loss {train[top]:.4g} is {resid:+.3g} off "
                f"the other arms' trend ({expected:.4g})"
            )
        # A rise: the upper half of the multipliers' loss rose against the lower half's since the
        # last window (a scale change moves both alike).
        low, high = _halves(train, order)
        last = self.last_halves
        if last is not None and last[0] > 0 and last[1] > 0 and low > 0:
            lift = high / last[1] - low / last[0]
            excess = high - last[1] * low / last[0]
            stats["lift"] = lift
            bar = BRAKE_Z * noise * math.sqrt(4.0 / len(order))
            if lift > max(cfg.brake_rise, self._history_bar("lift")) and excess > bar:
                return (
                    f"the high-LR arms' loss rose {high / last[1] - 1:+.1%} over the window against "
                    f"{low / last[0] - 1:+.1%} for the low-LR arms"
                )
        return None

    def cut_scale(self, factor: float = 0.5) -> None:
        """After a rollback: multiply every multiplicative scale by ``factor`` (clamped to
        ``scale_bounds``) and reset all velocities (their momentum led to the blow-up)."""
        if not _is_number(factor) or not math.isfinite(factor) or factor <= 0:
            raise ValueError(f"cut_scale factor={factor!r} must be a finite number > 0")
        for name, axis in self._axes.items():
            if not axis.additive:
                self._scale[name] = self._clamp(self._scale[name] * factor)
            self._velocity[name] = 0.0

    def _bound_shift(self, axis: Axis, shift: float, base: float | None) -> float:
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
    def state_dict(self) -> dict[str, Any]:
        """Plain-data state (ints, floats, strings, lists, dicts) for checkpoints."""
        return {
            "version": STATE_VERSION,
            "num_arms": self.num_arms,
            "window": self.window,
            "num_updates": self.num_updates,
            "hold": self.hold,
            "last_mean_loss": self.last_mean_loss,
            "noise": self.noise,
            "last_halves": None if self.last_halves is None else list(self.last_halves),
            "last_bases": dict(self.last_bases),
            "history": {name: [count, ms] for name, (count, ms) in self.history.items()},
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
        if state["version"] not in _LOADABLE_VERSIONS:
            raise ValueError(
                f"controller state version {state['version']!r} is not supported (expected one of "
                f"{list(_LOADABLE_VERSIONS)})"
            )
        hold = state.get("hold", 0)  # version 1 had no brake
        if isinstance(hold, bool) or not isinstance(hold, int) or hold < 0:
            raise ValueError(f"controller state['hold']={hold!r} must be an integer >= 0")
        last, noise = state.get("last_mean_loss"), state.get("noise")
        for key, value in (("last_mean_loss", last), ("noise", noise)):
            if value is not None and (not _is_number(value) or not math.isfinite(value)):
                raise ValueError(f"controller state[{key!r}]={value!r} must be a finite number or None")
        halves = state.get("last_halves")
        if halves is not None:
            if (
                not isinstance(halves, (list, tuple))
                or len(halves) != 2
                or not all(_is_number(v) and math.isfinite(v) for v in halves)
            ):
                raise ValueError(
                    f"controller state['last_halves']={halves!r} must be two finite numbers or None"
                )
            halves = (float(halves[0]), float(halves[1]))
        history: dict[str, tuple[int, float]] = {}
        for name, entry in (state.get("history") or {}).items():
            if (
                name not in ("spike", "lift")
                or not isinstance(entry, (list, tuple))
                or len(entry) != 2
                or isinstance(entry[0], bool)
                or not isinstance(entry[0], int)
                or not _is_number(entry[1])
                or not math.isfinite(entry[1])
            ):
                raise ValueError(f"controller state['history'][{name!r}]={entry!r} is malformed")
            history[name] = (int(entry[0]), float(entry[1]))
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
        bases = state.get("last_bases") or {}  # absent before the warm-up hold existed
        if not isinstance(bases, Mapping) or not all(
            name in self._axes and _is_number(v) and math.isfinite(v) for name, v in bases.items()
        ):
            raise ValueError(
                f"controller state['last_bases']={bases!r} must map this config's axes to finite numbers"
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
        self.hold = hold
        self.last_mean_loss = None if last is None else float(last)
        self.noise = None if noise is None else float(noise)
        self.last_halves = halves
        self.last_bases = {name: float(v) for name, v in bases.items()}
        self.history = history
