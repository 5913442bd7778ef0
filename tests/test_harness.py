"""The multi-rank harness reports failures with tracebacks and kills hung worlds."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from tests.harness import WorldFailed, run_world


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank, dist.get_rank(), float(t)  # the rank it was given and the one gloo assigned


def _rank1_raises(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank one")
    dist.barrier()  # rank 0 would wait here forever without the harness' timeout


def _rank0_hangs(rank, world_size):
    if rank == 0:
        dist.recv(torch.zeros(1), src=1)  # rank 1 never sends
    else:
        threading.Event().wait()  # stays alive (a closed peer would turn the hang into an error)


def test_results_in_rank_order():
    assert run_world(3, _sum_ranks) == [(0, 0, 3.0), (1, 1, 3.0), (2, 2, 3.0)]


def test_failure_reports_traceback_and_rank():
    with pytest.raises(WorldFailed) as info:
        run_world(2, _rank1_raises, timeout=60)
    message = str(info.value)
    assert "rank 1" in message and "boom on rank one" in message and "Traceback" in message


def test_hang_is_killed_at_timeout():
    with pytest.raises(WorldFailed, match=r"ranks \[0, 1\] did not finish within 5s"):
        run_world(2, _rank0_hangs, timeout=5)
