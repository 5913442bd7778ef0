"""Converge cost: HDET's bucketed averager vs the alternatives, on a real Megatron GPT's tensors.

    .venv/bin/torchrun --standalone --nproc-per-node 4 benchmarks/converge.py --out benchmarks/results

Every rank builds the same Megatron-Core ``GPTModel`` (local spec, fp32, >= 50M parameters) and
averages its parameter list across the 4 gloo ranks with:

* ``per_tensor``: one ``all_reduce`` per tensor, then divide (the paper's reference code);
* ``average_parameters``: ``torch.distributed.algorithms.model_averaging.utils.average_parameters``
  (one ``torch.cat`` of everything, one all-reduce, copy back);
* ``flat_limit``: one all-reduce of a *preallocated* flat buffer of the same bytes, no packing:
  the transport's limit;
* ``bucketed[X MB]``: :class:`hdet_megatron.averaging.BucketedAverager` for each bucket size
  (copying path: pack into a bucket buffer, all-reduce, divide-unpack);
* ``homed[X MB]``: the same averager with ``home=True`` (what the HDET runtimes use by default):
  the tensors live in its flat buckets, a converge is an in-place all-reduce + divide per bucket;
* ``pack_unpack_only[40MB]``: the averager's two memory passes without any communication (what
  it costs on top of the transport).

Methods are interleaved round-robin for ``--reps`` rounds; we report medians and ratios to
``flat_limit`` measured in the same run. Peak extra memory is the peak RSS increase of the
process during one call (sampled every 0.5 ms by a thread), next to what each method allocates
by construction.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

import psutil
import torch
import torch.distributed as dist


class PeakRSS:
    """Samples this process' RSS in a thread; ``peak - start`` is the extra memory of a call."""

    def __init__(self, interval: float = 0.0005):
        self.proc = psutil.Process()
        self.interval = interval

    def __enter__(self):
        self.start = self.proc.memory_info().rss
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            self._stop.wait(self.interval)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def extra(self) -> int:
        return self.peak - self.start


def build_tensors(args) -> list[torch.Tensor]:
    from hdet_megatron.megatron import toy

    from megatron.core import parallel_state as ps

    setup = toy.ToyGPTSetup(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=8,
        vocab_size=args.vocab,
        seq_length=128,
    )
    ps.initialize_model_parallel()
    torch.manual_seed(0)
    toy.model_parallel_cuda_manual_seed(0)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    model = GPTModel(
        config=toy.transformer_config(setup),
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=setup.vocab_size,
        max_sequence_length=setup.seq_length,
    )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(dist.get_rank())  # ranks differ, so averaging does real work
    return [p.data for p in model.parameters()]


