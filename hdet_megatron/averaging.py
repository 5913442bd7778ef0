"""Bucketed, weighted parameter averaging across a process group (the HDET converge step).

:class:`BucketedAverager` packs a fixed list of tensors into flat buckets, all-reduces the
buckets and writes the average back in place. Layout and buffers are built once in
``__init__``; :meth:`BucketedAverager.average` allocates nothing of model size.

* One dtype per bucket: float64 tensors go to float64 buckets, everything else (float32,
  bfloat16, float16) to float32 buckets, so low-precision tensors are accumulated in fp32.
* Tensors are laid out back to back per bucket dtype and cut into buckets of ``bucket_mb`` MiB;
  a tensor that crosses a bucket boundary (or is larger than a bucket) is split.
* The all-reduce of bucket ``i+1`` is in flight (``async_op=True``) while bucket ``i`` is being
  unpacked. Buckets go through a small ring of preallocated byte buffers (``num_buffers``,
  default 2), so the extra memory is ``num_buffers`` buckets, not a model copy.
* Weights: ``average(w)`` computes ``sum_r w_r x_r / sum_r w_r``. The weight travels in one
  extra element of the first bucket (no extra collective). A rank with weight 0 contributes
  zeros (its buffer is zeroed, not multiplied, so its NaN/Inf never reach the others) and
  receives the others' weighted mean. The weight sum is checked on the host once per call
  (the only host sync; all ranks see the same sum, so all raise together when it is 0).
* ``average()`` without weights is ``sum / group_size``; the all-reduce result is the same on
  every rank, so every rank ends with the same bits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Optional, Union

import torch
import torch.distributed as dist

__all__ = ["AverageStats", "BucketedAverager"]

_FLOAT_BUCKET_DTYPE = {
    torch.float64: torch.float64,
    torch.float32: torch.float32,
    torch.bfloat16: torch.float32,
    torch.float16: torch.float32,
}


@dataclass
class AverageStats:
    """What one :meth:`BucketedAverager.average` call did."""

    bytes: int
    """Bytes all-reduced (bucket payload, in the buckets' dtypes) by this rank."""
    num_buckets: int
    """Number of all-reduce calls."""
    seconds: float
    """Host wall time of the call (on GPU, kernels may still be running when it returns)."""
    weighted: bool = False
    """Whether per-rank weights were used."""
    weight_sum: Optional[torch.Tensor] = None
    """Sum of the ranks' weights (0-dim tensor on the buckets' device), when weighted."""


@dataclass(frozen=True)
class _Segment:
    tensor: int  # index into self._tensors
    tensor_offset: int  # in elements of the flattened tensor
    bucket_offset: int  # in elements of the bucket
    numel: int


@dataclass(frozen=True)
class _Bucket:
    dtype: torch.dtype
    numel: int  # payload elements (without the weight slot)
    slot: bool  # carries the weight in element ``numel``
    segments: tuple[_Segment, ...]

    @property
    def length(self) -> int:
        return self.numel + (1 if self.slot else 0)


class BucketedAverager:
    """Average ``tensors`` in place across ``group`` with bucketed async all-reduces.

    Args:
        tensors: floating-point tensors (float64/32, bfloat16, float16), contiguous, all on one
            device; the same list (same shapes, same order) on every rank of ``group``.
            Duplicates (the same tensor object twice) are averaged once.
        group: process group (default: the WORLD group).
        bucket_mb: bucket size in MiB (payload of one all-reduce).
        num_buffers: how many bucket buffers to keep (>= 1); with 2 or more, packing/unpacking
            overlaps the all-reduce of the next bucket.
    """

    def __init__(
        self,
        tensors: Iterable[torch.Tensor],
        group: Optional[dist.ProcessGroup] = None,
        bucket_mb: float = 40.0,
        num_buffers: int = 2,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "BucketedAverager needs an initialized torch.distributed process group "
                "(call torch.distributed.init_process_group first)"
            )
        if not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0:
            raise ValueError(f"bucket_mb={bucket_mb!r} must be > 0")
        if isinstance(num_buffers, bool) or not isinstance(num_buffers, int) or num_buffers < 1:
            raise ValueError(f"num_buffers={num_buffers!r} must be an integer >= 1")
        self.group = group
        self.group_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError("this rank is not a member of the process group given to BucketedAverager")

        unique: list[torch.Tensor] = []
        seen: set[int] = set()
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tensors[{i}] is a {type(t).__name__}, not a torch.Tensor")
            if id(t) in seen:
                continue
            seen.add(id(t))
            if t.dtype not in _FLOAT_BUCKET_DTYPE:
                raise TypeError(
                    f"tensors[{i}] has dtype {t.dtype}; only float64, float32, bfloat16 and "
                    "float16 tensors can be averaged"
                )
            if not t.is_contiguous():
                raise ValueError(
                    f"tensors[{i}] (shape {tuple(t.shape)}, stride {t.stride()}) is not contiguous; "
                    "BucketedAverager writes the average back through a flat view, so pass "
                    "contiguous tensors (parameters, or contiguous views of a flat buffer)"
                )
            unique.append(t)
        self._tensors = unique
        self._numels = [t.numel() for t in unique]
        devices = {t.device for t in unique}
        if len(devices) > 1:
            raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")
        self.bucket_bytes = max(8, int(bucket_mb * 2**20))

        # Streams per bucket dtype, in order of first appearance; cut into buckets.
        streams: dict[torch.dtype, list[int]] = {}
        for idx, t in enumerate(unique):
            if t.numel():
                streams.setdefault(_FLOAT_BUCKET_DTYPE[t.dtype], []).append(idx)
        buckets: list[_Bucket] = []
        for dtype, members in streams.items():
            capacity = max(1, self.bucket_bytes // _itemsize(dtype))
            segs: list[_Segment] = []
            fill = 0
            for idx in members:
                offset, remaining = 0, self._numels[idx]
                while remaining:
                    take = min(remaining, capacity - fill)
                    segs.append(_Segment(idx, offset, fill, take))
                    offset += take
                    remaining -= take
                    fill += take
                    if fill == capacity:
                        buckets.append(_Bucket(dtype, fill, not buckets, tuple(segs)))
                        segs, fill = [], 0
            if fill:
                buckets.append(_Bucket(dtype, fill, not buckets, tuple(segs)))
        if not buckets:  # nothing to average: keep one bucket for the weight slot
            buckets.append(_Bucket(torch.float32, 0, True, ()))
        self._buckets = buckets

        self.num_buffers = min(num_buffers, len(buckets))
        buffer_bytes = max(b.length * _itemsize(b.dtype) for b in buckets)
        self._buffers = [
            torch.empty(buffer_bytes, dtype=torch.uint8, device=self.device)
            for _ in range(self.num_buffers)
        ]
        self._weight_sum = torch.zeros((), dtype=buckets[0].dtype, device=self.device)

    # ------------------------------------------------------------------ properties
    @property
    def numel(self) -> int:
        """Elements averaged (sum over the distinct tensors)."""
        return sum(self._numels)

    @property
    def nbytes(self) -> int:
        """Bytes all-reduced per :meth:`average` call (bucket dtypes, incl. the weight slot)."""
        return sum(b.length * _itemsize(b.dtype) for b in self._buckets)

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    @property
    def buffer_nbytes(self) -> int:
        """Memory held by the bucket buffers."""
        return sum(b.numel() for b in self._buffers)

    @property
    def tensors(self) -> list[torch.Tensor]:
        return list(self._tensors)

    # ------------------------------------------------------------------ averaging
    def _view(self, i: int) -> torch.Tensor:
        b = self._buckets[i]
        raw = self._buffers[i % self.num_buffers]
        return raw[: b.length * _itemsize(b.dtype)].view(b.dtype)

    def _flat(self, idx: int) -> torch.Tensor:
        t = self._tensors[idx]
        if t.numel() != self._numels[idx] or not t.is_contiguous():
            raise RuntimeError(
                f"tensor {idx} changed since the BucketedAverager was built (now shape "
                f"{tuple(t.shape)}, contiguous={t.is_contiguous()}); build a new averager"
            )
        return t.view(-1)

    def _pack(self, i: int, weight) -> torch.Tensor:
        b = self._buckets[i]
        buf = self._view(i)
        data = buf[: b.numel]
        if isinstance(weight, float) and weight == 0.0:
            # Excluded replica: contribute exact zeros (never 0 * NaN).
            data.zero_()
        else:
            for s in b.segments:
                data[s.bucket_offset : s.bucket_offset + s.numel].copy_(
                    self._flat(s.tensor)[s.tensor_offset : s.tensor_offset + s.numel]
                )
            if isinstance(weight, torch.Tensor):
                data.mul_(weight)
                data.masked_fill_(weight == 0, 0.0)
            elif weight is not None and weight != 1.0:
                data.mul_(weight)
        if b.slot:
            if isinstance(weight, torch.Tensor):
                buf[b.numel].copy_(weight)
            else:
                buf[b.numel].fill_(1.0 if weight is None else weight)
        return buf

    def _unpack(self, i: int, divisor) -> None:
        b = self._buckets[i]
        data = self._view(i)[: b.numel]
        # Divide straight into the destination: one pass over the bucket instead of a div_ and
        # a copy_. Same rounding: the quotient is computed in the bucket dtype (fp32 for bf16
        # tensors) and rounded once on store, exactly like div_ followed by copy_.
        for s in b.segments:
            torch.div(
                data[s.bucket_offset : s.bucket_offset + s.numel],
                divisor,
                out=self._flat(s.tensor)[s.tensor_offset : s.tensor_offset + s.numel],
            )

    @torch.no_grad()
    def average(self, weights: Union[None, float, torch.Tensor] = None) -> AverageStats:
        """Average the tensors in place across the group.

        Args:
            weights: this rank's weight ``w_r >= 0`` (a float or a 0-dim tensor), or None for
                the plain mean. The result is ``sum_r w_r x_r / sum_r w_r``; a rank with
                weight 0 is excluded and overwritten with the others' average. All ranks must
                pass weights, or all None.

        Raises:
            ValueError: a negative or non-finite float weight.
            RuntimeError: all weights are 0 (tensors are left untouched, on every rank).
        """
        start = time.perf_counter()
        weight = _check_weight(weights, self.device)
        if self.group_size == 1:
            if weight is not None:
                if isinstance(weight, torch.Tensor):
                    self._weight_sum.copy_(weight)
                else:
                    self._weight_sum.fill_(weight)
                if not bool(self._weight_sum > 0):
                    raise RuntimeError(_ALL_ZERO)
            return AverageStats(0, 0, time.perf_counter() - start, weight is not None,
                                self._weight_sum.clone() if weight is not None else None)

        n = len(self._buckets)
        depth = self.num_buffers
        works: list = [None] * n

        def launch(i: int) -> None:
            works[i] = dist.all_reduce(self._pack(i, weight), group=self.group, async_op=True)

        for i in range(min(depth - 1, n)):
            launch(i)
        divisor: Union[float, torch.Tensor] = float(self.group_size)
        try:
            for i in range(n):
                if i + depth - 1 < n:
                    launch(i + depth - 1)
                works[i].wait()
                works[i] = None
                if i == 0 and weight is not None:
                    b0 = self._buckets[0]
                    self._weight_sum.copy_(self._view(0)[b0.numel])
                    if not bool(self._weight_sum > 0):  # the one host sync (weighted only)
                        raise RuntimeError(_ALL_ZERO)
                    divisor = self._weight_sum
                self._unpack(i, divisor)
        finally:
            # Keep the group consistent if anything above raised: drain in-flight all-reduces.
            for w in works:
                if w is not None:
                    w.wait()
        return AverageStats(
            bytes=self.nbytes,
            num_buckets=n,
            seconds=time.perf_counter() - start,
            weighted=weight is not None,
            weight_sum=self._weight_sum.clone() if weight is not None else None,
        )

    __call__ = average

    def __repr__(self) -> str:
        return (
            f"BucketedAverager(tensors={len(self._tensors)}, numel={self.numel}, "
            f"buckets={self.num_buckets}, bucket_bytes={self.bucket_bytes}, "
            f"group_size={self.group_size}, device={self.device})"
        )


_ALL_ZERO = (
    "BucketedAverager.average: the weights of all ranks are 0 (every replica excluded), so there "
    "is nothing to average; the tensors were left unchanged"
)


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _check_weight(weights, device: torch.device):
    if weights is None:
        return None
    if isinstance(weights, torch.Tensor):
        if weights.numel() != 1:
            raise ValueError(
                f"weights must be this rank's scalar weight (a float or 0-dim tensor), got a "
                f"tensor of shape {tuple(weights.shape)}"
            )
        return weights.detach().reshape(()).to(device=device)
    if isinstance(weights, bool) or not isinstance(weights, (int, float)):
        raise TypeError(f"weights must be a float, a 0-dim tensor or None, got {type(weights).__name__}")
    weight = float(weights)
    if not (weight >= 0.0 and weight != float("inf")):
        raise ValueError(f"weights={weights!r}: a rank's weight must be finite and >= 0")
    return weight
