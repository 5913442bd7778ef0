"""Rank-side code of the probe-signal tests of ``HDETOneCycleLR`` (DDP and FSDP2/HSDP, 4 gloo
ranks): a tiny regression MLP with dropout, probed through :class:`BatchProbe`.

Every run records, per step: the params' digest, the LR, host syncs made by the scheduler's
``step`` (from hdet_megatron code), whether the global RNG and the model's mode survived the
step, and whether the params the averager saw were the ones training left (so every probe
restored them bit-exactly); per converge: the controller's state, update and line fit.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
import torch.nn as nn

from hdet_megatron.config import Axis, HDETConfig
from hdet_megatron.line_search import BatchProbe
from hdet_megatron.megatron.sync_counter import HostSyncCounter
from hdet_megatron.torch_scheduler import HDETOneCycleLR

DROP = 0.3
NEWTON = {"rule": "newton", "meta_lr": 1.0, "momentum": 0.5}


@dataclass
class ProbeRun:
    signal: str = "average"
    fsdp: bool = False
    replicas: int = 4
    """FSDP2: replicate size of the (replicas, 4 / replicas) HSDP mesh."""
    reshard_after_forward: bool = True
    """FSDP2: ``fully_shard(..., reshard_after_forward=...)`` of every layer and the root."""
    auto: bool = True
    steps: int = 12
    period: int = 3
    config: dict = field(default_factory=dict)
    nan_at: int | None = None
    """After the optimizer step of this step, rank 1 (arm 1) sets its params to NaN."""
    rehome_at: int | None = None
    """FSDP2: after this step, ``model._apply(clone)`` gives every param new storage (as
    ``module.to()`` can), un-homing it from the converge buckets."""
    save_at: int | None = None
    resume: dict | None = None
    """A checkpoint taken by a run with ``save_at`` (DDP: state dicts; FSDP2: a DCP directory)."""
    save_dir: str | None = None
    max_lr: float = 0.05
    """``HDETOneCycleLR``'s peak LR (the brake test sets it far too high)."""
    batches: str | None = None
    """Whose probe batches: None = as documented (``probe``: one stream for all ranks, the line
    signals: each rank its own), ``"shared"`` or ``"own"`` to get it wrong on purpose."""


def _batch(rank: int, step: int, n: int = 16):
    """Training batch of ``rank`` at ``step``: a pure function of both (a resume sees the same)."""
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(n, 8, generator=gen)
    w = torch.randn(8, 2, generator=torch.Generator().manual_seed(7))
    return x, torch.tanh(x @ w) + 0.1 * torch.randn(n, 2, generator=gen)


def _probe_batch(key: int, window: int):
    """Held-out batch number ``window`` of stream ``key`` (never trained on: seeds >= 10**6)."""
    return _batch(10**6 + 1000 * key, window, n=32)


