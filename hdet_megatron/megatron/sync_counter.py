"""Count host-device synchronisations made *from hdet_megatron code* (for tests and benchmarks).

On a GPU, ``Tensor.item()``, ``.cpu()``, ``.tolist()``, ``float(tensor)``/``bool(tensor)``
and ``torch.cuda.synchronize()`` block the host until the device catches up. HDET promises none
on non-converge steps. :class:`HostSyncCounter` wraps those entry points and counts the calls
whose immediate Python caller is a file inside the ``hdet_megatron`` package (megatron's own
syncs are not ours to count).
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import torch

import hdet_megatron

_PACKAGE_DIR = os.path.dirname(os.path.abspath(hdet_megatron.__file__))
_TENSOR_METHODS = ("item", "cpu", "tolist", "__float__", "__bool__", "__int__")


class HostSyncCounter:
    """Context manager; ``counts`` maps ``"Tensor.item"`` etc. to calls made from hdet_megatron."""

    def __init__(self, package_dir: str = _PACKAGE_DIR, exclude: tuple[str, ...] = ("sync_counter.py",)):
        self.package_dir = package_dir
        self.exclude = exclude
        self.counts: Counter = Counter()
        self._saved: list = []

    def _from_package(self) -> bool:
        frame = sys._getframe(2)  # caller of the wrapped function
        path = frame.f_code.co_filename
        return path.startswith(self.package_dir) and not path.endswith(self.exclude)

    def _wrap(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            if self._from_package():
                self.counts[label] += 1
            return original(*args, **kwargs)

        self._saved.append((owner, name, original))
        setattr(owner, name, wrapped)

    def __enter__(self) -> HostSyncCounter:
        for name in _TENSOR_METHODS:
            self._wrap(torch.Tensor, name, f"Tensor.{name}")
        self._wrap(torch.cuda, "synchronize", "cuda.synchronize")
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def reset(self) -> None:
        self.counts.clear()
