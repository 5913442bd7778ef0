"""torchrun entry of the patched-loop tests (tests/test_training_patch.py): runs
examples/pretrain_gpt/pretrain_gpt_hdet.py unchanged, with per-rank records of what HDET did.

Each rank writes ``$HDET_TEST_RECORD_DIR/rank<R>.json`` at exit:

* ``windows``: every window end (its metrics without the per-rank timings and byte counts);
* ``line_evals``: per line search, digests of the main params, the model params and the RNG
  states (torch's and Megatron's model-parallel tracker) before and after it;
* ``probe_calls``: per probe pass, the window and the digests of the batches it read (per data
  stream, in order);
* ``train_batches``: digests of the batches training took from the read-ahead iterator, by the
  (1-based) iteration that took them;
* ``params_at_end``: digest of this rank's model params at each window's end (before the
  probes and the converge), by iteration.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import json
import multiprocessing
import os
import runpy
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "pretrain_gpt" / "pretrain_gpt_hdet.py"
RECORD_DIR = Path(os.environ["HDET_TEST_RECORD_DIR"])

if not torch.cuda.is_available():  # as the example does, before any megatron import
    from hdet_megatron.megatron.cpu import apply_training_cpu_shims

    apply_training_cpu_shims()
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

from hdet_megatron.line_search import LineSearch  # noqa: E402
from hdet_megatron.megatron import training_hooks  # noqa: E402
from hdet_megatron.megatron.runtime import HDET  # noqa: E402
from hdet_megatron.megatron.training_probe import PeekableIterator, TrainingLoopProbe  # noqa: E402

RECORD: dict = {"windows": [], "line_evals": [], "probe_calls": [], "train_batches": {}, "params_at_end": {}}


def _digest_tensors(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _batch_digest(batch) -> str:
    return _digest_tensors([batch["tokens"]])


def _state_digests(search: LineSearch) -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    hdet = training_hooks.runtime()
    model_params = [p for chunk in hdet.model for p in chunk.parameters()]
    tracker = get_cuda_rng_tracker().get_states()
    return {
        "main": _digest_tensors(search.params()),
        "model": _digest_tensors(model_params),
        "rng": _digest_tensors([torch.get_rng_state()] + [tracker[k] for k in sorted(tracker)]),
    }


_evaluate = LineSearch.evaluate


def evaluate(self, *args, **kwargs):
    before = _state_digests(self)
    result = _evaluate(self, *args, **kwargs)
    RECORD["line_evals"].append({"before": before, "after": _state_digests(self)})
    return result


_call = TrainingLoopProbe.__call__


def probe_call(self):
    losses = _call(self)
    RECORD["probe_calls"].append(
        {"window": self._window, "batches": [[_batch_digest(b) for b in s] for s in self._batches]}
    )
    return losses


_next = PeekableIterator.__next__


def peekable_next(self):
    batch = _next(self)
    hdet = training_hooks.runtime()
    RECORD["train_batches"].setdefault(str(hdet.iteration + 1), []).append(_batch_digest(batch))
    return batch


_end_window = HDET._end_window


def end_window(self, forced):
    if "layout" not in RECORD:
        from megatron.core import parallel_state as ps

        RECORD["layout"] = {
            "arm": self.layout.arm,
            "dp_rank": self.layout.dp_rank,
            "tp_rank": ps.get_tensor_model_parallel_rank(),
            "pp_rank": ps.get_pipeline_model_parallel_rank(),
        }
    params = [p for chunk in self.model for p in chunk.parameters()]
    RECORD["params_at_end"][str(self.iteration)] = _digest_tensors(params)
    metrics = _end_window(self, forced)
    row = dataclasses.asdict(metrics)
    for key in ("converge_seconds", "probe_seconds", "converge_bytes", "grad_bytes_per_step"):
        row.pop(key)
    RECORD["windows"].append(row)
    return metrics


LineSearch.evaluate = evaluate
TrainingLoopProbe.__call__ = probe_call
PeekableIterator.__next__ = peekable_next
HDET._end_window = end_window


@atexit.register
def _write() -> None:
    RECORD_DIR.mkdir(parents=True, exist_ok=True)
    path = RECORD_DIR / f"rank{os.environ.get('RANK', '0')}.json"
    path.write_text(json.dumps(RECORD, default=repr))


sys.path.insert(0, str(EXAMPLE.parent))
sys.argv[0] = str(EXAMPLE)
try:
    runpy.run_path(str(EXAMPLE), run_name="__main__")
except SystemExit as exc:  # Megatron's --exit-interval path ends in sys.exit(0)
    if exc.code not in (None, 0):
        raise
# The run succeeded: write the records and leave without the interpreter's teardown, which
# costs about 4 s per launch of these tests: gloo closes Megatron's process groups one by one,
# and the data loader's worker processes, orphaned by an abrupt exit, would hold the output pipe
# until their watchdog (5 s) notices; they are stopped here instead. pretrain_gpt.py also
# leaves with os._exit(0). A failure (above) exits the normal way, and atexit still writes its
# records. The example's own clean exit is checked where it runs unchanged
# (tests/test_multinode.py launches it through pretrain_gpt_hdet.sh and asserts exit code 0 on
# every node).
_write()
for worker in multiprocessing.active_children():  # torch DataLoader workers (--num-workers)
    worker.terminate()
    worker.join()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
