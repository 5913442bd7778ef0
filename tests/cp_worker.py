"""Rank-side code of the context-parallel HDET tests (tests/test_megatron_moe.py).

TEST-ONLY: Megatron's local ``DotProductAttention`` refuses CP > 1 (real CP attention is
Transformer Engine's, which needs CUDA). :class:`AllGatherCPAttention` stands in so that the
group plumbing (arms, gradient reduction over DP x CP, converge, loss rows) can be checked on CPU.
It is exact causal attention for a sequence split *contiguously* across the CP ranks (rank ``i``
holds chunk ``i``), which is not the load-balanced split Megatron-LM feeds TE; it must never be
used outside these tests.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from hdet_megatron.config import Axis, HDETConfig
from hdet_megatron.megatron import toy

from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule


class AllGatherCPAttention(MegatronModule):
    """TEST-ONLY causal core attention over a contiguously CP-split sequence: K and V are
    all-gathered over the CP group (backward: reduce-scatter, so each rank's K/V get the gradient
    from every rank's queries), queries stay local and are masked by their global positions."""

    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        attention_dropout=None,
        softmax_scale=None,
        cp_comm_type=None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        self.cp_group = ps.get_context_parallel_group()
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, **_):
        # [s, b, np, hn]; K/V of the whole sequence, in CP-rank order.
        key = gather_from_sequence_parallel_region(key, group=self.cp_group)
        value = gather_from_sequence_parallel_region(value, group=self.cp_group)
        s_q, b = query.size(0), query.size(1)
        offset = self.cp_group.rank() * s_q
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, np, s, hn]
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.softmax_scale
        q_pos = torch.arange(s_q).unsqueeze(1) + offset
        future = torch.arange(key.size(0)).unsqueeze(0) > q_pos
        probs = torch.softmax(scores.float().masked_fill(future, float("-inf")), dim=-1).to(q.dtype)
        context = torch.matmul(probs, v)  # [b, np, s_q, hn]
        return context.permute(2, 0, 1, 3).reshape(s_q, b, -1)


def cp_chunks(batches, cp_rank: int, cp: int):
    """TEST-ONLY: each batch's contiguous sequence chunk ``cp_rank`` of ``cp`` (what
    :class:`AllGatherCPAttention` expects), global position ids kept."""
    for batch in batches:
        n = batch["tokens"].size(1) // cp
        yield {k: v[:, cp_rank * n : (cp_rank + 1) * n].contiguous() for k, v in batch.items()}


def cp_train(rank: int, world_size: int, case: dict) -> dict:
    """Train one CP case under HDET (or plain, ``hdet=False``): per step this rank's digest,
    local loss, LR, and at each converge the arms' window losses HDET compared."""
    from hdet_megatron.megatron.runtime import HDET
    from hdet_megatron.megatron.scheduler import HDETOptimizerParamScheduler
    from tests.cross_arm import CrossArmBytes
    from tests.megatron_hdet_worker import digest

    case = dict(case)
    steps, period = case.pop("steps", 4), case.pop("period", 2)
    arms, grad_sync = case.pop("arms", 2), case.pop("grad_sync", "global")
    spread, arm_data = case.pop("spread", 0.5), case.pop("arm_data", False)
    optimizer_kwargs = case.pop("optimizer", {})
    if case.get("use_distributed_optimizer"):
        case.setdefault("num_distributed_optimizer_instances", arms)
    case.setdefault("cp", 2)
    # CP=1: Megatron's own local attention (the reference the stand-in is checked against).
    attention = AllGatherCPAttention if case["cp"] > 1 else None
    setup = toy.ToyGPTSetup(lr=1e-2, core_attention=attention, **case)
    out: dict = {"steps": [], "windows": []}
    with toy.parallel(setup):
        model = toy.build_model(setup)
        optimizer = toy.build_optimizer(setup, model, **optimizer_kwargs)
        dp_rank = ps.get_data_parallel_rank()
        stream = toy.synthetic_batches(
            setup, seed=dp_rank % (ps.get_data_parallel_world_size() // arms) if arm_data else dp_rank
        )
        data = cp_chunks(stream, ps.get_context_parallel_rank(), setup.cp)
        config = HDETConfig(
            period=period, arms=arms, grad_sync=grad_sync, axes=(Axis("lr", spread),), auto=False
        )
        kwargs = toy.scheduler_kwargs(setup, steps, 0)
        scheduler = HDETOptimizerParamScheduler(optimizer, hdet=config, **kwargs)
        hdet = HDET(config, model, optimizer, scheduler)
        layout = hdet.layout
        out.update(
            arm=layout.arm,
            grad_arm=layout.grad_arm_ranks,
            cross=layout.cross_arm_ranks,
            row=layout.loss_row,
            reporter=layout.is_loss_reporter,
            tp_rank=ps.get_tensor_model_parallel_rank(),
        )
        arm_of_rank: list = [None] * world_size
        dist.all_gather_object(arm_of_rank, layout.arm)
        counter = CrossArmBytes(dict(enumerate(arm_of_rank)))
        for _ in range(steps):
            for chunk in model:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            with counter:
                losses = toy.forward_backward(setup, model, data, forward_only=False)
            ok, _norm, _zeros = optimizer.step()
            assert ok
            scheduler.step(1)
            metrics = hdet.step(losses)
            out["steps"].append(
                {
                    "digest": digest([p for c in model for p in c.module.parameters()]),
                    "loss": float(torch.stack([o["lm loss"] for o in losses]).double().mean()),
                    "converged": metrics is not None,
                }
            )
            if metrics is not None:
                out["windows"].append(metrics.arm_train_losses)
        out["grad_cross_bytes"] = counter.bytes
        out["scaling"] = sorted(
            {b.gradient_scaling_factor for c in model for g in c.bucket_groups for b in g.buckets}
        )
        out["params"] = [p.detach().float().clone() for c in model for p in c.module.parameters()]
        hdet.close()
    return out


def cp_cases(rank: int, world_size: int, cases: dict) -> dict:
    return {name: cp_train(rank, world_size, case) for name, case in cases.items()}


def cp_layouts(rank: int, world_size: int) -> dict:
    """ArmLayout groups on TP2 x CP2 x DP2 (8 ranks), the DistOpt instance check with CP, and
    training on that mesh (``global`` and ``arm``)."""
    from hdet_megatron.megatron.layout import ArmLayout, HDETSetupError

    out = {}
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2)
    layout = ArmLayout.from_parallel_state(2)
    out["plain"] = (
        layout.arm,
        layout.arm_ranks,
        layout.cross_arm_ranks,
        layout.grad_arm_ranks,
        layout.loss_row,
    )
    try:
        layout.check_distributed_optimizer(1)
    except HDETSetupError as exc:
        out["distopt_1"] = str(exc)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=2, context_parallel_size=2, num_distributed_optimizer_instances=2
    )
    layout = ArmLayout.from_parallel_state(2)
    layout.check_distributed_optimizer(2)  # instance = the arm's DP x CP ranks: accepted
    out["distopt_2"] = layout.grad_arm_ranks
    ps.destroy_model_parallel()
    # And training on TP2 x CP2 x DP2, both gradient-sync modes.
    out.update(cp_cases(rank, world_size, {"global": dict(tp=2), "arm": dict(tp=2, grad_sync="arm")}))
    return out
