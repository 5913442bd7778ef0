"""The update line of a window: its start, its running sum, and probing points on it.

With ``grad_sync="global"`` the arms of one window lie on one update line
``theta(s) = theta0 - s * D`` (:mod:`hdet_megatron.line_signal`). At the window's end every rank
rebuilds points of that line from its own params and the window engine
(:mod:`hdet_megatron.window`) probes them on a batch nobody trained on. :class:`LineSearch` keeps
the window-start copy ``theta0`` of the params and, for ``"average"``, the running sum of
``theta_t - theta0`` (one device-side ``_foreach`` add per step, no host sync), writes each point
into the params, runs the probe there and restores the arm's own params bit-exactly from a
scratch copy.

The params are read through a callable each time (the tensors the optimizer updates: Megatron's
main params, a DDP model's parameters, FSDP2's local shards): a framework may replace a tensor
object (FSDP2's ``reset_sharded_param`` after ``module.to()`` or ``load_state_dict(assign=True)``,
and the averager's re-homing after it), and a list captured once would then write points where
the model no longer reads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hdet_megatron.config import LINE_SIGNALS

# The documented import path of the probe (docs/python-api.md); it lives in its own module.
from hdet_megatron.probe import BatchProbe

__all__ = ["BatchProbe", "LineSearch"]


class LineSearch:
    """One rank's view of the window's update line: window start, running sum, probing, restore.

    Args:
        params: returns the tensors a point is written into (the optimizer's main params on this
            rank), read anew at every use: the same shapes in the same order every time.
        signal: ``"line"`` (points through the arm's end point) or ``"average"`` (through its
            window-averaged iterate; keeps a running sum: one more copy of ``params``).

    Memory: two copies of ``params`` (the window start and a scratch copy of the arm's own
    params), three with ``"average"``.
    """

    def __init__(self, params: Callable[[], Sequence[torch.Tensor]], signal: str) -> None:
        if signal not in LINE_SIGNALS:
            raise ValueError(f"LineSearch is for the line signals {LINE_SIGNALS}, got {signal!r}")
        self._params = params
        self.signal = signal
        now = self.params()
        self.origin = [torch.empty_like(p) for p in now]
        self.scratch = [torch.empty_like(p) for p in now]
        self.total = [torch.zeros_like(p) for p in now] if signal == "average" else None
        self.steps = 0
        """Steps summed into :attr:`total` since the window start."""
        self.valid = False
        """Whether :attr:`origin` is this window's start (False after a mid-window resume: the
        window's line is unknown, and it must not steer the controller)."""

    def params(self) -> list[torch.Tensor]:
        """The tensors as they are now (checked against the copies' shapes)."""
        now = list(self._params())
        if hasattr(self, "origin") and [t.shape for t in now] != [t.shape for t in self.origin]:
            raise RuntimeError(
                "LineSearch: the params changed shape or number since the window engine was built; "
                "build HDET after the model and optimizer are final"
            )
        return now

    @torch.no_grad()
    def mark_window_start(self, steps_in_window: int = 0) -> None:
        """The params are the start of a window (after a converge, or loaded from a checkpoint;
        ``steps_in_window`` > 0 when the load was mid-window: the line is then invalid)."""
        for dst, src in zip(self.origin, self.params(), strict=True):
            dst.copy_(src)
        if self.total is not None:
            for t in self.total:
                t.zero_()
        self.steps = 0
        self.valid = steps_in_window == 0

    @torch.no_grad()
    def accumulate(self) -> None:
        """Account one optimizer step: ``"average"`` adds ``theta_t - theta0`` to the running sum
        (small numbers: no cancellation when the average is taken); device-side, no host sync."""
        if self.total is not None:
            torch._foreach_add_(self.total, torch._foreach_sub(self.params(), self.origin))
        self.steps += 1

    @torch.no_grad()
    def evaluate(
        self,
        points: Sequence[float],
        rho: float,
        refresh: Callable[[], None],
        probe: Callable[[], torch.Tensor | None],
    ) -> torch.Tensor | None:
        """This rank's probe loss at every point of the line (a tensor, one entry per point; None
        where ``probe`` returns None, e.g. off the last pipeline stage).

        The arm's params are ``theta0 - rho * D``; the point of multiplier ``s`` is
        ``theta0 + (s / rho) (theta_arm - theta0)`` (``"line"``, ``torch.lerp``) or
        ``theta0 + s / (rho * steps) * sum_t (theta_t - theta0)`` (``"average"``). Each point is
        written into the params, ``refresh()`` makes the model use it, ``probe()`` evaluates it;
        then the arm's own params come back bit-exactly from the scratch copy (and ``refresh()``
        again). Collective where ``refresh``/``probe`` are: the same calls on every rank.
        """
        params = self.params()
        for dst, src in zip(self.scratch, params, strict=True):
            dst.copy_(src)
        losses = []
        try:
            for s in points:
                if self.total is None:
                    for p, p0, p_arm in zip(params, self.origin, self.scratch, strict=True):
                        torch.lerp(p0, p_arm, s / rho, out=p)
                else:
                    w = s / (rho * self.steps)
                    for p, p0, total in zip(params, self.origin, self.total, strict=True):
                        torch.add(p0, total, alpha=w, out=p)
                refresh()
                loss = probe()
                if loss is not None:
                    losses.append(loss)
        finally:
            for dst, src in zip(params, self.scratch, strict=True):
                dst.copy_(src)
            refresh()
        return torch.stack(losses) if losses else None
