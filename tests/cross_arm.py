"""Shared by the HDET world tests: count the bytes that collectives move across arms."""

from __future__ import annotations

import torch
import torch.distributed as dist

#: torch.distributed collectives wrapped by default.
COLLECTIVES = (
    "all_reduce",
    "all_gather_single",
    "reduce_scatter_single",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
)


class CrossArmBytes:
    """Counts calls and bytes of collectives whose group spans more than one arm.

    A call's bytes are those of its largest tensor argument (the full-size side of a gather
    or a reduce-scatter). ``extra`` names more ``(module, attribute)`` entry points to wrap,
    e.g. megatron's ``param_and_grad_buffer.dist_reduce_scatter_func`` alias.
    """

    def __init__(self, arm_of_rank: dict[int, int], extra: tuple = ()):
        self.arm_of_rank = arm_of_rank
        self.targets = [(dist, name) for name in COLLECTIVES] + list(extra)
        self.bytes = 0
        self.calls = 0
        self._saved: list = []

    def _spans_arms(self, group) -> bool:
        ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
        return len({self.arm_of_rank[r] for r in ranks}) > 1

    def __enter__(self):
        for module, name in self.targets:
            original = getattr(module, name, None)
            if original is None:
                continue

            def wrapped(*args, _original=original, **kwargs):
                if self._spans_arms(kwargs.get("group")):
                    tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
                    self.bytes += max((t.numel() * t.element_size() for t in tensors), default=0)
                    self.calls += 1
                return _original(*args, **kwargs)

            self._saved.append((module, name, original))
            setattr(module, name, wrapped)
        return self

    def __exit__(self, *exc):
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()
