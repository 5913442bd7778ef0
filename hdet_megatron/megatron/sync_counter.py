"""Count host-device synchronisations made *from hdet_megatron code* (for tests and benchmarks).

On a GPU these block the host until the device catches up; HDET promises none on non-converge
steps. :class:`HostSyncCounter` wraps their Python entry points while it is active:

* tensor methods that hand a value to the host: ``.item()``, ``.tolist()``, ``.numpy()``,
  ``.cpu()``, ``.to(...)`` of a device tensor to the CPU or to a target spelled ``"cpu"``
  (``.to(other.device)`` of a CPU tensor is no copy), ``float()``/``int()``/``bool()``/
  ``complex()``/``operator.index`` of a tensor, ``numpy.asarray(tensor)`` (``__array__``), and
  ``.nonzero()`` (its size is data);
* functions that return host values or data-dependent shapes: ``torch.equal``,
  ``torch.allclose``, ``torch.is_nonzero``, ``torch.nonzero``, ``torch.masked_select``,
  ``torch.unique``;
* ``torch.distributed``'s object collectives (``all_gather_object``, ``gather_object``,
  ``broadcast_object_list``, ``scatter_object_list``, ``send_object_list``,
  ``recv_object_list``: pickled through host memory) and barriers;
* ``torch.cuda.synchronize`` and the streams' and events' ``synchronize``.

A call counts when the nearest calling frame outside torch is a file of the ``hdet_megatron``
package (so a sync inside a torch helper that our code called is ours, a sync in megatron's own
code is not), and only the outermost wrapped call counts (``all_gather_object`` calls ``.item``
inside: one sync, counted once). Entry points not listed here (boolean-mask indexing, C++
extensions) are not seen; on a GPU, ``torch.cuda.set_sync_debug_mode("warn")`` sees every sync.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import Counter
from types import FrameType

import torch
import torch.distributed as dist

import hdet_megatron

_PACKAGE_DIR = os.path.dirname(os.path.abspath(hdet_megatron.__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_THIS_FILE = os.path.abspath(__file__)
_TENSOR_METHODS = (
    "item",
    "cpu",
    "tolist",
    "numpy",
    "nonzero",
    "__float__",
    "__bool__",
    "__int__",
    "__index__",
    "__complex__",
    "__array__",
)
_TORCH_FUNCTIONS = ("equal", "allclose", "is_nonzero", "nonzero", "masked_select", "unique")
_DIST_FUNCTIONS = (
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
    "barrier",
    "monitored_barrier",
)


def _to_host(args, kwargs) -> bool:
    """Whether ``tensor.to(*rest, **kwargs)`` (``args = (tensor, *rest)``) copies to the host: a
    device tensor to a CPU target, or a target spelled ``"cpu"`` (a copy to the host wherever the
    tensor lives on a GPU machine). ``.to(other.device)`` of a CPU tensor is not one."""
    tensor, rest = args[0], args[1:]
    for target in [kwargs.get("device"), *rest[:1]]:
        if isinstance(target, torch.Tensor):
            target = target.device
        if isinstance(target, str):
            try:
                return torch.device(target).type == "cpu"
            except RuntimeError:
                return False
        if isinstance(target, torch.device):
            return target.type == "cpu" and tensor.device.type != "cpu"
    return False


class HostSyncCounter:
    """Context manager; ``counts`` maps ``"Tensor.item"``, ``"torch.equal"``,
    ``"dist.all_gather_object"`` ... to the calls made from hdet_megatron."""

    def __init__(self, package_dir: str = _PACKAGE_DIR, exclude: tuple[str, ...] = (_THIS_FILE,)):
        self.package_dir = package_dir
        self.exclude = exclude
        self.counts: Counter = Counter()
        self._saved: list = []
        self._local = threading.local()

    def _from_package(self) -> bool:
        frame: FrameType | None = sys._getframe(2)  # the caller of the wrapped function
        while frame is not None and frame.f_code.co_filename.startswith(_TORCH_DIR):
            frame = frame.f_back  # a torch helper: whoever called it decides
        if frame is None:
            return False
        path = frame.f_code.co_filename
        return path.startswith(self.package_dir) and not path.endswith(self.exclude)

    def _wrap(self, owner, name: str, label: str, when=None) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return
        local = self._local

        def wrapped(*args, **kwargs):
            depth = getattr(local, "depth", 0)
            if depth == 0 and (when is None or when(args, kwargs)) and self._from_package():
                self.counts[label] += 1
            local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                local.depth = depth

        self._saved.append((owner, name, original))
        setattr(owner, name, wrapped)

    def __enter__(self) -> HostSyncCounter:
        for name in _TENSOR_METHODS:
            self._wrap(torch.Tensor, name, f"Tensor.{name}")
        self._wrap(torch.Tensor, "to", "Tensor.to(cpu)", when=_to_host)
        for name in _TORCH_FUNCTIONS:
            self._wrap(torch, name, f"torch.{name}")
        for name in _DIST_FUNCTIONS:
            self._wrap(dist, name, f"dist.{name}")
        self._wrap(torch.cuda, "synchronize", "cuda.synchronize")
        self._wrap(torch.cuda.Stream, "synchronize", "cuda.Stream.synchronize")
        self._wrap(torch.cuda.Event, "synchronize", "cuda.Event.synchronize")
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
