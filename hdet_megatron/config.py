"""HDET configuration: what is explored (axes) and how arms fan out, converge and learn.

Pure module: no torch.distributed, no megatron.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

#: Signals that evaluate the window's update line (every replica, its own unseen batch).
LINE_SIGNALS = ("line", "average")

#: The measured defaults (BENCHMARKS.md section 3) that ``"auto"``/``None`` fields resolve to:
#: with a probe, the ``average`` signal and the ``newton`` rule, started low; without one, the
#: paper's ``train`` signal with the ``relative`` rule at the user's LR (it cannot climb far, so
#: it must not start low).
LINE_SPREAD = 0.3
PAPER_SPREAD = 1.0 / 9.0
#: Where the LR scale starts with the probe defaults: a quarter of the user's LR. A too-high LR
#: does lasting damage within the first windows, a too-low one only costs the windows it takes
#: the controller to climb (BENCHMARKS.md 3c/3d).
SLOW_START_SCALE = 0.25
#: Windows a run needs for the slow start to pay off: the climb from a quarter of the guess moves
#: at most 2x per window, damped by momentum. Measured: 12 windows were enough (8x batch, guess
#: best/4 ended 1.5% below the best sweep point), 6 were not (+9.5%, BENCHMARKS.md 3d).
MIN_CLIMB_WINDOWS = 10

#: Axes whose spread is additive (the value can be 0); all others are multiplicative.
ADDITIVE_AXES = frozenset({"dropout"})
_FIXED_AXES = ("lr", "weight_decay", "dropout", "attention_temperature")
_GROUP_AXIS = re.compile(r"^lr:(?P<group>[A-Za-z0-9_.*\-]+)$")


class HDETConfigError(ValueError):
    """A bad HDET configuration value; the message names the field and what to do."""


@dataclass(frozen=True)
class Axis:
    """One explored scalar hyperparameter (paper Remark 1)."""

    name: str
    """``lr`` (all param groups), ``lr:<group>`` (one Megatron param group, by name or pattern),
    ``weight_decay``, ``dropout`` or ``attention_temperature``."""
    spread: float
    """Spread alpha. Multiplicative axes: arm multipliers lie in ``[1-alpha, 1+alpha]`` (linear)
    or ``[exp(-alpha), exp(alpha)]`` (log); must be in [0, 1) for linear. Additive axes
    (dropout): arm offsets lie in ``[-alpha, +alpha]`` around the base value."""
    kind: str = "linear"
    """``linear`` (the paper's evenly spaced values, mean exactly 1) or ``log`` (log-symmetric,
    geometric mean 1)."""
    min: float | None = None
    """Lower bound of the value an arm may use (after scale and spread); None = unbounded."""
    max: float | None = None
    """Upper bound of the value an arm may use; None = unbounded."""

    @property
    def additive(self) -> bool:
        """Additive spread (values that can be 0, e.g. dropout) rather than multiplicative."""
        return self.name in ADDITIVE_AXES

    @property
    def group(self) -> str | None:
        """The param-group selector of an ``lr:<group>`` axis, else None."""
        match = _GROUP_AXIS.match(self.name)
        return match.group("group") if match else None

    def validate(self) -> None:
        if not isinstance(self.name, str) or not (self.name in _FIXED_AXES or _GROUP_AXIS.match(self.name)):
            raise HDETConfigError(
                f"Axis.name={self.name!r} is not a known axis; use one of "
                f"{', '.join(_FIXED_AXES)} or 'lr:<group>'"
            )
        if not isinstance(self.spread, (int, float)) or not math.isfinite(self.spread):
            raise HDETConfigError(f"Axis({self.name!r}).spread={self.spread!r} must be a finite number")
        if self.spread < 0:
            raise HDETConfigError(
                f"Axis({self.name!r}).spread={self.spread} is negative; use a value >= 0 "
                "(0 switches the fan-out of this axis off)"
            )
        if self.kind not in ("linear", "log"):
            raise HDETConfigError(f"Axis({self.name!r}).kind={self.kind!r} must be 'linear' or 'log'")
        if not self.additive and self.kind == "linear" and self.spread >= 1:
            raise HDETConfigError(
                f"Axis({self.name!r}).spread={self.spread} >= 1 gives an arm a multiplier <= 0; "
                "use spread < 1 (the paper uses 1/9) or kind='log'"
            )
        for bound in ("min", "max"):
            value = getattr(self, bound)
            if value is not None and (not isinstance(value, (int, float)) or math.isnan(value)):
                raise HDETConfigError(f"Axis({self.name!r}).{bound}={value!r} must be a number or None")
        if self.name == "attention_temperature" and self.min is not None and self.min <= 0:
            raise HDETConfigError(
                f"Axis('attention_temperature').min={self.min}: a temperature <= 0 is invalid; use min > 0"
            )
        if self.name == "dropout" and (
            (self.min is not None and self.min < 0) or (self.max is not None and self.max >= 1)
        ):
            raise HDETConfigError(
                f"Axis('dropout') bounds [{self.min}, {self.max}] leave [0, 1); a dropout "
                "probability must be >= 0 and < 1"
            )
        if self.name == "dropout" and self.spread >= 1:
            raise HDETConfigError(
                f"Axis('dropout').spread={self.spread} >= 1 leaves [0, 1) for any base value"
            )
        if self.min is not None and self.max is not None and self.min > self.max:
            raise HDETConfigError(f"Axis({self.name!r}) bounds are inverted: min={self.min} > max={self.max}")


#: Fields that change how, not what, HDET computes: left out of ``fingerprint()`` (checkpoints,
#: run logs), so checkpoints stay what they were and a resume never reports them as changed.
_NOT_FINGERPRINTED = ("home_main_params", "resolution_note")


@dataclass(frozen=True)
class HDETConfig:
    """Hyperparameter-Divergent Ensemble Training settings (defaults follow the paper)."""

    period: int = 1000
    """Converge period T in optimizer steps: arms fan out for T steps, then average."""
    arms: int | None = None
    """Number of arms A; None = one per data-parallel replica. Must divide the DP size."""
    grad_sync: str = "global"
    """``global``: gradients are all-reduced across all DP ranks every step (the paper);
    ``arm``: only inside an arm during fan-out (local-SGD style, less DP traffic)."""
    axes: tuple[Axis, ...] | None = None
    """Explored hyperparameters, each with its own spread and per-window permutation. None: one
    ``lr`` axis with the measured spread (0.3 with auto-LR on a line signal, the paper's 1/9
    otherwise: with auto-LR off there is no line to fit, and the wide spread costs at a good LR)."""
    auto: bool = True
    """Run the auto controller (moves each axis' shared base toward the better arms)."""
    auto_start: int = 0
    """Optimizer steps before the controller may move (windows before it still fan out)."""
    temperature: float | str = 0.1
    """Softmax temperature sigma over the arms' loss advantages, or ``"auto"`` (std of the
    arms' window losses)."""
    meta_lr: float | None = None
    """Meta learning rate lambda of the controller update. None: 1.0 with ``rule="newton"`` (the
    step follows the fitted curve), else 0.5."""
    momentum: float | None = None
    """Momentum beta of the controller's velocity. None: 0.5 with ``rule="newton"``, else 0.9."""
    scale_bounds: tuple[float, float] = (0.01, 100.0)
    """Clamp ``[c_min, c_max]`` of every multiplicative axis' learned scale."""
    rule: str = "auto"
    """``auto`` (``newton`` with a line signal, else ``relative``), ``relative`` (our
    dimensionless update ``c <- c (1 + lambda v)``), ``paper`` (the paper's absolute update,
    with the decay taken from the base schedule) or ``newton`` (fit a quadratic to the arms'
    losses over their values and step towards its minimum:
    ``v <- beta v + (1-beta) log(rho*/rho_mean)``, ``c <- c exp(lambda v)``, with ``rho*`` at most
    a factor 2 from the arms' centre per window; needs >= 3 arms)."""
    seed: int = 0
    """Seed of the counter-based generator of per-window permutations (global RNGs untouched)."""
    bucket_mb: float = 40.0
    """Bucket size of the converge all-reduce, in MiB."""
    home_main_params: bool = True
    """Move the tensors a converge averages (fp32 main params: Megatron's masters or DistOpt
    shards, fp32 model params, FSDP2 local shards) into the converge's flat buckets once, so a
    converge is an in-place all-reduce of each bucket (no pack/unpack copies). Tensors that
    cannot be moved (bf16/fp16 params, views into another buffer such as DistOpt's fp32 shards)
    keep the copying path, logged once. ``False``: always copy. Not a training setting: the
    results are bit-identical either way, and it is not part of the checkpointed config."""
    converge_on_save: bool = True
    """Converge before a checkpoint is written, so the saved model is the averaged one."""
    nonfinite: str = "exclude"
    """A non-finite arm: ``exclude`` (weight 0, overwritten by the healthy arms' average) or
    ``raise`` (stop with an error)."""
    rollback: bool = False
    """When every arm is non-finite: restore the last converged state and cut the scale,
    instead of raising."""
    signal: str = "auto"
    """What the controller compares across arms. ``auto`` (the default): ``average`` when the
    training loop supplies a probe (``probe_fn``), the run has >= 3 arms, ``grad_sync="global"``
    and only an unbounded ``lr`` axis is explored, else ``train`` (the run logs which and why).
    ``train`` (each arm's mean training loss over
    the window, as in the paper) or ``probe`` (each arm's loss on one batch that is the same for
    every arm and that no arm has trained on, measured at the window's end before averaging; it
    removes the arms' different data from the comparison, at one forward pass per window; the
    training loop supplies the batch, see ``HDET(probe_fn=...)``) or ``line`` (every replica
    evaluates the window's update line at every arm's multiplier on its own unseen batch, and
    the fitted line's slope is corrected for the short-horizon bias, see
    :mod:`hdet_megatron.line_signal`; one forward pass per arm per window; needs
    ``grad_sync="global"``, one ``lr`` axis with a spread > 0 and >= 3 arms) or ``average``
    (the same line search through the arms' *window-averaged* iterates instead of their end
    points, uncorrected: a weight average stands in for the annealed model, so the noise floor
    that a later LR decay removes is left out of the comparison, while lasting damage is not;
    same requirements, plus one running sum of the main params updated every step)."""
    start_scale: float | None = None
    """Slow start: the LR scale the controller starts at, a fraction of the user's LR that it
    climbs from on evidence (multiplicative ``lr`` and ``lr:<group>`` axes). None: 0.25 when auto
    is on with a line signal (a too-high LR does lasting damage early, a too-low one only costs
    time), else 1 (the ``train`` signal cannot climb back far enough)."""
    brake: bool = True
    """Cut the LR scale by ``brake_factor`` at the first sign of instability (an arm's non-finite
    or spiking training loss, the high arms' loss rising, the mean loss blowing up) and hold it
    for ``brake_hold`` windows."""
    brake_factor: float = 0.5
    """Factor of a brake's cut of every multiplicative LR scale (in (0, 1))."""
    brake_spike: float = 0.2
    """Spike threshold: an arm's window training loss above the arms' median by this fraction
    of the median (and above the noise) brakes, when it is the arm with the highest LR or not
    finite."""
    brake_rise: float = 0.1
    """Rise threshold: the upper half of the arms (by LR) ending a window with a mean training
    loss this fraction above the previous window's mean brakes."""
    brake_hold: int = 2
    """Windows after a brake in which the LR scale may not rise."""
    noise_aware: bool = True
    """With a line signal: shrink each step by its confidence ``d^2 / (d^2 + se^2)``, where
    ``se`` is the jackknife standard error of the step over the replicas' own line losses, so a
    weak signal (small batch) leaves the scale where it is instead of overshooting."""
    warmup_hold: bool = True
    """No rise of an LR scale while the base schedule's LR is still rising (its warm-up, told
    by the base values of consecutive converges): the arms' window comparison there favours
    LRs the schedule keeps low on purpose, and a rise compounds with the warm-up's own. Acts
    only in windows that end inside a warm-up, so a warm-up shorter than one window is
    untouched (BENCHMARKS.md 3h)."""
    line_width: float | None = None
    """Line signals: score the window's line at as many evenly spaced multipliers as the arms have
    distinct ones, over ``[1 - line_width, 1 + line_width]``, instead of at the arms' own (None,
    the default). With ``grad_sync="global"`` the arms lie on one line and every replica rebuilds
    any point of it from its own parameters, so the line may be scored wider than the arms
    train: with ``axes=(Axis("lr", 0.05),)`` and ``line_width=0.3`` no arm trains at 1.3x the LR
    (past the edge of stability near a good LR) while the fit still compares 0.7..1.3. Measured,
    not the default (BENCHMARKS.md 3l)."""
    resolution_note: str = field(default="", compare=False, repr=False)
    """Set by :meth:`resolve`: which defaults it chose and why (the run logs it once at start).
    Not a setting: not compared, not checkpointed."""

    def __post_init__(self) -> None:
        # Accept lists for axes/scale_bounds (from argparse or JSON) but store tuples.
        if isinstance(self.axes, list):
            object.__setattr__(self, "axes", tuple(self.axes))
        if isinstance(self.scale_bounds, list):
            object.__setattr__(self, "scale_bounds", tuple(self.scale_bounds))
        self.validate()

    def validate(self) -> None:
        def bad(name: str, value: object, why: str) -> HDETConfigError:
            return HDETConfigError(f"HDETConfig.{name}={value!r}: {why}")

        if isinstance(self.period, bool) or not isinstance(self.period, int) or self.period < 1:
            raise bad("period", self.period, "must be an integer >= 1 (steps between converges)")
        if self.arms is not None and (
            isinstance(self.arms, bool) or not isinstance(self.arms, int) or self.arms < 1
        ):
            raise bad("arms", self.arms, "must be an integer >= 1 or None (one arm per DP replica)")
        if self.grad_sync not in ("global", "arm"):
            raise bad("grad_sync", self.grad_sync, "must be 'global' or 'arm'")
        if self.axes is not None and (
            not isinstance(self.axes, tuple) or not all(isinstance(a, Axis) for a in self.axes)
        ):
            raise bad("axes", self.axes, "must be a sequence of Axis(name, spread, ...) or None")
        seen: set[str] = set()
        for axis in self.axes or ():
            axis.validate()
            if axis.name in seen:
                raise bad("axes", axis.name, "the same axis is given twice; give each axis once")
            seen.add(axis.name)
        if "lr" in seen and any(Axis(n, 0).group for n in seen):
            raise bad(
                "axes",
                sorted(seen),
                "'lr' and 'lr:<group>' axes overlap; use either one global LR axis or per-group axes",
            )
        if not isinstance(self.auto, bool):
            raise bad("auto", self.auto, "must be True or False")
        if isinstance(self.auto_start, bool) or not isinstance(self.auto_start, int) or self.auto_start < 0:
            raise bad("auto_start", self.auto_start, "must be an integer >= 0")
        if isinstance(self.temperature, str):
            if self.temperature != "auto":
                raise bad("temperature", self.temperature, "must be a positive number or 'auto'")
        elif (
            not isinstance(self.temperature, (int, float))
            or not math.isfinite(self.temperature)
            or self.temperature <= 0
        ):
            raise bad("temperature", self.temperature, "sigma must be > 0 (or 'auto')")
        if self.meta_lr is not None and (
            not _number(self.meta_lr) or not math.isfinite(self.meta_lr) or self.meta_lr < 0
        ):
            raise bad("meta_lr", self.meta_lr, "must be a finite number >= 0 (or None: the measured default)")
        if self.momentum is not None and (not _number(self.momentum) or not 0 <= self.momentum < 1):
            raise bad("momentum", self.momentum, "must be in [0, 1) (or None: the measured default)")
        lo_hi = self.scale_bounds
        if (
            not isinstance(lo_hi, tuple)
            or len(lo_hi) != 2
            or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in lo_hi)
        ):
            raise bad("scale_bounds", lo_hi, "must be two finite numbers (c_min, c_max)")
        if lo_hi[0] <= 0 or lo_hi[0] > 1 or lo_hi[1] < 1:
            raise bad(
                "scale_bounds",
                lo_hi,
                "need 0 < c_min <= 1 <= c_max (the scale starts at 1); bounds inverted?",
            )
        if self.rule not in ("auto", "relative", "paper", "newton"):
            raise bad("rule", self.rule, "must be 'auto', 'relative', 'paper' or 'newton'")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise bad("seed", self.seed, "must be an integer >= 0")
        if not isinstance(self.bucket_mb, (int, float)) or not self.bucket_mb > 0:
            raise bad("bucket_mb", self.bucket_mb, "must be > 0 (MiB per converge bucket)")
        if not isinstance(self.home_main_params, bool):
            raise bad("home_main_params", self.home_main_params, "must be True or False")
        if not isinstance(self.converge_on_save, bool):
            raise bad("converge_on_save", self.converge_on_save, "must be True or False")
        if self.nonfinite not in ("exclude", "raise"):
            raise bad("nonfinite", self.nonfinite, "must be 'exclude' or 'raise'")
        if not isinstance(self.rollback, bool):
            raise bad("rollback", self.rollback, "must be True or False")
        if self.signal not in ("auto", "train", "probe") + LINE_SIGNALS:
            raise bad("signal", self.signal, "must be 'auto', 'train', 'probe', 'line' or 'average'")
        if self.signal in LINE_SIGNALS:
            why = _line_unsupported(self)
            if why:
                raise bad("signal", self.signal, why)
        if self.start_scale is not None and (
            not _number(self.start_scale)
            or not math.isfinite(self.start_scale)
            or not lo_hi[0] <= self.start_scale <= lo_hi[1]
        ):
            raise bad(
                "start_scale",
                self.start_scale,
                f"must be a number within scale_bounds {list(lo_hi)} (or None: the measured default)",
            )
        if not isinstance(self.brake, bool):
            raise bad("brake", self.brake, "must be True or False")
        if not _number(self.brake_factor) or not 0 < self.brake_factor < 1:
            raise bad("brake_factor", self.brake_factor, "must be in (0, 1) (the scale is multiplied by it)")
        for name in ("brake_spike", "brake_rise"):
            value = getattr(self, name)
            if not _number(value) or not math.isfinite(value) or value <= 0:
                raise bad(name, value, "must be a number > 0 (a fraction of the loss)")
        if isinstance(self.brake_hold, bool) or not isinstance(self.brake_hold, int) or self.brake_hold < 0:
            raise bad("brake_hold", self.brake_hold, "must be an integer >= 0 (windows)")
        if not isinstance(self.noise_aware, bool):
            raise bad("noise_aware", self.noise_aware, "must be True or False")
        if not isinstance(self.warmup_hold, bool):
            raise bad("warmup_hold", self.warmup_hold, "must be True or False")
        if self.line_width is not None:
            if not _number(self.line_width) or not 0.0 < self.line_width < 1.0:
                raise bad("line_width", self.line_width, "must be in (0, 1) (the points stay positive)")
            if self.signal not in ("auto",) + LINE_SIGNALS:
                why = f"only a line signal scores a line, not {self.signal!r}"
                raise bad("line_width", self.line_width, why)

    def axis(self, name: str) -> Axis | None:
        """The axis called ``name``, or None."""
        return next((a for a in self.axes or () if a.name == name), None)

    @property
    def resolved_axes(self) -> tuple[Axis, ...]:
        """The explored axes; a runtime reads them from a resolved config (:meth:`resolve`)."""
        if self.axes is None:
            raise HDETConfigError("HDETConfig.axes=None: resolve() the config first (the measured default)")
        return self.axes

    @property
    def resolved(self) -> bool:
        """No ``"auto"``/None field is left for :meth:`resolve` to fill."""
        return (
            self.signal != "auto"
            and self.rule != "auto"
            and self.axes is not None
            and self.meta_lr is not None
            and self.momentum is not None
            and self.start_scale is not None
        )

    def resolve(self, probe_available: bool, num_arms: int) -> Resolution:
        """Fill every ``"auto"``/None field with the measured default for this run.

        ``probe_available``: the training loop supplies a probe (``probe_fn``); ``num_arms``: the
        run's arm count. A resolved config returns itself. The note says what was chosen and why
        (one line for the run's log; empty when the user chose everything).
        """
        if self.resolved:
            return Resolution(self, "")
        signal, why = self.signal, ""
        if signal == "auto":
            blocker = _line_unsupported(self) or (
                "needs >= 3 arms (a quadratic over the arms)" if num_arms < 3 else ""
            )
            if not probe_available:
                blocker = "no probe_fn was given (a batch no arm trained on, at each window's end)"
            signal = "average" if not blocker else "train"
            why = f"signal {signal!r}" + (f": 'average' {blocker}" if blocker else " (a probe is available)")
        line = signal in LINE_SIGNALS
        rule = self.rule
        if rule == "auto":
            rule = "newton" if line and num_arms >= 3 else "relative"
        newton = rule == "newton"
        # The wide spread is there for the line's fit; with auto-LR off nothing fits a line, and at
        # an LR near the edge of stability the arm at 1.3x costs 3-11% (BENCHMARKS.md 3j, 3k).
        wide = line and self.auto
        axes = self.axes if self.axes is not None else (Axis("lr", LINE_SPREAD if wide else PAPER_SPREAD),)
        width = self.line_width if line else None  # no line signal, no line to score
        start = self.start_scale
        if start is None:
            start = SLOW_START_SCALE if self.auto and line and newton and num_arms >= 3 else 1.0
        config = replace(
            self,
            signal=signal,
            rule=rule,
            axes=axes,
            meta_lr=self.meta_lr if self.meta_lr is not None else (1.0 if newton else 0.5),
            momentum=self.momentum if self.momentum is not None else (0.5 if newton else 0.9),
            start_scale=start,
            line_width=width,
        )
        # With auto-LR off the signal and the rule never run: only the spread is worth a line.
        chosen = [why] if why and self.auto else []
        if self.rule == "auto" and self.auto:
            chosen.append(f"rule {rule!r}")
        if self.axes is None:
            chosen.append(f"LR spread {axes[0].spread:.3g}")
        if self.start_scale is None and self.auto:
            chosen.append(
                f"slow start at {start:g}x the given LR"
                if start != 1
                else "start at the given LR (no slow start without a line signal)"
            )
        head = "HDET auto-LR defaults: " if self.auto else "HDET defaults (auto-LR off): "
        note = head + "; ".join(chosen) if chosen else ""
        # The resolved config carries its note, so whoever builds the runtime from it (the
        # example resolves before it builds the scheduler) logs it.
        return Resolution(replace(config, resolution_note=note), note)

    def replace(self, **changes: Any) -> HDETConfig:
        return replace(self, **changes)

    def fingerprint(self) -> dict[str, Any]:
        """Plain-data view (for checkpoints and logs)."""
        out = {}
        for f in fields(self):
            if f.name in _NOT_FINGERPRINTED:
                continue
            value = getattr(self, f.name)
            if f.name == "axes" and value is not None:
                value = [
                    {"name": a.name, "spread": a.spread, "kind": a.kind, "min": a.min, "max": a.max}
                    for a in value
                ]
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @classmethod
    def from_fingerprint(cls, data: dict[str, Any]) -> HDETConfig:
        data = dict(data)
        # Checkpoints written before slow start, the brake and noise-aware steps existed ran
        # without them: a resume keeps that behaviour.
        data.setdefault("start_scale", 1.0)
        data.setdefault("brake", False)
        data.setdefault("noise_aware", False)
        data.setdefault("warmup_hold", False)
        if data.get("axes") is not None:
            data["axes"] = tuple(Axis(**a) for a in data["axes"])
        if "scale_bounds" in data:
            data["scale_bounds"] = tuple(data["scale_bounds"])
        return cls(**data)


