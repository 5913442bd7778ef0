"""Rank-side code of the checkpoint tests: train, save, resume in new processes, compare."""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from hdet_megatron.config import Axis, HDETConfig
from hdet_megatron.megatron import checkpointing as ckpt
from hdet_megatron.megatron import toy
from hdet_megatron.megatron.checkpointing import HDETCheckpointError
from hdet_megatron.megatron.runtime import HDET, main_params
from hdet_megatron.megatron.scheduler import HDETOptimizerParamScheduler
from hdet_megatron.probe import BatchProbe
from hdet_megatron.spread import arm_spread

from megatron.core import parallel_state as ps
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


@dataclass
class Run:
    tp: int = 1
    pp: int = 1
    arms: int | None = None
    dist_opt: bool = False
    bf16: bool = False
    hdet: bool = True
    period: int = 2
    steps: int = 8
    spread: float = 0.2
    temperature: float = 0.05
    grad_sync: str = "global"
    config: dict = field(default_factory=dict)
    """Extra HDETConfig fields."""
    sched: dict = field(default_factory=dict)
    """Extra scheduler kwargs (override_opt_param_scheduler, ...)."""
    setup: dict = field(default_factory=dict)
    """Extra ToyGPTSetup fields (MoE: num_experts, ep, ...)."""


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class Job:
    """One training job on this rank (model, optimizer, scheduler, HDET, data)."""

    def __init__(self, run: Run, world_size: int):
        self.run = run
        dp = world_size // (run.tp * run.pp)
        arms = run.arms or dp
        self.setup = toy.ToyGPTSetup(
            **{
                "tp": run.tp,
                "pp": run.pp,
                "num_layers": 2,
                "use_distributed_optimizer": run.dist_opt,
                "num_distributed_optimizer_instances": arms if run.dist_opt else 1,
                "bf16": run.bf16,
                **run.setup,
            }
        )
        toy.init_parallel(self.setup)
        self.model = toy.build_model(self.setup)
        self.optimizer = toy.build_optimizer(self.setup, self.model)
        kwargs = {**toy.scheduler_kwargs(self.setup, run.steps), **run.sched}
        self.hdet = None
        if run.hdet:
            self.config = HDETConfig(
                period=run.period,
                arms=run.arms,
                grad_sync=run.grad_sync,
                axes=(Axis("lr", run.spread),),
                temperature=run.temperature,
                **run.config,
            )
            self.scheduler = HDETOptimizerParamScheduler(self.optimizer, hdet=self.config, **kwargs)
            self.probe_losses: list[float] = []
            probe = None
            if self.config.signal in ("probe", "line", "average"):
                probe = BatchProbe(self._probe_loss, self._probe_batch)
            self.hdet = HDET(self.config, self.model, self.optimizer, self.scheduler, probe_fn=probe)
        else:
            self.scheduler = OptimizerParamScheduler(self.optimizer, **kwargs)
        self.iteration = 0
        self.losses: dict[int, float] = {}
        self.digests: dict[int, str] = {}  # model params after each iteration
        self.history: list = []

    def _probe_batch(self, window: int) -> list:
        """A fixed batch: each DP replica's own (signal="line") or DP rank 0's on every rank
        (signal="probe"); the same in every window."""
        dp = 0 if self.config.signal == "probe" else ps.get_data_parallel_rank()
        data = toy.synthetic_batches(self.setup, seed=9000 + dp)
        return [next(data) for _ in range(self.setup.num_microbatches)]

    def _probe_loss(self, batch: list) -> list:
        """A forward-only pass on ``batch``."""
        losses = toy.forward_backward(self.setup, self.model, iter(batch), forward_only=True)
        if losses:
            self.probe_losses.append(float(torch.stack([o["lm loss"] for o in losses]).mean()))
        return losses

    def seek(self, iteration: int) -> None:
        """Data position of ``iteration`` (each DP replica has its own stream)."""
        self.iteration = iteration
        # One iterator per model chunk (the interleaved schedule reads each chunk's own).
        streams = [
            toy.synthetic_batches(self.setup, seed=ps.get_data_parallel_rank())
            for _ in range(self.setup.vpp or 1)
        ]
        if self.setup.cp > 1:  # the contiguous split tests/cp_worker.py's test-only attention expects
            from tests.cp_worker import cp_chunks

            streams = [cp_chunks(s, ps.get_context_parallel_rank(), self.setup.cp) for s in streams]
        for stream in streams:
            for _ in range(iteration * self.setup.num_microbatches):
                next(stream)
        self.data = streams if self.setup.vpp else streams[0]

    def train_until(self, iteration: int) -> None:
        while self.iteration < iteration:
            losses, ok = toy.train_step(self.setup, self.model, self.optimizer, self.data)
            assert ok
            self.scheduler.step(1)
            self.iteration += 1
            if self.hdet is not None:
                metrics = self.hdet.step(losses)
                if metrics is not None:
                    self.history.append((self.iteration, metrics.scales, metrics.arm_losses))
            if losses:
                self.losses[self.iteration] = float(torch.stack([o["lm loss"] for o in losses]).mean())
            self.digests[self.iteration] = self.params()["model"]

    def converge(self) -> None:
        metrics = self.hdet.converge()
        if metrics is not None:
            self.history.append((self.iteration, metrics.scales, metrics.arm_losses))

    def save(self, root: str, fmt: str) -> None:
        metrics = ckpt.save_checkpoint(
            root, self.iteration, self.model, self.optimizer, self.scheduler, format=fmt
        )
        if metrics is not None:
            self.history.append((self.iteration, metrics.scales, metrics.arm_losses))

    def load(self, root: str, iteration=None, **kwargs) -> int:
        it = ckpt.load_checkpoint(
            root, self.model, self.optimizer, self.scheduler, iteration=iteration, **kwargs
        )
        self.seek(it)
        return it

    def params(self) -> dict:
        return {
            "main": digest(main_params(self.optimizer)),
            "model": digest(p for c in self.model for p in c.module.parameters()),
        }

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def result(self) -> dict:
        out = {
            "losses": dict(self.losses),
            "params": self.params(),
            "history": list(self.history),
            "iteration": self.iteration,
            "digests": dict(self.digests),
            "chunks": len(self.model),
        }
        if self.hdet is not None:
            out["scales"] = self.scheduler.controller.scales()
            out["window"] = self.scheduler.window
        return out

    def close(self) -> None:
        if self.hdet is not None:
            self.hdet.close()
        toy.destroy_parallel()


