"""Device-aware test suite.

* ``@pytest.mark.gpu`` marks a test that needs CUDA. Where ``torch.cuda.is_available()`` is
  False it is skipped with a reason saying so (CPU CI runs exactly what it ran before); on a GPU
  machine ``pytest -m gpu`` (or ``scripts/gpu_check.sh``) runs them. See docs/gpu.md.
* The ``device`` fixture is the device a device-agnostic test should use: the current CUDA
  device when there is one, else the CPU.
"""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()
SKIP_REASON = (
    "needs a CUDA device (gpu marker): torch.cuda.is_available() is False here; "
    "run scripts/gpu_check.sh or `pytest -m gpu` on a GPU machine"
)


def pytest_collection_modifyitems(config, items):
    if CUDA:
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def pick_device() -> torch.device:
    """CUDA (the current device) when available, else CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if CUDA else torch.device("cpu")


@pytest.fixture
def device() -> torch.device:
    return pick_device()