def per_tensor(tensors, n):
    for t in tensors:
        dist.all_reduce(t)
        t.div_(n)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--bucket-mb", type=float, nargs="+", default=[1, 4, 16, 40, 100])
    p.add_argument(
        "--home-mb", type=float, nargs="*", default=[40], help="bucket sizes of the homed (in-place) averager"
    )
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument(
        "--no-average-parameters",
        action="store_true",
        help="leave out torch's average_parameters (slow, allocates a model copy per call)",
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from torch.distributed.algorithms.model_averaging.utils import average_parameters

    from hdet_megatron.averaging import BucketedAverager

    rank, n = dist.get_rank(), dist.get_world_size()
    tensors = build_tensors(args)
    numel = sum(t.numel() for t in tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    flat = torch.empty(numel, dtype=torch.float32)
    averagers = {mb: BucketedAverager(tensors, bucket_mb=mb) for mb in args.bucket_mb}
    # Homing moves the tensors' storage into the averager's flat buffer, once: each homed averager
    # gets its own copy of the tensors (the main params a run would home), built and homed here,
    # outside the timed calls.
    homed = {}
    for mb in args.home_mb:
        own = [t.clone() for t in tensors]
        homed[mb] = BucketedAverager(own, bucket_mb=mb, home=True)
        assert homed[mb].homed_numel == numel
    methods = {
        "per_tensor": lambda: per_tensor(tensors, n),
        **(
            {}
            if args.no_average_parameters
            else {"average_parameters": lambda: average_parameters(iter(tensors), None)}
        ),
        "flat_limit": lambda: (dist.all_reduce(flat), flat.div_(n)),
    }
    for mb, avg in averagers.items():
        methods[f"bucketed[{mb:g}MB]"] = avg.average
    for mb, avg in homed.items():
        methods[f"homed[{mb:g}MB]"] = avg.average
    # Decomposition, no communication: the bucketed averager's own memory passes (pack into the
    # bucket, divide-unpack into the tensors; divisor 1 keeps the values) for the default size.
    default_mb = 40.0 if 40.0 in averagers else max(averagers)
    copy_only = averagers[default_mb]

    def pack_unpack() -> None:
        for i in range(copy_only.num_buckets):
            copy_only._pack(i, None)
            copy_only._unpack(i, 1.0)

    methods[f"pack_unpack_only[{default_mb:g}MB]"] = pack_unpack
    by_construction = {
        "per_tensor": 0,
        **({} if args.no_average_parameters else {"average_parameters": nbytes}),
        "flat_limit": nbytes,  # the preallocated buffer itself (held permanently)
        **{f"bucketed[{mb:g}MB]": avg.buffer_nbytes for mb, avg in averagers.items()},
        f"pack_unpack_only[{default_mb:g}MB]": copy_only.buffer_nbytes,
        **{f"homed[{mb:g}MB]": avg.buffer_nbytes for mb, avg in homed.items()},
    }
    load_start = os.getloadavg()
    if rank == 0:
        print(f"[converge] load average (1/5/15 min) at start: {load_start}", flush=True)
        print(
            f"[converge] {len(tensors)} tensors, {numel / 1e6:.1f}M params, "
            f"{nbytes / 2**20:.0f} MiB fp32, {n} gloo ranks, {args.reps} rounds",
            flush=True,
        )
    times: dict[str, list[float]] = {k: [] for k in methods}
    cpu: dict[str, list[float]] = {k: [] for k in methods}
    mem: dict[str, int] = {k: 0 for k in methods}
    names = list(methods)
    for fn in methods.values():  # warm-up (first-touch of buffers, gloo pairs)
        fn()
    for rep in range(args.reps):
        # Rotate the order every round: no method always follows the same neighbour.
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            fn = methods[name]
            dist.barrier()
            with PeakRSS() as peak:
                start, start_cpu = time.perf_counter(), time.process_time()
                fn()
                elapsed, used = time.perf_counter() - start, time.process_time() - start_cpu
            # The slowest rank defines a collective's wall time; CPU time (all threads, gloo's
            # included) is summed over the ranks: the work done, which a loaded machine does not
            # inflate the way it inflates waiting.
            t = torch.tensor([elapsed])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            c = torch.tensor([used])
            dist.all_reduce(c)
            times[name].append(float(t))
            cpu[name].append(float(c))
            mem[name] = max(mem[name], peak.extra)
        if rank == 0:
            print(f"[converge] round {rep + 1}/{args.reps} done", flush=True)
    if rank == 0:
        limit = statistics.median(times["flat_limit"])
        limit_cpu = statistics.median(cpu["flat_limit"])
        rows = []
        for name in methods:
            med = statistics.median(times[name])
            # Paired: each round's time over the same round's flat_limit time, then the median.
            paired = statistics.median(a / b for a, b in zip(times[name], times["flat_limit"], strict=True))
            rows.append(
                {
                    "method": name,
                    "median_s": med,
                    "ratio_to_limit": med / limit,
                    "paired_ratio_to_limit": paired,
                    "cpu_s": statistics.median(cpu[name]),
                    "cpu_ratio_to_limit": statistics.median(cpu[name]) / limit_cpu,
                    "speedup_vs_per_tensor": statistics.median(times["per_tensor"]) / med,
                    "peak_rss_extra_mib": mem[name] / 2**20,
                    "allocated_by_construction_mib": by_construction[name] / 2**20,
                    "times_s": times[name],
                    "cpu_times_s": cpu[name],
                }
            )
        print(f"[converge] load average at end: {os.getloadavg()}")
        print(
            f"{'method':22s} {'median s':>9s} {'x limit':>8s} {'paired x':>8s} {'CPU s':>7s} "
            f"{'CPU x':>6s} {'vs per-tensor':>13s} {'peak RSS+ MiB':>13s} {'buffers MiB':>11s}"
        )
        for r in rows:
            print(
                f"{r['method']:22s} {r['median_s']:9.3f} {r['ratio_to_limit']:8.2f} "
                f"{r['paired_ratio_to_limit']:8.2f} {r['cpu_s']:7.2f} {r['cpu_ratio_to_limit']:6.2f} "
                f"{r['speedup_vs_per_tensor']:13.2f} {r['peak_rss_extra_mib']:13.1f} "
                f"{r['allocated_by_construction_mib']:11.1f}"
            )
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "converge.json"), "w") as f:
            json.dump(
                {
                    "params": numel,
                    "bytes": nbytes,
                    "ranks": n,
                    "reps": args.reps,
                    "loadavg_start": load_start,
                    "loadavg_end": os.getloadavg(),
                    "torch": torch.__version__,
                    "rows": rows,
                },
                f,
                indent=2,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
