"""Rank-side worker of ``benchmarks/generalize.py``'s plain-torch tasks (run under ``torchrun``).

A byte-level GPT written in plain torch, trained on the embedded default corpus (the running
interpreter's standard-library sources, as the Megatron example's default), one optimizer
per run:

- ``plain``: AdamW + ``torch.optim.lr_scheduler.OneCycleLR`` (the baseline and the sweep);
- ``hdet`` / ``hdet-off``: AdamW + ``HDETOneCycleLR(..., hdet=HDETConfig(period=T), model=model,
  probe_fn=BatchProbe(loss_fn, batches))`` exactly as docs/python-api.md shows it (``hdet-off``
  adds ``auto=False``: spread and converge only);
- ``hdet-fixed``: the controller runs, probes and logs its line and step every window but never
  moves the LR (``meta_lr=0``, ``start_scale=1``, no brake): the signal measured without feedback
  at a fixed LR, for ``benchmarks/signal_audit.py`` (``auto=False`` skips the probes);
- ``sf``: Schedule-Free AdamW (``schedulefree.AdamWScheduleFree``), no scheduler, its own linear
  warm-up over the task's warm-up steps, ``optimizer.train()`` for training and ``.eval()`` for
  the evaluation (its docs);
- ``prodigy``: ``prodigyopt.Prodigy`` at lr 1 under the task's OneCycleLR shape (``max_lr=1``),
  ``safeguard_warmup=True`` (its docs, for schedules with a warm-up).

Parallelism: ``--fsdp 0`` is DDP over the 4 ranks (4 replicas = 4 HDET arms); ``--fsdp S`` is
FSDP2 on an HSDP mesh ``(world / S, S)`` (arms = the replicate dimension, docs/fsdp.md). Data:
documents are split by index into train / probe / validation (the probe split is what
``BatchProbe`` scores: no rank trains on it); each rank draws its training windows from a
generator keyed by (seed, rank, step), so every run of one seed sees the same data. Writes
``metrics.jsonl`` records shaped like the example's (``run``, ``window`` with ``update`` and
``line``, ``final`` with ``valid_loss``), which ``generalize.py`` reads for both paths.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 256  # byte-level tokens


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4x GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(w, dim=2)
        q, k, v = (z.view(b, t, self.heads, w // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, w))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """Byte-level GPT: token and learned position embeddings, blocks, final norm, linear head."""

    def __init__(self, width: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, width)
        self.pos = nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)
        for m in self.modules():  # GPT-2's init: small normal weights, zero biases
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def corpus_splits() -> dict[str, torch.Tensor]:
    """The default corpus's bytes, split by document index: 1 in 10 validation, 1 in 10 probe."""
    from hdet_megatron.corpus import default_corpus_files

    parts: dict[str, list[bytes]] = {"train": [], "probe": [], "valid": []}
    for i, path in enumerate(default_corpus_files()):
        with open(path, "rb") as f:
            data = f.read()
        parts["valid" if i % 10 == 0 else "probe" if i % 10 == 5 else "train"].append(data)
    return {k: torch.frombuffer(bytearray(b"".join(v)), dtype=torch.uint8).long() for k, v in parts.items()}


