"""hdet-megatron: Hyperparameter-Divergent Ensemble Training for Megatron-Core and PyTorch.

The names users type::

    from hdet_megatron import HDETConfig, Axis, AutoController, BucketedAverager, HDETOneCycleLR, BatchProbe

Importing the package loads none of them: each is imported on first use (``HDETConfig``,
``Axis`` and ``AutoController`` without torch; the averager and the scheduler with torch), and
megatron.core is never imported from here. The Megatron names (``HDET``,
``HDETOptimizerParamScheduler``, ``ArmLayout``) live in :mod:`hdet_megatron.megatron`, FSDP2
checkpoints in :mod:`hdet_megatron.fsdp`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: Public name -> the module that defines it.
_EXPORTS = {
    "HDETConfig": "hdet_megatron.config",
    "Axis": "hdet_megatron.config",
    "HDETConfigError": "hdet_megatron.config",
    "AutoController": "hdet_megatron.controller",
    "ControllerUpdate": "hdet_megatron.controller",
    "AllArmsNonFinite": "hdet_megatron.controller",
    "NonFiniteArm": "hdet_megatron.controller",
    "arm_spread": "hdet_megatron.spread",
    "BucketedAverager": "hdet_megatron.averaging",
    "AverageStats": "hdet_megatron.averaging",
    "HDETOneCycleLR": "hdet_megatron.torch_scheduler",
    "MissingLoss": "hdet_megatron.torch_scheduler",
    "BatchProbe": "hdet_megatron.probe",
    "ProbeBatchMismatch": "hdet_megatron.window",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    # ``X as X``: an explicit re-export (PEP 484), so linters and mypy see the names as public.
    from hdet_megatron.averaging import AverageStats as AverageStats
    from hdet_megatron.averaging import BucketedAverager as BucketedAverager
    from hdet_megatron.config import Axis as Axis
    from hdet_megatron.config import HDETConfig as HDETConfig
    from hdet_megatron.config import HDETConfigError as HDETConfigError
    from hdet_megatron.controller import AllArmsNonFinite as AllArmsNonFinite
    from hdet_megatron.controller import AutoController as AutoController
    from hdet_megatron.controller import ControllerUpdate as ControllerUpdate
    from hdet_megatron.controller import NonFiniteArm as NonFiniteArm
    from hdet_megatron.probe import BatchProbe as BatchProbe
    from hdet_megatron.spread import arm_spread as arm_spread
    from hdet_megatron.torch_scheduler import HDETOneCycleLR as HDETOneCycleLR
    from hdet_megatron.torch_scheduler import MissingLoss as MissingLoss
    from hdet_megatron.window import ProbeBatchMismatch as ProbeBatchMismatch


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hdet_megatron' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
