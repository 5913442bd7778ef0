"""Run metrics: one JSON object per line in ``RUN_DIR/metrics.jsonl`` (+ TensorBoard if installed).

Pure module (no torch.distributed, no megatron); only the writing rank creates a writer.

Record types (field ``"type"``), as written by ``examples/pretrain_gpt/pretrain_gpt.py`` and read
by :mod:`hdet_megatron.report`:

* ``run``: once per launch: arguments, topology (tp/pp/dp/world), arms, HDET config (or null),
  parameter count, tokens per iteration, ``resumed_from`` iteration.
* ``step``: one per iteration: ``loss`` (mean over DP replicas), ``arm_losses`` (per arm, before
  any DP reduction), ``base_lr`` (the schedule), ``lr`` (base x controller scale, the centre of
  the arms), ``arm_lrs``, ``scale``, ``window``, ``tokens_per_s``, ``elapsed_s``.
* ``window``: one per converge: ``arm_losses`` (what the controller compared: window training
  loss means, or with ``signal`` "probe" each arm's loss on the shared probe batch),
  ``arm_train_losses`` (window training loss means), ``arm_values`` (per axis, the
  spread each arm used), ``arm_lrs``, ``scales`` (after the update), ``update`` (the controller
  update), ``converge_seconds``, ``converge_bytes`` (this rank's converge all-reduce payload),
  ``converge_bytes_per_step`` (the same over the window's steps), ``grad_bytes_per_step`` (this
  rank's data-parallel gradient-sync payload per step, Megatron DDP's grad buffers), ``forced``.
* ``valid`` / ``test``: ``loss``, ``ppl``, ``arm_losses`` (each arm's current model),
  ``converged`` (all replicas equal: the averaged model).
* ``checkpoint``: ``path``, ``seconds``; ``final``: wall time and last losses.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

METRICS_FILE = "metrics.jsonl"


def _clean(value: Any) -> Any:
    """JSON-safe: non-finite floats become the strings "nan"/"inf"/"-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def tensorboard_available() -> bool:
    """Whether tensorboard and torch's SummaryWriter import (the optional TensorBoard output)."""
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except Exception:
        return False
    return True


class MetricsWriter:
    """Appends records to ``RUN_DIR/metrics.jsonl``; mirrors scalars to TensorBoard.

    ``tensorboard_dir``: a directory, ``None`` (``RUN_DIR/tensorboard`` when ``tensorboard``
    is installed) or ``False`` (off).
    """

    def __init__(self, run_dir: str, tensorboard_dir: Any = None) -> None:
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, METRICS_FILE)
        self._fh = open(self.path, "a", buffering=1)
        self.tb = None
        self.tensorboard_dir = None
        if tensorboard_dir is not False and tensorboard_available():
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard_dir = tensorboard_dir or os.path.join(run_dir, "tensorboard")
            self.tb = SummaryWriter(self.tensorboard_dir)

    def write(self, record: dict[str, Any]) -> None:
        record = {"type": record.get("type", "event"), "time": round(time.time(), 3), **record}
        self._fh.write(json.dumps(_clean(record)) + "\n")
        if self.tb is not None:
            self._to_tensorboard(record)

    def _to_tensorboard(self, r: dict[str, Any]) -> None:
        it = r.get("iteration")
        if it is None:
            return
        kind = r["type"]
        tb = self.tb
        assert tb is not None  # write() calls this only with a writer

        def put(tag: str, value: Any) -> None:
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                tb.add_scalar(tag, value, it)

        if kind == "step":
            put("train/loss", r.get("loss"))
            put("lr/base", r.get("base_lr"))
            put("lr/lr", r.get("lr"))
            put("throughput/tokens_per_s", r.get("tokens_per_s"))
            for a, v in enumerate(r.get("arm_losses") or []):
                put(f"train/arm{a}_loss", v)
            for a, v in enumerate(r.get("arm_lrs") or []):
                put(f"lr/arm{a}", v)
        elif kind == "window":
            for a, v in enumerate(r.get("arm_losses") or []):
                put(f"window/arm{a}_loss", v)
            for name, v in (r.get("scales") or {}).items():
                put(f"hdet/scale_{name}", v)
            put("hdet/converge_seconds", r.get("converge_seconds"))
            put("hdet/converge_bytes", r.get("converge_bytes"))
            put("hdet/converge_bytes_per_step", r.get("converge_bytes_per_step"))
            put("hdet/grad_bytes_per_step", r.get("grad_bytes_per_step"))
        elif kind in ("valid", "test"):
            put(f"{kind}/loss", r.get("loss"))
            put(f"{kind}/ppl", r.get("ppl"))

    def close(self) -> None:
        self._fh.close()
        if self.tb is not None:
            self.tb.close()


def read_metrics(run_dir_or_file: str) -> list[dict[str, Any]]:
    """All records of a run (``RUN_DIR`` or the ``metrics.jsonl`` path), in file order."""
    path = run_dir_or_file
    if os.path.isdir(path):
        path = os.path.join(path, METRICS_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no {METRICS_FILE} in {run_dir_or_file}")
    records = []
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                # A run killed mid-write leaves at most a partial last line.
                continue
    return records


def as_float(value: Any) -> float | None:
    """A record value as float (``"nan"``/``"inf"`` strings included), or None."""
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
