"""``HostSyncCounter`` sees every kind of host sync it names, from our code only, once per call."""

from __future__ import annotations

import operator
from pathlib import Path

import numpy
import torch
import torch.distributed as dist

from hdet_megatron.megatron.sync_counter import HostSyncCounter
from tests.harness import run_world

HERE = str(Path(__file__).resolve().parent)  # count calls made from this directory


def _elsewhere(fn_text: str, **names):
    """Run ``fn_text`` as code of a file outside the counted directory (megatron's, say)."""
    code = compile(fn_text, "/somewhere/else/megatron_like.py", "exec")
    exec(code, dict(names))


def test_tensor_and_torch_syncs_are_counted():
    t = torch.tensor([1.5, 0.0, 2.0])
    one = torch.tensor(3)
    with HostSyncCounter(package_dir=HERE) as counter:
        t[0].item(), t.tolist(), t.numpy(), t.cpu()
        t.to("cpu"), t.to(device="cpu"), t.to("cpu", torch.float64)  # spelled: a host copy
        try:
            torch.empty(2, device="meta").to(torch.device("cpu"))  # off the CPU, to it
        except NotImplementedError:  # (a meta tensor has no data to copy; the call counts)
            pass
        t.to(torch.device("cpu")), t.to(one), t.to(one.device)  # CPU to CPU: no copy
        t.to(torch.float64), t.to(dtype=torch.float16)  # not a transfer
        float(t[0]), int(t[0]), bool(t[0]), complex(t[0]), operator.index(one)
        numpy.asarray(t)  # __array__ (its inner .numpy() is the same sync)
        t.nonzero(), torch.nonzero(t), torch.masked_select(t, t > 0), torch.unique(t)
        torch.equal(t, t), torch.allclose(t, t), torch.is_nonzero(one)
    want = {
        "Tensor.item": 1,
        "Tensor.tolist": 1,
        "Tensor.numpy": 1,
        "Tensor.cpu": 1,
        "Tensor.to(cpu)": 4,
        "Tensor.__float__": 1,
        "Tensor.__int__": 1,
        "Tensor.__bool__": 1,
        "Tensor.__complex__": 1,
        "Tensor.__index__": 1,
        "Tensor.__array__": 1,
        "Tensor.nonzero": 1,
        "torch.nonzero": 1,
        "torch.masked_select": 1,
        "torch.unique": 1,
        "torch.equal": 1,
        "torch.allclose": 1,
        "torch.is_nonzero": 1,
    }
    assert dict(counter.counts) == want
    # Restored on exit: nothing is counted (or wrapped) any more.
    assert torch.Tensor.item.__name__ == "item" and torch.equal.__name__ == "equal"
    # A torch helper our code calls (printing reads the values) is ours; code of another package
    # (megatron's) is not.
    with HostSyncCounter(package_dir=HERE) as counter:
        str(t)
        assert counter.total >= 1
        counter.reset()
        _elsewhere("t[0].item(); torch.equal(t, t); str(t)", t=t, torch=torch)
        assert counter.total == 0


def _object_collectives(rank, world_size):
    with HostSyncCounter(package_dir=HERE) as counter:
        out = [None] * world_size
        dist.all_gather_object(out, {"rank": rank})  # pickles through host tensors inside: once
        objs = [rank]
        dist.broadcast_object_list(objs, src=0)
        dist.barrier()
        t = torch.ones(2)
        dist.all_reduce(t)  # a device collective: no host sync
    return dict(counter.counts), out, objs


def test_object_collectives_and_barriers_are_counted_once():
    for counts, out, objs in run_world(2, _object_collectives, timeout=120):
        assert counts == {"dist.all_gather_object": 1, "dist.broadcast_object_list": 1, "dist.barrier": 1}
        assert out == [{"rank": 0}, {"rank": 1}] and objs == [0]
