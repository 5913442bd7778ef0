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
* Weights: ``average(w)`` computes ``sum_r w_r x_r / sum_r w_r``. The weights are summed first
  by a one-element all-reduce (before any tensor is touched, so that homed tensors stay
  untouched when every weight is 0). A rank with weight 0 contributes zeros (its buffer is
  zeroed, not multiplied, so its NaN/Inf never reach the others) and receives the others'
  weighted mean. The weight sum is checked on the host once per call (the only host sync; all
  ranks see the same sum, so all raise together when it is 0).
* ``average()`` without weights is ``sum / group_size``; the all-reduce result is the same on
  every rank, so every rank ends with the same bits.
* The copying path (below) works on views of the tensors and the buckets built once, not per
  call, and packs a bucket with one multi-tensor copy (``torch._foreach_copy_``) per source
  dtype: slicing each segment in Python at every call cost more host time than the device's
  copies take (2.7-2.9x the HBM copy time on an H200 with 40 MB buckets). The divide-unpack
  writes each large segment straight into its tensor (one pass); runs of adjacent small
  segments are divided in place in the bucket with one kernel and copied out with one
  multi-tensor copy. Every path computes the same quotient in the bucket dtype and rounds it
  once into the tensor, so the bits are those of a per-segment ``torch.div(..., out=tensor)``.

Homing (``home=True``, what the HDET runtimes ask for by default): tensors whose dtype *is* their
bucket dtype (float32, float64) and that own their storage are moved, once, into one flat
storage per dtype: the values are copied there and each tensor's ``.data`` is set to its view
of it (the tensor *objects* stay the same, so optimizer state keyed by them, Megatron's
``fp32_from_float16_groups`` / ``main_param`` handles and param-group lists keep working). A
converge then all-reduces slices of that storage in place and divides in place: no pack, no
unpack, no bucket buffers for them. Tensors that cannot be homed (bfloat16/float16, views into
someone else's buffer such as Megatron DistOpt's fp32 shards of DDP's ``param_data``, tensor
subclasses, tensors sharing storage) keep the copying path; that is logged once per reason.
Homed tensors get bit-identical results to the copying path (same operations on the same
values in the same dtype). Because a homed tensor's storage is the whole flat buffer,
``torch.save`` of the tensor itself would write the whole buffer: :func:`own_storage` (and the
state-dict hooks of the runtimes) hand out copies with their own storage instead.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

__all__ = [
    "AverageStats",
    "BucketedAverager",
    "GroupedAverager",
    "Homer",
    "home_reason",
    "own_storage",
    "protect_module_state_dicts",
]

logger = logging.getLogger(__name__)

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
    weight_sum: torch.Tensor | None = None
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
    numel: int
    segments: tuple[_Segment, ...]
    home: tuple[int, int] | None = None  # homed: (index into self._homes, element offset)

    @property
    def length(self) -> int:
        return self.numel


#: A segment of fewer bucket bytes than this is "small": its copy takes less device time than a
#: kernel launch costs, so adjacent small segments share one in-place divide and one
#: multi-tensor copy-out (the extra pass over their few bytes is cheaper than the launches).
_SMALL_SEGMENT_BYTES = 1 << 20

_ViewLists = tuple[tuple[list[torch.Tensor], list[torch.Tensor]], ...]


@dataclass(frozen=True)
class _CopyPlan:
    """One copying bucket's pack and divide-unpack, as views built once (see the module doc)."""

    keys: tuple[tuple[int, tuple[int, int, torch.dtype, bool]], ...]
    """(tensor index, (data_ptr, numel, dtype, contiguous)) of the tensors the views are into:
    a tensor whose ``.data`` was replaced since gets new views."""
    pack: _ViewLists
    """Per source dtype: (bucket views, tensor views), for one ``torch._foreach_copy_``."""
    divide_into: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    """(bucket view, tensor view) of the segments divided straight into their tensor."""
    runs: tuple[torch.Tensor, ...]
    """Bucket slices holding runs of adjacent small segments: divided in place..."""
    copy_out: _ViewLists
    """...then copied out, per tensor dtype: (tensor views, bucket views)."""


_HOMEABLE_DTYPES = (torch.float32, torch.float64)
_warned: set[str] = set()


def _warn_once(key: str, message: str, *args: object) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message, *args)


