"""Rank-side code of the MoE / context-parallel HDET tests (tests/test_megatron_moe.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hdet_megatron.config import HDETConfig
from hdet_megatron.megatron import toy
from hdet_megatron.megatron.layout import ArmLayout, HDETSetupError

from megatron.core import parallel_state as ps


def _outcome(fn):
    try:
        layout = fn()
    except HDETSetupError as exc:
        return "error: " + str(exc)
    return {
        "arms": layout.num_arms,
        "arm": layout.arm,
        "cross": layout.cross_arm_ranks,
        "arm_ranks": layout.arm_ranks,
    }


def layout_cases(rank: int, world_size: int) -> dict:
    """ArmLayout on expert-parallel meshes of 4 ranks: the arm counts chosen or refused."""
    from hdet_megatron.megatron.scheduler import HDETOptimizerParamScheduler

    out: dict = {}
    cases = {
        "dp4_ep2": dict(expert_model_parallel_size=2),
        "tp2_ep2_etp1": dict(
            tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1
        ),
        "tp2_ep2_etp2": dict(tensor_model_parallel_size=2, expert_model_parallel_size=2),
        "dp4_ep4": dict(expert_model_parallel_size=4),
    }
    for name, kwargs in cases.items():
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(**kwargs)
        for arms in (None, 1, 2, 4):
            out[(name, arms)] = _outcome(lambda arms=arms: ArmLayout.from_parallel_state(arms))
        # The scheduler (built before the first step) refuses the same way.
        try:
            optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
            HDETOptimizerParamScheduler(
                optimizer, hdet=HDETConfig(arms=4), **toy.scheduler_kwargs(toy.ToyGPTSetup(), 4)
            )
        except HDETSetupError as exc:
            out[(name, "scheduler")] = "error: " + str(exc)
        else:
            out[(name, "scheduler")] = "<no error>"
        out[(name, "ep_ranks")] = tuple(dist.get_process_group_ranks(ps.get_expert_model_parallel_group()))
    ps.destroy_model_parallel()
    return out


def _expert_and_dense(model) -> tuple[dict[int, list[torch.Tensor]], list[torch.Tensor]]:
    """This rank's model params: experts by global expert id (``SequentialMLP.local_experts``,
    expert ``ep_rank * num_local + i``), and everything else (dense)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    experts: dict[int, list[torch.Tensor]] = {}
    expert_ids: set[int] = set()
    for chunk in model:
        for module in chunk.module.modules():
            if isinstance(module, SequentialMLP):
                first = module.ep_group.rank() * module.num_local_experts
                for i, expert in enumerate(module.local_experts):
                    params = list(expert.parameters())
                    experts.setdefault(first + i, []).extend(params)
                    expert_ids.update(id(p) for p in params)
    dense = [p for chunk in model for p in chunk.module.parameters() if id(p) not in expert_ids]
    return experts, dense


def moe_train(rank: int, world_size: int, case: dict) -> dict:
    """Train one MoE case under HDET; per step: digests of the dense params and of every local
    expert, each param group's LR and expert flag, and whether the step ended a window."""
    from hdet_megatron.config import Axis
    from hdet_megatron.megatron.runtime import HDET, main_param_is_expert
    from hdet_megatron.megatron.scheduler import HDETOptimizerParamScheduler
    from tests.cross_arm import CrossArmBytes
    from tests.megatron_hdet_worker import digest

    case = dict(case)
    steps, period = case.pop("steps", 5), case.pop("period", 2)
    arms, grad_sync = case.pop("arms", None), case.pop("grad_sync", "global")
    count_bytes = case.pop("count_bytes", False)
    spread = case.pop("spread", 0.5)
    # "arm data": the data stream of a replica's position inside its arm, so every arm sees the
    # same data (arm mode then computes the same gradients as global mode).
    arm_data = case.pop("arm_data", False)
    optimizer_kwargs = case.pop("optimizer", {})
    return_params = case.pop("return_params", False)
    case.setdefault("ep", 2)
    if case.get("use_distributed_optimizer"):
        case.setdefault("num_distributed_optimizer_instances", arms or 2)
    setup = toy.ToyGPTSetup(num_experts=4, num_layers=2, lr=1e-2, **case)
    out: dict = {"steps": []}
    with toy.parallel(setup):
        model = toy.build_model(setup)
        optimizer = toy.build_optimizer(setup, model, **optimizer_kwargs)
        dp_rank = ps.get_data_parallel_rank()
        data = toy.synthetic_batches(
            setup, seed=dp_rank % (ps.get_data_parallel_world_size() // (arms or 2)) if arm_data else dp_rank
        )
        config = HDETConfig(
            period=period, arms=arms, grad_sync=grad_sync, axes=(Axis("lr", spread),), auto=False
        )
        scheduler = HDETOptimizerParamScheduler(
            optimizer, hdet=config, **toy.scheduler_kwargs(setup, steps, 0)
        )
        hdet = HDET(config, model, optimizer, scheduler)
        layout = hdet.layout
        out.update(
            tp_rank=ps.get_tensor_model_parallel_rank(),
            arm=layout.arm,
            arms=layout.num_arms,
            cross=layout.cross_arm_ranks,
            expert_cross=layout.expert_cross_arm_ranks,
            expert_arm=layout.expert_arm_ranks,
            expert_main_params=sum(main_param_is_expert(optimizer)),
            averager_parts=[p.group_size for p in hdet.averager.parts],
        )
        arm_of_rank: list = [None] * world_size
        dist.all_gather_object(arm_of_rank, layout.arm)
        from megatron.core.distributed import param_and_grad_buffer as pgb

        counter = CrossArmBytes(
            dict(enumerate(arm_of_rank)),
            extra=((pgb, "dist_reduce_scatter_func"), (pgb, "dist_all_gather_func")),
        )
        grad_cross_bytes = 0
        for _ in range(steps):
            lrs = [(bool(g.get("is_expert_parallel")), float(g["lr"])) for g in optimizer.param_groups]
            for chunk in model:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            if count_bytes:
                with counter:  # the gradient sync runs in finalize_model_grads, inside
                    losses = toy.forward_backward(setup, model, data, forward_only=False)
                grad_cross_bytes += counter.bytes
                counter.bytes = 0
            else:
                losses = toy.forward_backward(setup, model, data, forward_only=False)
            ok, _norm, _zeros = optimizer.step()
            assert ok
            scheduler.step(1)
            metrics = hdet.step(losses)
            experts, dense = _expert_and_dense(model)
            out["steps"].append(
                {
                    "lrs": lrs,
                    "converged": metrics is not None,
                    "dense": digest(dense),
                    "experts": {e: digest(ps_) for e, ps_ in experts.items()},
                    "loss": float(torch.stack([o["lm loss"] for o in losses]).mean()),
                }
            )
        out["grad_cross_bytes"] = grad_cross_bytes
        out["expert_scaling"] = sorted(
            {
                b.gradient_scaling_factor
                for c in model
                for g in c.expert_parallel_bucket_groups
                for b in g.buckets
            }
        )
        if return_params:
            experts, dense = _expert_and_dense(model)
            out["params"] = {
                "dense": [p.detach().float().clone() for p in dense],
                "experts": {e: [p.detach().float().clone() for p in v] for e, v in experts.items()},
            }
        hdet.close()
    return out


def moe_cases(rank: int, world_size: int, cases: dict) -> dict:
    """Several MoE cases in one world, in order."""
    return {name: moe_train(rank, world_size, case) for name, case in cases.items()}
