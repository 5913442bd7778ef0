"""The ``dist_checkpointing`` (torch_dist) format: sharded state dicts, common state, RNG as a sharded object.

HDET's state travels in the common state (every non-tensor entry; rank 0 writes it, every rank
reads it); the per-arm ``lr``/``weight_decay`` of the optimizer's param groups are left out of
dist_checkpointing's cross-rank consistency check.
"""

from __future__ import annotations

import multiprocessing
import queue
from collections.abc import Mapping, Sequence
from typing import Any

from hdet_megatron.megatron import cpu as _cpu  # noqa: F401  (shims before megatron.core)
from hdet_megatron.megatron.ckpt.files import _layout_meta, _model_key, _unwrap, init_optimizer_state_for_load

from megatron.core import parallel_state as ps


def _sharded_metadata(sharding_type: str) -> dict:
    return {
        "distrib_optim_sharding_type": sharding_type,
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True),
    }


def _model_sharded_state_dict(model: Sequence, metadata: dict) -> dict:
    return {
        _model_key(model, i): _unwrap(chunk).sharded_state_dict(metadata=metadata)
        for i, chunk in enumerate(model)
    }


def _rng_sharded_object(data) -> Any:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    meta = _layout_meta()
    # One object per rank: CP ranks share their DP rank, so the last axis is DP x CP (equal to
    # DP, as before, without context parallelism).
    return ShardedObject(
        "rng_state",
        data,
        (meta["pp"], meta["tp"], ps.get_data_parallel_world_size(with_context_parallel=True)),
        (
            ps.get_pipeline_model_parallel_rank(),
            ps.get_tensor_model_parallel_rank(),
            ps.get_data_parallel_rank(with_context_parallel=True),
        ),
        replica_id=0,
    )


def _sync_write_queue() -> None:
    """dist_checkpointing's writer reports results through a ``multiprocessing.Manager`` queue,
    which a daemonic process (e.g. a multiprocessing worker rank) cannot start. A synchronous save
    only needs an in-process queue."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if multiprocessing.current_process().daemon and filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def _save_dist(ckpt_dir, model, optimizer, common, rng, sharding_type) -> None:
    from megatron.core import dist_checkpointing

    metadata = _sharded_metadata(sharding_type)
    state = _model_sharded_state_dict(model, metadata)
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=False, metadata=metadata)
    state.update(common)
    if rng is not None:
        state["rng_state"] = _rng_sharded_object(rng)
    _sync_write_queue()
    dist_checkpointing.save(state, ckpt_dir, preprocess_common_before_consistancy_check=_without_arm_values)


#: Param-group entries HDET sets per arm: they differ across DP ranks by design (rank 0's copy is
#: written; the scheduler state rewrites them on load).
_ARM_GROUP_KEYS = ("lr", "weight_decay")


def _without_arm_values(common: Mapping) -> dict:
    """The common state as compared across ranks by dist_checkpointing's consistency check,
    without the per-arm ``lr``/``weight_decay`` of the optimizer's param groups."""
    out = dict(common)
    optim = out.get("optimizer")

    def strip(groups):
        return [
            {k: v for k, v in g.items() if k not in _ARM_GROUP_KEYS} if isinstance(g, Mapping) else g
            for g in groups
        ]

    def walk(node):
        if isinstance(node, Mapping):
            return {
                k: (strip(v) if k == "param_groups" and isinstance(v, list) else walk(v))
                for k, v in node.items()
            }
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    if optim is not None:
        out["optimizer"] = walk(optim)
    return out


def _load_dist_tensors(ckpt_dir, model, optimizer, load_rng: bool, sharding_type: str) -> dict:
    from megatron.core import dist_checkpointing

    metadata = _sharded_metadata(sharding_type)
    state = _model_sharded_state_dict(model, metadata)
    if optimizer is not None:
        init_optimizer_state_for_load(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=True, metadata=metadata)
    if load_rng:
        state["rng_state"] = _rng_sharded_object(None)
    return dist_checkpointing.load(state, ckpt_dir)
