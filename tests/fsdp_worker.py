"""Rank-side code of the FSDP2 (HSDP) HDET tests: a tiny fully_shard-ed MLP trained with
HDETOneCycleLR; records what each rank saw (LRs, losses, digests of the gathered parameters,
cross-arm gradient traffic)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from hdet_megatron.config import Axis, HDETConfig
from hdet_megatron.torch_scheduler import HDETOneCycleLR
from tests.cross_arm import CrossArmBytes


@dataclass
class FSDPScenario:
    replicas: int = 2
    hdet: bool = True
    arms: int | None = None
    grad_sync: str = "global"
    spread: float = 0.3
    auto: bool = True
    period: int = 3
    steps: int = 7
    temperature: float = 0.05
    count_bytes: bool = False
    save_at: int | None = None
    """Save a checkpoint after this many steps (to ``save_dir``)."""
    save_dir: str | None = None
    save_converge: bool | None = None
    resume_from: str | None = None
    """Build fresh, load this checkpoint, then train steps ``resume_step+1..steps``."""
    extra: dict = field(default_factory=dict)


def build_mesh(replicas: int):
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    return init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))


def build_model(mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)  # identical initial weights on every rank
    # 33 outputs: uneven shards (17 + 16 rows) exercise FSDP2's padding.
    model = nn.Sequential(nn.Linear(16, 33), nn.Tanh(), nn.Linear(33, 32), nn.Tanh(), nn.Linear(32, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch(rank: int, step: int):
    """This rank's batch of ``step`` (a pure function of both: resumed runs see the same data)."""
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(8, 16, generator=gen)
    teacher = torch.Generator().manual_seed(7)
    w = torch.randn(16, 4, generator=teacher)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(8, 4, generator=gen)
    return x, y


def digest(model, mesh) -> str:
    """Digest of the full (gathered) parameters of this rank's replica: every shard rank hashes
    its local shards, one all-gather over the shard group joins the hashes. Collective."""
    h = hashlib.sha256()
    with torch.no_grad():
        for p in model.parameters():
            h.update(p.to_local().contiguous().numpy().tobytes())
    mine = torch.frombuffer(bytearray(h.digest()), dtype=torch.uint8)
    group = mesh.get_group(1)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    return hashlib.sha256(torch.cat(parts).numpy().tobytes()).hexdigest()[:16]


