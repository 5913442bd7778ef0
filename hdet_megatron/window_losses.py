"""The per-window loss reduction every runtime shares: one small all-reduce, one host sync.

At a window's end every rank contributes to one float64 table:

* per arm, whether any of its ranks holds non-finite params (every rank checks its own main
  params or their shard; summed flags);
* one row per loss reporter (one per data-parallel replica: Megatron's last-stage TP-rank-0
  rank, every rank of a torch runtime), written by that reporter only: its arm, its window
  training-loss sum and count, its probe loss (``signal="probe"``), its loss at every point of
  the update line (``"line"``/``"average"``) and the fingerprint of the batch it probed
  (:func:`hdet_megatron.probe.batch_fingerprint`).

Each entry has at most one non-zero contributor, so the all-reduce is exact whatever order the
backend adds in, and every rank reads the same bits. The host then forms per-arm means and, for
the line signals, each replica's curve: every rank knows every replica's losses (the noise-aware
step reads their spread), and the rows of replicas whose arm has non-finite params are dropped,
so one diverged arm cannot poison the points that the healthy replicas evaluated (issue #29
bug 1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["LossAccumulator", "WindowLosses", "params_finite", "reduce_window"]

_ROW_HEAD = 7  # arm + 1 | train sum | train count | probe loss | probe count | fingerprint | has one


@dataclass(frozen=True)
class WindowLosses:
    """One window's reduced losses (plain floats, the same on every rank)."""

    train: list[float]
    """Per arm: mean training loss over the window (NaN where no loss was reported)."""
    train_counts: list[float]
    """Per arm: how many losses :attr:`train` averages (reporters, or steps x ranks)."""
    probe: list[float]
    """Per arm: mean probe loss over its reporters (NaN without probes)."""
    bad: list[bool]
    """Per arm: some rank of the arm holds non-finite params."""
    replica_arms: list[int]
    """With line points: the arm of each row of :attr:`replica_losses`."""
    replica_losses: list[list[float]]
    """With line points: each reporting replica's loss at every point, one row per replica whose
    arm is finite (in reporter order)."""
    point_losses: list[float]
    """With line points: the mean of :attr:`replica_losses` at every point (NaN without rows)."""
    fingerprints: list[float] = field(default_factory=list)
    """The probe batch's fingerprint of every reporter that sent one (in reporter order)."""


