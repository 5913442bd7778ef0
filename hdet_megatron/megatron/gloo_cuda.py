"""Several ranks on one GPU: Megatron's DDP / distributed optimizer over gloo with CUDA tensors.

NCCL refuses two ranks on one device, so a one-GPU machine runs multi-rank worlds (HDET needs
>= 2 data-parallel ranks) over gloo with the tensors on the GPU. gloo has CUDA versions of
``allreduce``, ``allgather`` and ``broadcast`` (staged through pinned host memory) and builds its
reduce-scatter from ``allreduce``, but **not** of the *coalesced* entry points:
``ProcessGroupGloo::allreduce_coalesced`` refuses CUDA tensors and its coalesced all-gather has
no CUDA path. Megatron's ``param_and_grad_buffer`` issues every gradient reduction and parameter
all-gather inside ``torch.distributed._coalescing_manager``, which sends the captured
collectives to exactly those entry points.

:func:`apply_gloo_cuda_adapter` replaces the ``_coalescing_manager`` that
``megatron.core.distributed.param_and_grad_buffer`` imported with one that, for gloo groups,
captures the collectives the same way (torch's own capture list) and then issues each one on its
own (``all_reduce`` / ``all_gather_into_tensor`` / ``reduce_scatter_tensor``, async), returning
them as one handle: the same results, one gloo call per bucket instead of one per group of
buckets. Other backends (NCCL) go to torch's manager unchanged. Nothing else in megatron is
touched; it is applied only where asked for (``pretrain_gpt.py --device cuda
--distributed-backend gloo``, the GPU tests and ``benchmarks/overhead.py``).
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist

_PATCHED = "_hdet_gloo_cuda_adapter"

_ALL_REDUCE = {"all_reduce"}
_ALL_GATHER = {"all_gather_into_tensor", "all_gather_single", "_all_gather_base"}
_REDUCE_SCATTER = {"reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base"}


def _is_gloo(group) -> bool:
    try:
        return dist.get_backend(group) == "gloo"
    except Exception:  # noqa: BLE001 - not a group torch knows: leave it to torch
        return False


def _issue(op, group):
    """Issue one captured collective on its own (async); returns its Work."""
    name = getattr(op.op, "__name__", "")
    if name in _ALL_REDUCE:
        return dist.all_reduce(op.tensor, op=op.redop, group=group, async_op=True)
    if name in _ALL_GATHER:
        return dist.all_gather_into_tensor(op.dst_tensor, op.tensor, group=group, async_op=True)
    if name in _REDUCE_SCATTER:
        return dist.reduce_scatter_tensor(op.dst_tensor, op.tensor, op=op.redop, group=group, async_op=True)
    raise RuntimeError(f"gloo CUDA adapter: cannot issue a captured {name or op.op!r} on its own")


def make_coalescing_manager(upstream):
    """A drop-in for ``torch.distributed._coalescing_manager`` (same signature and handle)."""
    from torch.distributed import distributed_c10d as c10d

    @contextlib.contextmanager
    def coalescing_manager(group=None, device=None, async_ops=False):
        group = group or c10d._get_default_group()
        if not _is_gloo(group) or device is not None:
            with upstream(group, device=device, async_ops=async_ops) as cm:
                yield cm
            return
        state = c10d._world.pg_coalesce_state
        if state.setdefault(group, []):
            raise ValueError("ProcessGroup has non-empty op list at the start of coalescing")
        cm = c10d._CoalescingManager()
        try:
            yield cm
        finally:
            ops = state.pop(group, [])
        works = [_issue(op, group) for op in ops]
        # A counter on the function object (typeshed's function type declares no attributes).
        coalescing_manager.issued += len(works)  # type: ignore[attr-defined]
        if async_ops:
            for work in works:
                cm.append(work)
        else:
            for work in works:
                work.wait()

    coalescing_manager.issued = 0  # type: ignore[attr-defined]  # collectives issued one by one (for tests)
    setattr(coalescing_manager, _PATCHED, True)
    return coalescing_manager


def apply_gloo_cuda_adapter() -> bool:
    """Install the adapter in megatron's ``param_and_grad_buffer``. Idempotent; returns True
    when it was installed by this call."""
    from megatron.core.distributed import param_and_grad_buffer as pgb

    if getattr(pgb._coalescing_manager, _PATCHED, False):
        return False
    pgb._coalescing_manager = make_coalescing_manager(pgb._coalescing_manager)
    return True


def adapter_applied() -> bool:
    """Whether Megatron's ``_coalescing_manager`` is wrapped by this module's adapter."""
    from megatron.core.distributed import param_and_grad_buffer as pgb

    return bool(getattr(pgb._coalescing_manager, _PATCHED, False))
