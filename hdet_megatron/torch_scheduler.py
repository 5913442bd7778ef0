"""``HDETOneCycleLR``: a drop-in for ``torch.optim.lr_scheduler.OneCycleLR`` that runs HDET.

Every rank of ``process_group`` is a data-parallel replica; replicas are grouped into arms
(``hdet.arms``; default one arm per rank; arm of rank r = ``r // (size / arms)``). Inside
window ``k`` (steps ``[k T, (k+1) T)``, ``T = hdet.period``) rank r trains with

    lr_g(t) = base_g(t) * c * rho_{arm(r)}(k)

where ``base_g`` is torch's OneCycle value for param group g (bit-identical, see
:mod:`hdet_megatron.schedule`), ``c`` the :class:`~hdet_megatron.controller.AutoController`'s
learned scale and ``rho`` the arm's multiplier from :func:`hdet_megatron.spread.arm_spread`
(a fresh permutation per window, from a counter-based generator: global RNGs are never
touched). Every ``T`` steps ``step()`` converges: it all-reduces the arms' window losses (one
tiny collective), updates the controller (identically on every rank) and averages the
parameters in place with a :class:`~hdet_megatron.averaging.BucketedAverager`; an arm whose
window loss is non-finite gets weight 0 and is overwritten by the healthy arms' average.

Unlike the paper's reference ``OneCycleAutoLR`` this spreads from step 0 (also with the
controller off), keeps the OneCycle shape (and momentum cycling) inside every window, lets
the base LR decay exactly like OneCycle while the controller only learns ``c``, never reseeds
a global RNG, averages in a few buckets, and makes no host sync per step (losses accumulate
on the device).

Typical loop (with or without a ``DistributedDataParallel`` wrapper)::

    sched = HDETOneCycleLR(opt, max_lr=1e-3, total_steps=N, hdet=HDETConfig(period=100))
    for batch in data:
        loss = loss_fn(model(batch))      # this rank's local loss, before any DP reduction
        loss.backward(); opt.step(); opt.zero_grad()
        sched.step(loss)
    sched.converge()                      # optional: average the final partial window too

With ``hdet=None`` (or one rank, spread 0 and the controller off) it is exactly ``OneCycleLR``.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import OneCycleLR

from hdet_megatron.averaging import AverageStats, BucketedAverager
from hdet_megatron.config import LINE_SIGNALS, HDETConfig, short_run_caution
from hdet_megatron.controller import AllArmsNonFinite, AutoController, ControllerUpdate
from hdet_megatron.fsdp import FSDPRuntime, is_fsdp2_setup
from hdet_megatron.line_search import start_probe_window
from hdet_megatron.line_signal import LineFit, fit_line, line_points, persistence
from hdet_megatron.schedule import ANNEAL_STRATEGIES, phase_at
from hdet_megatron.torch_runtime import _Runtime
from hdet_megatron.window_losses import WindowLosses

logger = logging.getLogger(__name__)

__all__ = ["HDETOneCycleLR", "MissingLoss"]


class MissingLoss(RuntimeError):
    """The controller needs window losses but ``step()`` got no ``loss`` (on some arm)."""


class HDETOneCycleLR(OneCycleLR):
    """``OneCycleLR`` with HDET's fan-out, converge and auto-LR controller.

    Same arguments and behaviour as :class:`torch.optim.lr_scheduler.OneCycleLR`, plus:

    Args:
        hdet: the HDET settings; None = plain ``OneCycleLR`` (no collectives at all). Only the
            learning rate can be explored here (axes ``lr`` or ``lr:<group>``, the latter
            matched against the param groups' ``"name"`` entries).
        model: average ``model.parameters()`` at each converge (default: the optimizer's params).
        process_group: the data-parallel ranks whose replicas form the arms (default: WORLD).
            With FSDP2: the ranks whose losses are reduced per window (default: WORLD).
        device_mesh: FSDP2 (``fully_shard``) models: the 2-D HSDP ``DeviceMesh``
            (replicate, shard) the model was sharded over; the arms are its replicate
            dimension (see :mod:`hdet_megatron.fsdp`). Inferred from the parameters' DTensors
            when omitted; a 1-D (pure FSDP) mesh is refused with an explanation.
        probe_fn: needed by ``hdet.signal`` ``"probe"``, ``"line"`` and ``"average"`` (with
            ``model=...``): a no-argument callable that returns this rank's loss (a scalar tensor
            or a float) on a batch it has not trained on. The scheduler calls it at a window's
            end, before the average, under ``torch.no_grad()`` with ``model`` switched to
            ``eval()`` (its previous mode restored): once with ``"probe"`` (the batch must be the
            same on every rank), once per point of the window's update line with the line
            signals (each rank its own batch, the same at every point of one window:
            :class:`~hdet_megatron.line_search.BatchProbe` does that). Collective when the model
            is (FSDP2: every rank calls it the same number of times).

    ``step(loss)`` takes this rank's (undetached is fine) local training loss of the step just
    taken; the arms' window losses drive the controller and the non-finite exclusion. An arm
    whose window loss is non-finite is excluded from the average (weight 0: its parameters are
    overwritten by the healthy arms' mean) and the non-finite entries of its optimizer state are
    zeroed, so it does not turn NaN again on its next step. All arms non-finite: the controller's
    :class:`~hdet_megatron.controller.AllArmsNonFinite`, or with ``hdet.rollback`` the
    parameters of the last converge are restored (a snapshot kept on the device) and the scale
    is halved. Single-arm runs need no loss (the controller has nothing to compare).
    An arm whose parameters are non-finite on any of its ranks counts as non-finite too (with the
    line signals its replicas' probe losses are left out of the line's points).
    Attributes after each converge: :attr:`last_update` (the controller's
    :class:`~hdet_megatron.controller.ControllerUpdate`), :attr:`last_line` (the line signals'
    :class:`~hdet_megatron.line_signal.LineFit`), :attr:`last_stats` (the averaging's
    :class:`~hdet_megatron.averaging.AverageStats`), :meth:`metrics`.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        max_lr: float | Sequence[float],
        total_steps: int | None = None,
        epochs: int | None = None,
        steps_per_epoch: int | None = None,
        pct_start: float = 0.3,
        anneal_strategy: Literal["cos", "linear"] = "cos",
        cycle_momentum: bool = True,
        base_momentum: float | Sequence[float] = 0.85,
        max_momentum: float | Sequence[float] = 0.95,
        div_factor: float = 25.0,
        final_div_factor: float = 1e4,
        three_phase: bool = False,
        last_epoch: int = -1,
        *,
        hdet: HDETConfig | None = None,
        model: torch.nn.Module | None = None,
        process_group: dist.ProcessGroup | None = None,
        device_mesh: Any | None = None,
        probe_fn: Callable[[], Any] | None = None,
    ) -> None:
        if hdet is not None and not isinstance(hdet, HDETConfig):
            raise TypeError(f"hdet must be an HDETConfig or None, got {type(hdet).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"{type(optimizer).__name__} is not an Optimizer")
        # Must exist before OneCycleLR.__init__ runs the initial step().
        self._hdet: _Runtime | None = None
        if hdet is not None:
            if device_mesh is not None or is_fsdp2_setup(optimizer, model):
                # FSDP2 (fully_shard) model: arms are the replicate dim of the HSDP mesh.
                self._hdet = FSDPRuntime(hdet, optimizer, model, process_group, device_mesh, probe_fn)
            else:
                self._hdet = _Runtime(hdet, optimizer, model, process_group, probe_fn)
        # torch annotates max_lr/base_momentum/max_momentum as float | list[float]; it takes any
        # sequence (OneCycleLR._format_param).
        super().__init__(
            optimizer,
            max_lr,  # type: ignore[arg-type]
            total_steps=total_steps,
            epochs=epochs,
            steps_per_epoch=steps_per_epoch,
            pct_start=pct_start,
            anneal_strategy=anneal_strategy,
            cycle_momentum=cycle_momentum,
            base_momentum=base_momentum,  # type: ignore[arg-type]
            max_momentum=max_momentum,  # type: ignore[arg-type]
            div_factor=div_factor,
            final_div_factor=final_div_factor,
            three_phase=three_phase,
            last_epoch=last_epoch,
        )
        if self._hdet is not None and last_epoch == -1:
            caution = short_run_caution(self._hdet.config, self.total_steps)
            if caution:
                logger.warning("%s", caution)

    # ------------------------------------------------------------------ schedule
    def _anneal(self):
        """The anneal function, chosen like ``OneCycleLR._anneal_func``: by ``_anneal_func_type``,
        else (the state of an older torch, which kept the function itself) ``anneal_func``."""
        if hasattr(self, "_anneal_func_type"):
            if self._anneal_func_type not in ANNEAL_STRATEGIES:
                raise ValueError(f"Unknown _anneal_func_type: {self._anneal_func_type}")
            return ANNEAL_STRATEGIES[self._anneal_func_type]
        return self.anneal_func  # type: ignore[attr-defined]  # an older torch's state (see above)

    def _base_lrs_at(self, step: int) -> list[float]:
        """OneCycle base LR of every group at ``step`` (no side effects)."""
        anneal = self._anneal()
        phase, pct = phase_at(self._schedule_phases, min(step, self.total_steps))
        return [anneal(g[phase["start_lr"]], g[phase["end_lr"]], pct) for g in self.optimizer.param_groups]

    # torch's get_lr returns list[float | Tensor] (a tensor LR stays one); this one plain floats.
    def get_lr(self) -> list[float]:  # type: ignore[override]
        """OneCycle's value (bit-identical to torch) times this arm's ``c * rho``; cycles the
        momentum / beta1 exactly like ``OneCycleLR`` (a side effect, as in torch)."""
        if not self._get_lr_called_within_step:
            warnings.warn(
                "To get the last learning rate computed by the scheduler, please use `get_last_lr()`.",
                UserWarning,
                stacklevel=2,
            )
        step_num = self.last_epoch
        if step_num > self.total_steps:
            raise ValueError(
                f"Tried to step {step_num} times. The specified number of total steps is {self.total_steps}"
            )
        anneal = self._anneal()
        rt = self._hdet
        window = step_num // rt.config.period if rt is not None else 0
        lrs, bases = [], []
        for g, group in enumerate(self.optimizer.param_groups):
            phase, pct = phase_at(self._schedule_phases, step_num)
            base = anneal(group[phase["start_lr"]], group[phase["end_lr"]], pct)
            bases.append(base)
            lrs.append(rt.factor_value(g, base, window) if rt is not None else base)
            if self.cycle_momentum:
                momentum = anneal(group[phase["start_momentum"]], group[phase["end_momentum"]], pct)
                if self.use_beta1:
                    group["betas"] = (momentum, *group["betas"][1:])
                else:
                    group["momentum"] = momentum
        if rt is not None:
            rt.last_base_lrs = bases
        return lrs

    # ------------------------------------------------------------------ stepping
    def step(self, loss: None | float | torch.Tensor = None) -> None:
        """Advance one optimizer step. ``loss``: this rank's local loss of the step just taken
        (needed by the controller; accumulated on the device, no host sync). Every
        ``hdet.period`` steps this converges (collective: call it on every rank)."""
        rt = self._hdet
        initial = getattr(self, "_is_initial", False) or getattr(self, "_step_count", 0) == 0
        if rt is not None and not initial:
            if loss is not None:
                rt.add_loss(loss)
            rt.after_step()
            done = self.last_epoch + 1  # optimizer steps taken so far
            if done > 0 and done % rt.config.period == 0:
                self._converge(done)
        super().step()

    def close(self) -> None:
        """Undo what HDET changed on the model: with an FSDP2 model and ``grad_sync="arm"``,
        FSDP's replicate-dimension gradient all-reduce is switched back on."""
        if self._hdet is not None:
            self._hdet.close()

    def converge(self) -> ControllerUpdate | None:
        """Converge now (collective), e.g. after the last step of a run whose length is not a
        multiple of the period: the controller sees the partial window's losses (when there
        are any) and the replicas are averaged. The current window's spread is kept."""
        if self._hdet is None:
            return None
        done = self.last_epoch
        self._converge(done, partial=True)
        return self.last_update

    def _window_signal(
        self, window: int, step: int
    ) -> tuple[WindowLosses, list[float] | None, LineFit | None]:
        """Probe (``signal`` probe/line/average, when the window has steps), then the window's one
        reduction. Returns the reduced losses, the controller's signal per arm (None: the train
        losses) and the window's line fit."""
        rt = self._runtime()
        cfg = rt.config
        spreads = rt.spreads(window)
        probe = points = losses = None
        if rt.steps_in_window and cfg.signal == "probe":
            start_probe_window(rt.probe_fn, window)
            probe = rt.probe_loss()
        elif rt.steps_in_window and rt.line_search is not None and rt.line_search.valid:
            start_probe_window(rt.probe_fn, window)
            points = line_points(spreads["lr"])
            losses = rt.line_search.evaluate(points, spreads["lr"][rt.arm], rt.refresh, rt.probe_loss)
        reduced = rt.reduce_window(probe, losses, len(points) if points is not None else 0)
        if points is not None:
            # "average" is not corrected (the weight average leaves the noise floor out); "line"
            # by the part of today's noise floor that survives to the end of the schedule.
            kappa = 1.0
            if cfg.signal == "line":
                kappa = persistence(self._base_lrs_at(step)[0], self._base_lrs_at(self.total_steps)[0])
            line = fit_line(points, reduced.point_losses, spreads["lr"], kappa, reduced.replica_losses)
            return reduced, list(line.pseudo_losses), line
        if cfg.signal in LINE_SIGNALS and rt.steps_in_window:
            # No line this window (a mid-window resume): equal losses, so nothing moves.
            return reduced, [0.0 if math.isfinite(x) else x for x in reduced.train], None
        if cfg.signal == "probe" and rt.steps_in_window:
            return reduced, reduced.probe, None
        return reduced, None, None

    def _runtime(self) -> _Runtime:
        """The HDET runtime, on the paths that run only with HDET on."""
        assert self._hdet is not None
        return self._hdet

    def _converge(self, step: int, partial: bool = False) -> None:
        rt = self._runtime()
        cfg = rt.config
        window = max(self.last_epoch, 0) // cfg.period
        reduced, signal, line = self._window_signal(window, step)
        counts = reduced.train_counts
        update: ControllerUpdate | None = None
        if signal is None and not any(counts):
            # No loss signal at all (e.g. a single arm used as a drop-in OneCycleLR): average,
            # leave the controller alone.
            if cfg.auto and step >= cfg.auto_start and not partial and rt.num_arms > 1:
                raise MissingLoss(
                    f"HDET window {window} ended at step {step} without any loss: pass this "
                    "rank's training loss to scheduler.step(loss) so the controller can compare "
                    "the arms (or set HDETConfig(auto=False))"
                )
        elif any(counts) and not all(counts):
            missing = [a for a, c in enumerate(counts) if not c]
            raise MissingLoss(
                f"HDET window {window}: arm(s) {missing} reported no loss while others did; "
                "call scheduler.step(loss) on every rank"
            )
        else:
            losses = reduced.train if signal is None else signal
            # An arm whose parameters blew up is as bad as an infinite loss, whatever it reported.
            losses = [math.inf if bad else x for x, bad in zip(losses, reduced.bad, strict=True)]
            bases = self._base_lrs_at(step)  # base schedule at the first step of the next window
            base_values = {
                axis.name: bases[rt.group_axes.index(axis)]
                for axis in cfg.resolved_axes
                if axis in rt.group_axes
            }
            try:
                update = rt.controller.update(
                    losses,
                    rt.spreads(window),
                    step,
                    base_values,
                    line=line,
                    train_losses=[
                        math.inf if bad else x for x, bad in zip(reduced.train, reduced.bad, strict=True)
                    ],
                )
            except AllArmsNonFinite:
                if not cfg.rollback:
                    raise
                rt.restore_snapshot()
                rt.refresh()
                self._sanitize_optimizer_state()
                rt.controller.cut_scale(0.5)
                rt.reset_losses()
                rt.steps_in_window = 0
                rt.mark_window_start()
                rt.num_rollbacks += 1
                warnings.warn(
                    f"HDET: every arm's loss was non-finite in window {window} (step {step}); "
                    "restored the last converged parameters and halved the LR scale",
                    RuntimeWarning,
                    stacklevel=3,
                )
                return
        excluded = update.excluded if update is not None else []
        if rt.averager is not None:
            weight = None
            if excluded:
                weight = 0.0 if rt.arm in excluded else 1.0
            rt.last_stats = rt.averager.average(weight)
        rt.refresh()
        if rt.arm in excluded:
            self._sanitize_optimizer_state()
        if cfg.rollback:
            rt.take_snapshot()
        rt.reset_losses()
        rt.steps_in_window = 0
        rt.mark_window_start()
        if update is not None:
            rt.last_update = update
            rt.last_line = line
        rt.num_converges += 1

    @torch.no_grad()
    def _sanitize_optimizer_state(self) -> None:
        """On an excluded arm: zero the non-finite entries of the optimizer state (momentum
        buffers, Adam moments), or the arm would turn NaN again on its next step although its
        parameters were just overwritten by the healthy arms' average. No host sync."""
        for state in self.optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    torch.nan_to_num_(value, nan=0.0, posinf=0.0, neginf=0.0)

    # ------------------------------------------------------------------ introspection
    @property
    def hdet(self) -> HDETConfig | None:
        return self._hdet.config if self._hdet is not None else None

    @property
    def arm(self) -> int:
        """This rank's arm (0 without HDET)."""
        return self._hdet.arm if self._hdet is not None else 0

    @property
    def num_arms(self) -> int:
        return self._hdet.num_arms if self._hdet is not None else 1

    @property
    def controller(self) -> AutoController | None:
        return self._hdet.controller if self._hdet is not None else None

    @property
    def averager(self) -> BucketedAverager | None:
        return self._hdet.averager if self._hdet is not None else None

    @property
    def last_update(self) -> ControllerUpdate | None:
        """The controller update of the last converge (None before the first)."""
        return self._hdet.last_update if self._hdet is not None else None

    @property
    def last_stats(self) -> AverageStats | None:
        """Averaging stats of the last converge (None before it, or on a single rank)."""
        return self._hdet.last_stats if self._hdet is not None else None

    @property
    def last_line(self) -> LineFit | None:
        """The line search of the last converge (``signal`` ``"line"``/``"average"``; else None)."""
        return self._hdet.last_line if self._hdet is not None else None

    @property
    def last_arm_losses(self) -> list[float] | None:
        update = self.last_update
        return list(update.arm_losses) if update is not None else None

    @property
    def window(self) -> int:
        """Index of the current window (``last_epoch // period``)."""
        return self.last_epoch // self._hdet.config.period if self._hdet is not None else 0

    def arm_multipliers(self, axis: str = "lr") -> list[float]:
        """Every arm's spread value on ``axis`` in the current window."""
        if self._hdet is None:
            return [1.0]
        return list(self._hdet.spreads(self.window)[axis])

    def get_last_base_lr(self) -> list[float]:
        """The OneCycle base LR of each group at the current step (before ``c * rho``)."""
        if self._hdet is None:
            # No HDET: get_lr() above gave OneCycle's base values (floats for float LRs).
            return cast("list[float]", list(self.get_last_lr()))
        return list(self._hdet.last_base_lrs)

    def metrics(self) -> dict:
        """Plain-data view for logging: window, arm, multipliers, scales, last converge."""
        if self._hdet is None:
            return {"step": self.last_epoch, "lr": list(self.get_last_lr())}
        rt = self._hdet
        out = {
            "step": self.last_epoch,
            "window": self.window,
            "arm": rt.arm,
            "num_arms": rt.num_arms,
            "lr": list(self.get_last_lr()),
            "base_lr": list(rt.last_base_lrs),
            "multipliers": {k: list(v) for k, v in rt.spreads(self.window).items()},
            "scales": rt.controller.scales(),
            "num_converges": rt.num_converges,
            "num_rollbacks": rt.num_rollbacks,
        }
        if rt.last_update is not None:
            out["last_update"] = rt.last_update.to_dict()
        if rt.last_line is not None:
            out["last_line"] = rt.last_line.to_dict()
        if rt.last_stats is not None:
            out["converge_bytes"] = rt.last_stats.bytes
            out["converge_buckets"] = rt.last_stats.num_buckets
            out["converge_seconds"] = rt.last_stats.seconds
        return out

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Torch's ``OneCycleLR`` state plus (with HDET) an ``"hdet"`` entry: controller state,
        the current window's loss accumulators and the config fingerprint."""
        state = {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "_hdet")}
        rt = self._hdet
        if rt is not None:
            state["hdet"] = {
                "controller": rt.controller.state_dict(),
                "loss_sum": float(rt.loss_sum) + rt.host_loss_sum,
                "loss_count": rt.loss_count,
                "steps_in_window": rt.steps_in_window,
                "num_converges": rt.num_converges,
                "num_rollbacks": rt.num_rollbacks,
                "config": rt.config.fingerprint(),
            }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load :meth:`state_dict` output, or a plain ``OneCycleLR`` state (HDET then starts
        fresh from that step)."""
        state = dict(state_dict)
        hdet_state = state.pop("hdet", None)
        state.pop("_hdet", None)
        self.__dict__.update(state)
        rt = self._hdet
        if rt is not None and hdet_state is not None:
            rt.controller.load_state_dict(hdet_state["controller"])
            rt.reset_losses()
            rt.host_loss_sum = float(hdet_state.get("loss_sum", 0.0))
            rt.loss_count = int(hdet_state.get("loss_count", 0))
            rt.num_converges = int(hdet_state.get("num_converges", 0))
            rt.num_rollbacks = int(hdet_state.get("num_rollbacks", 0))
        if rt is not None:
            # Steps since the last converge; a state from before this entry existed (or a plain
            # OneCycleLR one) converged at multiples of the period.
            steps = (hdet_state or {}).get("steps_in_window")
            rt.steps_in_window = (
                int(steps) if steps is not None else max(self.last_epoch, 0) % rt.config.period
            )
            # The line signals start the update line at the loaded params (load the model before
            # the scheduler, as usual); mid-window, that window's line is unknown and does not
            # steer the controller.
            rt.mark_window_start()
