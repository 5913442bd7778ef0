"""Rank-side code of the Megatron HDET tests: runs HDET training and records what each rank saw."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hdet_megatron.config import Axis, HDETConfig
from hdet_megatron.megatron import toy
from hdet_megatron.megatron.runtime import HDET, main_params
from hdet_megatron.megatron.scheduler import HDETOptimizerParamScheduler
from hdet_megatron.probe import BatchProbe
from tests.cross_arm import CrossArmBytes

from megatron.core import parallel_state as ps
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


@dataclass
class Scenario:
    tp: int = 1
    pp: int = 1
    arms: int | None = None
    grad_sync: str = "global"
    dist_opt: bool = False
    bf16: bool = False
    spread: float = 0.2
    auto: bool = True
    period: int = 3
    steps: int = 7
    hdet: bool = True
    temperature: float = 0.05
    data_seed: int = 0
    count_bytes: bool = False
    probe: bool = False  # signal="probe": a forward-only pass on one batch shared by all ranks
    extra: dict = field(default_factory=dict)


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(
            t.detach().contiguous().view(torch.uint8).numpy().tobytes()
            if t.dtype == torch.bfloat16
            else t.detach().contiguous().numpy().tobytes()
        )
    return h.hexdigest()[:16]


def model_params(model) -> list[torch.Tensor]:
    return [p for chunk in model for p in chunk.module.parameters()]


def check_homed_converge(hdet, before, metrics) -> int:
    """The converge HDET just did (homed main params: in-place all-reduce) gave the same bits as
    the copying path does on the same inputs: rerun it with a copying averager from ``before``."""
    from hdet_megatron.averaging import BucketedAverager

    tensors = hdet.averager.tensors
    after = [t.detach().clone() for t in tensors]
    copying = getattr(hdet, "_test_copying", None)
    if copying is None:
        copying = hdet._test_copying = BucketedAverager(
            tensors, group=hdet.layout.cross_arm_group, bucket_mb=hdet.config.bucket_mb, home=False
        )
    assert not metrics.excluded
    with torch.no_grad():
        for t, b in zip(tensors, before, strict=True):
            t.copy_(b)
        copying.average()
        for t, a in zip(tensors, after, strict=True):
            assert torch.equal(
                t.view(torch.uint8) if t.dtype == torch.bfloat16 else t,
                a.view(torch.uint8) if a.dtype == torch.bfloat16 else a,
            ), "homed and copying converge differ"
            t.copy_(a)
    return 1


def run(rank: int, world_size: int, sc: Scenario) -> dict:
    """Train ``sc.steps`` iterations; return per-step LRs, digests and HDET metrics."""
    instances = (sc.arms or (world_size // (sc.tp * sc.pp))) if sc.dist_opt else 1
    setup = toy.ToyGPTSetup(
        tp=sc.tp,
        pp=sc.pp,
        num_layers=2 * sc.pp,
        bf16=sc.bf16,
        use_distributed_optimizer=sc.dist_opt,
        num_distributed_optimizer_instances=instances,
    )
    out: dict = {
        "lrs": [],
        "losses": [],
        "window_digests": [],
        "step_digests": [],
        "history": [],
        "probe_losses": [],
    }
    with toy.parallel(setup):
        model = toy.build_model(setup)
        optimizer = toy.build_optimizer(setup, model)
        data = toy.synthetic_batches(setup, seed=sc.data_seed * 1000 + ps.get_data_parallel_rank())
        kwargs = toy.scheduler_kwargs(setup, sc.steps)
        if sc.hdet:
            config = HDETConfig(
                period=sc.period,
                arms=sc.arms,
                grad_sync=sc.grad_sync,
                axes=(Axis("lr", sc.spread),),
                auto=sc.auto,
                temperature=sc.temperature,
                signal="probe" if sc.probe else "train",
                **sc.extra,
            )
            scheduler = HDETOptimizerParamScheduler(optimizer, hdet=config, **kwargs)
            # The same seed on every rank: every arm is probed on the same batches.
            probe_data = toy.synthetic_batches(setup, seed=424242)

            def probe_loss(batch):
                losses = toy.forward_backward(setup, model, iter(batch), forward_only=True)
                out["probe_losses"].append(
                    float(torch.stack([o["lm loss"] for o in losses]).mean()) if losses else None
                )
                return losses

            probe = BatchProbe(
                probe_loss, lambda window: [next(probe_data) for _ in range(setup.num_microbatches)]
            )
            hdet = HDET(config, model, optimizer, scheduler, probe_fn=probe if sc.probe else None)
            layout = hdet.layout
            out.update(arm=layout.arm, reporter=layout.is_loss_reporter, cross=layout.cross_arm_ranks)
        else:
            scheduler = OptimizerParamScheduler(optimizer, **kwargs)
            hdet = None
            out.update(arm=0, reporter=False, cross=())
        out.update(
            tp_rank=ps.get_tensor_model_parallel_rank(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            dp_rank=ps.get_data_parallel_rank(),
            last_stage=ps.is_pipeline_last_stage(),
        )
        arm_of_rank = [None] * world_size
        dist.all_gather_object(arm_of_rank, out["arm"])
        from megatron.core.distributed import param_and_grad_buffer as pgb

        counter = CrossArmBytes(
            dict(enumerate(arm_of_rank)),
            extra=((pgb, "dist_reduce_scatter_func"), (pgb, "dist_all_gather_func")),
        )
        window_bytes = []
        for _step in range(sc.steps):
            # The LR this rank applies in this step (set by the previous scheduler step / window).
            out["lrs"].append(float(optimizer.param_groups[0]["lr"]))
            if sc.count_bytes:
                counter.__enter__()
            try:
                losses, ok = toy.train_step(setup, model, optimizer, data)
                scheduler.step(1)
                converging = hdet is not None and hdet.steps_in_window + 1 >= hdet.config.period
                before = [t.detach().clone() for t in hdet.averager.tensors] if converging else None
                metrics = hdet.step(losses) if hdet is not None else None
            finally:
                if sc.count_bytes:
                    counter.__exit__()
            if metrics is not None:
                out["homing_checks"] = out.get("homing_checks", 0) + check_homed_converge(
                    hdet, before, metrics
                )
            assert ok
            if out["last_stage"]:
                out["losses"].append(float(torch.stack([o["lm loss"] for o in losses]).mean()))
            mains = main_params(optimizer)
            entry = {
                "main": digest(mains),
                "model": digest(model_params(model)),
            }
            out["step_digests"].append(entry)
            if metrics is not None:
                out["history"].append(
                    {
                        "arm_losses": metrics.arm_losses,
                        "arm_train_losses": metrics.arm_train_losses,
                        "scales": metrics.scales,
                        "update": metrics.update,
                        "arm_values": metrics.arm_values,
                        "bytes": metrics.converge_bytes,
                        "grad_bytes": metrics.grad_bytes_per_step,
                        "bytes_per_step": metrics.converge_bytes_per_step,
                    }
                )
                window_bytes.append(counter.bytes)
                counter.bytes = 0
                if sc.bf16:
                    # Model params must equal the (averaged) fp32 masters after a converge.
                    checked = 0
                    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
                        if hasattr(sub, "fp32_from_float16_groups"):
                            for mg, fg in zip(sub.float16_groups, sub.fp32_from_float16_groups, strict=True):
                                for m, f in zip(mg, fg, strict=True):
                                    assert torch.equal(m.detach(), f.detach().to(m.dtype))
                                    checked += 1
                        if hasattr(sub, "shard_fp32_from_float16_groups"):
                            # DistOpt: this rank's shard of each bf16 param equals its fp32 shard.
                            for mg, sg in zip(
                                sub.model_float16_groups, sub.shard_fp32_from_float16_groups, strict=True
                            ):
                                for m, f in zip(mg, sg, strict=True):
                                    r = sub._get_model_param_range_map(m)["param"]
                                    shard = m.detach().view(-1)[r.start : r.end]
                                    assert torch.equal(shard, f.detach().to(m.dtype))
                                    checked += 1
                    assert checked > 0, "no fp32 masters found"
        out["window_bytes"] = window_bytes
        out["final_model"] = digest(model_params(model))
        if hdet is not None:
            out["averaged_bytes"] = hdet.averager.nbytes
            out["homed_numel"] = hdet.averager.homed_numel
            out["averaged_numel"] = hdet.averager.numel
            hdet.close()
    return out


def bad_setups(rank: int, world_size: int) -> dict[str, str]:
    """Each bad setup's error message (4 ranks, TP2 x DP2)."""
    from hdet_megatron.megatron.layout import HDETSetupError

    messages: dict[str, str] = {}

    def expect(name, fn):
        try:
            fn()
        except (HDETSetupError, ValueError) as exc:
            messages[name] = str(exc)
        else:
            messages[name] = "<no error>"

    from hdet_megatron.megatron.layout import ArmLayout

    ps.destroy_model_parallel()
    expect("parallel_state_not_initialized", lambda: ArmLayout.from_parallel_state())
    setup = toy.ToyGPTSetup(tp=2)
    with toy.parallel(setup):
        model = toy.build_model(setup)
        optimizer = toy.build_optimizer(setup, model)
        kwargs = toy.scheduler_kwargs(setup, 10)
        expect(
            "arms_not_dividing_dp",
            lambda: HDETOptimizerParamScheduler(optimizer, hdet=HDETConfig(arms=3), **kwargs),
        )
        config = HDETConfig(period=2)
        scheduler = HDETOptimizerParamScheduler(optimizer, hdet=config, **kwargs)
        expect(
            "plain_scheduler",
            lambda: HDET(config, model, optimizer, OptimizerParamScheduler(optimizer, **kwargs)),
        )
        # Megatron's precision-aware optimizer (TE FusedAdam holds the fp32 masters): refused.
        subs = getattr(optimizer, "chained_optimizers", [optimizer])
        for sub in subs:
            sub.config.use_precision_aware_optimizer = True
        expect("precision_aware_optimizer", lambda: HDET(config, model, optimizer, scheduler))
        for sub in subs:
            sub.config.use_precision_aware_optimizer = False
        hdet = HDET(config, model, optimizer, scheduler)
        expect("no_losses_on_last_stage", lambda: hdet.step([]))
        probe_config = HDETConfig(period=2, signal="probe")
        probe_sched = HDETOptimizerParamScheduler(optimizer, hdet=probe_config, **kwargs)
        expect("probe_without_probe_fn", lambda: HDET(probe_config, model, optimizer, probe_sched))
        expect("loss_key_missing", lambda: hdet.step([{"my loss": torch.tensor(1.0)}]))
        arm_config = HDETConfig(period=2, grad_sync="arm")
        arm_sched = HDETOptimizerParamScheduler(optimizer, hdet=arm_config, **kwargs)
        expect(
            "arm_sync_without_megatron_ddp",
            lambda: HDET(arm_config, [model[0].module], optimizer, arm_sched),
        )
        # Param groups changed after HDET was built: detected at the next converge.
        optimizer.param_groups[0]["params"].append(torch.nn.Parameter(torch.zeros(3)))
        data = toy.data_iterator_for_rank(setup)

        def two_steps():
            for _ in range(2):
                losses, _ = toy.train_step(setup, model, optimizer, data)
                hdet.step(losses)

        expect("param_groups_changed", two_steps)
    # Distributed optimizer with one instance but two arms.
    setup = toy.ToyGPTSetup(tp=2, use_distributed_optimizer=True)
    with toy.parallel(setup):
        model = toy.build_model(setup)
        optimizer = toy.build_optimizer(setup, model)
        config = HDETConfig(period=2)
        scheduler = HDETOptimizerParamScheduler(optimizer, hdet=config, **toy.scheduler_kwargs(setup, 10))
        expect("distopt_instances", lambda: HDET(config, model, optimizer, scheduler))
    return messages
