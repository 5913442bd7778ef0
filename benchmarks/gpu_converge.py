"""Converge cost on CUDA tensors, next to the HBM copy bandwidth measured in the same run.

    torchrun --standalone --nproc-per-node 1 benchmarks/gpu_converge.py --gb 1 4 --out DIR

For each size (GB of fp32 "main params", shaped like a GPT's parameter list: per layer QKV,
proj, two MLP matrices, biases and norms, plus a 50304 x H embedding) every rank averages its
tensors across the NCCL world (one rank per GPU) with:

* ``per_tensor``: one ``all_reduce`` per tensor, then divide (the paper's reference code);
* ``flat_limit``: one all-reduce of a *preallocated* flat buffer of the same bytes, then divide
  (no packing: the transport's limit);
* ``bucketed[X MB]``: :class:`hdet_megatron.averaging.BucketedAverager` (with 2+ ranks only:
  in a group of one it has nothing to do and returns at once);
* ``pack_unpack_only[X MB]``: the averager's two memory passes (pack into a bucket, divide-unpack
  into the tensors) with no communication;
* ``pack_unpack_reference[X MB]``: the same two passes done as before issue 36 (one ``copy_`` and
  one ``torch.div(out=)`` per segment, views sliced at every call), on the same averager's
  layout: the before/after of the copying path in one run. After the timing, both run once
  more on copies of the tensors (weight 0.37, divisor 3: a quotient that rounds) and
  ``bit_identical_to_reference`` says whether they gave the same bits on this device;
* ``d2d_copy``: ``dst.copy_(src)`` of the same bytes (device to device), which gives the HBM
  bandwidth of a copy in this run: ``copy_GBps = 2 * bytes / time`` (read + write).

``copy_limit_s`` = time of the averager's two memory passes at that bandwidth (pack: read +
write; divide-unpack: read + write, i.e. two copies' worth = 2 x ``d2d_copy``). On one GPU the
world has one rank (NCCL refuses two ranks on one device), so no all-reduce moves data: what is
measured is the averager's own memory passes (``pack_unpack_only``) against the HBM copy limit,
and the per-call overhead of ``per_tensor`` (one NCCL call + one divide per tensor) against
``flat_limit`` (one call + one divide). With several GPUs (nproc = GPUs) the ``bucketed`` rows
appear and the all-reduce adds NVLink/network time, as on a node.

Times are medians of ``--reps`` interleaved rounds (after one warm-up call of each method);
each call is bracketed by ``torch.cuda.synchronize()`` and the slowest rank counts; ``host_s`` is
the median time until the call returned to Python (before the synchronize): close to
``median_s`` means the host, not the device, set the pace. Peak extra memory is
``torch.cuda.max_memory_allocated`` during the call minus the memory before it.
Writes ``OUT/gpu_converge.json``.

``--device cpu`` (gloo) smoke-tests this script. ``--device meta`` puts the tensors on PyTorch's
meta device (no data, no kernels) and, instead of timing, counts the ATen operations each
``pack_unpack`` row issues per converge (``aten_ops``; ``compute_ops`` leaves out views and
metadata-only calls: each of those is a kernel launch on a GPU), on any machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

VOCAB = 50304


def gpt_shapes(hidden: int, layers: int) -> list[tuple[int, ...]]:
    h = hidden
    per_layer = [
        (3 * h, h),
        (3 * h,),
        (h, h),
        (h,),
        (4 * h, h),
        (4 * h,),
        (h, 4 * h),
        (h,),
        (h,),
        (h,),
        (h,),
        (h,),
    ]
    return [(VOCAB, h)] + per_layer * layers + [(h,), (h,)]


def shapes_for_bytes(target_bytes: float, hidden: int) -> list[tuple[int, ...]]:
    per_layer = sum(_numel(s) for s in gpt_shapes(hidden, 1)) - _numel((VOCAB, hidden)) - 2 * hidden
    fixed = VOCAB * hidden + 2 * hidden
    layers = max(1, round((target_bytes / 4 - fixed) / per_layer))
    return gpt_shapes(hidden, layers)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def timed(fn, device) -> tuple[float, int, float]:
    """Seconds (slowest rank), peak extra CUDA memory (0 elsewhere) and host seconds (until
    ``fn`` returned, slowest rank) of one call."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    dist.barrier()
    if cuda:
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    fn()
    host = time.perf_counter() - start
    if cuda:
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    extra = torch.cuda.max_memory_allocated(device) - before if cuda else 0
    t = torch.tensor([elapsed, host], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0]), extra, float(t[1])


