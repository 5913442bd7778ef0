"""The window engine: one piece of code from "a step was taken" to "the controller updated".

Every runtime (``HDETOneCycleLR`` with DDP or FSDP2, Megatron-Core's ``HDET``, its FSDP variant,
the patched megatron.training loop) runs its windows through :class:`WindowEngine`; what differs
between them is a thin :class:`WindowAdapter` (topology, parameters, ``refresh``, the reduction
group, the base schedule). Per step the engine accumulates the training loss on the device and,
for ``signal="average"``, the running sum of the iterates (no host sync). At a window's end it:

1. probes: fetches one batch per window from the :class:`~hdet_megatron.probe.BatchProbe` and
   scores it once (``probe``) or at every point of the window's update line
   (``line``/``average``, :class:`~hdet_megatron.line_search.LineSearch`); nothing is probed when
   auto-LR is off (nothing would read it);
2. reduces the window in one small all-reduce (:func:`~hdet_megatron.window_losses.reduce_window`):
   each reporter's training-loss ``(sum, count)``, its probe losses, whether its arm's params are
   finite, and its probe batch's fingerprint, which is checked: ``probe`` needs the same batch on
   every replica (an error otherwise), the line signals each replica its own (a warning when they
   are all the same: the replicas' rows then agree exactly, the standard error is 0 and the noise
   guard is gone);
3. fits the line (``kappa`` from the adapter's :meth:`WindowAdapter.horizon_lrs`), marks arms
   with non-finite params as infinitely bad, updates the controller;
4. averages the arms (an excluded arm contributes nothing and its optimizer state is sanitized),
   or, when every arm diverged and ``rollback`` is on, restores the last converged params and cuts
   the scale by ``brake_factor``;
5. starts the next window.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hdet_megatron.averaging import AverageStats, own_storage
from hdet_megatron.config import LINE_SIGNALS, HDETConfig
from hdet_megatron.controller import AllArmsNonFinite, AutoController, ControllerUpdate
from hdet_megatron.line_search import LineSearch
from hdet_megatron.line_signal import LineFit, fit_line, line_points, persistence
from hdet_megatron.probe import BatchProbe, run_probe
from hdet_megatron.window_losses import LossAccumulator, WindowLosses, params_finite

logger = logging.getLogger(__name__)

__all__ = [
    "MissingLoss",
    "ProbeBatchMismatch",
    "RollbackStore",
    "WindowAdapter",
    "WindowEnd",
    "WindowEngine",
    "show_notices",
    "startup_notice",
    "zero_non_finite_state",
]

#: Signals whose controller input comes from a probe.
PROBE_SIGNALS = ("probe",) + LINE_SIGNALS


class MissingLoss(RuntimeError):
    """The controller needs window losses but ``step()`` got no ``loss`` (on some arm)."""


class ProbeBatchMismatch(RuntimeError):
    """``signal="probe"`` scored the arms on different batches (they must share one)."""


def startup_notice(config: HDETConfig, note: str = "", probe_given: bool = True) -> tuple[str, bool]:
    """The one line a run logs about auto-LR when it starts, and whether it is a warning.

    ``config`` is resolved; ``note`` is :meth:`HDETConfig.resolve`'s (why the defaults were
    chosen; empty when the caller resolved the config itself). A warning when auto-LR starts
    below the given LR (the slow start) or runs without a probe."""
    if not config.auto:  # the note (if any) says auto-LR is off and names the spread it chose
        idle = (
            "the probe is not run (nothing would read it)"
            if probe_given and config.signal in PROBE_SIGNALS
            else ""
        )
        if note:
            return note + (f"; {idle}" if idle else ""), False
        return (f"HDET auto-LR is off: {idle}" if idle else ""), False
    if note:  # the resolution's note names what it chose and why
        parts = [note]
    else:
        axes = ", ".join(f"{a.name} spread {a.spread:.3g}" for a in config.resolved_axes)
        width = f", line scored at 1 +- {config.line_width:g}" if config.line_width is not None else ""
        parts = [f"HDET auto-LR: signal {config.signal!r}, rule {config.rule!r}, {axes}{width}"]
    start = config.start_scale if config.start_scale is not None else 1.0
    slow = start < 1
    if slow:
        said = "slow start at" in note  # the note named the start already
        parts.append(
            ("that is " if said else "the LR starts ")
            + f"{1 / start:g}x below the given LR"
            + ("" if said else f" (start_scale {start:g})")
            + ", climbing only on evidence: start_scale=1 (--hdet-start-scale 1) starts at the given "
            "LR, auto=False (--no-hdet-auto) switches auto-LR off"
        )
    no_probe = config.signal not in PROBE_SIGNALS and not probe_given
    return "; ".join(parts), slow or no_probe


def is_log_rank() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class _NoticeHandler(logging.StreamHandler):
    """The handler :func:`show_notices` installs (found again by its type)."""


def show_notices(prefix: str) -> None:
    """Print the window engine's run-level notices (the auto-LR settings it resolved and why,
    the slow start, probe-batch warnings) on stdout as ``prefix message``, like the program's own
    progress lines; they are logged on rank 0 only. For programs that configure no logging (the
    example, Megatron-LM's loop); calling it again replaces the prefix."""
    log = logging.getLogger(__name__)
    for old in [h for h in log.handlers if isinstance(h, _NoticeHandler)]:
        log.removeHandler(old)
    handler = _NoticeHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"{prefix} %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False  # once, even where the root logger has a handler too


@dataclass
class WindowEnd:
    """What one window's end did (plain data and the controller's own objects)."""

    window: int
    """Index of the window that just ended."""
    step: int
    """The runtime's step count when it ended."""
    steps: int
    """Steps in the window (``period``, or fewer for a forced converge)."""
    arm_values: dict[str, list[float]]
    """Per axis: the spread value (multiplier/offset) each arm used in the window."""
    losses: WindowLosses
    """The window's reduced losses."""
    arm_losses: list[float]
    """What the controller compared (the line's pseudo-losses, the probe losses or the training
    losses; inf for an arm with non-finite params)."""
    train_losses: list[float]
    """Each arm's mean training loss over the window (inf for non-finite params)."""
    excluded: list[int]
    """Arms left out of the average (non-finite)."""
    update: ControllerUpdate | None
    """The controller update (None: no loss at all, or a rollback)."""
    line: LineFit | None
    """The window's line fit (line signals; None otherwise or without a valid line)."""
    stats: AverageStats | None
    """The average's stats (None on a single replica or after a rollback)."""
    probe_seconds: float = 0.0
    """Host wall time of the window's probes."""
    converge_seconds: float = 0.0
    """Host wall time of the average, refresh and snapshot (or of the rollback)."""
    forced: bool = False
    """A converge requested before the window's end (a save, the run's end)."""
    rolled_back: bool = False
    """Every arm diverged and the last converged params were restored."""


class WindowAdapter:
    """What a runtime supplies to the :class:`WindowEngine` (subclass and fill in).

    Attributes a subclass sets: ``config`` (resolved), ``arm``, ``num_arms``, ``device``.
    """

    config: HDETConfig
    arm: int
    num_arms: int
    device: torch.device

    @property
    def controller(self) -> AutoController:
        """The controller (Megatron's scheduler owns it, and a resume replaces it)."""
        raise NotImplementedError

    def tensors(self) -> list[torch.Tensor]:
        """The tensors the optimizer updates on this rank, as they are now."""
        raise NotImplementedError

    def probe_modules(self) -> list[torch.nn.Module]:
        """The modules switched to eval mode while probing."""
        raise NotImplementedError

    def refresh(self) -> None:
        """Make the model compute with :meth:`tensors` as they are now."""

    def after_probe(self) -> None:
        """After each probe forward (FSDP: reshard what the forward left gathered)."""

    def probe_value(self, raw: Any) -> torch.Tensor | None:
        """This rank's loss from what the probe's ``loss_fn`` returned (None where it reports
        none, e.g. off the last pipeline stage)."""
        raise NotImplementedError

    def reduce(
        self,
        *,
        train_sum: torch.Tensor,
        train_count: int,
        probe: torch.Tensor | None,
        points: torch.Tensor | None,
        num_points: int,
        finite: torch.Tensor,
        fingerprint: torch.Tensor | None,
    ) -> WindowLosses:
        """The window's one reduction over the runtime's loss group
        (:func:`~hdet_megatron.window_losses.reduce_window`)."""
        raise NotImplementedError

    def horizon_lrs(self, step: int) -> tuple[float, float]:
        """``(base LR of the next step, base LR at the schedule's end)`` of param group 0, after
        ``step`` steps (``line``'s persistence kappa)."""
        raise NotImplementedError

    def base_values(self, step: int) -> dict[str, float]:
        """Every axis's base (un-spread, un-scaled) value for the next step, after ``step`` steps
        (``rule="paper"``)."""
        raise NotImplementedError

    def average(self, weight: float | None) -> AverageStats | None:
        """Average the arms' tensors (``weight``: this replica's, when some arm is excluded)."""
        raise NotImplementedError

    def sanitize_optimizer_state(self) -> None:
        """Zero non-finite optimizer state (an excluded arm's moments)."""
        raise NotImplementedError


@torch.no_grad()
def zero_non_finite_state(states: Iterable[Mapping[Any, Any]]) -> None:
    """Zero the non-finite entries of optimizer states (momentum buffers, Adam moments) in place:
    an excluded arm's params are overwritten by the healthy arms' average, but its moments would
    turn them non-finite again on its next step. No host sync."""
    for state in states:
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                torch.nan_to_num_(value, nan=0.0, posinf=0.0, neginf=0.0)


class RollbackStore:
    """The last converged params, in host memory (pinned next to a GPU) or on disk (one file per
    rank). ``tensors``: a list, or a callable read at every save and restore (the window engine
    passes its adapter's, which may replace tensor objects)."""

    def __init__(
        self, tensors: Callable[[], Sequence[torch.Tensor]] | Sequence[torch.Tensor], directory: str | None
    ) -> None:
        if callable(tensors):
            self.tensors = tensors
        else:
            fixed = list(tensors)
            self.tensors = lambda: fixed
        self.directory = directory
        self._host: list[torch.Tensor] | None = None
        if directory is not None:
            os.makedirs(directory, exist_ok=True)
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            self.path = os.path.join(directory, f"hdet-rollback-rank{rank}.pt")
        self.save()

    @torch.no_grad()
    def save(self) -> None:
        tensors = list(self.tensors())
        if self.directory is None:
            if self._host is None:
                # Pinned when the params are on a GPU: faster device-to-host copies.
                self._host = [torch.empty_like(t, device="cpu", pin_memory=t.is_cuda) for t in tensors]
            for dst, src in zip(self._host, tensors, strict=True):
                dst.copy_(src)
        else:
            tmp = self.path + ".tmp"
            torch.save([own_storage(t).cpu() for t in tensors], tmp)
            os.replace(tmp, self.path)  # never leave a half-written snapshot

    @torch.no_grad()
    def restore(self) -> None:
        saved = self._host if self.directory is None else torch.load(self.path)
        assert saved is not None  # restore() follows a save()
        for dst, src in zip(self.tensors(), saved, strict=True):
            dst.copy_(src)


class WindowEngine:
    """The window path of every runtime (see the module docstring).

    Args:
        adapter: the runtime's :class:`WindowAdapter`.
        probe: the :class:`~hdet_megatron.probe.BatchProbe` (None: no probe).
        rollback_dir: with ``config.rollback``: None keeps the snapshot in host memory, else
            one file per rank in this directory.
        note: :meth:`HDETConfig.resolve`'s note, logged once with the run's auto-LR settings.
    """

    def __init__(
        self,
        adapter: WindowAdapter,
        probe: BatchProbe | None,
        *,
        rollback_dir: str | None = None,
        note: str = "",
        acc_dtype: torch.dtype = torch.float64,
    ) -> None:
        self.adapter = adapter
        self.config = config = adapter.config
        if config.signal in PROBE_SIGNALS and probe is None:
            raise ValueError(f"HDETConfig.signal={config.signal!r} needs a probe")
        self.probe = probe
        # Probes run only when something reads them: the controller (auto-LR on).
        self.probing = probe is not None and config.auto and config.signal in PROBE_SIGNALS
        self.losses = LossAccumulator(adapter.device, acc_dtype)
        self.steps_in_window = 0
        """Steps since the last converge (the window's start)."""
        # The line signals' memory: 2 copies of the params (3 with "average"), only when probed.
        self.line_search: LineSearch | None = None
        if self.probing and config.signal in LINE_SIGNALS:
            self.line_search = LineSearch(adapter.tensors, config.signal)
            self.line_search.mark_window_start()
        self.rollback = RollbackStore(adapter.tensors, rollback_dir) if config.rollback else None
        self.num_converges = 0
        self.num_rollbacks = 0
        self.last: WindowEnd | None = None
        self.last_update: ControllerUpdate | None = None
        self.last_line: LineFit | None = None
        self._warned_same_batch = False
        line, warn = startup_notice(config, note or config.resolution_note, probe is not None)
        if line and is_log_rank():
            (logger.warning if warn else logger.info)("%s", line)

    # -- per step ----------------------------------------------------------------------------------
    def add_loss(self, loss: torch.Tensor | float) -> None:
        """This reporter's training loss of the step just taken (device-side, no host sync)."""
        self.losses.add(loss)

    def after_step(self) -> None:
        """One optimizer step done (``"average"``: one device-side add to the running sum)."""
        if self.line_search is not None:
            self.line_search.accumulate()
        self.steps_in_window += 1

    def mark_window_start(self) -> None:
        """The params are a window's start (after a converge; after a checkpoint load, valid for
        the line signals only at a window boundary)."""
        if self.line_search is not None:
            self.line_search.mark_window_start(self.steps_in_window)

    def load_window(self, steps_in_window: int, loss_sum: float, loss_count: int) -> None:
        """Continue a window from a checkpoint: its steps and this reporter's loss sum/count."""
        self.steps_in_window = int(steps_in_window)
        self.losses.load(loss_sum, loss_count)
        self.mark_window_start()

    # -- the window's end --------------------------------------------------------------------------
    def _score(self, batch: Any) -> torch.Tensor | None:
        assert self.probe is not None  # only called while probing
        probe = self.probe
        raw = run_probe(lambda: probe.loss(batch), self.adapter.probe_modules())
        self.adapter.after_probe()
        return self.adapter.probe_value(raw)

    def _probe(
        self, window: int, arm_values: dict[str, list[float]]
    ) -> tuple[torch.Tensor | None, list[float] | None, torch.Tensor | None, torch.Tensor | None]:
        """The window's probes: (probe loss, line points, losses at the points, fingerprint)."""
        if not self.probing or not self.steps_in_window:
            return None, None, None, None
        line_search = self.line_search
        if self.config.signal in LINE_SIGNALS and (line_search is None or not line_search.valid):
            return None, None, None, None  # no line this window (a mid-window resume)
        assert self.probe is not None  # probing
        batch = self.probe.batch(window)
        probe = points = losses = None
        if line_search is None:
            probe = self._score(batch)
        else:
            points = line_points(arm_values["lr"], self.config.line_width)
            rho = arm_values["lr"][self.adapter.arm]
            losses = line_search.evaluate(points, rho, self.adapter.refresh, lambda: self._score(batch))
        fingerprint = None
        if probe is not None or losses is not None:  # this rank reports: its batch's fingerprint
            fingerprint = self.probe.fingerprint(batch, self.adapter.device)
        return probe, points, losses, fingerprint

    def _check_batches(self, reduced: WindowLosses, window: int) -> None:
        """The probe-batch check (the same verdict on every rank: every rank has every row)."""
        prints = reduced.fingerprints
        if len(prints) < 2:
            return
        same = all(p == prints[0] for p in prints)
        if self.config.signal == "probe":
            if not same:
                raise ProbeBatchMismatch(
                    f"HDET window {window}: signal='probe' scored the arms on different batches "
                    f"({len(set(prints))} distinct among {len(prints)} replicas); every rank's "
                    "BatchProbe must return the same batch for a window (e.g. built from a fixed "
                    "seed), or use signal='average' with each replica's own batch"
                )
        elif same:
            if not self._warned_same_batch and is_log_rank():
                logger.warning(
                    "HDET window %d: every replica probed the same batch; with signal=%r each "
                    "replica should score its own (e.g. its shard of held-out data): with one "
                    "batch the replicas' line losses agree exactly, the step's standard error is "
                    "0 and the noise-aware step no longer shrinks noisy steps",
                    window,
                    self.config.signal,
                )
            self._warned_same_batch = True

    def end_window(
        self, window: int, step: int, arm_values: dict[str, list[float]], *, forced: bool = False
    ) -> WindowEnd:
        """End window ``window`` at ``step`` (collective: every rank calls it alike).

        ``arm_values``: the window's spread per axis. ``forced``: a converge before the window's
        end (a save, the run's end); it does not require losses. Raises :class:`MissingLoss`
        when the controller needs losses that some arm did not report,
        :class:`ProbeBatchMismatch` for ``probe`` on differing batches, and the controller's
        errors (``AllArmsNonFinite`` without ``rollback``, ``NonFiniteArm``).
        """
        cfg, adapter = self.config, self.adapter
        steps = self.steps_in_window
        probe_start = time.perf_counter()
        probe, points, point_losses, fingerprint = self._probe(window, arm_values)
        # Host time of the probes (on an accelerator part of their work may run on after this).
        probe_seconds = time.perf_counter() - probe_start
        reduced = adapter.reduce(
            train_sum=self.losses.total(),
            train_count=self.losses.count,
            probe=probe,
            points=point_losses,
            num_points=len(points) if points is not None else 0,
            finite=params_finite(adapter.tensors()),
            fingerprint=fingerprint,
        )  # the window's one host sync
        self._check_batches(reduced, window)
        train = [math.inf if bad else x for x, bad in zip(reduced.train, reduced.bad, strict=True)]
        line: LineFit | None = None
        signal: list[float] | None = None
        if points is not None:
            # "average" is not corrected (the weight average leaves the noise floor out); "line"
            # by the part of today's noise floor that survives to the end of the schedule.
            kappa = persistence(*adapter.horizon_lrs(step)) if cfg.signal == "line" else 1.0
            line = fit_line(points, reduced.point_losses, arm_values["lr"], kappa, reduced.replica_losses)
            signal = list(line.pseudo_losses)
        elif self.probing and steps and cfg.signal in LINE_SIGNALS:
            # No line this window (a mid-window resume): equal losses, so nothing moves.
            signal = [0.0 if math.isfinite(x) else x for x in reduced.train]
        elif self.probing and steps and cfg.signal == "probe":
            signal = reduced.probe
        counts = reduced.train_counts
        update: ControllerUpdate | None = None
        arm_losses = train
        if signal is None and not any(counts):
            # No loss signal at all (e.g. a single arm used as a drop-in OneCycleLR): average,
            # leave the controller alone.
            if cfg.auto and step >= cfg.auto_start and not forced and adapter.num_arms > 1:
                raise MissingLoss(
                    f"HDET window {window} ended at step {step} without any loss: pass this "
                    "rank's training loss to the runtime's step (scheduler.step(loss)) so the "
                    "controller can compare the arms (or set HDETConfig(auto=False))"
                )
        elif any(counts) and not all(counts):
            missing = [a for a, c in enumerate(counts) if not c]
            raise MissingLoss(
                f"HDET window {window}: arm(s) {missing} reported no loss while others did; "
                "pass the step's loss on every rank"
            )
        else:
            base = train if signal is None else signal
            # An arm whose parameters blew up is as bad as an infinite loss, whatever it reported.
            arm_losses = [math.inf if bad else x for x, bad in zip(base, reduced.bad, strict=True)]
            try:
                # Raises (on every rank alike) before anything changes, so with
                # nonfinite="raise" nothing diverged is ever averaged or saved.
                update = adapter.controller.update(
                    arm_losses,
                    arm_values,
                    step,
                    adapter.base_values(step),
                    line=line,
                    train_losses=train,
                )
            except AllArmsNonFinite:
                if self.rollback is None:
                    raise
                return self._roll_back(window, step, arm_values, reduced, arm_losses, train, forced)
        excluded = update.excluded if update is not None else []
        start = time.perf_counter()
        # Weights only when some arm is excluded (every rank knows ``excluded`` alike): a plain
        # mean needs no up-front weight reduction.
        weight = None if not excluded else (0.0 if adapter.arm in excluded else 1.0)
        stats = adapter.average(weight)
        adapter.refresh()
        if adapter.arm in excluded:
            adapter.sanitize_optimizer_state()
        if self.rollback is not None:
            self.rollback.save()
        end = WindowEnd(
            window=window,
            step=step,
            steps=steps,
            arm_values=arm_values,
            losses=reduced,
            arm_losses=arm_losses,
            train_losses=train,
            excluded=excluded,
            update=update,
            line=line,
            stats=stats,
            probe_seconds=probe_seconds,
            converge_seconds=time.perf_counter() - start,
            forced=forced,
        )
        self.num_converges += 1
        if update is not None:
            self.last_update = update
            self.last_line = line
        return self._next_window(end)

    def _roll_back(
        self,
        window: int,
        step: int,
        arm_values: dict[str, list[float]],
        reduced: WindowLosses,
        arm_losses: list[float],
        train: list[float],
        forced: bool,
    ) -> WindowEnd:
        """Every arm diverged: restore the last converged params and cut the scale by the brake's
        factor (the brake's cut, for the worst instability there is)."""
        start = time.perf_counter()
        assert self.rollback is not None  # only with config.rollback
        adapter = self.adapter
        self.rollback.restore()
        adapter.refresh()
        adapter.sanitize_optimizer_state()
        adapter.controller.cut_scale(self.config.brake_factor)
        self.num_rollbacks += 1
        warnings.warn(
            f"HDET: every arm's loss was non-finite in window {window} (step {step}); restored the "
            f"last converged parameters and cut the LR scale by {self.config.brake_factor:g} to "
            f"{adapter.controller.scales()}",
            RuntimeWarning,
            stacklevel=3,
        )
        end = WindowEnd(
            window=window,
            step=step,
            steps=self.steps_in_window,
            arm_values=arm_values,
            losses=reduced,
            arm_losses=arm_losses,
            train_losses=train,
            excluded=list(range(len(arm_losses))),
            update=None,
            line=None,
            stats=None,
            converge_seconds=time.perf_counter() - start,
            forced=forced,
            rolled_back=True,
        )
        return self._next_window(end)

    def _next_window(self, end: WindowEnd) -> WindowEnd:
        self.losses.reset()
        self.steps_in_window = 0
        self.mark_window_start()
        self.last = end
        return end
