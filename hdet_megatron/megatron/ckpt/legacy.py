"""The legacy (``torch.save``) format: one file per TP/PP(/EP) rank from DP rank 0 (expert-DP rank
0 with EP), plus per-DP-rank distributed-optimizer files.

HDET's state travels inside ``opt_param_scheduler`` (Megatron-LM's own ``save_checkpoint`` picks
it up from ``opt_param_scheduler.state_dict()`` unchanged).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from hdet_megatron.megatron import cpu as _cpu  # noqa: F401  (shims before megatron.core)
from hdet_megatron.megatron.ckpt.files import (
    _expert_parallel_size,
    _is_distopt,
    _layout_meta,
    _legacy_file,
    _model_key,
    _sub_optimizers,
    _unwrap,
)
from hdet_megatron.megatron.ckpt.state import HDETCheckpointError

from megatron.core import parallel_state as ps


def _distopt_param_state(optimizer) -> list:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return [
        s.get_parameter_state_dp_reshardable() if isinstance(s, DistributedOptimizer) else None
        for s in _sub_optimizers(optimizer)
    ]


def _distopt_file(ckpt_dir: str) -> str:
    return os.path.join(
        os.path.dirname(_legacy_file(ckpt_dir)), f"distrib_optim_dp{ps.get_data_parallel_rank():03d}.pt"
    )


def _save_legacy(ckpt_dir, model, optimizer, common, rng) -> None:
    dp_group = ps.get_data_parallel_group(with_context_parallel=True)
    rng_all = None
    if rng is not None:
        rng_all = [None] * dist.get_world_size(dp_group)
        dist.all_gather_object(rng_all, rng, group=dp_group)
    distopt = optimizer is not None and _is_distopt(optimizer)
    path = _legacy_file(ckpt_dir)
    if distopt:
        # Like Megatron-LM's distrib_optim.pt, but one file per DP rank (no gather to DP rank 0:
        # megatron-core's gather path needs CUDA); resumable with the same DP layout.
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(
            {"param_state": _distopt_param_state(optimizer), "layout": _layout_meta()},
            _distopt_file(ckpt_dir),
        )
    # One writer per file: DP rank 0, or with expert parallelism expert-DP rank 0 (one per EP
    # rank, as Megatron-LM's legacy save), since EP ranks of one replica hold different experts.
    writer = (
        ps.get_expert_data_parallel_rank() == 0
        if _expert_parallel_size() > 1
        else ps.get_data_parallel_rank(with_context_parallel=True) == 0
    )
    if not writer:
        return
    state = dict(common)
    for i, chunk in enumerate(model):
        state[_model_key(model, i)] = _unwrap(chunk).state_dict_for_save_checkpoint()
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    if rng_all is not None:
        state["rng_state"] = rng_all
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def _load_legacy_distopt(ckpt_dir: str, optimizer) -> None:
    path = _distopt_file(ckpt_dir)
    if not os.path.exists(path):
        raise HDETCheckpointError(
            f"{path} is missing: legacy distributed-optimizer checkpoints need the same DP layout "
            "(use format='torch_dist' to change it)"
        )
    data = torch.load(path, map_location="cpu", weights_only=False)
    if data.get("layout") != _layout_meta():
        raise HDETCheckpointError(
            f"{path} was written with layout {data.get('layout')}, this run is {_layout_meta()}: "
            "legacy distributed-optimizer checkpoints need the same layout (use torch_dist)"
        )
    subs = _sub_optimizers(optimizer)
    if len(data["param_state"]) != len(subs):
        raise HDETCheckpointError(
            f"{path} holds {len(data['param_state'])} optimizer states, this run has {len(subs)}"
        )
    for sub, param_state in zip(subs, data["param_state"], strict=True):
        if param_state is not None:
            _set_distopt_param_state(sub, param_state, path)


def _set_distopt_param_state(sub, state, path: str) -> None:
    """Inverse of ``DistributedOptimizer.get_parameter_state_dp_reshardable`` for this rank's own
    shards (``load_parameter_state_from_dp_reshardable`` expects the padded torch_dist layout)."""
    if state.get("per_bucket_numel_unpadded") != sub.per_bucket_numel_unpadded:
        raise HDETCheckpointError(f"{path}: optimizer buckets differ from this run's (model changed?)")
    for gbuf_idx, gbuf_range_maps in enumerate(sub.gbuf_ranges):
        for dtype, range_maps in gbuf_range_maps.items():
            for bucket_idx, range_map in enumerate(range_maps):
                bucket_state = state[gbuf_idx][dtype][bucket_idx]
                if len(bucket_state) != len(range_map["param_map"]):
                    raise HDETCheckpointError(f"{path}: bucket {bucket_idx} does not match this run's")
                for tensors, model_param in zip(bucket_state, range_map["param_map"], strict=True):
                    sub._set_main_param_and_optimizer_states(model_param, tensors)