class OpCounter(TorchDispatchMode):
    """Counts the ATen operations dispatched inside it (views and metadata ops apart)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.compute = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.total += 1
        if not (func.is_view or func.overloadpacket in _METADATA_OPS):
            self.compute += 1
        return func(*args, **(kwargs or {}))


_METADATA_OPS = {torch.ops.aten.detach, torch.ops.aten.is_contiguous, torch.ops.aten.sym_numel}


def count_ops(fn) -> tuple[int, int]:
    """(all ATen ops, compute ops) of one call of ``fn``."""
    with OpCounter() as counter:
        fn()
    return counter.total, counter.compute


def _pack_unpack(avg, weight=None, divisor=1.0):
    def run() -> None:
        for i in range(avg.num_buckets):
            avg._pack(i, weight)
            avg._unpack(i, divisor)

    return run


def _pack_unpack_reference(avg, tensors, weight=None, divisor=1.0):
    """The copying path as it was before issue 36 (kept here as the benchmark's "before"): one
    copy_ and one torch.div(out=) per segment, every view sliced at every call."""

    def run() -> None:
        for i, b in enumerate(avg._buckets):
            data = avg._view(i)[: b.numel]
            for s in b.segments:
                src = tensors[s.tensor].view(-1)[s.tensor_offset : s.tensor_offset + s.numel]
                data[s.bucket_offset : s.bucket_offset + s.numel].copy_(src)
            if weight is not None:
                data.mul_(weight)
            for s in b.segments:
                dst = tensors[s.tensor].view(-1)[s.tensor_offset : s.tensor_offset + s.numel]
                torch.div(data[s.bucket_offset : s.bucket_offset + s.numel], divisor, out=dst)

    return run


def same_bits_as_reference(tensors, bucket_mb: float) -> bool:
    """Whether one pack/unpack of the averager and of the reference on copies of ``tensors``
    (weight 0.37, divisor 3: the quotient rounds) give the same bits."""
    from hdet_megatron.averaging import BucketedAverager

    new = [t.clone() for t in tensors]
    old = [t.clone() for t in tensors]
    _pack_unpack(BucketedAverager(new, bucket_mb=bucket_mb), 0.37, 3.0)()
    _pack_unpack_reference(BucketedAverager(old, bucket_mb=bucket_mb), old, 0.37, 3.0)()
    return all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(new, old, strict=True))


def run_size(gb: float, args, device, n: int) -> dict:
    from hdet_megatron.averaging import BucketedAverager

    shapes = shapes_for_bytes(gb * 2**30, args.hidden)
    rank = dist.get_rank()
    meta = device.type == "meta"  # no data, no kernels, no collectives: ATen op counts only
    tensors = [torch.empty(s, device=device, dtype=torch.float32).normal_().add_(rank) for s in shapes]
    numel = sum(t.numel() for t in tensors)
    nbytes = numel * 4
    flat = torch.empty(numel, device=device, dtype=torch.float32)
    copy_src = torch.empty(numel, device=device, dtype=torch.float32).normal_()
    averagers = {mb: BucketedAverager(tensors, bucket_mb=mb) for mb in args.bucket_mb}

    def per_tensor():
        for t in tensors:
            dist.all_reduce(t)
            t.div_(n)

    methods = {}
    if not meta:
        methods = {
            "d2d_copy": lambda: flat.copy_(copy_src),
            "per_tensor": per_tensor,
            "flat_limit": lambda: (dist.all_reduce(flat), flat.div_(n)),
        }
    if n > 1 and not meta:  # a group of one: BucketedAverager.average returns at once
        for mb, avg in averagers.items():
            methods[f"bucketed[{mb:g}MB]"] = avg.average
    # The averager's own memory passes, no communication: pack into the bucket, divide-unpack
    # into the tensors (divisor 1 keeps the values). On one GPU this *is* its cost. Next to it
    # the per-segment code it replaced, on the same layout.
    for mb, avg in averagers.items():
        methods[f"pack_unpack_only[{mb:g}MB]"] = _pack_unpack(avg)
        methods[f"pack_unpack_reference[{mb:g}MB]"] = _pack_unpack_reference(avg, tensors)
    if rank == 0:
        print(
            f"[gpu_converge] {gb:g} GB: {len(tensors)} tensors, {numel / 1e6:.0f}M params, "
            f"{nbytes / 2**30:.2f} GiB fp32, {n} rank(s), {args.reps} rounds",
            flush=True,
        )
    for fn in methods.values():  # warm-up (NCCL communicators, allocator)
        fn()
    if meta:
        rows = []
        for name, fn in methods.items():
            total, compute = count_ops(fn)
            rows.append({"method": name, "aten_ops": total, "compute_ops": compute})
        return {"gb": gb, "params": numel, "bytes": nbytes, "tensors": len(tensors), "rows": rows}
    times: dict[str, list[float]] = {k: [] for k in methods}
    hosts: dict[str, list[float]] = {k: [] for k in methods}
    mem: dict[str, int] = {k: 0 for k in methods}
    for _ in range(args.reps):
        for name, fn in methods.items():
            t, extra, host = timed(fn, device)
            times[name].append(t)
            hosts[name].append(host)
            mem[name] = max(mem[name], extra)
    med = {k: statistics.median(v) for k, v in times.items()}
    copy_gbps = 2 * nbytes / med["d2d_copy"] / 1e9
    copy_limit = 2 * med["d2d_copy"]
    rows = []
    for name in methods:
        rows.append(
            {
                "method": name,
                "median_s": med[name],
                "min_s": min(times[name]),
                "host_s": statistics.median(hosts[name]),
                "ratio_to_flat_limit": med[name] / med["flat_limit"],
                "ratio_to_copy_limit": med[name] / copy_limit,
                "speedup_vs_per_tensor": med["per_tensor"] / med[name],
                "peak_extra_mib": mem[name] / 2**20,
                "buffers_mib": (
                    averagers[float(name.split("[")[1].split("MB")[0])].buffer_nbytes / 2**20
                    if "[" in name
                    else (nbytes / 2**20 if name == "flat_limit" else 0)
                ),
            }
        )
    result = {
        "gb": gb,
        "all_reduce_moves_data": n > 1,
        "params": numel,
        "bytes": nbytes,
        "tensors": len(tensors),
        "copy_GBps": copy_gbps,
        "copy_limit_s": copy_limit,
        "rows": rows,
        "bit_identical_to_reference": (
            {f"{mb:g}MB": same_bits_as_reference(tensors, mb) for mb in args.bucket_mb}
        ),
    }
    # Drop the buffers before empty_cache (rebinding, not del: the closures in ``methods`` share
    # these variables' cells).
    tensors = flat = copy_src = averagers = methods = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gb", type=float, nargs="+", default=[1.0, 4.0], help="fp32 main-param sizes")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size of the GPT shapes")
    p.add_argument("--bucket-mb", type=float, nargs="+", default=[40.0, 200.0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    p.add_argument(
        "--device",
        choices=("cuda", "cpu", "meta"),
        default="cuda",
        help="cpu: gloo, for a smoke test of this script only (benchmarks/converge.py is the CPU "
        "benchmark); meta: ATen op counts of the pack/unpack rows (no data, no kernels)",
    )
    args = p.parse_args()
    if "RANK" not in os.environ:  # plain `python gpu_converge.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("gpu_converge.py needs CUDA (use benchmarks/converge.py on CPU)")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device(args.device)
        dist.init_process_group("gloo")
    n = dist.get_world_size()
    sizes = [run_size(gb, args, device, n) for gb in args.gb]
    if dist.get_rank() == 0:
        for s in sizes:
            if "aten_ops" in s["rows"][0]:  # --device meta
                print(
                    f"\n{s['gb']:g} GB ({s['params'] / 1e6:.0f}M params, {s['tensors']} tensors): "
                    "ATen ops per call"
                )
                for r in s["rows"]:
                    print(f"{r['method']:30s} {r['aten_ops']:6d} ops, {r['compute_ops']:6d} of them compute")
                continue
            print(
                f"\n{s['gb']:g} GB ({s['params'] / 1e6:.0f}M params, {s['tensors']} tensors): "
                f"d2d copy {s['copy_GBps']:.0f} GB/s -> the averager's two passes need "
                f">= {s['copy_limit_s'] * 1e3:.2f} ms"
            )
            print(
                f"{'method':30s} {'median ms':>10s} {'host ms':>8s} {'x flat':>7s} {'x copy lim':>10s} "
                f"{'vs per-tensor':>13s} {'peak+ MiB':>10s}"
            )
            for r in s["rows"]:
                print(
                    f"{r['method']:30s} {r['median_s'] * 1e3:10.3f} {r['host_s'] * 1e3:8.3f} "
                    f"{r['ratio_to_flat_limit']:7.2f} {r['ratio_to_copy_limit']:10.2f} "
                    f"{r['speedup_vs_per_tensor']:13.2f} {r['peak_extra_mib']:10.1f}"
                )
            if s["bit_identical_to_reference"] is not None:
                print(
                    f"copying path vs the per-segment reference, same bits: {s['bit_identical_to_reference']}"
                )
        os.makedirs(args.out, exist_ok=True)
        cuda = device.type == "cuda"
        with open(os.path.join(args.out, "gpu_converge.json"), "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(device) if cuda else device.type,
                    "torch": torch.__version__,
                    "cuda": torch.version.cuda,
                    "nccl": str(torch.cuda.nccl.version()) if cuda else None,
                    "ranks": n,
                    "reps": args.reps,
                    "sizes": sizes,
                },
                f,
                indent=2,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