def _model(fsdp: bool, mesh, reshard: bool) -> nn.Module:
    torch.manual_seed(0)  # identical init on every rank
    model = nn.Sequential(
        nn.Linear(8, 33), nn.Tanh(), nn.Dropout(DROP), nn.Linear(33, 16), nn.Tanh(), nn.Linear(16, 2)
    )
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _flat(model) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([_local(p).detach().reshape(-1) for p in model.parameters()])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical (NaN included)."""
    return a.shape == b.shape and bool(torch.equal(a.view(torch.int32), b.view(torch.int32)))


def _digest(model) -> str:
    return hashlib.sha256(_flat(model).numpy().tobytes()).hexdigest()[:16]


def _full_digest(model) -> str:
    """Digest of the gathered full params (collective with FSDP2)."""
    h = hashlib.sha256()
    with torch.no_grad():
        for p in model.parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            h.update(full.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def run(rank: int, world: int, spec: ProbeRun) -> dict:
    mesh = None
    if spec.fsdp:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(
            "cpu", (spec.replicas, world // spec.replicas), mesh_dim_names=("replicate", "shard")
        )
    model = _model(spec.fsdp, mesh, spec.reshard_after_forward)
    net = model
    if not spec.fsdp:
        from torch.nn.parallel import DistributedDataParallel as DDP

        # One parameter per gradient bucket, before and after DDP's bucket rebuild after the
        # first step: each element is all-reduced in the same order in a resumed run (whose first
        # step uses the initial buckets) as in the uninterrupted one.
        net = DDP(model, bucket_cap_mb_list=[1e-9])
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    extra = NEWTON if spec.signal in ("line", "average") else {"temperature": 0.02}
    config = HDETConfig(
        period=spec.period,
        axes=(Axis("lr", 0.3),),
        auto=spec.auto,
        signal=spec.signal,
        **{**extra, **spec.config},
    )
    # "probe": one batch shared by all ranks; the line signals: each rank its own batch.
    shared = spec.signal == "probe" if spec.batches is None else spec.batches == "shared"
    key = 0 if shared else rank
    probed: list[float] = []

    def loss_fn(batch):
        x, y = batch
        loss = nn.functional.mse_loss(net(x), y)
        probed.append(float(loss))
        return loss

    probe = BatchProbe(loss_fn, lambda window: _probe_batch(key, window)) if spec.signal != "train" else None
    sched = HDETOneCycleLR(
        optimizer,
        max_lr=spec.max_lr,
        total_steps=spec.steps + 1,
        hdet=config,
        model=model,
        device_mesh=mesh,
        probe_fn=probe,
    )
    start = 0
    if spec.resume is not None:
        if spec.fsdp:
            from hdet_megatron.fsdp import load_checkpoint

            extra = {"rng": torch.get_rng_state()}
            load_checkpoint(spec.resume["dir"], model, optimizer, sched, extra=extra)
            torch.set_rng_state(extra["rng"])  # the dropout stream, as the saving run left it
        else:
            model.load_state_dict(spec.resume["model"])
            optimizer.load_state_dict(spec.resume["optimizer"])
            sched.load_state_dict(spec.resume["scheduler"])
            torch.set_rng_state(spec.resume["rng"])
        start = sched.last_epoch
    rt = sched._hdet
    out: dict = {"arm": sched.arm, "digests": {}, "lrs": {}, "history": [], "syncs": [], "restored": []}
    out["start_scale"] = sched.hdet.start_scale
    out["error"] = None
    out["rng_kept"] = out["mode_kept"] = True
    # The params the averager sees must be those the last optimizer step left (probes restored).
    expected: dict = {}
    if rt.averager is not None:
        average = rt.averager.average

        def checked_average(*args, **kwargs):
            out["restored"].append(_same_bits(_flat(model), expected["params"]))
            return average(*args, **kwargs)

        rt.averager.average = checked_average
    for step in range(start + 1, spec.steps + 1):
        out["lrs"][step] = optimizer.param_groups[0]["lr"]
        x, y = _batch(rank, step)
        loss = nn.functional.mse_loss(net(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if spec.nan_at == step and rank == 1:
            with torch.no_grad():
                for p in model.parameters():
                    _local(p).fill_(math.nan)
        if spec.rehome_at == step:
            model._apply(lambda t: t.clone())
        expected["params"] = _flat(model)
        rng = torch.get_rng_state()
        converges = rt.num_converges
        try:
            with HostSyncCounter() as counter:
                sched.step(loss.detach())
        except RuntimeError as err:  # a misuse the window engine refuses (same on every rank)
            out["error"] = f"{type(err).__name__}: {err}"
            break
        converged = rt.num_converges != converges
        out["syncs"].append((converged, counter.total))
        out["rng_kept"] &= bool(torch.equal(rng, torch.get_rng_state()))
        out["mode_kept"] &= model.training and all(m.training for m in model.modules())
        out["digests"][step] = _digest(model)
        if converged:
            line = sched.last_line
            update = sched.last_update
            out["history"].append(
                {
                    "step": step,
                    "controller": sched.controller.state_dict(),
                    "scales": dict(sched.controller.scales()),
                    "update": update.to_dict() if update is not None else None,
                    "line": line.to_dict() if line is not None else None,
                    "full_digest": _full_digest(model),
                }
            )
        if spec.save_at == step:
            if spec.fsdp:
                from hdet_megatron.fsdp import save_checkpoint

                save_checkpoint(spec.save_dir, model, optimizer, sched, extra={"rng": torch.get_rng_state()})
            else:
                out["checkpoint"] = {
                    "model": copy.deepcopy(model.state_dict()),
                    "optimizer": copy.deepcopy(optimizer.state_dict()),
                    "scheduler": copy.deepcopy(sched.state_dict()),
                    "rng": torch.get_rng_state(),
                }
    out["probed"] = probed
    out["num_rollbacks"] = rt.num_rollbacks
    sched.close()
    return out


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def world_runs(rank: int, world: int, specs: list[ProbeRun]) -> list[dict]:
    results = []
    hdet_log = logging.getLogger("hdet_megatron")
    for spec in specs:
        if spec.resume == "previous":  # resume from the checkpoint the previous run took
            ckpt = results[-1].pop("checkpoint", None) if not spec.fsdp else None
            spec = replace(spec, resume={"dir": spec.save_dir} if spec.fsdp else ckpt, save_dir=None)
        records = _Records()
        hdet_log.addHandler(records)
        try:
            results.append(run(rank, world, spec))
        finally:
            hdet_log.removeHandler(records)
        results[-1]["warnings"] = records.messages  # what rank 0 logs (the others log nothing)
        dist.barrier()
    for r in results:
        r.pop("checkpoint", None)
    return results
