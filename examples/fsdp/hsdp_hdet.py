"""HDET on a PyTorch FSDP2 (``fully_shard``) model: arms = the replicate dim of an HSDP mesh.

CPU (gloo), 4 processes = 2 arms x 2 shards::

    .venv/bin/torchrun --nproc-per-node 4 examples/fsdp/hsdp_hdet.py --replicas 2

GPUs (NCCL), e.g. 8 GPUs = 4 arms x 2 shards, arm-local gradients::

    torchrun --nproc-per-node 8 examples/fsdp/hsdp_hdet.py --replicas 4 --grad-sync arm

Trains a small MLP on a synthetic regression task, saves a checkpoint mid-window
(``--save-at``, converge-on-save through ``torch.distributed.checkpoint``), and with
``--resume`` continues from it instead of starting fresh. Prints every step's per-arm LR/loss.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from hdet_megatron.config import Axis, HDETConfig
from hdet_megatron.fsdp import load_checkpoint, save_checkpoint
from hdet_megatron.torch_scheduler import HDETOneCycleLR


def batch(rank: int, step: int, device):
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(32, 16, generator=gen)
    w = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))
    y = torch.tanh(x @ w) + 0.1 * torch.randn(32, 4, generator=gen)
    return x.to(device), y.to(device)


def main(argv=None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2, help="R: replicate size (= arms)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--period", type=int, default=10, help="converge every PERIOD steps")
    parser.add_argument("--spread", type=float, default=0.3)
    parser.add_argument("--grad-sync", choices=("global", "arm"), default="global")
    parser.add_argument("--save-at", type=int, default=15, help="checkpoint after this step (0: never)")
    parser.add_argument("--ckpt", default="/tmp/hdet_hsdp_ckpt")
    parser.add_argument("--resume", action="store_true", help="continue from --ckpt")
    args = parser.parse_args(argv)

    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(
        device_type, (args.replicas, world // args.replicas), mesh_dim_names=("replicate", "shard")
    )

    torch.manual_seed(0)  # identical initial weights in every replica
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    model.to(device_type)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    hdet = HDETConfig(period=args.period, axes=(Axis("lr", args.spread),), grad_sync=args.grad_sync)
    sched = HDETOneCycleLR(
        optimizer, max_lr=5e-2, total_steps=args.steps, hdet=hdet, model=model, device_mesh=mesh
    )
    start = 0
    if args.resume:
        load_checkpoint(args.ckpt, model, optimizer, sched)
        start = sched.last_epoch
    lines = []
    for step in range(start + 1, args.steps + 1):
        x, y = batch(rank, step, device_type)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        lr = optimizer.param_groups[0]["lr"]
        sched.step(loss.detach())  # this rank's local loss; converges every --period steps
        if mesh.get_coordinate()[1] == 0:  # one line per arm replica (shard rank 0)
            line = f"step {step:3d} arm {sched.arm} lr {lr:.5f} loss {loss.item():.5f}"
            if sched.last_update is not None and step % args.period == 0:
                line += f"  converged; arm losses {[round(v, 4) for v in sched.last_update.arm_losses]}"
                line += f" scale {sched.controller.scale('lr'):.4f}"
            print(line, flush=True)
            lines.append(line)
        if step == args.save_at and not args.resume:
            save_checkpoint(args.ckpt, model, optimizer, sched)
    sched.close()
    return lines


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
