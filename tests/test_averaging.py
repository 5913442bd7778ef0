"""BucketedAverager: bucketed async all-reduce averaging (4 gloo ranks, one world)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from hdet_megatron.averaging import AverageStats, BucketedAverager
from tests.harness import run_world

SHAPES = [  # (shape, dtype)
    ((5, 3), torch.float32),
    ((17,), torch.bfloat16),
    ((2, 2, 3), torch.float64),
    ((0,), torch.float32),
    ((9,), torch.float16),
    ((31,), torch.float32),  # larger than the tiny buckets: split across several
    ((4, 4), torch.float64),
    ((3,), torch.bfloat16),
]


def _data(rank: int, dyadic: bool) -> list[torch.Tensor]:
    """Rank ``rank``'s tensors; every rank can rebuild every other rank's data."""
    gen = torch.Generator().manual_seed(1000 + rank)
    out = []
    for shape, dtype in SHAPES:
        if dyadic:  # small multiples of 1/8: every sum and the /4 are exact in all dtypes
            t = torch.randint(-64, 64, shape, generator=gen).to(torch.float64) / 8
        else:
            t = torch.randn(shape, generator=gen, dtype=torch.float64) * 3
        out.append(t.to(dtype))
    return out


def _bits(tensors) -> list[bytes]:
    return [t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in tensors]


def _reference(world: int, dyadic: bool, weights=None) -> list[torch.Tensor]:
    all_data = [_data(r, dyadic) for r in range(world)]
    weights = weights or [1.0] * world
    out = []
    for i, (_, dtype) in enumerate(SHAPES):
        acc = sum(
            (all_data[r][i].double() * w for r, w in enumerate(weights) if w != 0),
            torch.zeros(SHAPES[i][0], dtype=torch.float64),
        )
        out.append((acc / sum(weights)).to(dtype))
    return out


def _averaging_world(rank, world):
    results = {}
    checks = 0

    # 1. Plain mean, dyadic data: exactly the mean, for several bucket sizes / buffer depths.
    for bucket_mb, num_buffers in ((40.0, 2), (28 / 2**20, 2), (8 / 2**20, 1), (40 / 2**20, 3)):
        data = _data(rank, dyadic=True)
        view_base = torch.arange(20, dtype=torch.float32) * (rank + 1)
        views = [view_base[3:9], view_base[12:20].view(2, 4)]  # contiguous views into one buffer
        tensors = data + views + [data[0]]  # duplicate object: averaged once
        avg = BucketedAverager(tensors, bucket_mb=bucket_mb, num_buffers=num_buffers)
        assert avg.numel == sum(math.prod(s) for s, _ in SHAPES) + 14
        stats = avg.average()
        assert isinstance(stats, AverageStats) and stats.num_buckets == avg.num_buckets
        assert stats.bytes == avg.nbytes and stats.seconds >= 0 and not stats.weighted
        ref = _reference(world, True)
        for got, want in zip(data, ref, strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want), (bucket_mb, got, want)
        mean_scale = sum(range(1, world + 1)) / world
        assert torch.equal(view_base[3:9], torch.arange(3, 9, dtype=torch.float32) * mean_scale)
        assert torch.equal(view_base[12:20], torch.arange(12, 20, dtype=torch.float32) * mean_scale)
        assert torch.equal(view_base[:3], torch.arange(3, dtype=torch.float32) * (rank + 1))  # untouched
        results[f"dyadic-{bucket_mb}"] = _bits(data)
        if bucket_mb < 1e-4:
            assert avg.num_buckets > len(SHAPES)  # tensors were split across buckets
            assert avg.buffer_nbytes <= num_buffers * 48  # a ring of tiny buffers, no model copy
        checks += 1

    # 2. Plain mean, random data: same bits on every rank, close to the exact mean.
    data = _data(rank, dyadic=False)
    avg = BucketedAverager(data, bucket_mb=20 / 2**20)
    avg.average()
    for got, want in zip(data, _reference(world, False), strict=True):
        tol = {torch.float64: 1e-14, torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 1e-3}
        assert torch.allclose(got.double(), want.double(), rtol=tol[got.dtype], atol=tol[got.dtype])
    results["random"] = _bits(data)
    # fp32 accumulation of low-precision tensors: bf16 inputs whose bf16 sum would round.
    # Mean of 256, 258, 258, 258 is 257.5 -> bf16 258; summed in bf16 (any order) it is 256.
    low = torch.tensor([1.0, 256.0 if rank == 0 else 258.0], dtype=torch.bfloat16)
    BucketedAverager([low], bucket_mb=1.0).average()
    assert low.tolist() == [1.0, 258.0]
    checks += 1

    # 3. Weighted average with an excluded rank holding NaN/Inf: float and tensor weights.
    weights = [1.0, 0.0, 2.0, 1.0]
    for as_tensor in (False, True):
        data = _data(rank, dyadic=True)
        if rank == 1:
            for t in data:
                if t.numel():
                    t.view(-1)[0] = float("nan")
                    t.view(-1)[-1] = float("inf")
        w = torch.tensor(weights[rank]) if as_tensor else weights[rank]
        avg = BucketedAverager(data, bucket_mb=24 / 2**20)
        stats = avg.average(w)
        assert stats.weighted and float(stats.weight_sum) == 4.0
        for got, want in zip(data, _reference(world, True, weights), strict=True):
            assert torch.isfinite(got).all() and torch.equal(got, want)
        results[f"weighted-{as_tensor}"] = _bits(data)
        checks += 1

    # 4. All weights zero: a clear error on every rank, tensors untouched, group still usable.
    data = _data(rank, dyadic=True)
    before = [t.clone() for t in data]
    avg = BucketedAverager(data, bucket_mb=24 / 2**20)
    with pytest.raises(RuntimeError, match="weights of all ranks are 0"):
        avg.average(0.0)
    assert all(torch.equal(a, b) for a, b in zip(data, before, strict=True))
    avg.average(1.0)  # equal weights = plain mean, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(data, _reference(world, True), strict=True))
    checks += 1

    # 5. Sub-groups: ranks {0, 2} and {1, 3} average separately.
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mine = groups[rank % 2]
    t = torch.full((6,), float(rank))
    BucketedAverager([t], group=mine, bucket_mb=8 / 2**20).average()
    assert torch.equal(t, torch.full((6,), float(rank % 2 + 1)))
    checks += 1

    # 6. Input validation.
    with pytest.raises(ValueError, match="not contiguous"):
        BucketedAverager([torch.zeros(4, 4).t()])
    with pytest.raises(TypeError, match="dtype torch.int64"):
        BucketedAverager([torch.zeros(3, dtype=torch.int64)])
    with pytest.raises(ValueError, match="finite and >= 0"):
        BucketedAverager([torch.zeros(3)]).average(-1.0)
    empty = BucketedAverager([])
    assert empty.numel == 0 and empty.num_buckets == 1
    empty.average()
    checks += 1

    # 7. Homing: a bucket-dtype stream whose tensors all own their storage and have the bucket
    #    dtype (here: the float64 one; the float32 stream also holds bf16/fp16 tensors and a view
    #    into a shared buffer, so it is copied; `pure` leaves those out) moves into the
    #    averager's flat storage (same tensor objects); results are bit-identical to the copying
    #    path, weighted and not, with buckets that split tensors.
    for pure in (False, True):
        keep = [i for i, (shape, dt) in enumerate(SHAPES) if not pure or dt in (torch.float32, torch.float64)]
        want_homed = {
            k
            for k, i in enumerate(keep)
            if math.prod(SHAPES[i][0])
            and (SHAPES[i][1] == torch.float64 or pure and SHAPES[i][1] == torch.float32)
        }
        for bucket_mb, w in (
            (40.0, None),
            (28 / 2**20, None),
            (24 / 2**20, weights[rank]),
            (24 / 2**20, torch.tensor(weights[rank])),
        ):
            homed_data = [torch.nn.Parameter(_data(rank, False)[i]) for i in keep]
            copied = [_data(rank, False)[i] for i in keep]
            base_h, base_c = (torch.arange(20, dtype=torch.float32) * (rank + 1) for _ in range(2))
            if rank == 1 and w is not None:  # the excluded rank's values never reach the others
                for t in homed_data + copied:
                    if t.numel():
                        t.data.view(-1)[0] = float("nan")
            objects = [id(t) for t in homed_data]
            extra_h, extra_c = ([], []) if pure else ([base_h[3:9]], [base_c[3:9]])
            h = BucketedAverager(homed_data + extra_h, bucket_mb=bucket_mb, home=True)
            c = BucketedAverager(copied + extra_c, bucket_mb=bucket_mb)
            assert [id(t) for t in h.tensors[: len(objects)]] == objects  # same objects
            got = {k for k, t in enumerate(homed_data) if any(t is x for x in h.homed_tensors)}
            assert got == want_homed, (pure, got, want_homed)
            assert h.homed_numel == sum(homed_data[k].numel() for k in want_homed)
            assert h.buffer_nbytes <= c.buffer_nbytes and (h.buffer_nbytes == 0) == pure
            hs, cs = h.average(w), c.average(w)
            extra = 0 if w is None else 4  # the weights' sum (float32: the first bucket's dtype)
            assert hs.bytes == h.nbytes + extra and cs.bytes == c.nbytes + extra
            assert h.nbytes == c.nbytes
            assert _bits(homed_data) == _bits(copied), (pure, bucket_mb, w)
            assert torch.equal(base_h, base_c)
            if w is None:
                assert all(torch.isfinite(t).all() for t in homed_data)
            results[f"homed-{pure}-{bucket_mb}-{type(w).__name__}"] = _bits(homed_data)
    # All weights 0: homed tensors untouched too. A replaced .data is moved back (and averaged).
    homed_data = [torch.nn.Parameter(t) for t in _data(rank, True) if t.dtype == torch.float32]
    before = [t.detach().clone() for t in homed_data]
    h = BucketedAverager(homed_data, bucket_mb=24 / 2**20, home=True)
    with pytest.raises(RuntimeError, match="weights of all ranks are 0"):
        h.average(0.0)
    assert all(torch.equal(a, b) for a, b in zip(homed_data, before, strict=True))
    homed_data[0].data = homed_data[0].data.clone()  # e.g. module.to() / load(assign=True)
    h.average()
    assert homed_data[0].data_ptr() == h.homed_tensors[0].data_ptr()
    ref = [t for t, (_, dt) in zip(_reference(world, True), SHAPES, strict=True) if dt == torch.float32]
    assert all(torch.equal(a, b) for a, b in zip(homed_data, ref, strict=True))
    # What torch.save writes: a homed tensor's own bytes via own_storage, not the whole buffer.
    import io

    from hdet_megatron.averaging import own_storage

    def saved(t):
        buf = io.BytesIO()
        torch.save(t, buf)
        return buf.getvalue()

    p = homed_data[-1]
    assert saved(own_storage(p)) == saved(p.detach().clone())
    assert len(saved(p.detach())) > len(saved(own_storage(p)))  # the trap own_storage avoids
    checks += 1
    return checks, results


@pytest.mark.slow
def test_bucketed_averaging_4_ranks():
    out = run_world(4, _averaging_world, timeout=120)
    assert [c for c, _ in out] == [11] * 4  # every check ran on every rank
    results = [r for _, r in out]
    for key in results[0]:
        assert all(r[key] == results[0][key] for r in results[1:]), key  # same bits everywhere


def test_requires_process_group():
    if dist.is_initialized():  # pragma: no cover - another test initialized one
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        BucketedAverager([torch.zeros(2)])


# -- the copying path against the per-segment arithmetic it replaced (issue 36) ----------------

#: (numel, dtype): odd sizes, every dtype, two tensors over 1 MiB of bucket bytes (divided
#: straight into the tensor) between runs of small ones (divided in place, copied out).
COPY_SHAPES = [
    (7, torch.float32),
    (262_147, torch.float32),
    (13, torch.bfloat16),
    (1, torch.float16),
    (5, torch.float64),
    (2, torch.float32),
    (262_151, torch.bfloat16),
    (33, torch.float16),
    (11, torch.float32),
    (3, torch.float64),
    (0, torch.float32),
    (9, torch.bfloat16),
]


def _copy_data(seed: int, small_only: bool = False, device: str = "cpu") -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for numel, dtype in COPY_SHAPES:
        if small_only and numel > 1000:
            continue
        t = torch.randn(numel, generator=gen, dtype=torch.float64) * 3
        if numel > 2:
            t[1], t[2] = float("nan"), float("inf")  # an excluded rank's values must not leak
        out.append(t.to(device=device, dtype=dtype))
    return out


def _old_pack(avg: BucketedAverager, i: int, weight, tensors) -> None:
    """The pack as it was before issue 36: one copy_ per segment, views sliced at every call."""
    b = avg._buckets[i]
    data = avg._view(i)[: b.numel]
    if isinstance(weight, float) and weight == 0.0:
        data.zero_()
        return
    for s in b.segments:
        flat = tensors[s.tensor].view(-1)
        data[s.bucket_offset : s.bucket_offset + s.numel].copy_(
            flat[s.tensor_offset : s.tensor_offset + s.numel]
        )
    if isinstance(weight, torch.Tensor):
        data.mul_(weight)
        data.masked_fill_(weight == 0, 0.0)
    elif weight is not None and weight != 1.0:
        data.mul_(weight)


def _old_unpack(avg: BucketedAverager, i: int, divisor, tensors) -> None:
    """The divide-unpack as it was: one torch.div(..., out=tensor slice) per segment."""
    b = avg._buckets[i]
    data = avg._view(i)[: b.numel]
    for s in b.segments:
        flat = tensors[s.tensor].view(-1)
        torch.div(
            data[s.bucket_offset : s.bucket_offset + s.numel],
            divisor,
            out=flat[s.tensor_offset : s.tensor_offset + s.numel],
        )


def copy_path_world(rank, world, device="cpu"):
    """New pack/unpack and the old per-segment code on the same layout and the same values, with
    a stand-in for the all-reduce applied identically to both buckets: same bits everywhere.
    tests/test_gpu.py runs it on CUDA tensors."""
    cases = 0
    paths = {"divide_into": 0, "runs": 0, "pack_groups": 0}
    base = {small_only: _copy_data(7, small_only, device) for small_only in (False, True)}
    # Tiny buckets (52 bytes: tensors split over many) with the small tensors only: a bucket
    # costs a few kernels here, and 52-byte buckets over the 2.3 MB would be 44,000 of them.
    for bucket_mb, small_only in ((40.0, False), (1.5, False), (0.3, False), (52 / 2**20, True)):
        for weight, divisor in (
            (None, 4.0),
            (None, 3.0),  # not a power of two: the quotient rounds
            (1.0, 7.0),
            (0.37, 2.9),
            (0.0, 3.0),  # excluded: zeros in, the others' mean out
            (torch.tensor(0.61, device=device), torch.tensor(2.3, device=device)),
            (torch.tensor(0.0, device=device), torch.tensor(5.0, device=device)),
        ):
            new, old = ([t.clone() for t in base[small_only]] for _ in range(2))
            a = BucketedAverager(new, bucket_mb=bucket_mb, num_buffers=2)
            b = BucketedAverager(old, bucket_mb=bucket_mb, num_buffers=2)
            assert a.homed_numel == 0 and a.num_buckets == b.num_buckets
            for i in range(a.num_buckets):
                a._pack(i, weight)
                _old_pack(b, i, weight, old)
                got, want = a._view(i)[: a._buckets[i].numel], b._view(i)[: b._buckets[i].numel]
                assert _bits([got]) == _bits([want]), ("pack", bucket_mb, weight, i)
                for bucket in (got, want):  # stands in for the all-reduce: same values, same ops
                    gen = torch.Generator().manual_seed(i)
                    noise = torch.randn(bucket.shape, generator=gen, dtype=torch.float64).to(bucket)
                    bucket.nan_to_num_(0.0).mul_(3).add_(noise)
                a._unpack(i, divisor)
                _old_unpack(b, i, divisor, old)
            assert _bits(new) == _bits(old), (bucket_mb, weight, divisor)
            for plan in a._plans.values():
                paths["divide_into"] += len(plan.divide_into)
                paths["runs"] += len(plan.runs)
                paths["pack_groups"] += len(plan.pack)
            cases += 1

    # The cached views follow a tensor whose storage was replaced (module.to(), load with
    # assign=True); a tensor that changed size is refused, as before.
    data = _copy_data(3, device=device)
    avg = BucketedAverager(data, bucket_mb=0.3)
    for i in range(avg.num_buckets):
        avg._plan(i)
    data[1].data = data[1].data.clone()
    moved = data[1]
    for i in range(avg.num_buckets):
        avg._pack(i, None)
        avg._view(i)[: avg._buckets[i].numel].fill_(6.0)
        avg._unpack(i, 2.0)
    assert torch.equal(moved, torch.full_like(moved, 3.0))
    data[0].data = torch.zeros(8, device=device)
    with pytest.raises(RuntimeError, match="tensor 0 changed since the BucketedAverager was built"):
        avg._pack(0, None)
    return cases, paths


def test_copying_path_bits_match_the_per_segment_code():
    """Issue 36: the copying path's views built once, multi-tensor pack, runs of small segments
    divided in place and copied out give the bits of the per-segment code it replaced (odd sizes,
    fp32/bf16/fp16/fp64, plain/weighted/excluded, divisors that round), and every new path ran."""
    ((cases, paths),) = run_world(1, copy_path_world, timeout=120)
    assert cases == 4 * 7
    assert paths["divide_into"] > 0 and paths["runs"] > 0 and paths["pack_groups"] > paths["runs"]
