"""The multi-rank harness reports failures with tracebacks and kills hung worlds."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch
import torch.distributed as dist

from tests import harness
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


def _how_started(rank, world_size, parent_pid):
    t = torch.tensor([1.0])
    dist.all_reduce(t)  # the world works
    return {
        "child_of_test_process": os.getppid() == parent_pid,
        "megatron_preloaded": "megatron.core" in sys.modules,
        # A fork of a process that had touched CUDA: torch would refuse to initialise it here.
        "bad_fork": torch.cuda._is_in_bad_fork(),
        "cuda_initialized": torch.cuda.is_initialized(),
        "sum": float(t),
    }


def test_start_method_spawns_where_cuda_is_available(monkeypatch):
    """With CUDA, ranks must be able to initialise it: spawn, never a fork of a process that
    asked for the device count (the forkserver's preload does, through apply_cpu_shims)."""
    monkeypatch.delenv(harness.START_METHOD_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert harness.start_method() == "spawn"
    assert harness._context().get_start_method() == "spawn"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert harness.start_method() == "forkserver"
    assert harness._context().get_start_method() == "forkserver"
    monkeypatch.setenv(harness.START_METHOD_ENV, "spawn")
    assert harness.start_method() == "spawn"
    monkeypatch.setenv(harness.START_METHOD_ENV, "fork")
    with pytest.raises(ValueError, match="HDET_TEST_START_METHOD='fork'"):
        harness.start_method()


def test_ranks_are_spawned_fresh_where_cuda_is_available(monkeypatch):
    """The spawn path for real (CUDA made to look available in this process only): each rank is
    a fresh child of the test process, not a fork of the preloaded forkserver, so nothing has
    touched CUDA in it."""
    monkeypatch.delenv(harness.START_METHOD_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ranks = run_world(2, _how_started, os.getpid(), timeout=120)
    for r in ranks:
        assert r == {
            "child_of_test_process": True,
            "megatron_preloaded": False,
            "bad_fork": False,
            "cuda_initialized": False,
            "sum": 2.0,
        }


def test_ranks_fork_from_the_preloaded_forkserver_without_cuda(monkeypatch):
    monkeypatch.delenv(harness.START_METHOD_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for r in run_world(2, _how_started, os.getpid(), timeout=120):
        assert not r["child_of_test_process"] and r["megatron_preloaded"] and r["sum"] == 2.0


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
