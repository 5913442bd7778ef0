"""Rank-side code of the ``signal="line"`` Megatron test: one 4-rank world (DP4 = 4 arms)."""

from __future__ import annotations

import os

import torch

from hdet_megatron.megatron.sync_counter import HostSyncCounter
from tests.checkpoint_worker import Job, Run

LINE = {"signal": "line", "rule": "newton", "meta_lr": 1.0, "momentum": 0.5}


def _train(job: Job, until: int, syncs: list) -> None:
    """``job.train_until`` one step at a time, counting host syncs in what HDET adds per step."""
    from hdet_megatron.megatron import toy

    while job.iteration < until:
        losses, ok = toy.train_step(job.setup, job.model, job.optimizer, job.data)
        assert ok
        with HostSyncCounter() as counter:
            job.scheduler.step(1)
            metrics = job.hdet.step(losses)
        job.iteration += 1
        syncs.append((metrics is not None, counter.total))
        if metrics is not None:
            job.history.append((job.iteration, metrics.scales, metrics.arm_losses, metrics.line))
        if losses:
            job.losses[job.iteration] = float(torch.stack([o["lm loss"] for o in losses]).mean())


def line_world(rank: int, world_size: int, root: str) -> dict:
    out: dict = {}
    for signal in ("line", "average"):
        config = {**LINE, "signal": signal}
        run = Run(period=3, steps=9, spread=0.3, config=config)
        # 1. The reference: 9 steps, a checkpoint at the window end 6.
        job = Job(run, world_size)
        job.seek(0)
        syncs: list = []
        _train(job, 6, syncs)
        job.save(os.path.join(root, signal), "torch")
        _train(job, 9, syncs)
        res = {"reference": job.result(), "syncs": syncs, "probe_losses": list(job.probe_losses)}
        res["start_scale"] = job.hdet.config.start_scale
        job.close()
        # 2. Resume from the checkpoint in fresh objects: bit-identical from there on.
        job = Job(run, world_size)
        assert job.load(os.path.join(root, signal), iteration=6) == 6
        _train(job, 9, [])
        res["resumed"] = job.result()
        job.close()
        # 3. With the controller off nothing reads the line: it is not probed, and the run is
        #    bit-identical to a train-signal run.
        job = Job(Run(period=3, steps=6, spread=0.3, config={**config, "auto": False}), world_size)
        job.seek(0)
        _train(job, 6, [])
        res["off"] = job.result()
        res["off_probes"] = len(job.probe_losses)
        job.close()
        out[signal] = res
    job = Job(Run(period=3, steps=6, spread=0.3, config={"auto": False}), world_size)
    job.seek(0)
    _train(job, 6, [])
    out["train_off"] = job.result()
    job.close()
    return out
