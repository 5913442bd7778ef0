"""Step overhead of HDET on a real Megatron-Core training step, A/B interleaved in one run.

    .venv/bin/torchrun --standalone --nproc-per-node 4 benchmarks/overhead.py --out benchmarks/results

Two identical Megatron GPT setups (TP2 x DP2 here) train side by side in the same processes:
``plain`` (Megatron's ``OptimizerParamScheduler``, no HDET) and ``hdet`` (the drop-in scheduler
plus ``HDET.step`` with a period longer than the run, so every measured step is a non-converge
step). Blocks of ``--block`` steps alternate A, B, A, B, ...; each step is timed (slowest rank)
and we report the median per-step time of each and their ratio. Then the converge itself is
timed ``--converges`` times (``HDET.converge`` after one step) and amortised over T = 100 and
T = 1000 steps. Host syncs made from hdet_megatron per non-converge step are counted with
:class:`~hdet_megatron.megatron.sync_counter.HostSyncCounter`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--block", type=int, default=5)
    p.add_argument("--converges", type=int, default=7)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: model and batches on GPU LOCAL_RANK %% device_count (several ranks "
        "may share one GPU over gloo; NCCL needs one GPU per rank)",
    )
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--bf16", action="store_true", help="bf16 params, fp32 main params")
    p.add_argument(
        "--dist-opt", action="store_true", help="distributed optimizer (one instance per arm: arms = DP)"
    )
    p.add_argument("--transformer-impl", choices=("local", "transformer_engine"), default="local")
    args = p.parse_args()
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    else:
        torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    if cuda and args.backend == "gloo":  # several ranks on one GPU
        from hdet_megatron.megatron.gloo_cuda import apply_gloo_cuda_adapter

        apply_gloo_cuda_adapter()
    from hdet_megatron.config import HDETConfig
    from hdet_megatron.megatron import toy
    from hdet_megatron.megatron.runtime import HDET
    from hdet_megatron.megatron.scheduler import HDETOptimizerParamScheduler
    from hdet_megatron.megatron.sync_counter import HostSyncCounter

    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    setup = toy.ToyGPTSetup(
        tp=args.tp,
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=8,
        vocab_size=512,
        seq_length=args.seq,
        micro_batch_size=4,
        num_microbatches=2,
        cuda=cuda,
        bf16=args.bf16,
        use_distributed_optimizer=args.dist_opt,
        num_distributed_optimizer_instances=(dist.get_world_size() // args.tp) if args.dist_opt else 1,
        transformer_impl=args.transformer_impl,
    )
    total = args.blocks * args.block * 2 + args.converges + 10
    toy.init_parallel(setup)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    runs = {}
    for name in ("plain", "hdet"):
        model = toy.build_model(setup)
        optimizer = toy.build_optimizer(setup, model)
        kwargs = toy.scheduler_kwargs(setup, total)
        if name == "plain":
            scheduler, hdet = OptimizerParamScheduler(optimizer, **kwargs), None
        else:
            config = HDETConfig(period=10**9)  # only forced converges below
            scheduler = HDETOptimizerParamScheduler(optimizer, hdet=config, **kwargs)
            hdet = HDET(config, model, optimizer, scheduler)
        runs[name] = (model, optimizer, scheduler, hdet, toy.data_iterator_for_rank(setup))

    hdet_calls: list[float] = []  # wall time of HDET.step alone (this rank), every hdet step

    def step(name):
        model, optimizer, scheduler, hdet, data = runs[name]
        dist.barrier()
        start = time.perf_counter()
        losses, _ = toy.train_step(setup, model, optimizer, data)
        scheduler.step(1)
        if hdet is not None:
            t0 = time.perf_counter()
            hdet.step(losses)
            hdet_calls.append(time.perf_counter() - t0)  # host time of the call (launches)
        if cuda:
            torch.cuda.synchronize()
        elapsed = torch.tensor([time.perf_counter() - start], device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed)

    for name in runs:  # warm-up
        step(name)
    times = {"plain": [], "hdet": []}
    for _ in range(args.blocks):
        for name in ("plain", "hdet"):
            times[name].extend(step(name) for _ in range(args.block))
    with HostSyncCounter() as counter:
        step("hdet")
    syncs = counter.total
    hdet = runs["hdet"][3]
    converge_s = []
    for _ in range(args.converges):
        step("hdet")
        dist.barrier()
        start = time.perf_counter()
        hdet.converge()
        if cuda:
            torch.cuda.synchronize()
        t = torch.tensor([time.perf_counter() - start], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        converge_s.append(float(t))
    if dist.get_rank() == 0:
        plain, with_hdet = statistics.median(times["plain"]), statistics.median(times["hdet"])
        conv = statistics.median(converge_s)
        result = {
            "setup": f"TP{args.tp} x DP{dist.get_world_size() // args.tp}, {args.layers} layers, "
            f"hidden {args.hidden}, seq {args.seq}, mbs 4 x 2 microbatches",
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "backend": args.backend,
            "bf16": args.bf16,
            "dist_opt": args.dist_opt,
            "transformer_impl": args.transformer_impl,
            "steps_per_arm": len(times["plain"]),
            "median_step_plain_s": plain,
            "median_step_hdet_s": with_hdet,
            "step_overhead": with_hdet / plain - 1,
            # Spread of the per-block ratio (hdet block median / the plain block run just
            # before it): how much of the overhead figure is noise.
            "block_ratio_quartiles": statistics.quantiles(
                [
                    statistics.median(times["hdet"][i : i + args.block])
                    / statistics.median(times["plain"][i : i + args.block])
                    for i in range(0, len(times["plain"]), args.block)
                ],
                n=4,
            ),
            "step_plain_quartiles_s": statistics.quantiles(times["plain"], n=4),
            "step_hdet_quartiles_s": statistics.quantiles(times["hdet"], n=4),
            # Direct measurement of what HDET adds to a non-converge step (no noise from the
            # rest of the step): the HDET.step call itself, relative to the plain step.
            "median_hdet_step_call_s": statistics.median(hdet_calls[1 : 1 + len(times["hdet"])]),
            "hdet_step_call_over_plain_step": statistics.median(hdet_calls[1 : 1 + len(times["hdet"])])
            / plain,
            "median_converge_s": conv,
            "converge_bytes": hdet.averager.nbytes,
            "amortized_T100": conv / (100 * plain),
            "amortized_T1000": conv / (1000 * plain),
            "host_syncs_per_non_converge_step": syncs,
        }
        for k, v in result.items():
            print(f"{k:34s} {v}")
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "overhead.json"), "w") as f:
            json.dump(result, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
