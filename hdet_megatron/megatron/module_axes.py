"""Axes that live in the model, not the optimizer: dropout and attention temperature.

The values are written into the attributes the forward pass reads (not just the config):

* dropout: every ``torch.nn.Dropout`` module's ``p`` (``LanguageModelEmbedding.embedding_dropout``,
  the local ``DotProductAttention.attention_dropout``), and float dropout attributes read in
  forward: ``TransformerLayer.hidden_dropout`` (passed to the bias-dropout-add) and
  Transformer Engine's ``DotProductAttention.attention_dropout`` (a float there).
* attention temperature tau: ``softmax_scale`` of core attention (local ``DotProductAttention``
  passes it as ``alpha`` to ``baddbmm``; TE's ``DotProductAttention`` reads its own
  ``softmax_scale``); the arm uses ``softmax_scale = base / tau``.

``restore()`` puts every attribute back to the value it had when HDET was built.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hdet_megatron.config import Axis, HDETConfig
from hdet_megatron.megatron.layout import HDETSetupError
from hdet_megatron.spread import arm_axis_value

#: Largest dropout probability an arm may get (``Dropout(p=1)`` zeros everything).
MAX_DROPOUT = 0.99


@dataclass
class _Target:
    axis: str
    module: torch.nn.Module
    attr: str  # "p" of a Dropout, or a float attribute
    base: float

    def read(self) -> float:
        return float(getattr(self.module, self.attr))

    def write(self, value: float) -> None:
        setattr(self.module, self.attr, value)


def _find_targets(model: Sequence[torch.nn.Module], axes: set[str]) -> list[_Target]:
    targets: list[_Target] = []
    for chunk in model:
        for module in chunk.modules():
            if "dropout" in axes:
                if isinstance(module, torch.nn.Dropout):
                    targets.append(_Target("dropout", module, "p", float(module.p)))
                for attr in ("hidden_dropout", "attention_dropout"):
                    value = getattr(module, attr, None)
                    if isinstance(value, float) and not isinstance(module, torch.nn.Dropout):
                        targets.append(_Target("dropout", module, attr, value))
            if "attention_temperature" in axes and "DotProductAttention" in type(module).__name__:
                scale = getattr(module, "softmax_scale", None)
                if isinstance(scale, float):
                    targets.append(_Target("attention_temperature", module, "softmax_scale", scale))
    return targets


class ModuleAxes:
    """Applies this arm's dropout / attention-temperature values to the live modules."""

    def __init__(self, model: Sequence[torch.nn.Module], config: HDETConfig, arm: int) -> None:
        self.axes: dict[str, Axis] = {
            a.name: a for a in config.resolved_axes if a.name in ("dropout", "attention_temperature")
        }
        self.arm = arm
        self.targets = _find_targets(model, set(self.axes))
        for name, axis in self.axes.items():
            found = [t for t in self.targets if t.axis == name]
            if not found:
                raise HDETSetupError(
                    f"axis {name!r}: the model has no {name} modules to apply it to "
                    "(local or Transformer Engine spec expected)"
                )
            if name == "dropout":
                for base in sorted({t.base for t in found}):
                    lo = base - axis.spread
                    hi = base + axis.spread
                    if axis.min is not None:
                        lo = max(lo, axis.min)
                    if axis.max is not None:
                        hi = min(hi, axis.max)
                    if lo < 0 or hi >= 1:
                        raise HDETSetupError(
                            f"axis 'dropout': spread {axis.spread} around the configured dropout "
                            f"{base} leaves [0, 1) (arms would use {base - axis.spread:g} .. "
                            f"{base + axis.spread:g}); use a smaller spread or bounds, e.g. "
                            f"--hdet-axis dropout:{axis.spread}:0:0.5"
                        )

    def base_values(self) -> dict[str, float]:
        """Base value per axis (the controller's paper rule needs one number per axis)."""
        out: dict[str, float] = {}
        for t in self.targets:
            out.setdefault(t.axis, t.base if t.axis == "dropout" else 1.0)
        return out

    def values(self, scales: Mapping[str, float], spread: Mapping[str, Sequence[float]]) -> dict:
        """This arm's value of each module axis (dropout: per distinct base; tau: one)."""
        out: dict[str, Any] = {}
        for name, axis in self.axes.items():
            if name == "dropout":
                out[name] = {
                    t.base: self._dropout(axis, t.base, scales[name], spread[name][self.arm])
                    for t in self.targets
                    if t.axis == name
                }
            else:
                out[name] = arm_axis_value(axis, 1.0, scales[name], spread[name][self.arm])
        return out

    @staticmethod
    def _dropout(axis: Axis, base: float, shift: float, offset: float) -> float:
        return min(max(arm_axis_value(axis, base, shift, offset), 0.0), MAX_DROPOUT)

    def apply(self, scales: Mapping[str, float], spread: Mapping[str, Sequence[float]]) -> None:
        if not self.targets:
            return
        values = self.values(scales, spread)
        for t in self.targets:
            if t.axis == "dropout":
                t.write(values["dropout"][t.base])
            else:
                tau = values["attention_temperature"]
                if not tau > 0:
                    raise HDETSetupError(f"attention temperature {tau} <= 0; set Axis min > 0")
                t.write(t.base / tau)

    def restore(self) -> None:
        for t in self.targets:
            t.write(t.base)
