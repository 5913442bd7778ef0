"""Smallest real Megatron-Core GPT training on CPU ranks (gloo), launched by torchrun.

    torchrun --nproc-per-node 4 examples/pretrain_gpt/toy_pretrain.py --tp 2 --steps 60

Uses the synthetic learnable token stream of ``hdet_megatron.megatron.toy``; the full example
with real data lands in ``examples/pretrain_gpt/pretrain_gpt.py``.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tp", type=int, default=2, help="tensor-model-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-model-parallel size")
    p.add_argument("--steps", type=int, default=60, help="training iterations")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    p.add_argument("--log-interval", type=int, default=10, help="iterations between log lines")
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from hdet_megatron.megatron import toy  # applies the CPU shims before megatron.core loads
    from megatron.core import parallel_state as ps

    world = dist.get_world_size()
    if world % (args.tp * args.pp):
        raise SystemExit(f"world size {world} is not divisible by TP*PP = {args.tp * args.pp}")
    setup = toy.ToyGPTSetup(tp=args.tp, pp=args.pp, num_layers=2 * args.pp, lr=args.lr, seed=args.seed)
    with toy.parallel(setup):
        model = toy.build_model(setup)
        optimizer = toy.build_optimizer(setup, model)
        data = toy.data_iterator_for_rank(setup)
        dp = ps.get_data_parallel_world_size()
        tokens_per_step = dp * setup.num_microbatches * setup.micro_batch_size * setup.seq_length
        reporter = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
        if dist.get_rank() == 0:
            print(f"[toy] world {world}: TP{args.tp} PP{args.pp} DP{dp}, {args.steps} steps", flush=True)
        start = time.perf_counter()
        for step in range(1, args.steps + 1):
            losses, _ = toy.train_step(setup, model, optimizer, data)
            if reporter and (step % args.log_interval == 0 or step == 1):
                loss = float(torch.stack([o["lm loss"] for o in losses]).mean())
                elapsed = time.perf_counter() - start
                eta = elapsed / step * (args.steps - step)
                print(
                    f"[toy] step {step:4d}/{args.steps} loss {loss:.4f} "
                    f"{tokens_per_step * step / elapsed:,.0f} tok/s ETA {eta:.0f}s",
                    flush=True,
                )
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
