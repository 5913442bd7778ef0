"""The probe: what the runtime scores the arms on at a window's end, and where the batch comes from.

The probe signals (``probe``, ``line``, ``average``) compare points of the parameter space on data
no arm has trained on. They are only worth something when the data noise cancels: every point of
one window must be scored on the *same* batch (each replica its own with the line signals, one
batch for every arm with ``probe``). A no-argument callable cannot promise that (a natural one
draws a fresh batch per call, and the comparison drowns in data noise without a word), so the
runtime owns the batch: the user says what to score and where batches come from, and the window
engine (:mod:`hdet_megatron.window`) fetches one batch per window and scores every point on it::

    probe = BatchProbe(lambda batch: loss_fn(model(batch)), lambda window: held_out[window % n])

A cheap fingerprint of each replica's batch rides along in the window's one all-reduce, so the
engine also sees the mistakes it cannot prevent (:func:`batch_fingerprint`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

__all__ = [
    "PROBE_RECIPE",
    "BatchProbe",
    "as_probe",
    "batch_fingerprint",
    "eval_mode",
    "probe_scalar",
    "run_probe",
]

#: The one line that shows how to build a probe (used by every refusal).
PROBE_RECIPE = (
    "probe_fn=BatchProbe(loss_fn, batches): loss_fn(batch) returns this rank's loss on a batch, "
    "batches(window) returns this rank's held-out batch of that window (or give an iterable), e.g. "
    "BatchProbe(lambda b: F.cross_entropy(model(b[0]), b[1]), lambda w: held_out[w % len(held_out)]) "
    "(from hdet_megatron import BatchProbe)"
)


class BatchProbe:
    """What the runtime scores at a window's end: ``loss_fn(batch)`` on one held-out batch per window.

    Args:
        loss_fn: ``loss_fn(batch)`` returns this rank's loss on ``batch`` with the model as it is
            (``HDETOneCycleLR``: a scalar tensor or a float; Megatron's ``HDET``: what
            ``forward_backward_func(forward_only=True)`` returned). The runtime calls it under
            ``torch.no_grad()`` with the model in eval mode, once per point it scores.
        batches: ``batches(window)`` returns this rank's batch for ``window`` (a function of the
            window index, so a resumed run probes the same batches as the uninterrupted one), or
            an iterable whose next item is taken once per window. With ``signal="probe"`` every
            rank must get the same batch; with ``"line"``/``"average"`` each data-parallel
            replica its own (the runtime checks both, see :func:`batch_fingerprint`).

    The runtime calls :meth:`batch` once per window and :meth:`loss` once per point on that
    batch; subclasses (e.g. Megatron-LM's read-ahead probe) override the two.
    """

    def __init__(self, loss_fn: Callable[[Any], Any], batches: Callable[[int], Any] | Iterable[Any]) -> None:
        if not callable(loss_fn):
            raise TypeError(f"BatchProbe: loss_fn must be callable, got {type(loss_fn).__name__}")
        if not callable(batches) and not isinstance(batches, Iterable):
            raise TypeError(
                "BatchProbe: batches must be a function of the window index or an iterable of "
                f"batches, got {type(batches).__name__}"
            )
        self.loss_fn = loss_fn
        self._by_window = batches if callable(batches) else None
        self._iterator: Iterator[Any] | None = None if callable(batches) else iter(batches)
        self._current: Any = None
        self._batch_window: int | None = None

    def batch(self, window: int) -> Any:
        """The batch of ``window`` (fetched once: a second call for the same window returns it)."""
        if window != self._batch_window:
            if self._by_window is not None:
                self._current = self._by_window(window)
            else:
                assert self._iterator is not None  # __init__ keeps one of the two
                try:
                    self._current = next(self._iterator)
                except StopIteration:
                    raise RuntimeError(
                        f"BatchProbe: the iterable of probe batches ran out at window {window}; "
                        "give one batch per window (or a function batches(window))"
                    ) from None
            self._batch_window = window
        return self._current

    def loss(self, batch: Any) -> Any:
        """This rank's loss on ``batch`` with the model's current parameters."""
        return self.loss_fn(batch)

    def fingerprint(self, batch: Any, device: torch.device) -> torch.Tensor | None:
        """A float64 device scalar that tells batches apart (None: nothing to fingerprint)."""
        return batch_fingerprint(batch, device)


def as_probe(probe_fn: Any) -> BatchProbe | None:
    """``probe_fn`` as given to a runtime: None, or a :class:`BatchProbe`. A bare callable is
    refused: the runtime must own the batch (see the module docstring)."""
    if probe_fn is None or isinstance(probe_fn, BatchProbe):
        return probe_fn
    raise TypeError(
        f"probe_fn must be a BatchProbe, not a {type(probe_fn).__name__} (the runtime fetches one "
        f"batch per window and scores every point on it); {PROBE_RECIPE}"
    )


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    """The tensors of a (nested dict/list/tuple) batch, in a fixed order."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for key in sorted(batch, key=str):
            yield from _tensors(batch[key])
    elif isinstance(batch, (list, tuple)):
        for item in batch:
            yield from _tensors(item)


#: Weights of the fingerprint's dot product repeat with this period (a prime: shifted copies
#: of one sequence do not collide).
_FINGERPRINT_PERIOD = 1009


@torch.no_grad()
def batch_fingerprint(batch: Any, device: torch.device) -> torch.Tensor | None:
    """A float64 scalar on ``device`` that identifies ``batch``'s tensors (no host sync).

    Every tensor is flattened to float64 and dotted with fixed weights ``1 + (i mod 1009)/1009``;
    the fingerprint sums those dot products and the tensors' sizes. Equal batches give equal bits
    (the same operations on the same values); different batches differ unless they collide by
    chance. None when the batch holds no tensors (nothing to check).
    """
    total: torch.Tensor | None = None
    for position, t in enumerate(_tensors(batch)):
        flat = t.detach().reshape(-1).to(device=device, dtype=torch.float64)
        weights = torch.arange(flat.numel(), device=device, dtype=torch.float64)
        weights = 1.0 + torch.remainder(weights + position, _FINGERPRINT_PERIOD) / _FINGERPRINT_PERIOD
        value = torch.dot(flat, weights) + flat.numel()
        total = value if total is None else total + value
    return total


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


def run_probe(score: Callable[[], Any], modules: Iterable[torch.nn.Module]) -> Any:
    """``score()`` under ``torch.no_grad()`` with ``modules`` in eval mode (restored after)."""
    with torch.no_grad(), eval_mode(modules):
        return score()


def probe_scalar(value: Any, device: torch.device, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A torch probe's result (a one-element tensor or a real number) as a ``dtype`` scalar on
    ``device``; a tensor stays on the device (no host sync)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"the probe's loss_fn must return this rank's loss as a scalar (a one-element "
                f"tensor or a float), got a tensor of shape {tuple(value.shape)}; return e.g. loss.mean()"
            )
        return value.detach().reshape(()).to(device=device, dtype=dtype)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor(float(value), device=device, dtype=dtype)
    raise TypeError(
        f"the probe's loss_fn must return this rank's loss (a scalar tensor or a float), got "
        f"{type(value).__name__}"
    )