def home_reason(t: torch.Tensor) -> str | None:
    """Why ``t`` cannot be moved into a flat buffer by setting its ``.data`` (None: it can).

    Only tensors that own their whole storage are homed: a tensor whose storage is shared with
    another tensor (a view, or a tensor others view) would silently stop being that other
    tensor's memory once its ``.data`` points elsewhere.
    """
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        return f"it is a {type(t).__name__} (tensor subclass)"
    if t.dtype not in _HOMEABLE_DTYPES:
        return f"its dtype {t.dtype} is averaged in a float32 bucket (the copy is the cast)"
    if t.requires_grad and not t.is_leaf:
        return "it is not a leaf tensor"
    if (
        t._base is not None
        or t.storage_offset() != 0
        or (t.untyped_storage().nbytes() != t.numel() * t.element_size())
    ):
        return (
            "it is a view into a larger storage (e.g. Megatron DistributedOptimizer's fp32 "
            "main-param shards, which are views of DDP's param buffer)"
        )
    return None


class Homer:
    """How :class:`BucketedAverager` (``home=``) moves tensors into its flat storage.

    The default moves a tensor by ``tensor.data = view``. Subclasses handle tensors whose
    storage is owned by a framework (``hdet_megatron.fsdp`` does FSDP2's sharded params).
    """

    def reason(self, tensor: torch.Tensor) -> str | None:
        """None when ``tensor`` can be homed, else why not (logged once per reason)."""
        return home_reason(tensor)

    def install(self, tensor: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
        """Make ``tensor`` live in ``view`` (same shape and dtype, values already copied);
        return the tensor the averager keeps for it."""
        tensor.data = view
        return tensor

    def current(self, kept: torch.Tensor) -> torch.Tensor:
        """The tensor that holds the values of homed tensor ``kept`` now (what :meth:`install`
        returned): ``kept`` itself here, whose ``.data`` something may have replaced."""
        return kept

    def rehome(self, kept: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
        """Move homed tensor ``kept`` back into ``view`` (its values already copied there);
        return the tensor the averager keeps for it from now on."""
        return self.install(kept, view)


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, copied into its own storage when it shares a larger one (a homed tensor):
    what ``torch.save`` should get so that it writes ``t``'s bytes and not the whole buffer."""
    t = t.detach()
    if t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return t.clone()
    return t


#: (id(state_dict), id(param)) -> (weakref to the state dict, the copy): a tensor reachable
#: under two keys of one state dict (tied weights) is copied once, so torch.save still writes one
#: storage for it, as it did before homing.
_copies: dict[tuple[int, int], tuple[weakref.ref[Any], torch.Tensor]] = {}


def _state_dict_hook(
    names: tuple[str, ...],
    module: torch.nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
) -> None:
    for stale in [k for k, v in _copies.items() if v[0]() is None]:
        del _copies[stale]
    for name in names:
        param = module._parameters.get(name)
        key = prefix + name
        value = state_dict.get(key)
        if param is None or value is None or value is param:  # keep_vars=True: the caller's choice
            continue
        memo = (id(state_dict), id(param))
        if memo not in _copies:
            _copies[memo] = (weakref.ref(state_dict), own_storage(value))
        state_dict[key] = _copies[memo][1]


def protect_module_state_dicts(
    modules: Sequence[torch.nn.Module], homed: Sequence[torch.Tensor]
) -> list[RemovableHandle]:
    """Make ``module.state_dict()`` return homed parameters in their own storage.

    ``state_dict()`` returns ``param.detach()``, which shares the parameter's storage; for a
    homed parameter that is the averager's whole flat buffer, and ``torch.save`` writes a
    tensor's whole storage. A state-dict post-hook on every module that owns a homed parameter
    swaps in a copy, so what is saved is byte-for-byte what it was before homing (one storage
    per parameter). ``keep_vars=True`` state dicts (used by Megatron's ``sharded_state_dict``,
    whose writers copy views themselves) are left alone. Returns the hook handles.
    """
    ids = {id(t) for t in homed}
    handles: list[RemovableHandle] = []
    seen: set[int] = set()
    for root in modules:
        for module in root.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            names = tuple(n for n, p in module._parameters.items() if p is not None and id(p) in ids)
            if names:
                # torch declares Module.register_state_dict_post_hook without annotations.
                hook = functools.partial(_state_dict_hook, names)
                handles.append(module.register_state_dict_post_hook(hook))  # type: ignore[no-untyped-call]
    return handles


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
        home: move the tensors that can be moved (see :func:`home_reason`) into flat storage
            owned by the averager, once (``True``, or a :class:`Homer`); a converge then
            all-reduces that storage in place. ``False`` (default): copy in and out of bucket
            buffers at every call. Which tensors are homed is agreed on by all ranks (one small
            all-reduce here), so the bucket layouts always match. Homing is skipped on a group
            of one rank (there is nothing to average).
    """

    def __init__(
        self,
        tensors: Iterable[torch.Tensor],
        group: dist.ProcessGroup | None = None,
        bucket_mb: float = 40.0,
        num_buffers: int = 2,
        home: bool | Homer = False,
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
        if not isinstance(home, (bool, Homer)):
            raise TypeError(f"home must be a bool or a Homer, got {type(home).__name__}")
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

        homer = home if isinstance(home, Homer) else (Homer() if home else None)
        homed = (
            self._choose_homed(homer) if homer is not None and self.group_size > 1 else [False] * len(unique)
        )

        # Streams per bucket dtype, in order of first appearance; cut into buckets. A stream is
        # homed when every tensor in it can be: then every bucket is a slice of its flat storage
        # with *the same element positions as the copying path*, so both paths all-reduce the
        # same buffers and get the same bits (a collective's summation order can depend on an
        # element's position in the buffer).
        streams: dict[torch.dtype, list[int]] = {}
        for idx, t in enumerate(unique):
            if t.numel():
                streams.setdefault(_FLOAT_BUCKET_DTYPE[t.dtype], []).append(idx)
        #: (flat storage, tensor indices) per homed stream.
        self._homes: list[tuple[torch.Tensor, tuple[int, ...]]] = []
        buckets: list[_Bucket] = []
        for dtype, members in streams.items():
            capacity = max(1, self.bucket_bytes // _itemsize(dtype))
            home_id = None
            if all(homed[i] for i in members):
                home_id = len(self._homes)
                total = sum(self._numels[i] for i in members)
                self._homes.append((torch.empty(total, dtype=dtype, device=self.device), tuple(members)))
            elif homer is not None and any(homed[i] for i in members):
                _warn_once(
                    f"mixed-{dtype}",
                    "BucketedAverager: the %s converge buckets also hold tensors that cannot be "
                    "homed, so the whole %s stream keeps the copying path",
                    dtype,
                    dtype,
                )
            segs: list[_Segment] = []
            fill = start = 0
            for idx in members:
                offset, remaining = 0, self._numels[idx]
                while remaining:
                    take = min(remaining, capacity - fill)
                    segs.append(_Segment(idx, offset, fill, take))
                    offset += take
                    remaining -= take
                    fill += take
                    if fill == capacity:
                        buckets.append(self._bucket(dtype, fill, segs, home_id, start))
                        start += fill
                        segs, fill = [], 0
            if fill:
                buckets.append(self._bucket(dtype, fill, segs, home_id, start))
        if not buckets:  # nothing to average: one empty bucket keeps the weight's dtype
            buckets.append(_Bucket(torch.float32, 0, ()))
        self._buckets = buckets
        self._homer = homer
        self._install_homes(homer)

        copy_ids = [i for i, b in enumerate(buckets) if b.home is None]
        self._ring = {i: k % max(1, min(num_buffers, len(copy_ids))) for k, i in enumerate(copy_ids)}
        self.num_buffers = min(num_buffers, len(copy_ids))
        buffer_bytes = max((buckets[i].length * _itemsize(buckets[i].dtype) for i in copy_ids), default=0)
        self._buffers = [
            torch.empty(buffer_bytes, dtype=torch.uint8, device=self.device) for _ in range(self.num_buffers)
        ]
        self._weight_sum = torch.zeros((), dtype=buckets[0].dtype, device=self.device)
        self._plans: dict[int, _CopyPlan] = {}  # copying bucket -> its views (built on first use)
        # Each bucket's payload view, sliced once: the buffers and the homes never move.
        self._bucket_views = [self._slice(i) for i in range(len(buckets))]

    @staticmethod
    def _bucket(
        dtype: torch.dtype, fill: int, segs: list[_Segment], home_id: int | None, start: int
    ) -> _Bucket:
        home = None if home_id is None else (home_id, start)
        return _Bucket(dtype, fill, tuple(segs), home)

    def _choose_homed(self, homer: Homer) -> list[bool]:
        """Which tensors to home: those the homer accepts on *every* rank (one all-reduce)."""
        reasons = [homer.reason(t) if t.numel() else "it is empty" for t in self._tensors]
        ptrs: dict[int, int] = {}
        for i, t in enumerate(self._tensors):
            if reasons[i] is None:
                ptr = t.untyped_storage().data_ptr()
                if ptr in ptrs:  # two tensor objects over one storage: home neither
                    reasons[i] = reasons[ptrs[ptr]] = "it shares its storage with another averaged tensor"
                ptrs[ptr] = i
        ok = torch.tensor([r is None for r in reasons], dtype=torch.int32, device=self.device)
        if ok.numel():
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)
        homed = [bool(v) for v in ok.tolist()]
        skipped: dict[str, list[int]] = {}
        for i, (r, h) in enumerate(zip(reasons, homed, strict=True)):
            if not h and self._numels[i]:
                skipped.setdefault(r or "another rank cannot home it", []).append(i)
        for reason, idx in skipped.items():
            nbytes = sum(self._numels[i] * self._tensors[i].element_size() for i in idx)
            _warn_once(
                reason,
                "BucketedAverager: %d tensor(s) (%.1f MiB) keep the copying converge path "
                "(pack into a bucket, unpack after the all-reduce) because %s",
                len(idx),
                nbytes / 2**20,
                reason,
            )
        return homed

    @torch.no_grad()
    def _install_homes(self, homer: Homer | None) -> None:
        self._home_views: dict[int, torch.Tensor] = {}
        for flat, members in self._homes:
            offset = 0
            for idx in members:
                t = self._tensors[idx]
                n = self._numels[idx]
                view = flat[offset : offset + n].view(t.shape)
                view.copy_(t)
                assert homer is not None  # a stream is homed only when a Homer chose its tensors
                kept = homer.install(t, view)
                if kept.data_ptr() != view.data_ptr():
                    raise RuntimeError(f"internal: tensor {idx} was not moved into the flat buffer")
                self._tensors[idx] = kept
                self._home_views[idx] = view
                offset += n

    # ------------------------------------------------------------------ properties
    @property
    def numel(self) -> int:
        """Elements averaged (sum over the distinct tensors)."""
        return sum(self._numels)

    @property
    def nbytes(self) -> int:
        """Bytes all-reduced by one unweighted :meth:`average` call (bucket dtypes); a weighted
        call sends one more element (the weights' sum, reduced up front)."""
        return sum(b.length * _itemsize(b.dtype) for b in self._buckets)

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    @property
    def buffer_nbytes(self) -> int:
        """Memory held by the bucket buffers (the copying path's; homed tensors need none)."""
        return sum(b.numel() for b in self._buffers)

    @property
    def tensors(self) -> list[torch.Tensor]:
        return list(self._tensors)

    @property
    def homed_tensors(self) -> list[torch.Tensor]:
        """The tensors that live in the averager's flat storage."""
        return [self._tensors[i] for i in self._home_views]

    @property
    def homed_numel(self) -> int:
        return sum(self._numels[i] for i in self._home_views)

    # ------------------------------------------------------------------ averaging
    def _view(self, i: int) -> torch.Tensor:
        return self._bucket_views[i]

    def _slice(self, i: int) -> torch.Tensor:
        b = self._buckets[i]
        if b.home is not None:
            flat = self._homes[b.home[0]][0]
            return flat[b.home[1] : b.home[1] + b.numel]
        raw = self._buffers[self._ring[i]]
        return raw[: b.length * _itemsize(b.dtype)].view(b.dtype)

    def _flat(self, idx: int) -> torch.Tensor:
        t = self._tensors[idx]
        if t.numel() != self._numels[idx] or not t.is_contiguous():
            raise RuntimeError(
                f"tensor {idx} changed since the BucketedAverager was built (now shape "
                f"{tuple(t.shape)}, contiguous={t.is_contiguous()}); build a new averager"
            )
        return t.view(-1)

    @torch.no_grad()
    def _check_homes(self) -> None:
        """Homed tensors must still live in the flat storage: something that replaced a
        tensor's ``.data`` (``module.to()``, ``load_state_dict(assign=True)``) would otherwise
        leave the average in the buffer and not in the tensor. Such a tensor is moved back."""
        homer = self._homer
        for idx, view in self._home_views.items():
            assert homer is not None  # home views exist only when a Homer installed them
            t = homer.current(self._tensors[idx])
            if t.data_ptr() == view.data_ptr() and t.shape == view.shape:
                continue
            if t.shape != view.shape or t.dtype != view.dtype or t.device != view.device:
                raise RuntimeError(
                    f"homed tensor {idx} changed since the BucketedAverager was built (shape "
                    f"{tuple(t.shape)}, {t.dtype}, {t.device}); build a new averager"
                )
            view.copy_(t)
            self._tensors[idx] = homer.rehome(self._tensors[idx], view)
            _warn_once(
                "rehomed",
                "BucketedAverager: a homed tensor's storage was replaced (e.g. by module.to() or "
                "load_state_dict(assign=True)); its values were moved back into the flat buffer",
            )

    def _key(self, idx: int) -> tuple[int, int, torch.dtype, bool]:
        t = self._tensors[idx]
        return (t.data_ptr(), t.numel(), t.dtype, t.is_contiguous())

    @torch.no_grad()
    def _plan(self, i: int) -> _CopyPlan:
        """Copying bucket ``i``'s views, rebuilt when one of its tensors changed storage."""
        plan = self._plans.get(i)
        if plan is not None and all(self._key(idx) == key for idx, key in plan.keys):
            return plan
        b = self._buckets[i]
        data = self._view(i)  # b.numel elements
        small_numel = _SMALL_SEGMENT_BYTES // _itemsize(b.dtype)
        pack: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        copy_out: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        divide_into: list[tuple[torch.Tensor, torch.Tensor]] = []
        runs: list[torch.Tensor] = []
        # Segments are back to back in bucket order; group maximal runs of small ones.
        groups: list[list[tuple[_Segment, torch.Tensor, torch.Tensor]]] = []
        last_small = False
        for s in b.segments:
            # Detached: the views write the tensors' values, never their autograd history.
            src = self._flat(s.tensor).detach()[s.tensor_offset : s.tensor_offset + s.numel]
            dst = data[s.bucket_offset : s.bucket_offset + s.numel]
            views = pack.setdefault(src.dtype, ([], []))
            views[0].append(dst)
            views[1].append(src)
            small = s.numel < small_numel
            if small and last_small:
                groups[-1].append((s, dst, src))
            else:
                groups.append([(s, dst, src)])
            last_small = small
        for group in groups:
            if len(group) == 1:
                divide_into.append((group[0][1], group[0][2]))
                continue
            first, last = group[0][0], group[-1][0]
            runs.append(data[first.bucket_offset : last.bucket_offset + last.numel])
            for _, dst, src in group:
                out = copy_out.setdefault(src.dtype, ([], []))
                out[0].append(src)
                out[1].append(dst)
        plan = _CopyPlan(
            keys=tuple((idx, self._key(idx)) for idx in dict.fromkeys(s.tensor for s in b.segments)),
            pack=tuple(pack.values()),
            divide_into=tuple(divide_into),
            runs=tuple(runs),
            copy_out=tuple(copy_out.values()),
        )
        self._plans[i] = plan
        return plan

    def _pack(self, i: int, weight: float | torch.Tensor | None) -> torch.Tensor:
        b = self._buckets[i]
        data = self._view(i)  # b.numel elements
        if isinstance(weight, float) and weight == 0.0:
            # Excluded replica: contribute exact zeros (never 0 * NaN).
            data.zero_()
        else:
            if b.home is None:
                # One multi-tensor copy per source dtype (a cast to the bucket dtype is exact).
                for dsts, srcs in self._plan(i).pack:
                    torch._foreach_copy_(dsts, srcs)
            if isinstance(weight, torch.Tensor):
                data.mul_(weight)
                data.masked_fill_(weight == 0, 0.0)
            elif weight is not None and weight != 1.0:
                data.mul_(weight)
        return data

    def _unpack(self, i: int, divisor: float | torch.Tensor) -> None:
        b = self._buckets[i]
        if b.home is not None:
            self._view(i).div_(divisor)  # in place: the bucket *is* the tensors' memory
            return
        plan = self._plan(i)
        # Divide straight into the destination: one pass over the bucket instead of a div_ and
        # a copy_. Same rounding: the quotient is computed in the bucket dtype (fp32 for bf16
        # tensors) and rounded once on store, exactly like div_ followed by copy_ -- which is
        # what the runs of small segments do (same division kernel, same values).
        for src, dst in plan.divide_into:
            torch.div(src, divisor, out=dst)
        for run in plan.runs:
            run.div_(divisor)
        for dsts, srcs in plan.copy_out:
            torch._foreach_copy_(dsts, srcs)

    @torch.no_grad()
    def average(self, weights: None | float | torch.Tensor = None) -> AverageStats:
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
            return AverageStats(
                0,
                0,
                time.perf_counter() - start,
                weight is not None,
                self._weight_sum.clone() if weight is not None else None,
            )

        self._check_homes()
        sent = sum(b.length * _itemsize(b.dtype) for b in self._buckets)
        divisor: float | torch.Tensor = float(self.group_size)
        if weight is not None:
            # Sum the weights before any homed tensor is scaled or zeroed in place, so that
            # "all weights 0" still leaves every tensor untouched (a slot in bucket 0 could not).
            if isinstance(weight, torch.Tensor):
                self._weight_sum.copy_(weight)
            else:
                self._weight_sum.fill_(weight)
            dist.all_reduce(self._weight_sum, group=self.group)
            sent += _itemsize(self._weight_sum.dtype)
            if not bool(self._weight_sum > 0):  # the one host sync (weighted only)
                raise RuntimeError(_ALL_ZERO)
            divisor = self._weight_sum

        n = len(self._buckets)
        depth = max(self.num_buffers, 1)
        # torch types all_reduce's result as Work | None (None only without async_op).
        works: list[Any] = [None] * n
        state = {"next": 0, "copies": 0}  # next bucket to launch; copy buckets in flight

        def pump() -> None:
            # Launch in bucket order: homed buckets need no buffer, copy buckets one of the ring.
            while state["next"] < n:
                i = state["next"]
                if self._buckets[i].home is None:
                    if state["copies"] >= depth:
                        return
                    state["copies"] += 1
                works[i] = dist.all_reduce(self._pack(i, weight), group=self.group, async_op=True)
                state["next"] += 1

        try:
            pump()
            for i in range(n):
                works[i].wait()
                works[i] = None
                b = self._buckets[i]
                self._unpack(i, divisor)
                if b.home is None:
                    state["copies"] -= 1
                pump()
        finally:
            # Keep the group consistent if anything above raised: drain in-flight all-reduces.
            for w in works:
                if w is not None:
                    w.wait()
        return AverageStats(
            bytes=sent,
            num_buckets=n,
            seconds=time.perf_counter() - start,
            weighted=weight is not None,
            weight_sum=self._weight_sum.clone() if weight is not None else None,
        )

    __call__ = average

    def __repr__(self) -> str:
        return (
            f"BucketedAverager(tensors={len(self._tensors)}, numel={self.numel}, "
            f"homed={self.homed_numel}, buckets={self.num_buckets}, "
            f"bucket_bytes={self.bucket_bytes}, group_size={self.group_size}, device={self.device})"
        )


class GroupedAverager:
    """One converge over several :class:`BucketedAverager` s, each averaging its tensors over its
    own process group (e.g. a MoE model's dense params over the data-parallel group and its
    expert params over the expert-data-parallel group, so that only copies of the same tensor
    are ever averaged together). Same interface as one averager; the parts run in order."""

    def __init__(self, parts: Sequence[BucketedAverager]) -> None:
        if not parts:
            raise ValueError("GroupedAverager needs at least one BucketedAverager")
        self.parts = list(parts)

    def average(self, weights: None | float | torch.Tensor = None) -> AverageStats:
        """Average every part (see :meth:`BucketedAverager.average`). Weighted: the weight sums
        agree when every part's group holds one rank per arm; all-zero weights raise in the
        first part, before any tensor is touched."""
        stats = [part.average(weights) for part in self.parts]
        return AverageStats(
            bytes=sum(s.bytes for s in stats),
            num_buckets=sum(s.num_buckets for s in stats),
            seconds=sum(s.seconds for s in stats),
            weighted=stats[0].weighted,
            weight_sum=stats[0].weight_sum,
        )

    __call__ = average

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [t for part in self.parts for t in part.tensors]

    @property
    def homed_tensors(self) -> list[torch.Tensor]:
        return [t for part in self.parts for t in part.homed_tensors]

    @property
    def numel(self) -> int:
        return sum(part.numel for part in self.parts)

    @property
    def homed_numel(self) -> int:
        return sum(part.homed_numel for part in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    @property
    def num_buckets(self) -> int:
        return sum(part.num_buckets for part in self.parts)

    @property
    def buffer_nbytes(self) -> int:
        return sum(part.buffer_nbytes for part in self.parts)

    def __repr__(self) -> str:
        return f"GroupedAverager({self.parts!r})"


_ALL_ZERO = (
    "BucketedAverager.average: the weights of all ranks are 0 (every replica excluded), so there "
    "is nothing to average; the tensors were left unchanged"
)


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _check_weight(weights: object, device: torch.device) -> float | torch.Tensor | None:
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
