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
import warnings
from collections.abc import Sequence
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import OneCycleLR

from hdet_megatron.averaging import AverageStats, BucketedAverager
from hdet_megatron.config import HDETConfig, short_run_caution
from hdet_megatron.controller import AutoController, ControllerUpdate
from hdet_megatron.fsdp import FSDPRuntime, is_fsdp2_setup
from hdet_megatron.line_signal import LineFit
from hdet_megatron.probe import BatchProbe
from hdet_megatron.schedule import ANNEAL_STRATEGIES, phase_at
from hdet_megatron.torch_runtime import _Runtime
from hdet_megatron.window import MissingLoss, is_log_rank

logger = logging.getLogger(__name__)

__all__ = ["HDETOneCycleLR", "MissingLoss"]


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
        probe_fn: a :class:`~hdet_megatron.probe.BatchProbe` ``(loss_fn, batches)``: what to
            score (``loss_fn(batch)``: this rank's loss, a scalar tensor or a float) and where the
            held-out batches come from (``batches(window)`` or an iterable). It gives the
            defaults ``signal="average"`` (with ``model=...`` and >= 3 arms). At a window's end,
            before the average, the scheduler fetches the window's batch once and scores it under
            ``torch.no_grad()`` with ``model`` in ``eval()`` (its previous mode restored): once
            with ``"probe"`` (the batch must be the same on every rank: checked), at every point
            of the window's update line with the line signals (each rank its own batch: a warning
            when all are the same). Not run with ``auto=False``. Collective when the model is
            (FSDP2: every rank scores the same number of times). A bare callable is refused.

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
        probe_fn: BatchProbe | None = None,
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
        if self._hdet is not None:
            self._hdet.base_lrs_at = self._base_lrs_at
            self._hdet.total_steps = self.total_steps
        if self._hdet is not None and last_epoch == -1:
            caution = short_run_caution(self._hdet.config, self.total_steps)
            if caution and is_log_rank():
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
                rt.engine.add_loss(loss)
            rt.engine.after_step()
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

    def _runtime(self) -> _Runtime:
        """The HDET runtime, on the paths that run only with HDET on."""
        assert self._hdet is not None
        return self._hdet

    def _converge(self, step: int, partial: bool = False) -> None:
        """End the window at ``step`` (the window engine does everything; collective)."""
        rt = self._runtime()
        window = max(self.last_epoch, 0) // rt.config.period
        rt.engine.end_window(window, step, rt.spreads(window), forced=partial)

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
        return self._hdet.engine.last_update if self._hdet is not None else None

    @property
    def last_stats(self) -> AverageStats | None:
        """Averaging stats of the last converge (None before it, or on a single rank)."""
        return self._hdet.last_stats if self._hdet is not None else None

    @property
    def last_line(self) -> LineFit | None:
        """The line search of the last converge (``signal`` ``"line"``/``"average"``; else None)."""
        return self._hdet.engine.last_line if self._hdet is not None else None

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
        engine = rt.engine
        if engine.last_update is not None:
            out["last_update"] = engine.last_update.to_dict()
        if engine.last_line is not None:
            out["last_line"] = engine.last_line.to_dict()
        if engine.last is not None:  # the window that ended last (``multipliers``: the current one)
            out["arm_train_losses"] = list(engine.last.train_losses)
            out["arm_values"] = {k: list(v) for k, v in engine.last.arm_values.items()}
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
            engine = rt.engine
            state["hdet"] = {
                "controller": rt.controller.state_dict(),
                "loss_sum": float(engine.losses.total()),
                "loss_count": engine.losses.count,
                "steps_in_window": engine.steps_in_window,
                "num_converges": engine.num_converges,
                "num_rollbacks": engine.num_rollbacks,
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
        if rt is None:
            return
        engine = rt.engine
        if hdet_state is not None:
            rt.controller.load_state_dict(hdet_state["controller"])
            engine.num_converges = int(hdet_state.get("num_converges", 0))
            engine.num_rollbacks = int(hdet_state.get("num_rollbacks", 0))
        # Steps since the last converge; a state from before this entry existed (or a plain
        # OneCycleLR one) converged at multiples of the period. The line signals start the update
        # line at the loaded params (load the model before the scheduler, as usual); mid-window,
        # that window's line is unknown and does not steer the controller.
        steps = (hdet_state or {}).get("steps_in_window")
        engine.load_window(
            int(steps) if steps is not None else max(self.last_epoch, 0) % rt.config.period,
            float((hdet_state or {}).get("loss_sum", 0.0)),
            int((hdet_state or {}).get("loss_count", 0)),
        )
