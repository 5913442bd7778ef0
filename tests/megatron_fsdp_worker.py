"""Rank-side code of the Megatron ``--use-torch-fsdp2`` HDET tests (tiny GPT, gloo)."""

from __future__ import annotations

import hashlib
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hdet_megatron.config import Axis, HDETConfig
from hdet_megatron.megatron import toy
from hdet_megatron.megatron.fsdp import TorchFSDPGradSync, TorchFSDPHDET, wrap_torch_fsdp2
from hdet_megatron.megatron.layout import ArmLayout
from hdet_megatron.megatron.scheduler import HDETOptimizerParamScheduler
from tests.cross_arm import CrossArmBytes

from megatron.core import parallel_state as ps
from megatron.core.distributed import finalize_model_grads
from megatron.core.distributed.torch_fully_sharded_data_parallel import TorchFullyShardedDataParallel
from megatron.core.distributed.torch_fully_sharded_data_parallel_config import (
    TorchFullyShardedDataParallelConfig,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


@dataclass
class MegatronFSDPScenario:
    wrap: str = "hsdp"
    """``hsdp`` (wrap_torch_fsdp2: shards inside each arm) or ``fsdp`` (Megatron's default
    TorchFullyShardedDataParallel over the whole DP group)."""
    hdet: bool = True
    arms: int | None = 2
    """2 arms on 4 ranks: each arm shards its copy over 2 ranks."""
    grad_sync: str = "global"
    spread: float = 0.3
    auto: bool = True
    period: int = 2
    steps: int = 4
    temperature: float = 0.05


def _model(setup):
    config = toy.transformer_config(setup)
    config.transformer_impl = "local"
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=setup.vocab_size,
        max_sequence_length=setup.seq_length,
    )
    return config, model


def _digest(chunk, group) -> str:
    """Digest of this replica's full parameters (local-shard hashes joined over the shard group)."""
    h = hashlib.sha256()
    with torch.no_grad():
        for p in chunk.parameters():
            h.update(p.to_local().detach().contiguous().numpy().tobytes())
    mine = torch.frombuffer(bytearray(h.digest()), dtype=torch.uint8)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    return hashlib.sha256(torch.cat(parts).numpy().tobytes()).hexdigest()[:16]


def run(rank: int, world_size: int, sc: MegatronFSDPScenario) -> dict:
    setup = toy.ToyGPTSetup()
    out: dict = {"lrs": {}, "losses": {}, "digests": {}, "grad_bytes": {}, "history": []}
    with toy.parallel(setup):
        config, model = _model(setup)
        layout = ArmLayout.from_parallel_state(sc.arms)
        if sc.wrap == "hsdp":
            chunk = wrap_torch_fsdp2(model, config, layout)
        else:
            chunk = TorchFullyShardedDataParallel(config, TorchFullyShardedDataParallelConfig(), model)
        config.finalize_model_grads_func = finalize_model_grads
        optimizer = toy.build_optimizer(setup, [chunk])
        kwargs = toy.scheduler_kwargs(setup, sc.steps)
        hdet = sync = None
        if sc.hdet:
            hcfg = HDETConfig(
                period=sc.period,
                arms=sc.arms,
                grad_sync=sc.grad_sync,
                axes=(Axis("lr", sc.spread),),
                auto=sc.auto,
                temperature=sc.temperature,
            )
            scheduler = HDETOptimizerParamScheduler(optimizer, hdet=hcfg, layout=layout, **kwargs)
            hdet = TorchFSDPHDET(hcfg, [chunk], optimizer, scheduler)
        else:
            scheduler = OptimizerParamScheduler(optimizer, **kwargs)
            if sc.wrap == "hsdp":
                sync = TorchFSDPGradSync([chunk], layout, "global")
                sync.install()
        all_arms = [None] * world_size
        dist.all_gather_object(all_arms, layout.arm)
        arm_of_rank = dict(enumerate(all_arms))
        out["arm"] = layout.arm
        data = toy.synthetic_batches(setup, seed=ps.get_data_parallel_rank())
        shard_group = chunk.process_group
        for step in range(1, sc.steps + 1):
            out["lrs"][step] = optimizer.param_groups[0]["lr"]
            counter = CrossArmBytes(arm_of_rank)
            with counter:
                losses, ok = toy.train_step(setup, [chunk], optimizer, data)
            assert ok
            out["grad_bytes"][step] = counter.bytes
            out["losses"][step] = float(torch.stack([x["lm loss"] for x in losses]).mean())
            scheduler.step(1)
            if hdet is not None:
                metrics = hdet.step(losses)
                if metrics is not None:
                    out["history"].append(
                        {"step": step, "arm_losses": metrics.arm_losses, "bytes": metrics.converge_bytes}
                    )
            out["digests"][step] = _digest(chunk, shard_group)
        if hdet is not None:
            hdet.close()
        if sync is not None:
            sync.uninstall()
    return out


def refusals(rank: int, world_size: int) -> dict:
    """HDET on Megatron's default (pure FSDP over DP) wrapping is refused with an explanation;
    Megatron-FSDP's constructor fails on CPU (recorded)."""
    setup = toy.ToyGPTSetup()
    out = {}
    with toy.parallel(setup):
        config, model = _model(setup)
        layout = ArmLayout.from_parallel_state(2)
        chunk = TorchFullyShardedDataParallel(config, TorchFullyShardedDataParallelConfig(), model)
        optimizer = toy.build_optimizer(setup, [chunk])
        hcfg = HDETConfig(period=2)
        scheduler = HDETOptimizerParamScheduler(
            optimizer, hdet=hcfg, layout=layout, **toy.scheduler_kwargs(setup, 4)
        )
        try:
            TorchFSDPHDET(hcfg, [chunk], optimizer, scheduler)
            out["pure_fsdp"] = None
        except Exception as exc:  # noqa: BLE001
            out["pure_fsdp"] = f"{type(exc).__name__}: {exc}"
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

        config2, model2 = _model(setup)
        try:
            FullyShardedDataParallel(
                config=config2,
                ddp_config=DistributedDataParallelConfig(
                    use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params"
                ),
                module=model2,
                device=torch.device("cpu"),
            )
            out["megatron_fsdp"] = None
        except Exception:  # noqa: BLE001
            out["megatron_fsdp"] = traceback.format_exc()[-1200:]
    return out


def world_tasks(rank, world_size, scenarios, with_refusals=False):
    out = {"runs": [run(rank, world_size, sc) for sc in scenarios]}
    if with_refusals:
        out["refusals"] = refusals(rank, world_size)
    return out
