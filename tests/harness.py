"""Run a function on N local gloo ranks, with tracebacks and a hard timeout.

How ranks start (:func:`start_method`):

* Without CUDA (the CPU suite): forked from a *forkserver* that has already imported torch,
  megatron.core and the CPU shims, so each world costs a fork instead of a ~5 s megatron import
  per process. The forkserver itself never runs torch ops, which keeps forking safe on CPU.
* Where CUDA is available: *spawned* (fresh interpreters, each paying the import). A forked
  child can never initialise CUDA once its parent has touched it, and the preload does touch
  it: ``apply_cpu_shims`` asks ``torch.cuda.is_available()``, which (without
  ``PYTORCH_NVML_BASED_CUDA_CHECK=1``) calls ``cudaGetDeviceCount`` and marks every later fork as
  bad; in the rank, Megatron's ``model_parallel_cuda_manual_seed`` (``torch.cuda.get_rng_state``)
  and ``torch.optim.Adam.step`` (``torch.cuda.graphs.is_current_stream_capturing``) then fail
  with "Cannot re-initialize CUDA in forked subprocess" / "CUDA error: initialization error".

``HDET_TEST_START_METHOD=spawn`` (or ``forkserver``) overrides the choice.

Usage::

    results = run_world(4, my_fn, arg1, timeout=120)   # my_fn(rank, world_size, arg1)

``my_fn`` must be a module-level function (it is pickled by reference). Its return values (one
per rank) come back in rank order. A rank that raises makes ``run_world`` raise
:class:`WorldFailed` with every failing rank's traceback; a world that runs past ``timeout`` is
killed (all ranks) and reported with the ranks that had not finished.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

PRELOAD = ["torch", "hdet_megatron.megatron.preload"]
START_METHODS = ("forkserver", "spawn")
START_METHOD_ENV = "HDET_TEST_START_METHOD"

_CONTEXTS: dict[str, Any] = {}


class WorldFailed(AssertionError):
    """One or more ranks failed or the world timed out."""


def start_method() -> str:
    """``spawn`` where CUDA is available (ranks must be able to initialise it), else
    ``forkserver`` (fast); ``$HDET_TEST_START_METHOD`` overrides."""
    forced = os.environ.get(START_METHOD_ENV)
    if forced:
        if forced not in START_METHODS:
            raise ValueError(f"{START_METHOD_ENV}={forced!r}: use one of {', '.join(START_METHODS)}")
        return forced
    import torch

    return "spawn" if torch.cuda.is_available() else "forkserver"


def _context():
    method = start_method()
    if method not in _CONTEXTS:
        ctx = mp.get_context(method)
        if method == "forkserver":
            ctx.set_forkserver_preload(PRELOAD)
        _CONTEXTS[method] = ctx
    return _CONTEXTS[method]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank, world_size, init_file, fn, args, kwargs, results, threads):
    import torch
    import torch.distributed as dist

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
    )
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args, **kwargs)
        # Plain pickle: multiprocessing's pickler would pass tensors by file descriptor, which
        # breaks once this rank has exited.
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - report everything, including SystemExit
        results.put((rank, False, traceback.format_exc()))
    finally:
        # Skip destroy_process_group: a peer may already be gone after a failure, and the
        # process exits right after anyway.
        pass


def run_world(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 240.0,
    threads: int = 1,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks, started as
    :func:`start_method` says."""
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="hdet-world-") as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(rank, world_size, init_file, fn, args, kwargs, results, threads),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        outcomes: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(outcomes) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    rank, ok, payload = results.get(timeout=min(remaining, 1.0))
                    outcomes[rank] = (ok, payload)
                    if not ok:
                        # Give peers a moment to report their own errors, then stop waiting:
                        # the survivors are probably blocked in a collective with the dead rank.
                        deadline = min(deadline, time.monotonic() + 10.0)
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in outcomes]
                    if dead and results.empty():
                        for r in dead:
                            outcomes[r] = (False, f"rank {r} died (exit code {procs[r].exitcode})")
                        deadline = min(deadline, time.monotonic() + 10.0)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
            for proc in procs:
                proc.join(timeout=10)
    failures = {r: p for r, (ok, p) in outcomes.items() if not ok}
    missing = [r for r in range(world_size) if r not in outcomes]
    if failures or missing:
        parts = [f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items())]
        if missing:
            parts.append(f"ranks {missing} did not finish within {timeout:.0f}s (killed)")
        raise WorldFailed(f"{fn.__name__} failed on {world_size} ranks:\n" + "\n".join(parts))
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]
