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