def full_digest(model) -> str:
    """Digest of the gathered full tensors (``full_tensor()``, one all-gather per parameter)."""
    h = hashlib.sha256()
    with torch.no_grad():
        for p in model.parameters():
            h.update(p.full_tensor().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def build(sc: FSDPScenario):
    mesh = build_mesh(sc.replicas)
    model = build_model(mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    config = None
    if sc.hdet:
        config = HDETConfig(
            period=sc.period,
            arms=sc.arms,
            grad_sync=sc.grad_sync,
            axes=(Axis("lr", sc.spread),),
            auto=sc.auto,
            temperature=sc.temperature,
            **sc.extra,
        )
    sched = HDETOneCycleLR(
        optimizer,
        max_lr=0.05,
        total_steps=sc.steps + 2,
        hdet=config,
        model=model,
        device_mesh=mesh if sc.hdet else None,
    )
    return mesh, model, optimizer, sched


def run(rank: int, world_size: int, sc: FSDPScenario) -> dict:
    from hdet_megatron.fsdp import load_checkpoint, save_checkpoint

    mesh, model, optimizer, sched = build(sc)
    replicate_rank = mesh.get_coordinate()[0]
    num_arms = sched.num_arms
    arm_of_rank = {}
    ranks = mesh.mesh.tolist()
    for r, row in enumerate(ranks):
        for g in row:
            arm_of_rank[g] = r // (len(ranks) // num_arms)
    out: dict = {
        "arm": sched.arm,
        "replica": replicate_rank,
        "lrs": {},
        "losses": {},
        "digests": {},
        "grad_bytes": {},
        "grad_calls": {},
        "history": [],
        "converge_bytes": [],
    }
    start = 0
    if sc.resume_from is not None:
        out["layout"] = load_checkpoint(sc.resume_from, model, optimizer, sched)
        start = sched.last_epoch
    out["start"] = start
    window_start = start + 1
    import time

    t0 = time.perf_counter()
    for step in range(start + 1, sc.steps + 1):
        out["lrs"][step] = optimizer.param_groups[0]["lr"]
        x, y = batch(rank, step)
        counter = CrossArmBytes(arm_of_rank)
        with counter:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        out["grad_bytes"][step] = counter.bytes
        out["grad_calls"][step] = counter.calls
        out["losses"][step] = float(loss)
        before = sched.hdet and sched._hdet.num_converges
        averager = sched.averager
        snapshot = [t.detach().clone() for t in averager.tensors] if averager is not None else None
        sched.step(loss.detach())
        if sched.hdet and sched._hdet.num_converges != before and averager is not None:
            out["homing_checks"] = out.get("homing_checks", 0) + check_homed_converge(
                averager, snapshot, sched.last_update
            )
        if sched.hdet and sched._hdet.num_converges != before:
            out["history"].append(
                {
                    "step": step,
                    "first": window_start,
                    "arm_losses": list(sched.last_update.arm_losses),
                    "scales": dict(sched.controller.scales()),
                }
            )
            window_start = step + 1
            out["converge_bytes"].append(sched.last_stats.bytes if sched.last_stats else 0)
        out["digests"][step] = digest(model, mesh)
        if step % sc.period == 0 or step == sc.steps:
            out.setdefault("full_digests", {})[step] = full_digest(model)
        if sc.save_at == step:
            out["saved_layout"] = save_checkpoint(
                sc.save_dir, model, optimizer, sched, converge=sc.save_converge
            )
            out["digest_after_save"] = full_digest(model)
            if out["saved_layout"]["converged"]:
                window_start = step + 1
    sched.close()
    out["seconds"] = time.perf_counter() - t0
    if sched.averager is not None:
        out["homed_numel"] = sched.averager.homed_numel
        out["averaged_numel"] = sched.averager.numel
    return out


def check_homed_converge(averager, before, update) -> int:
    """The converge just done (homed: in place) equals the copying path's on the same inputs."""
    from hdet_megatron.averaging import BucketedAverager

    tensors = averager.tensors
    after = [t.detach().clone() for t in tensors]
    copying = getattr(averager, "_test_copying", None)
    if copying is None:
        copying = averager._test_copying = BucketedAverager(
            tensors, group=averager.group, bucket_mb=averager.bucket_bytes / 2**20, home=False
        )
    assert update is None or not update.excluded
    with torch.no_grad():
        for t, b in zip(tensors, before, strict=True):
            t.copy_(b)
        copying.average()
        for t, a in zip(tensors, after, strict=True):
            assert torch.equal(t, a), "homed and copying converge differ"
            t.copy_(a)
    return 1


def run_many(rank, world_size, scenarios):
    return [run(rank, world_size, sc) for sc in scenarios]


def grad_check(rank: int, world_size: int, replicas: int, grad_sync: str) -> float:
    """One FSDP2 backward under HDET's grad sync vs. gradients computed by hand: the world mean
    ("global") or the mean over this arm's ranks ("arm"). Returns the max abs difference."""
    from hdet_megatron.fsdp import FSDP2GradSync, HSDPArms

    mesh = build_mesh(replicas)
    model = build_model(mesh)
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(16, 33), nn.Tanh(), nn.Linear(33, 32), nn.Tanh(), nn.Linear(32, 4))
    arms = HSDPArms.from_mesh(mesh, arm_groups=grad_sync == "arm")
    sync = FSDP2GradSync(model, arms, grad_sync)
    sync.install()
    x, y = batch(rank, 1)
    nn.functional.mse_loss(model(x), y).backward()
    nn.functional.mse_loss(reference(x), y).backward()
    worst = 0.0
    ranks = mesh.mesh.tolist()
    members = [g for r, row in enumerate(ranks) for g in row if grad_sync == "global" or r == arms.arm]
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        gathered = [torch.zeros_like(q.grad) for _ in range(world_size)]
        dist.all_gather(gathered, q.grad)
        expected = torch.stack([gathered[g] for g in members]).mean(0)
        full = p.grad.full_tensor()  # this replica's gradient
        worst = max(worst, float((full - expected).abs().max()))
    sync.uninstall()
    return worst


def setup_errors(rank: int, world_size: int) -> dict:
    """What a pure-FSDP (1-D) mesh and a bad arms value produce."""
    from torch.distributed.device_mesh import init_device_mesh

    from hdet_megatron.fsdp import FSDPSetupError, HSDPRequired

    out = {}
    mesh1d = init_device_mesh("cpu", (world_size,), mesh_dim_names=("shard",))
    model = build_model(mesh1d)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for key, kwargs in (("explicit_mesh", {"device_mesh": mesh1d}), ("inferred_mesh", {})):
        try:
            HDETOneCycleLR(opt, max_lr=0.05, total_steps=10, hdet=HDETConfig(period=2), model=model, **kwargs)
            out[key] = None
        except HSDPRequired as exc:
            out[key] = str(exc)
    mesh = build_mesh(2)
    model = build_model(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    try:
        HDETOneCycleLR(opt, max_lr=0.05, total_steps=10, hdet=HDETConfig(period=2, arms=3), model=model)
        out["bad_arms"] = None
    except FSDPSetupError as exc:
        out["bad_arms"] = str(exc)
    # A model sharded over a 1-D mesh but given a 2-D mesh: refused as well.
    model = build_model(mesh1d)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    try:
        HDETOneCycleLR(
            opt, max_lr=0.05, total_steps=10, hdet=HDETConfig(period=2), model=model, device_mesh=mesh
        )
        out["mismatch"] = None
    except HSDPRequired as exc:
        out["mismatch"] = str(exc)
    return out


def run_example(argv: list[str]) -> list[str]:
    """``examples/fsdp/hsdp_hdet.py``'s main() (the README's FSDP example) on this world."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "examples", "fsdp", "hsdp_hdet.py")
    spec = importlib.util.spec_from_file_location("hsdp_hdet_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def world_tasks(rank, world_size, scenarios, grad_checks=(), errors=False, example=None):
    out = {"runs": run_many(rank, world_size, scenarios)}
    out["grad_checks"] = [grad_check(rank, world_size, r, m) for r, m in grad_checks]
    if errors:
        out["errors"] = setup_errors(rank, world_size)
    if example is not None:
        out["example"] = run_example(example)
    return out