def windows(tokens: torch.Tensor, n: int, seq: int, key: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random (input, target) windows of ``seq`` tokens, a pure function of ``key``."""
    gen = torch.Generator().manual_seed(key)
    starts = torch.randint(0, tokens.numel() - seq - 1, (n,), generator=gen)
    rows = torch.stack([tokens[s : s + seq + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def lm_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    modes = ("plain", "hdet", "hdet-off", "hdet-fixed", "sf", "prodigy")
    p.add_argument("--mode", choices=modes, required=True)
    p.add_argument("--lr", type=float, required=True, help="peak LR (ignored by prodigy: lr 1)")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--pct-start", type=float, required=True, help="OneCycleLR warm-up fraction")
    p.add_argument("--div-factor", type=float, default=25.0)
    p.add_argument("--final-div-factor", type=float, default=1e4)
    p.add_argument("--period", type=int, required=True, help="HDET converge period T")
    p.add_argument("--width", type=int, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--batch", type=int, required=True, help="sequences per rank per step")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--fsdp", type=int, default=0, help="0: DDP; S: FSDP2 HSDP mesh (world/S, S)")
    p.add_argument("--eval-batches", type=int, default=32, help="validation batches of --batch")
    p.add_argument(
        "--prototype",
        action="append",
        default=[],
        help="switch on a controller prototype (hdet_megatron.controller.PROTOTYPES)",
    )
    p.add_argument(
        "--spread",
        type=float,
        default=None,
        help="HDET modes: the LR axis's spread (default: HDETConfig's, 0.3 with auto-LR on, else 1/9)",
    )
    p.add_argument(
        "--line-width",
        type=float,
        default=None,
        help="HDET modes: HDETConfig.line_width (default: the line at the arms' own multipliers)",
    )
    p.add_argument(
        "--no-warmup-hold",
        dest="warmup_hold",
        action="store_false",
        help="HDET modes: HDETConfig(warmup_hold=False) (default: the hold on)",
    )
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--run-dir", required=True)
    return p.parse_args(argv)


def build_optimizer(args: argparse.Namespace, model: nn.Module):
    """The run's optimizer and, for the torch-scheduled modes, the scheduler's keyword arguments."""
    shape = dict(
        total_steps=args.steps,
        pct_start=args.pct_start,
        div_factor=args.div_factor,
        final_div_factor=args.final_div_factor,
    )
    if args.mode == "sf":
        try:
            from schedulefree import AdamWScheduleFree
        except ImportError as exc:  # a benchmark-only dependency: pip install -e '.[bench]'
            raise SystemExit("--mode sf needs the 'schedulefree' package: pip install -e '.[bench]'") from exc
        warmup = round(args.pct_start * args.steps)
        opt = AdamWScheduleFree(
            model.parameters(), lr=args.lr, weight_decay=args.weight_decay, warmup_steps=warmup
        )
        return opt, None
    if args.mode == "prodigy":
        try:
            from prodigyopt import Prodigy
        except ImportError as exc:
            raise SystemExit(
                "--mode prodigy needs the 'prodigyopt' package: pip install -e '.[bench]'"
            ) from exc
        opt = Prodigy(model.parameters(), lr=1.0, weight_decay=args.weight_decay, safeguard_warmup=True)
        return opt, dict(shape, max_lr=1.0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    return opt, dict(shape, max_lr=args.lr)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    if args.steps % args.period:
        raise SystemExit(f"--steps {args.steps} must be a multiple of --period {args.period}")
    splits = corpus_splits()
    torch.manual_seed(args.seed)  # identical init on every rank
    model = GPT(args.width, args.layers, args.heads, args.seq)
    mesh = None
    if args.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world // args.fsdp, args.fsdp), mesh_dim_names=("replicate", "shard"))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        net: nn.Module = model
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = DDP(model)
    opt, shape = build_optimizer(args, model)
    sched = None
    if args.mode in ("hdet", "hdet-off", "hdet-fixed"):
        from hdet_megatron import Axis, HDETConfig, HDETOneCycleLR
        from hdet_megatron.line_search import BatchProbe

        # The documented recipe: each rank scores its own held-out batch per window.
        probe = BatchProbe(
            lambda b: lm_loss(net, b),
            lambda w: windows(splits["probe"], args.batch, args.seq, 10**9 + 7919 * rank + w),
        )
        from gen_megatron import switch_on_prototypes

        switch_on_prototypes(args.prototype)
        hdet = HDETConfig(period=args.period, auto=args.mode != "hdet-off")
        if args.spread is not None:
            hdet = dataclasses.replace(hdet, axes=(Axis("lr", args.spread),))
        if args.line_width is not None:
            hdet = dataclasses.replace(hdet, line_width=args.line_width)
        if not args.warmup_hold:
            hdet = dataclasses.replace(hdet, warmup_hold=False)
        if args.mode == "hdet-fixed":
            hdet = dataclasses.replace(hdet, meta_lr=0.0, start_scale=1.0, brake=False)
        assert shape is not None
        sched = HDETOneCycleLR(opt, **shape, hdet=hdet, model=model, device_mesh=mesh, probe_fn=probe)
    elif shape is not None:
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, **shape)
    if args.mode == "sf":
        opt.train()
    os.makedirs(args.run_dir, exist_ok=True)
    out = open(os.path.join(args.run_dir, "metrics.jsonl"), "w") if rank == 0 else None

    def write(rec: dict) -> None:
        if out is not None:
            out.write(json.dumps(rec) + "\n")
            out.flush()

    write({"type": "run", "args": vars(args), "world": world, "optimizer": type(opt).__name__})
    converges, start, last_losses = 0, time.perf_counter(), []
    for step in range(1, args.steps + 1):
        batch = windows(splits["train"], args.batch, args.seq, args.seed * 1_000_003 + 7919 * rank + step)
        loss = lm_loss(net, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if hasattr(sched, "metrics"):  # HDETOneCycleLR: this rank's local loss
            sched.step(loss.detach())
        elif sched is not None:
            sched.step()
        if step > args.steps - args.period:
            last_losses.append(loss.detach())
        if hasattr(sched, "metrics"):
            m = sched.metrics()
            if m["num_converges"] > converges:
                converges = m["num_converges"]
                write(
                    {
                        "type": "window",
                        "iteration": step,
                        "window": m["window"] - 1,
                        "base_lr": m["base_lr"][0],
                        "scales": m["scales"],
                        "update": m.get("last_update"),
                        "line": m.get("last_line"),
                        "arm_train_losses": m.get("arm_train_losses"),
                        "arm_values": m.get("arm_values"),  # as the example's window records
                    }
                )
    train_seconds = time.perf_counter() - start
    if args.mode == "sf":
        opt.eval()  # the averaged iterate x, which Schedule-Free evaluates
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64)
    with torch.no_grad():
        for i in range(rank, args.eval_batches, world):  # the same validation set for every run
            sums[0] += float(lm_loss(net, windows(splits["valid"], args.batch, args.seq, 555_555 + i)))
            sums[1] += 1
        sums[2] = float(torch.stack(last_losses).mean())
    if args.fsdp and sums[1] == 0:
        raise SystemExit("every rank must evaluate (FSDP2's forward is collective)")
    dist.all_reduce(sums)
    valid = float(sums[0] / sums[1])
    scales = sched.metrics().get("scales", {}) if hasattr(sched, "metrics") else {}
    write(
        {
            "type": "final",
            "valid_loss": valid if math.isfinite(valid) else float("inf"),
            "train_loss": float(sums[2] / world),
            "train_seconds": train_seconds,
            "scales": scales,
        }
    )
    if out is not None:
        out.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
    # Everything written, the process group destroyed: leave without the interpreter's
    # finalization, where gloo's worker threads can abort the process ("terminate called without
    # an active exception", as examples/pretrain_gpt/pretrain_gpt.py notes) after a finished run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