def params_finite(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A device-side bool: every entry of ``tensors`` is finite (no host sync)."""
    if not tensors:
        return torch.tensor(True)
    return torch.stack([torch.isfinite(t).all() for t in tensors]).all()


def reduce_window(
    *,
    num_arms: int,
    num_rows: int,
    arm: int,
    row: int | None,
    group=None,
    reduce: bool = True,
    device: torch.device,
    dtype: torch.dtype = torch.float64,
    train_sum: torch.Tensor | float = 0.0,
    train_count: float = 0.0,
    probe: torch.Tensor | None = None,
    points: torch.Tensor | None = None,
    num_points: int = 0,
    finite: torch.Tensor | None = None,
    fingerprint: torch.Tensor | None = None,
) -> WindowLosses:
    """Reduce one window's losses over ``group`` (``reduce=False``: one process). Collective.

    Args:
        num_arms, num_rows: the arms and the loss reporters (rows) of the run.
        arm: this rank's arm; ``row``: this rank's reporter row, None on ranks that report none.
        train_sum, train_count: this reporter's window training-loss sum and how many losses it
            holds (e.g. ``(mean, 1)`` or ``(sum of step losses, steps)``).
        probe: this reporter's probe loss (``signal="probe"``).
        points: this reporter's loss at each of the ``num_points`` line points.
        finite: whether this rank's params are finite (every rank, reporter or not).
        fingerprint: this reporter's probe-batch fingerprint (None: it probed nothing).
    """
    width = _ROW_HEAD + num_points
    buf = torch.zeros(num_arms + num_rows * width, dtype=dtype, device=device)
    if finite is not None:
        buf[arm] = (~finite).to(dtype)
    if row is not None:
        base = num_arms + row * width
        buf[base] = arm + 1
        buf[base + 1] = train_sum
        buf[base + 2] = train_count
        if probe is not None:
            buf[base + 3] = probe
            buf[base + 4] = 1.0
        if points is not None:
            if points.numel() != num_points:
                raise RuntimeError(f"internal: {points.numel()} line-point losses, expected {num_points}")
            buf[base + _ROW_HEAD : base + width] = points
        if fingerprint is not None:
            buf[base + 5] = fingerprint
            buf[base + 6] = 1.0
    if reduce:
        dist.all_reduce(buf, group=group)
    values = buf.tolist()  # the one host sync of the window
    bad = [v > 0 for v in values[:num_arms]]
    slots = [values[num_arms + r * width : num_arms + (r + 1) * width] for r in range(num_rows)]
    rows = [(int(round(r[0])) - 1, r) for r in slots if r[0] > 0]  # (arm, row) of filled slots
    train_sums: list[list[float]] = [[] for _ in range(num_arms)]
    train_counts: list[list[float]] = [[] for _ in range(num_arms)]
    probe_sums: list[list[float]] = [[] for _ in range(num_arms)]
    probe_counts: list[list[float]] = [[] for _ in range(num_arms)]
    for a, r in rows:
        train_sums[a].append(r[1])
        train_counts[a].append(r[2])
        probe_sums[a].append(r[3])
        probe_counts[a].append(r[4])

    def means(sums: list[list[float]], counts: list[list[float]]) -> list[float]:
        out = []
        for s, c in zip(sums, counts, strict=True):
            n = math.fsum(c)
            out.append(math.fsum(s) / n if n > 0 else math.nan)
        return out

    healthy = [(a, r[_ROW_HEAD:]) for a, r in rows if not bad[a]] if num_points else []
    columns = list(zip(*(losses for _, losses in healthy), strict=True))
    point_losses = [math.fsum(col) / len(healthy) for col in columns] if healthy else [math.nan] * num_points
    return WindowLosses(
        train=means(train_sums, train_counts),
        train_counts=[math.fsum(c) for c in train_counts],
        probe=means(probe_sums, probe_counts),
        bad=bad,
        replica_arms=[a for a, _ in healthy],
        replica_losses=[list(losses) for _, losses in healthy],
        point_losses=point_losses,
        fingerprints=[r[5] for _, r in rows if r[6] > 0],
    )


class LossAccumulator:
    """One reporter's training losses of the current window: a device-side sum (no host sync per
    step), a host-side sum for losses given as numbers, and how many were added."""

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.float64) -> None:
        self.sum = torch.zeros((), dtype=dtype, device=device)
        self.host_sum = 0.0
        self.count = 0

    def add(self, loss: torch.Tensor | float) -> None:
        """Add one step's loss (a scalar tensor, kept on its device, or a number)."""
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                raise ValueError(
                    f"step loss must be a scalar (this rank's mean loss of the step), got shape "
                    f"{tuple(loss.shape)}"
                )
            self.sum.add_(loss.detach().reshape(()).to(self.sum.device, self.sum.dtype))
        elif isinstance(loss, (int, float)) and not isinstance(loss, bool):
            self.host_sum += float(loss)
        else:
            raise TypeError(f"step loss must be a tensor or a number, got {type(loss).__name__}")
        self.count += 1

    def total(self) -> torch.Tensor:
        """The window's loss sum (a device scalar)."""
        return self.sum + self.host_sum

    def reset(self) -> None:
        self.sum.zero_()
        self.host_sum = 0.0
        self.count = 0

    def load(self, total: float, count: int) -> None:
        """Continue a window from a checkpoint: the sum kept on the device, as in an uninterrupted
        run."""
        self.reset()
        self.sum.fill_(float(total))
        self.count = int(count)
