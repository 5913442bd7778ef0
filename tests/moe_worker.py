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
