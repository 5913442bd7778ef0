"""Where Megatron DDP reduces gradients under HDET's two ``grad_sync`` modes.

``global`` (the paper): Megatron's data-parallel gradient reduction is left untouched; all arms
apply the same averaged gradient with their own step sizes.

``arm``: gradients are reduced only among the replicas of one arm, so arms learn from their own
data during fan-out and the only traffic between arms is the converge. Megatron DDP reduces each
bucket group in ``_ParamAndGradBucketGroup.start_grad_sync``
(``megatron/core/distributed/param_and_grad_buffer.py``) over

* ``data_parallel_group`` without the distributed optimizer (an all-reduce), or
* ``intra_distributed_optimizer_instance_group`` (a reduce-scatter) and, when
  ``ddp_config.num_distributed_optimizer_instances > 1``, an all-reduce over
  ``inter_distributed_optimizer_instance_group``,

after scaling each bucket's grads by ``bucket.gradient_scaling_factor`` (1/DP unless
``average_in_collective``). In ``arm`` mode we point the first at the arm's group, drop the
inter-instance all-reduce (each instance *is* an arm, see ``ArmLayout.check_distributed_optimizer``)
and rescale to 1/(ranks of the arm). MoE expert params live in DDP's
``expert_parallel_bucket_groups``, reduced over the expert-data-parallel group: in ``arm`` mode
over its ranks inside the arm (``ArmLayout.expert_arm_group``), with the same rescaling. Dense
grads reduce over the arm's DP x CP ranks (``ArmLayout.grad_arm_group``). ``uninstall`` restores
every attribute.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hdet_megatron.megatron.layout import ArmLayout, HDETSetupError


class ArmGradSync:
    """Installs (and removes) HDET's gradient-synchronisation mode on Megatron DDP chunks."""

    def __init__(self, model: list, layout: ArmLayout, mode: str, distributed_optimizer: bool):
        if mode not in ("global", "arm"):
            raise HDETSetupError(f"grad_sync={mode!r} must be 'global' or 'arm'")
        self.model = model
        self.layout = layout
        self.mode = mode
        self.distributed_optimizer = distributed_optimizer
        self._saved: list[tuple[Any, str, Any]] = []

    @property
    def installed(self) -> bool:
        return bool(self._saved)

    def _set(self, obj: Any, attr: str, value: Any) -> None:
        self._saved.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, value)

    def install(self) -> None:
        if self.mode == "global" or self.installed:
            return
        layout = self.layout
        # Megatron scales every bucket by 1/|DP x CP| (dense and expert alike, unless
        # average_in_collective): the sum over the whole group is the mean gradient. Inside an
        # arm the sum covers the arm's DP x CP ranks (expert grads: the arm's expert-DP ranks,
        # whose experts already saw the tokens of the arm's EP peers), so the mean is 1/|arm|.
        expected = 1.0 / (len(layout.grad_arm_ranks) * layout.num_arms)
        arm_scale = 1.0 / len(layout.grad_arm_ranks)
        for chunk in self.model:
            bucket_groups = getattr(chunk, "bucket_groups", None)
            if bucket_groups is None:
                raise HDETSetupError(
                    "grad_sync='arm' needs Megatron DistributedDataParallel model chunks "
                    f"(got {type(chunk).__name__})"
                )
            expert_groups = getattr(chunk, "expert_parallel_bucket_groups", None) or []
            for groups, arm_group in (
                (bucket_groups, layout.grad_arm_group),
                (expert_groups, layout.expert_arm_group),
            ):
                for group in groups:
                    self._install_group(group, arm_group, expected, arm_scale)

    def _install_group(self, group, arm_group, expected: float, arm_scale: float) -> None:
        config = group.ddp_config
        if self.distributed_optimizer:
            if config.num_distributed_optimizer_instances > 1:
                # One instance per arm (dense and expert instance groups are checked against the
                # arm by ArmLayout.check_distributed_optimizer): keep the reduce-scatter inside
                # the instance, skip the all-reduce across instances (= across arms).
                self._set(
                    group, "ddp_config", dataclasses.replace(config, num_distributed_optimizer_instances=1)
                )
        else:
            self._set(group, "data_parallel_group", arm_group)
        if not config.average_in_collective:
            for bucket in group.buckets:
                if abs(bucket.gradient_scaling_factor - expected) > 1e-12 * expected:
                    raise HDETSetupError(
                        "grad_sync='arm': unexpected DDP gradient scaling factor "
                        f"{bucket.gradient_scaling_factor} (expected 1/(DP x CP) = {expected}); "
                        "per-token loss (calculate_per_token_loss) is not supported here"
                    )
                self._set(bucket, "gradient_scaling_factor", arm_scale)
        # average_in_collective: dense buckets are unscaled and averaged over the (arm) group;
        # expert buckets are pre-scaled by |expert DP| / |DP x CP|, which is the same ratio
        # inside one arm, and averaged over the arm's expert-DP ranks: nothing to change.

    def uninstall(self) -> None:
        for obj, attr, value in reversed(self._saved):
            setattr(obj, attr, value)
        self._saved.clear()
