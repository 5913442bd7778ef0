"""Megatron-LM's checkpoint layout: directories, tracker, format detection, common state, RNG,
optimizer-state fixes.

Shared by both formats (:mod:`.torch_dist`, :mod:`.legacy`) and by the save/load entry points in
:mod:`hdet_megatron.megatron.checkpointing`.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping, Sequence
from typing import cast

import torch

from hdet_megatron.config import HDETConfig
from hdet_megatron.megatron import cpu as _cpu  # noqa: F401  (shims before megatron.core)
from hdet_megatron.megatron.ckpt.state import (
    HDET_STATE_KEY,
    HDETCheckpointError,
    _bad,
    _config_from_fingerprint,
)
from hdet_megatron.run_files import TRACKER

from megatron.core import parallel_state as ps

#: The ``DistributedOptimizer`` sharding type that megatron-core 0.19.2 saves and loads (with
#: partial instances too). The default ``fully_sharded_model_space`` fails with
#: "ShardedTensor.flattened_range is not supported"; ``fully_reshardable`` and
#: ``dp_zero_gather_scatter`` gather through CUDA-only code on CPU machines.
DISTOPT_SHARDING_TYPE = "dp_reshardable"


TRACKER_FILE = TRACKER  # Megatron-LM's name (hdet_megatron.run_files: one definition)


LEGACY_FILE = "model_optim_rng.pt"


CHECKPOINT_VERSION = 3.0


def checkpoint_dir(root: str, iteration: int) -> str:
    """Megatron-LM's layout: ``<root>/iter_0000010``."""
    return os.path.join(root, f"iter_{int(iteration):07d}")


def _legacy_file(ckpt_dir: str) -> str:
    tp = ps.get_tensor_model_parallel_rank()
    pp = ps.get_pipeline_model_parallel_rank()
    name = f"mp_rank_{tp:02d}"
    if ps.get_pipeline_model_parallel_world_size() > 1:
        name += f"_{pp:03d}"
    if _expert_parallel_size() > 1:
        # Megatron-LM's get_checkpoint_name: one file per expert-parallel rank too (its ranks
        # hold different experts).
        name += f"_{ps.get_expert_model_parallel_rank():03d}"
    return os.path.join(ckpt_dir, name, LEGACY_FILE)


def _expert_parallel_size() -> int:
    group = ps.get_expert_model_parallel_group(check_initialized=False)
    return group.size() if group is not None else 1


def _unwrap(chunk):
    """The module inside Megatron DDP (checkpoint keys without the ``module.`` prefix, as in
    Megatron-LM checkpoints)."""
    return getattr(chunk, "module", chunk)


def _model_key(model: Sequence, i: int) -> str:
    return "model" if len(model) == 1 else f"model{i}"


def _sub_optimizers(optimizer) -> list:
    return [
        s
        for s in (getattr(optimizer, "chained_optimizers", None) or [optimizer])
        if not getattr(s, "is_stub_optimizer", False)
    ]


def _is_distopt(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(s, DistributedOptimizer) for s in _sub_optimizers(optimizer))


def _layout_meta() -> dict:
    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
    }


def _rng_state() -> dict:
    import numpy as np

    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    # legacy=True (the default) returns the tuple form; numpy types it as tuple | dict.
    legacy_state = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state())
    name, keys, pos, has_gauss, gauss = legacy_state
    state = {
        "random": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)),
        "torch": torch.get_rng_state(),
        "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: Mapping) -> None:
    import numpy as np

    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["random"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(dict(state["tracker"]))


def _resolve_dir(root: str, iteration: int | None) -> tuple[str, int]:
    if iteration is None:
        tracker = os.path.join(root, TRACKER_FILE)
        if not os.path.exists(tracker):
            raise FileNotFoundError(f"no checkpoint in {root!r} ({TRACKER_FILE} is missing)")
        with open(tracker) as f:
            text = f.read().strip()
        try:
            iteration = int(text)
        except ValueError:
            raise HDETCheckpointError(f"{tracker} holds {text!r}, not an iteration") from None
    ckpt_dir = checkpoint_dir(root, iteration)
    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"checkpoint directory {ckpt_dir!r} does not exist")
    return ckpt_dir, iteration


