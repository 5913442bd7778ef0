"""Rank-side code of the multi-rank GPU tests (``tests/test_gpu.py``); run under torchrun.

    torchrun --standalone --nproc-per-node 2 tests/gpu_worker.py SCENARIO OUT_DIR [--te]

Several ranks share the one GPU of a single-GPU machine: NCCL refuses two ranks on one device
("Duplicate GPU detected"), so these worlds use **gloo with CUDA tensors** (gloo stages them
through host memory). Every rank binds ``cuda:(LOCAL_RANK % device_count)``; with one rank per
GPU on a multi-GPU machine, ``HDET_GPU_BACKEND=nccl`` runs the same checks over NCCL.

Each rank writes ``OUT_DIR/rank<r>.json``; the test reads and checks them. Scenarios:

* ``averager``: :class:`~hdet_megatron.averaging.BucketedAverager` on CUDA fp32 + bf16 tensors
  (plain and weighted average) against the mean computed on the host.
* ``torch_scheduler``: ``HDETOneCycleLR`` on a plain torch model on CUDA.
* ``hdet``: Megatron GPT (local or, with ``--te``, Transformer Engine layer spec) on CUDA in bf16
  with the distributed optimizer (one instance per arm), 2 arms, HDET with lr, dropout and
  attention-temperature axes; after every converge the fp32 main params agree bit for bit
  across ranks; no host sync from hdet_megatron on a non-converge step.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _device():
    """The GPU (``HDET_WORKER_DEVICE=cpu``: the CPU, only to smoke-test this file without one)."""
    import torch

    if os.environ.get("HDET_WORKER_DEVICE") == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def averager(rank: int, world: int) -> dict:
    import torch

    from hdet_megatron.averaging import BucketedAverager

    dev = _device()
    shapes = [(1000, 37), (5,), (256, 256), (3, 7, 11)]
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(s, generator=gen) for s in shapes]  # the same on every rank
    # rank r holds base * (r + 1) (fp32 tensors) and the same in bf16.
    fp32 = [(b * (rank + 1)).to(dev) for b in base]
    bf16 = [(b * (rank + 1)).to(dev, torch.bfloat16) for b in base]
    tensors = fp32 + bf16
    avg = BucketedAverager(tensors, bucket_mb=0.1)  # several buckets
    assert avg.device == dev, avg.device
    avg.average()
    mean_factor = sum(r + 1 for r in range(world)) / world
    err_fp32 = max(float((t.cpu() - b * mean_factor).abs().max()) for t, b in zip(fp32, base, strict=True))
    err_bf16 = max(
        float((t.float().cpu() - (b * mean_factor)).abs().max() / (b.abs().max() * mean_factor))
        for t, b in zip(bf16, base, strict=True)
    )
    plain_digest = _digest(tensors)
    # Weighted: rank r weighs r + 1 (a CUDA tensor weight).
    for t, b in zip(fp32, base, strict=True):
        t.copy_((b * (rank + 1)).to(dev))
    avg.average(torch.tensor(float(rank + 1), device=dev))
    weights = [r + 1 for r in range(world)]
    wmean = sum(w * w for w in weights) / sum(weights)  # sum_r w_r * (r+1) / sum_r w_r, w_r = r+1
    err_weighted = max(float((t.cpu() - b * wmean).abs().max()) for t, b in zip(fp32, base, strict=True))
    return {
        "err_fp32": err_fp32,
        "err_bf16_rel": err_bf16,
        "err_weighted": err_weighted,
        "digest": plain_digest,
        "weighted_digest": _digest(fp32),
        "device": str(avg.device),
    }


def hdet(rank: int, world: int, te: bool) -> dict:
    import torch
    import torch.distributed as dist

    from hdet_megatron.config import Axis, HDETConfig
    from hdet_megatron.megatron import cpu, toy
    from hdet_megatron.megatron.runtime import HDET, main_params
    from hdet_megatron.megatron.scheduler import HDETOptimizerParamScheduler
    from hdet_megatron.megatron.sync_counter import HostSyncCounter

    assert cpu.shims_applied() == (_device().type == "cpu"), "CPU shims must stay off on CUDA"
    setup = toy.ToyGPTSetup(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=128,
        seq_length=32,
        bf16=True,
        use_distributed_optimizer=True,
        num_distributed_optimizer_instances=world,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        cuda=_device().type == "cuda",
        transformer_impl="transformer_engine" if te else "local",
    )
    steps, period = 8, 3
    out: dict = {"window_main_digests": [], "losses": [], "syncs_non_converge": None}
    with toy.parallel(setup):
        model = toy.build_model(setup)
        optimizer = toy.build_optimizer(setup, model)
        config = HDETConfig(
            period=period,
            axes=(Axis("lr", 0.2), Axis("dropout", 0.05), Axis("attention_temperature", 0.1)),
        )
        scheduler = HDETOptimizerParamScheduler(optimizer, hdet=config, **toy.scheduler_kwargs(setup, steps))
        runtime = HDET(config, model, optimizer, scheduler)
        out["module_axis_targets"] = sorted(
            {f"{type(t.module).__name__}.{t.attr}" for t in runtime.module_axes.targets}
        )
        out["param_devices"] = sorted({str(p.device) for c in model for p in c.parameters()})
        out["main_dtypes"] = sorted({str(p.dtype) for p in main_params(optimizer)})
        data = toy.data_iterator_for_rank(setup)
        for step in range(steps):
            counting = step == 1  # inside the first window: a non-converge step
            counter = HostSyncCounter()
            if counting:
                counter.__enter__()
            try:
                losses, ok = toy.train_step(setup, model, optimizer, data)
                scheduler.step(1)
                metrics = runtime.step(losses)
            finally:
                if counting:
                    counter.__exit__()
            assert ok
            if counting:
                assert metrics is None
                out["syncs_non_converge"] = dict(counter.counts)
            out["losses"].append(float(torch.stack([o["lm loss"] for o in losses]).mean()))
            if metrics is not None:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                out["window_main_digests"].append(_digest(main_params(optimizer)))
        runtime.close()
    digests = [None] * world
    dist.all_gather_object(digests, out["window_main_digests"])
    out["all_window_main_digests"] = digests
    return out


def torch_scheduler(rank: int, world: int) -> dict:
    """``HDETOneCycleLR`` on a plain torch model on CUDA: the loss accumulator and the window's
    loss table live on the device, converge averages CUDA params."""
    import torch
    import torch.nn as nn

    from hdet_megatron.config import Axis, HDETConfig
    from hdet_megatron.megatron.sync_counter import HostSyncCounter
    from hdet_megatron.torch_scheduler import HDETOneCycleLR

    dev = _device()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(dev)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    steps, period = 7, 3
    sched = HDETOneCycleLR(
        optimizer,
        max_lr=0.05,
        total_steps=steps + 2,
        model=model,
        hdet=HDETConfig(period=period, axes=(Axis("lr", 0.3),)),
    )
    gen = torch.Generator().manual_seed(100 + rank)
    out: dict = {"digests": [], "lrs": [], "syncs_non_converge": None, "converges": []}
    for step in range(1, steps + 1):
        x = torch.randn(8, 16, generator=gen).to(dev)
        y = torch.tanh(x[:, :4])
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        out["lrs"].append(optimizer.param_groups[0]["lr"])
        before = sched._hdet.num_converges
        if step == 2:  # a non-converge step
            with HostSyncCounter() as counter:
                sched.step(loss.detach())
            out["syncs_non_converge"] = dict(counter.counts)
        else:
            sched.step(loss.detach())
        if sched._hdet.num_converges != before:
            out["converges"].append(step)
        out["digests"].append(_digest(list(model.parameters())))
    out["param_devices"] = sorted({str(p.device) for p in model.parameters()})
    sched.close()
    return out


def main() -> int:
    scenario, out_dir = sys.argv[1], sys.argv[2]
    te = "--te" in sys.argv[3:]
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if os.environ.get("HDET_WORKER_DEVICE") != "cpu":
        torch.cuda.set_device(local % torch.cuda.device_count())
    backend = os.environ.get("HDET_GPU_BACKEND", "gloo")
    dist.init_process_group(backend)
    if backend == "gloo" and os.environ.get("HDET_WORKER_DEVICE") != "cpu":
        from hdet_megatron.megatron.gloo_cuda import apply_gloo_cuda_adapter

        apply_gloo_cuda_adapter()  # Megatron DDP's coalesced collectives on CUDA tensors
    if scenario == "averager":
        result = averager(rank, world)
    elif scenario == "hdet":
        result = hdet(rank, world, te)
    elif scenario == "torch_scheduler":
        result = torch_scheduler(rank, world)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())


def gloo_adapter_equivalence(rank: int, world: int) -> dict:
    """CPU (gloo) check of :mod:`hdet_megatron.megatron.gloo_cuda`: the adapter's collectives
    give torch's results, and Megatron DDP + DistOpt trains to the same bits with it."""
    import torch
    import torch.distributed as dist
    from torch.distributed import _coalescing_manager

    from hdet_megatron.megatron import gloo_cuda, toy
    from hdet_megatron.megatron.runtime import main_params

    manager = gloo_cuda.make_coalescing_manager(_coalescing_manager)
    out: dict = {}
    for async_ops in (False, True):
        a, b = torch.full((4,), float(rank + 1)), torch.full((3,), 10.0 * (rank + 1))
        with manager(async_ops=async_ops) as cm:
            dist.all_reduce(a, async_op=async_ops)
            dist.all_reduce(b, async_op=async_ops)
        if async_ops:
            cm.wait()
        gathered = torch.empty(2 * world)
        shards = torch.arange(2 * world, dtype=torch.float32) * (rank + 1)
        scattered = torch.empty(2)
        with manager(async_ops=async_ops) as cm:
            dist.all_gather_into_tensor(gathered, torch.full((2,), float(rank)), async_op=async_ops)
        if async_ops:
            cm.wait()
        with manager(async_ops=async_ops) as cm:
            dist.reduce_scatter_tensor(scattered, shards, async_op=async_ops)
        if async_ops:
            cm.wait()
        out[f"async={async_ops}"] = (a.tolist(), b.tolist(), gathered.tolist(), scattered.tolist())

    def train(adapter: bool) -> str:
        setup = toy.ToyGPTSetup(
            use_distributed_optimizer=True, num_distributed_optimizer_instances=1, overlap_grad_reduce=True
        )
        with toy.parallel(setup):
            model = toy.build_model(setup)
            optimizer = toy.build_optimizer(setup, model)
            data = toy.data_iterator_for_rank(setup)
            for _ in range(3):
                toy.train_step(setup, model, optimizer, data)
            return _digest(main_params(optimizer)) + _digest([p for c in model for p in c.parameters()])

    out["plain"] = train(False)
    out["installed"] = gloo_cuda.apply_gloo_cuda_adapter()
    out["installed_again"] = gloo_cuda.apply_gloo_cuda_adapter()
    out["adapter"] = train(True)
    from megatron.core.distributed import param_and_grad_buffer as pgb

    out["issued"] = pgb._coalescing_manager.issued
    return out