@dataclass(frozen=True)
class Resolution:
    """What :meth:`HDETConfig.resolve` chose."""

    config: HDETConfig
    """The config with every ``"auto"``/None field filled in."""
    note: str
    """One line naming the defaults chosen and why (empty when nothing was left to choose)."""


def short_run_caution(config: HDETConfig, total_iterations: int) -> str:
    """One line for the run's log when a slow start has too few windows to climb back to the
    given LR (empty otherwise); ``config`` is resolved, ``total_iterations`` the run's length."""
    start = config.start_scale
    if not config.auto or start is None or start >= 1 or total_iterations <= 0:
        return ""
    climbing = total_iterations - config.auto_start  # iterations the controller acts in
    windows = climbing // config.period
    if windows >= MIN_CLIMB_WINDOWS:
        return ""
    period = max(1, climbing // MIN_CLIMB_WINDOWS)
    return (
        f"HDET auto-LR: this run has only {max(windows, 0)} windows of {config.period} iterations and "
        f"starts at {start:g}x the given LR; the climb back needs about {MIN_CLIMB_WINDOWS}: use a "
        f"period of {period} or less, or start_scale 1 (--hdet-start-scale 1) if the LR is not too high"
    )


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _line_unsupported(config: HDETConfig) -> str:
    """Why the line signals cannot run with ``config`` (empty when they can)."""
    # The arms lie on one line only when they share gradients and differ by step size.
    if config.grad_sync != "global":
        return "needs grad_sync='global' (arms on one update line)"
    if config.axes is None:
        return ""
    if [a.name for a in config.axes] != ["lr"] or not config.axes[0].spread > 0:
        return (
            "needs exactly one axis, 'lr', with a spread > 0 (other axes move the arms off the "
            f"update line); axes are {[(a.name, a.spread) for a in config.axes]}"
        )
    if config.axes[0].min is not None or config.axes[0].max is not None:
        # Clipped arms leave the line, and the points rebuilt from the multipliers would not be
        # where the arms trained (issue 29 bug 5).
        return (
            "needs an unbounded 'lr' axis: min/max clip some arms' LRs off the update line; "
            "drop the bounds (scale_bounds limit the learned scale)"
        )
    return ""


def parse_axis(text: str) -> Axis:
    """Parse ``NAME:SPREAD[:MIN:MAX]`` (the ``--hdet-axis`` flag); ``lr:<group>`` names allowed.

    Examples: ``lr:0.111``, ``dropout:0.05:0:0.3``, ``lr:embedding:0.2``.
    """
    parts = text.split(":")
    # An lr:<group> name contains one colon itself.
    if len(parts) >= 2 and parts[0] == "lr" and not _is_number(parts[1]):
        parts = [parts[0] + ":" + parts[1]] + parts[2:]
    if len(parts) not in (2, 4):
        raise HDETConfigError(
            f"--hdet-axis {text!r}: expected NAME:SPREAD or NAME:SPREAD:MIN:MAX "
            "(e.g. lr:0.111 or dropout:0.05:0:0.3)"
        )
    try:
        numbers = [float(p) if p != "" else None for p in parts[1:]]
    except ValueError:
        raise HDETConfigError(f"--hdet-axis {text!r}: SPREAD, MIN and MAX must be numbers") from None
    if numbers[0] is None:
        raise HDETConfigError(f"--hdet-axis {text!r}: SPREAD is required")
    axis = Axis(
        parts[0],
        numbers[0],
        min=numbers[1] if len(numbers) > 1 else None,
        max=numbers[2] if len(numbers) > 2 else None,
    )
    axis.validate()
    return axis


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def axes_from_strings(items: Sequence[str]) -> tuple[Axis, ...]:
    """:func:`parse_axis` over each of ``items``."""
    return tuple(parse_axis(item) for item in items)