# -- the "must show" worlds ----------------------------------------------------------------------


def train_and_save(rank, world_size, runs, root, saves, converge_at):
    """For each run: train ``run.steps``; after iteration s save every format in ``saves[s]``
    (into ``root/<run>/<fmt>``) or converge when s in ``converge_at`` (None: no saves)."""
    results = []
    for name, run in runs:
        job = Job(run, world_size)
        job.seek(0)
        for s in range(1, run.steps + 1):
            job.train_until(s)
            if saves is not None and s in saves.get(name, {}):
                for fmt in saves[name][s]:
                    job.save(os.path.join(root, name, fmt), fmt)
            if converge_at is not None and s in converge_at.get(name, ()):
                job.converge()
        results.append(job.result())
        job.close()
    return results


def resume(rank, world_size, jobs, root):
    """For each (name, run, fmt, iteration, converge_at): load ``root/name/fmt`` at ``iteration``
    into a fresh job in this (new) world and train to ``run.steps``, converging after the
    iterations in ``converge_at`` (where the reference run saved again)."""
    results = []
    for name, run, fmt, iteration, converge_at in jobs:
        job = Job(run, world_size)
        got = job.load(os.path.join(root, name, fmt), iteration=iteration)
        assert got == iteration
        assert job.hdet.iteration == iteration and job.hdet.steps_in_window == 0
        for s in range(iteration + 1, run.steps + 1):
            job.train_until(s)
            if s in converge_at:
                job.converge()
        results.append(job.result())
        job.close()
    return results


# -- resume rules on 2 ranks ---------------------------------------------------------------------


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _write_without_runtime(src_root: str, dst_root: str, iteration: int) -> None:
    """Copy the legacy checkpoint of ``iteration`` in ``src_root`` with its HDET runtime state
    removed (what a scheduler without an HDET runtime saves). Collective; every rank writes its
    own TP/PP file (DP rank 0 only, as a legacy save)."""
    if ps.get_data_parallel_rank() == 0:
        data = torch.load(ckpt._legacy_file(ckpt.checkpoint_dir(src_root, iteration)), weights_only=False)
        data["opt_param_scheduler"]["hdet"]["runtime"] = None
        path = ckpt._legacy_file(ckpt.checkpoint_dir(dst_root, iteration))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(data, path)
    dist.barrier()
    if dist.get_rank() == 0:
        ckpt.write_tracker(dst_root, iteration)
    dist.barrier()


