"""The line-search engine behind the probe signals, shared by every runtime (torch only).

With ``grad_sync="global"`` the arms of one window lie on one update line
``theta(s) = theta0 - s * D`` (:mod:`hdet_megatron.line_signal`). At the window's end every rank
rebuilds points of that line from its own params and probes them on a batch nobody trained on:

* :class:`LineSearch` keeps the window-start copy ``theta0`` of the params, for ``"average"`` the
  running sum of ``theta_t - theta0`` (one device-side ``_foreach`` add per step, no host sync),
  writes each point into the params, runs the probe there and restores the arm's own params
  bit-exactly from a scratch copy;
* :func:`run_probe` runs a user's probe under ``torch.no_grad()`` with the model in ``eval()``
  mode (dropout would consume RNG and add noise), the previous mode restored afterwards;
* :func:`probe_scalar` turns what a torch probe returned (a scalar tensor or a float) into a
  float64 device scalar.

A runtime plugs in through three things (its adapter): the params (the tensors the optimizer
updates: Megatron's main params, a DDP model's parameters, FSDP2's local shards), ``refresh``
(make the model compute with what was just written into them: Megatron copies main params to the
model params; FSDP2 reshards so that the next forward gathers the new shards) and ``probe`` (this
rank's loss, or None on ranks that compute none, e.g. off the last pipeline stage). Which group
reduces the losses is :mod:`hdet_megatron.window_losses`' business.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from hdet_megatron.config import LINE_SIGNALS

__all__ = ["BatchProbe", "LineSearch", "eval_mode", "probe_scalar", "run_probe", "start_probe_window"]


@contextlib.contextmanager
def eval_mode(modules: Iterable[torch.nn.Module]) -> Iterator[None]:
    """Every module of ``modules`` (and below) in ``eval()`` mode; each module's own previous
    ``training`` flag is restored afterwards (also a model whose parts were in mixed modes)."""
    roots = [m for m in modules if m is not None]
    saved = [(m, m.training) for root in roots for m in root.modules()]
    root_modes = [root.training for root in roots]
    for root in roots:
        root.eval()
    try:
        yield
    finally:
        # train(mode) first (modules that override train() see the call), then the exceptions.
        for root, mode in zip(roots, root_modes, strict=True):
            root.train(mode)
        for module, mode in saved:
            if module.training != mode:
                module.training = mode


class BatchProbe:
    """A ``probe_fn`` that scores one held-out batch per window: ``loss_fn(batch)``.

    With ``signal="line"``/``"average"`` the runtime calls ``probe_fn`` once per point of the
    window's update line, and the points are compared on the same data only when every call of
    one window sees the same batch. The runtime calls :meth:`new_window` once per window before
    its probes; the batch is then ``batches(window)`` (a function of the window index: a resumed
    run probes the same batches as the uninterrupted one) or the next item of an iterable::

        probe = BatchProbe(lambda b: F.cross_entropy(model(b[0]), b[1]), lambda w: held_out[w % n])
        sched = HDETOneCycleLR(opt, max_lr, total_steps, hdet=HDETConfig(period=100),
                               model=model, probe_fn=probe)

    ``loss_fn`` runs under ``torch.no_grad()`` with the model in eval mode (the runtime's doing).
    """

    def __init__(self, loss_fn: Callable[[Any], Any], batches: Callable[[int], Any] | Iterable[Any]) -> None:
        if not callable(loss_fn):
            raise TypeError(f"BatchProbe: loss_fn must be callable, got {type(loss_fn).__name__}")
        self.loss_fn = loss_fn
        self._by_window = batches if callable(batches) else None
        self._iterator = None if callable(batches) else iter(batches)
        self._batch: Any = None
        self._window: int | None = None

    def new_window(self, window: int) -> None:
        """Take the batch of ``window`` (called by the runtime before the window's probes)."""
        if window != self._window or self._batch is None:
            if self._by_window is not None:
                self._batch = self._by_window(window)
            else:
                assert self._iterator is not None  # __init__ keeps one of the two
                self._batch = next(self._iterator)
            self._window = window

    def __call__(self) -> Any:
        if self._batch is None:  # called outside a runtime: the first batch
            self.new_window(0)
        return self.loss_fn(self._batch)


def start_probe_window(probe_fn: Any, window: int) -> None:
    """Tell ``probe_fn`` that the probes of ``window`` start (its ``new_window(window)``, when it
    has one, e.g. :class:`BatchProbe`)."""
    hook = getattr(probe_fn, "new_window", None)
    if callable(hook):
        hook(window)


def run_probe(probe_fn: Callable[[], Any], modules: Iterable[torch.nn.Module]) -> Any:
    """``probe_fn()`` under ``torch.no_grad()`` with ``modules`` in eval mode (restored after)."""
    with torch.no_grad(), eval_mode(modules):
        return probe_fn()


def probe_scalar(value: Any, device: torch.device, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A torch probe's result (a one-element tensor or a real number) as a ``dtype`` scalar on
    ``device``; a tensor stays on the device (no host sync)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"probe_fn must return this rank's loss as a scalar (a one-element tensor or a "
                f"float), got a tensor of shape {tuple(value.shape)}; return e.g. loss.mean()"
            )
        return value.detach().reshape(()).to(device=device, dtype=dtype)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor(float(value), device=device, dtype=dtype)
    raise TypeError(
        f"probe_fn must return this rank's loss (a scalar tensor or a float), got {type(value).__name__}"
    )


class LineSearch:
    """One rank's view of the window's update line: window start, running sum, probing, restore.

    Args:
        params: the tensors a point is written into (the optimizer's main params on this rank).
        signal: ``"line"`` (points through the arm's end point) or ``"average"`` (through its
            window-averaged iterate; keeps a running sum: one more copy of ``params``).

    Memory: two copies of ``params`` (the window start and a scratch copy of the arm's own
    params), three with ``"average"``.
    """

    def __init__(self, params: Sequence[torch.Tensor], signal: str) -> None:
        if signal not in LINE_SIGNALS:
            raise ValueError(f"LineSearch is for the line signals {LINE_SIGNALS}, got {signal!r}")
        self.params = list(params)
        self.signal = signal
        self.origin = [torch.empty_like(p) for p in self.params]
        self.scratch = [torch.empty_like(p) for p in self.params]
        self.total = [torch.zeros_like(p) for p in self.params] if signal == "average" else None
        self.steps = 0
        """Steps summed into :attr:`total` since the window start."""
        self.valid = False
        """Whether :attr:`origin` is this window's start (False after a mid-window resume: the
        window's line is unknown, and it must not steer the controller)."""

    @torch.no_grad()
    def mark_window_start(self, steps_in_window: int = 0) -> None:
        """The params are the start of a window (after a converge, or loaded from a checkpoint;
        ``steps_in_window`` > 0 when the load was mid-window: the line is then invalid)."""
        for dst, src in zip(self.origin, self.params, strict=True):
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
            torch._foreach_add_(self.total, torch._foreach_sub(self.params, self.origin))
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
        for dst, src in zip(self.scratch, self.params, strict=True):
            dst.copy_(src)
        losses = []
        try:
            for s in points:
                if self.total is None:
                    for p, p0, p_arm in zip(self.params, self.origin, self.scratch, strict=True):
                        torch.lerp(p0, p_arm, s / rho, out=p)
                else:
                    w = s / (rho * self.steps)
                    for p, p0, total in zip(self.params, self.origin, self.total, strict=True):
                        torch.add(p0, total, alpha=w, out=p)
                refresh()
                loss = probe()
                if loss is not None:
                    losses.append(loss)
        finally:
            for dst, src in zip(self.params, self.scratch, strict=True):
                dst.copy_(src)
            refresh()
        return torch.stack(losses) if losses else None