def _detect_format(ckpt_dir: str) -> str:
    from megatron.core import dist_checkpointing

    if dist_checkpointing.check_is_distributed_checkpoint(ckpt_dir):
        return "torch_dist"
    if any(name.startswith("mp_rank_") for name in os.listdir(ckpt_dir)):
        return "torch"
    raise HDETCheckpointError(f"{ckpt_dir!r} is neither a torch_dist nor a legacy Megatron checkpoint")


def _read_common(ckpt_dir: str, fmt: str) -> dict:
    """The non-tensor part of a checkpoint (legacy: this rank's whole file)."""
    if fmt == "torch_dist":
        from megatron.core import dist_checkpointing

        return dist_checkpointing.load_common_state_dict(ckpt_dir)
    path = _legacy_file(ckpt_dir) if ps.model_parallel_is_initialized() else None
    if path is None or not os.path.exists(path):
        candidates = sorted(
            os.path.join(ckpt_dir, d, LEGACY_FILE) for d in os.listdir(ckpt_dir) if d.startswith("mp_rank_")
        )
        if path is not None or not candidates:
            raise FileNotFoundError(f"legacy checkpoint file {path or ckpt_dir!r} does not exist")
        path = candidates[0]
    return torch.load(path, map_location="cpu", weights_only=False)


def read_checkpoint_hdet_state(root: str, iteration: int | None = None) -> dict | None:
    """The HDET state stored in a checkpoint (None for a plain Megatron checkpoint)."""
    ckpt_dir, _ = _resolve_dir(root, iteration)
    common = _read_common(ckpt_dir, _detect_format(ckpt_dir))
    sched = common.get("opt_param_scheduler") or {}
    return sched.get(HDET_STATE_KEY) if isinstance(sched, Mapping) else None


def checkpoint_hdet_config(root: str, iteration: int | None = None) -> HDETConfig | None:
    """The HDETConfig a checkpoint was written with (None for a plain Megatron checkpoint): build
    the resumed run with it to change nothing (like Megatron-LM's ``--use-checkpoint-args``)."""
    state = read_checkpoint_hdet_state(root, iteration)
    if state is None:
        return None
    if not isinstance(state, Mapping) or "config" not in state:
        raise _bad("['config']", "is missing (partial state)")
    return _config_from_fingerprint(state["config"])[0]


_TORCH_ADAM = (torch.optim.Adam, torch.optim.AdamW)


def init_optimizer_state_for_load(optimizer) -> None:
    """A fresh ``DistributedOptimizer`` over torch's Adam/AdamW cannot build its loading sharded
    state dict (``state_dict()`` asserts one per-param ``step``): allocate the state first, as
    the first optimizer step would."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for sub in _sub_optimizers(optimizer):
        inner = sub.optimizer
        if not isinstance(sub, DistributedOptimizer) or not isinstance(inner, _TORCH_ADAM):
            continue
        if sub.init_state_fn is not None:
            sub.init_state_fn(inner, sub.config)
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                state.setdefault("exp_avg", torch.zeros_like(p))
                state.setdefault("exp_avg_sq", torch.zeros_like(p))
                state.setdefault("step", torch.tensor(0.0))


def restore_adam_steps(optimizer) -> None:
    """After ``DistributedOptimizer.load_state_dict`` torch Adam's per-param ``step`` is one
    tensor shared by every param (so each step adds n_params to it) and the ``dp_reshardable``
    param state then overwrites it with a stale value: give every param its own ``step`` from
    the loaded param groups (where megatron keeps the true value)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for sub in _sub_optimizers(optimizer):
        inner = sub.optimizer
        if not isinstance(sub, DistributedOptimizer) or not isinstance(inner, _TORCH_ADAM):
            continue
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for p in group["params"]:
                if "step" in inner.state[p]:
                    inner.state[p]["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)