def line_origin(rank, world_size, root):
    """signal="line" (4 arms): the first window's update line after loading a plain Megatron
    checkpoint, or an HDET one without runtime state, next to the same run that marks the window
    start at the loaded params by hand."""
    base = Run(period=3, steps=9, spread=0.3, config={"signal": "line"})
    for name, run in (("plain", replace(base, hdet=False)), ("hdet", base)):
        job = Job(run, world_size)
        job.seek(0)
        job.train_until(3)
        job.save(os.path.join(root, name), "torch")
        if name == "hdet":
            _write_without_runtime(os.path.join(root, name), os.path.join(root, "no_runtime"), 3)
        job.close()
    out = {}
    for name in ("plain", "no_runtime"):
        got = []
        for mark in (False, True):
            job = Job(base, world_size)
            start = job.load(os.path.join(root, name))
            if mark:
                job.hdet.mark_window_start()
            job.train_until(start + 3)
            got.append((start, job.history, job.probe_losses))
            job.close()
        out[name] = {"auto": got[0], "marked": got[1]}
    return out


def rules(rank, world_size, root):
    """Each resume rule on real checkpoints (2 ranks: TP1 x DP2, and TP2 x DP1 for a DP change)."""
    capture = _Capture()
    logging.getLogger("hdet_megatron").addHandler(capture)
    logging.getLogger("hdet_megatron").setLevel(logging.INFO)
    out: dict = {}
    base = Run(period=3, steps=12)

    # An HDET run, saved mid-window (iteration 4 = window 1 + 1 step): both formats.
    job = Job(base, world_size)
    job.seek(0)
    job.train_until(4)
    job.save(os.path.join(root, "hdet", "torch"), "torch")
    job.save(os.path.join(root, "hdet", "torch_dist"), "torch_dist")
    out["saved"] = {
        "scales": job.scheduler.controller.scales(),
        "window": job.scheduler.window,
        "params": job.params(),
        "velocity": job.scheduler.controller.velocities(),
    }
    out["checkpoint_config"] = [
        ckpt.checkpoint_hdet_config(os.path.join(root, "hdet", fmt)) == job.scheduler.hdet_config  # resolved
        for fmt in ("torch", "torch_dist")
    ]
    job.close()

    # A plain Megatron run saved at iteration 3.
    job = Job(replace(base, hdet=False), world_size)
    job.seek(0)
    job.train_until(3)
    job.save(os.path.join(root, "plain", "torch"), "torch")
    plain_params = job.params()
    plain_lr = job.lr()  # Megatron's own scheduler after 3 steps
    job.close()
    out["checkpoint_config"].append(ckpt.checkpoint_hdet_config(os.path.join(root, "plain", "torch")))

    # 1. plain Megatron checkpoint -> HDET run: scale 1, window 0, from iteration 3.
    job = Job(base, world_size)
    capture.messages.clear()
    it = job.load(os.path.join(root, "plain", "torch"))
    out["plain_to_hdet"] = {
        "iteration": it,
        "hdet_iteration": job.hdet.iteration,
        "scales": job.scheduler.controller.scales(),
        "window": job.scheduler.window,
        "num_steps": job.scheduler.num_steps,
        "params_equal": job.params() == plain_params,
        "lr": job.lr(),
        # Megatron's LR at iteration 3 x scale 1 x the multiplier of this rank's arm in window 0
        # (2 arms over DP2: the arm is the DP rank).
        "expected_lr": plain_lr * 1.0 * arm_spread(job.config, 2, 0)["lr"][ps.get_data_parallel_rank()],
        "logged": any("no HDET state" in m for m in capture.messages),
    }
    job.train_until(6)  # the first window after the resume ends 3 steps later
    out["plain_to_hdet"]["converged_at"] = [h[0] for h in job.history]
    job.close()

    # 2. HDET checkpoint -> plain Megatron scheduler: loads, extra key ignored, warned once.
    job = Job(replace(base, hdet=False), world_size)
    capture.messages.clear()
    job.load(os.path.join(root, "hdet", "torch"))
    num_steps = job.scheduler.num_steps  # (Megatron's load adds to it: fresh schedulers only)
    for fmt in ("torch_dist", "torch"):
        job.load(os.path.join(root, "hdet", fmt))
    state = job.scheduler.state_dict()
    out["hdet_to_plain"] = {
        "warnings": sum("ignored by this plain OptimizerParamScheduler" in m for m in capture.messages),
        "num_steps": num_steps,
        "has_hdet_key": "hdet" in state,
        "params_equal": job.params()["main"] == out["saved"]["params"]["main"],
    }
    # Megatron's own load_state_dict takes the HDET superset as is.
    hdet_sched_state = ckpt._read_common(
        ckpt.checkpoint_dir(os.path.join(root, "hdet", "torch"), 4), "torch"
    )["opt_param_scheduler"]
    job.scheduler.load_state_dict(hdet_sched_state)
    job.train_until(6)
    job.close()

    # 3. different arm count (arms 2 -> 1 on DP2): scales kept, windows restarted, logged.
    job = Job(replace(base, arms=1), world_size)
    capture.messages.clear()
    job.load(os.path.join(root, "hdet", "torch"))
    out["arms_changed"] = {
        "scales": job.scheduler.controller.scales(),
        "window": job.scheduler.window,
        "steps_in_window": job.hdet.steps_in_window,
        "logged": [m for m in capture.messages if "windows restarted" in m],
    }
    job.close()

    # 4. different DP size (TP1 x DP2 -> TP2 x DP1, torch_dist reshards the model).
    job = Job(replace(base, tp=2), world_size)
    capture.messages.clear()
    job.load(os.path.join(root, "hdet", "torch_dist"))
    out["dp_changed"] = {
        "scales": job.scheduler.controller.scales(),
        "window": job.scheduler.window,
        "logged": [m for m in capture.messages if "windows restarted" in m],
    }
    job.train_until(7)
    out["dp_changed"]["losses"] = job.losses
    job.close()

    # 5. changed HDET config: checkpoint wins / override wins / strict mismatch errors.
    changed = replace(base, period=4, temperature=0.2)
    job = Job(changed, world_size)
    capture.messages.clear()
    job.load(os.path.join(root, "hdet", "torch"))
    out["config_checkpoint_wins"] = {
        "period": job.hdet.config.period,
        "sched_period": job.scheduler.hdet_config.period,
        "temperature": job.scheduler.controller.config.temperature,
        "logged": [m for m in capture.messages if "differs from the checkpoint" in m],
    }
    job.close()
    overrides = {}
    for label, run, kwargs in (
        ("flag", changed, {"override_hdet_config": True}),
        (
            "megatron_flag",
            replace(
                changed,
                sched={"override_opt_param_scheduler": True, "use_checkpoint_opt_param_scheduler": False},
            ),
            {},
        ),
    ):
        job = Job(run, world_size)
        job.load(os.path.join(root, "hdet", "torch"), **kwargs)
        overrides[label] = {"period": job.hdet.config.period, "scales": job.scheduler.controller.scales()}
        job.close()
    out["config_override"] = overrides
    job = Job(replace(changed, sched={"use_checkpoint_opt_param_scheduler": False}), world_size)
    before = job.params()
    try:
        job.load(os.path.join(root, "hdet", "torch"))
        out["config_strict"] = "<no error>"
    except HDETCheckpointError as exc:
        out["config_strict"] = str(exc)
    out["config_strict_untouched"] = job.params() == before and job.hdet.iteration == 0
    job.close()

    # 6. a corrupted HDET state in a real checkpoint file: clear error, nothing modified.
    job = Job(base, world_size)
    job.seek(0)
    job.train_until(2)
    before = (job.params(), job.lr(), job.scheduler.state_dict(), job.hdet.iteration)
    bad_root = os.path.join(root, "corrupt")
    src = ckpt.checkpoint_dir(os.path.join(root, "hdet", "torch"), 4)
    if rank == 0:
        data = torch.load(ckpt._legacy_file(src), weights_only=False)
        data["opt_param_scheduler"]["hdet"]["controller"]["axes"]["lr"]["scale"] = "oops"
        path = ckpt._legacy_file(ckpt.checkpoint_dir(bad_root, 4))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(data, path)
        with open(os.path.join(bad_root, ckpt.TRACKER_FILE), "w") as f:
            f.write("4")
    dist.barrier()
    try:
        job.load(bad_root)
        out["corrupt"] = "<no error>"
    except HDETCheckpointError as exc:
        out["corrupt"] = str(exc)
    after = (job.params(), job.lr(), job.scheduler.state_dict(), job.hdet.iteration)
    out["corrupt_untouched"] = after == before
    job.close()

    # 7. Saving without converging keeps the window's per-arm losses; loading before HDET exists
    #    hands the position to the runtime built afterwards.
    job = Job(replace(base, config={"converge_on_save": False}), world_size)
    job.seek(0)
    job.train_until(4)
    sums_before = None
    job.save(os.path.join(root, "noconv", "torch_dist"), "torch_dist")
    sums_before = job.hdet.runtime_state_dict()
    job.close()
    run = replace(base, config={"converge_on_save": False})
    setup_job = Job(replace(run, hdet=False), world_size)  # model/optimizer only
    sched = HDETOptimizerParamScheduler(
        setup_job.optimizer,
        hdet=HDETConfig(period=3, axes=(Axis("lr", 0.2),), temperature=0.05, converge_on_save=False),
        **toy.scheduler_kwargs(setup_job.setup, run.steps),
    )
    ckpt.load_checkpoint(
        os.path.join(root, "noconv", "torch_dist"), setup_job.model, setup_job.optimizer, sched
    )
    hdet = HDET(sched.hdet_config, setup_job.model, setup_job.optimizer, sched)
    out["noconv"] = {
        "saved": sums_before,
        "loaded": hdet.runtime_state_dict(),
        "warned": any("mixes arms" in m for m in capture.messages),
    }
    hdet.close()
    setup_job.close()

    # 8. Homed main params (issue 19) write the same checkpoint bytes as separately stored ones
    #    (what every run wrote before homing): save (A), give every homed tensor its own storage
    #    again, save the same state (B), compare every file; then load A back.
    out["homed_files"] = {}
    for name, variant in (
        ("fp32", {}),
        ("bf16", {"bf16": True}),
        ("bf16_distopt", {"bf16": True, "dist_opt": True}),
    ):
        job = Job(replace(base, steps=4, **variant), world_size)
        job.seek(0)
        job.train_until(4)
        homed = job.hdet.averager.homed_tensors
        assert homed and job.hdet.averager.homed_numel == job.hdet.averager.numel, name
        for fmt in ("torch", "torch_dist"):
            job.save(os.path.join(root, "homed", name, "A", fmt), fmt)
        params = job.params()
        for t in homed:
            t.data = t.data.clone()
        for fmt in ("torch", "torch_dist"):
            job.save(os.path.join(root, "homed", name, "B", fmt), fmt)
        dist.barrier()
        files = {}
        a_root = os.path.join(root, "homed", name, "A")
        for dirpath, _, names in os.walk(a_root):
            for f in names:
                rel = os.path.relpath(os.path.join(dirpath, f), a_root)
                with (
                    open(os.path.join(a_root, rel), "rb") as fa,
                    open(os.path.join(root, "homed", name, "B", rel), "rb") as fb,
                ):
                    same = fa.read() == fb.read()
                    if not same and f == ".metadata":  # DCP's: compare all but storage_meta
                        # (its checkpoint_id is the directory, its save_id a fresh uuid)
                        ma, mb = (
                            pickle.load(open(os.path.join(r, rel), "rb"))
                            for r in (a_root, os.path.join(root, "homed", name, "B"))
                        )
                        same = (ma.state_dict_metadata, ma.storage_data, ma.planner_data) == (
                            mb.state_dict_metadata,
                            mb.storage_data,
                            mb.planner_data,
                        )
                    files[rel] = (same, os.path.getsize(os.path.join(a_root, rel)))
        loaded = {}
        for fmt in ("torch", "torch_dist"):
            job.load(os.path.join(root, "homed", name, "A", fmt))
            loaded[fmt] = job.params() == params
        out["homed_files"][name] = {"files": files, "loaded": loaded}
        job.close()
        # --no-load-optim (load_optimizer=False): the fp32 main params of a bf16 run must follow
        # the loaded weights, or the first step copies the initial ones over them.
        if name != "fp32":
            no_optim = {}
            for fmt in ("torch", "torch_dist"):
                job = Job(replace(base, steps=4, **variant), world_size)
                initial = job.params()
                job.load(os.path.join(root, "homed", name, "A", fmt), load_optimizer=False)
                loaded = job.params()
                job.optimizer.reload_model_params()  # main params from the model (Megatron's own)
                no_optim[fmt] = {
                    "params": loaded,
                    "refreshed": job.params(),
                    "initial": initial,
                    "saved": params,
                }
                job.close()
            out.setdefault("no_load_optim", {})[name] = no_optim
    logging.getLogger("hdet_megatron").removeHandler(capture)
    return out
