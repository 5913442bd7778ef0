"""HDET on Megatron-Core's fully sharded data parallel paths.

**``--use-torch-fsdp2``** (``megatron.core.distributed.TorchFullyShardedDataParallel``):
supported. Megatron wraps the model with ``fully_shard`` over a 1-D mesh built from the whole
data-parallel group (``DeviceMesh.from_group(dp_group, "cuda")``): pure FSDP, where no rank holds
an arm's model copy. :func:`wrap_torch_fsdp2` passes the *arm's* DP ranks as the process group
instead, so every arm shards its own full copy over its ``DP/A`` ranks (HSDP with the arms as
the replicate dimension, the same layout as :mod:`hdet_megatron.fsdp` on a 2-D mesh).
:class:`TorchFSDPGradSync` provides the replicate-dimension reduction:

* ``grad_sync="global"``: an FSDP2 all-reduce hook (``FSDPModule.set_all_reduce_hook``, run
  right after each reduce-scatter) averages the reduce-scattered gradient across the arms
  (:attr:`ArmLayout.cross_arm_group`) - exactly what FSDP2's native HSDP all-reduce does;
* ``grad_sync="arm"``: no hook, so gradients are averaged inside the arm only and the converge
  is the only cross-arm traffic.

:class:`TorchFSDPHDET` is :class:`~hdet_megatron.megatron.runtime.HDET` for such chunks: converge
averages the local shards of the DTensor main params (the optimizer's parameters; FSDP2 keeps
them in fp32) across the cross-arm group.

On CPU (gloo) this needs the shim that turns the literal ``"cuda"`` of
``TorchFullyShardedDataParallel.__init__`` into ``"cpu"`` (``hdet_megatron.megatron.cpu``) and
``TransformerConfig.transformer_impl="local"`` with the local layer spec (otherwise Megatron also
wraps the ``ColumnParallelLinear`` inside already wrapped ``TransformerLayer`` s and
``fully_shard`` fails in ``DeviceMesh._concatenate`` with "TypeError: Invariant encountered:
value was None when it should not be").

**Megatron-FSDP** (``megatron_fsdp``, ``--use-megatron-fsdp``): not supported. It does not run
on CPU in megatron-core 0.19.2 (measured, gloo, torch 2.13): the adapter calls
``torch.cuda.current_device()`` unconditionally (``mcore_fsdp_adapter.py:156``, and
``megatron_fsdp.py:234`` even when ``device=cpu`` is passed): "AssertionError: Torch not
compiled with CUDA enabled". With ``torch.cuda.current_device/Stream/stream/synchronize`` faked,
its ``_init_dist_index`` builds every ``DeviceMesh`` with ``device_type="cuda"`` and
``DTensor.from_local`` moves the shards to CUDA (same assertion); with that forced to CPU too,
``uneven_dtensor.validate_uneven_dtensor`` calls ``.cuda()``. Its buffers
(``megatron_fsdp/param_and_grad_buffer.py``, ``utils.py``) contain about 100 further CUDA
spellings (streams, ``torch.cuda.synchronize``, memory pools, NCCL user buffers). A CPU port
would be global CUDA emulation, which the shims deliberately avoid; without a way to run it,
HDET for Megatron-FSDP is not built and :class:`TorchFSDPHDET` refuses its chunks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from hdet_megatron.fsdp import (
    PURE_FSDP_EXPLANATION,
    FSDP2Homer,
    FSDPSetupError,
    HSDPRequired,
    local_shards,
    reshard_all,
)
from hdet_megatron.megatron import cpu as _cpu  # noqa: F401  (shims before megatron.core)
from hdet_megatron.megatron.layout import ArmLayout, HDETSetupError
from hdet_megatron.megatron.runtime import HDET, main_params

from megatron.core.distributed.torch_fully_sharded_data_parallel import TorchFullyShardedDataParallel
from megatron.core.distributed.torch_fully_sharded_data_parallel_config import (
    TorchFullyShardedDataParallelConfig,
)

__all__ = [
    "MEGATRON_FSDP_UNSUPPORTED",
    "TorchFSDPGradSync",
    "TorchFSDPHDET",
    "wrap_torch_fsdp2",
]

MEGATRON_FSDP_UNSUPPORTED = (
    "HDET does not support Megatron-FSDP (megatron_fsdp / --use-megatron-fsdp) yet: it cannot "
    "run on CPU in megatron-core 0.19.2 (torch.cuda.current_device() in its constructor, "
    "DeviceMesh(device_type='cuda'), .cuda() calls and CUDA streams throughout), so it could not "
    "be built and tested here. Use --use-torch-fsdp2 with "
    "hdet_megatron.megatron.fsdp.wrap_torch_fsdp2 (arms = replicate dimension of HSDP)"
)


def _is_megatron_fsdp(chunk) -> bool:
    try:
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    except Exception:  # noqa: BLE001 - the adapter may fail to import; then it is not in use
        return False
    return isinstance(chunk, FullyShardedDataParallel)


def _check_local_layers(module, config) -> None:
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.transformer_layer import TransformerLayer

    if config.transformer_impl == "local":
        return
    for layer in module.modules():
        if isinstance(layer, TransformerLayer) and any(
            isinstance(m, ColumnParallelLinear) for m in layer.modules()
        ):
            raise FSDPSetupError(
                "TorchFullyShardedDataParallel with the local layer spec needs "
                "TransformerConfig.transformer_impl='local' (else it also wraps the "
                "ColumnParallelLinear inside each already wrapped TransformerLayer and "
                "fully_shard fails in DeviceMesh._concatenate)"
            )


def wrap_torch_fsdp2(
    module: torch.nn.Module,
    config,
    layout: ArmLayout,
    ddp_config: TorchFullyShardedDataParallelConfig | None = None,
    **kwargs,
) -> TorchFullyShardedDataParallel:
    """Megatron's ``TorchFullyShardedDataParallel`` sharding inside each HDET arm (HSDP).

    ``layout`` is the :class:`ArmLayout` also given to ``HDETOptimizerParamScheduler``; the
    model is sharded over ``layout.arm_group`` (the arm's ``DP/A`` ranks). The cross-arm
    gradient reduction is installed by :class:`TorchFSDPHDET` (``grad_sync="global"``), or by
    ``TorchFSDPGradSync(chunks, layout, "global").install()`` for plain HSDP without HDET.
    """
    if layout.arm_group is None:
        raise HDETSetupError("the ArmLayout has no arm group")
    _check_local_layers(module, config)
    chunk = TorchFullyShardedDataParallel(
        config,
        ddp_config if ddp_config is not None else TorchFullyShardedDataParallelConfig(),
        module,
        process_group=layout.arm_group,
        **kwargs,
    )
    return chunk


def _fsdp_modules(chunk) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in chunk.modules() if isinstance(m, FSDPModule)]


def _check_chunk(chunk, layout: ArmLayout) -> None:
    if _is_megatron_fsdp(chunk):
        raise HDETSetupError(MEGATRON_FSDP_UNSUPPORTED)
    if not isinstance(chunk, TorchFullyShardedDataParallel):
        raise HDETSetupError(
            "TorchFSDPHDET needs TorchFullyShardedDataParallel model chunks (wrap_torch_fsdp2); "
            f"got {type(chunk).__name__} (use HDET for Megatron DDP)"
        )
    ranks = tuple(dist.get_process_group_ranks(chunk.process_group))
    if ranks != tuple(layout.arm_ranks):
        if layout.num_arms > 1 and set(layout.arm_ranks) < set(ranks):
            raise HSDPRequired(
                f"the model is sharded over ranks {ranks} (Megatron's default: the whole DP "
                f"group, pure FSDP), HDET's arm {layout.arm} is ranks {tuple(layout.arm_ranks)}. "
                f"{PURE_FSDP_EXPLANATION.split('. Build')[0]}. Wrap the model with "
                "hdet_megatron.megatron.fsdp.wrap_torch_fsdp2(module, config, layout), which "
                "shards inside each arm"
            )
        raise HDETSetupError(
            f"the model is sharded over ranks {ranks}, HDET's arm {layout.arm} is ranks "
            f"{tuple(layout.arm_ranks)}; wrap with wrap_torch_fsdp2 using the same ArmLayout"
        )


class TorchFSDPGradSync:
    """Cross-arm gradient reduction for chunks from :func:`wrap_torch_fsdp2`.

    ``global``: every FSDP module gets an all-reduce hook that averages its reduce-scattered
    gradient over ``layout.cross_arm_group`` (HSDP). ``arm``: nothing is installed.
    """

    def __init__(self, model: Sequence[torch.nn.Module], layout: ArmLayout, mode: str) -> None:
        if mode not in ("global", "arm"):
            raise HDETSetupError(f"grad_sync={mode!r} must be 'global' or 'arm'")
        self.model = list(model) if isinstance(model, (list, tuple)) else [model]
        self.layout = layout
        self.mode = mode
        self._hooked: list = []

    @property
    def installed(self) -> bool:
        return bool(self._hooked)

    def _hook(self, reduce_output: torch.Tensor) -> None:
        group = self.layout.cross_arm_group
        if reduce_output.dtype in (torch.float32, torch.bfloat16):
            dist.all_reduce(reduce_output, op=dist.ReduceOp.AVG, group=group)
        else:  # fp16 and others: FSDP2 post-divides by the shard count afterwards
            dist.all_reduce(reduce_output, group=group)
            reduce_output.div_(self.layout.num_arms)

    def install(self) -> None:
        for chunk in self.model:
            _check_chunk(chunk, self.layout)
        if self.mode == "arm" or self.layout.num_arms == 1 or self.installed:
            return
        for chunk in self.model:
            for module in _fsdp_modules(chunk):
                module.set_all_reduce_hook(self._hook)
                self._hooked.append(module)

    def uninstall(self) -> None:
        for module in self._hooked:
            for group in module._get_fsdp_state()._fsdp_param_groups:
                group._all_reduce_hook = None
        self._hooked.clear()


class TorchFSDPHDET(HDET):
    """:class:`HDET` for ``TorchFullyShardedDataParallel`` chunks built by :func:`wrap_torch_fsdp2`.

    Same arguments and call order as :class:`HDET`. Converge averages this rank's local shards
    of the DTensor main params across the arms; ``grad_sync`` is :class:`TorchFSDPGradSync`.
    """

    def _converge_tensors(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        from torch.distributed.tensor import DTensor

        for chunk in self.model:
            _check_chunk(chunk, self.layout)
        arm_ranks = tuple(self.layout.arm_ranks)
        for i, p in enumerate(params):
            if not isinstance(p, DTensor):
                raise HDETSetupError(
                    f"main param {i} is a {type(p).__name__}, not an FSDP2 DTensor; build the "
                    "optimizer after wrap_torch_fsdp2 (mixed-precision main-param copies of FSDP2 "
                    "params are not supported)"
                )
            mesh_ranks = tuple(p.device_mesh.mesh.flatten().tolist())
            if mesh_ranks != arm_ranks:
                raise HSDPRequired(
                    f"main param {i} is sharded over ranks {mesh_ranks}, not over this arm's "
                    f"ranks {arm_ranks}. {PURE_FSDP_EXPLANATION.split('. Build')[0]}"
                )
        return self._local_tensors(params)

    def _local_tensors(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's local shards, as FSDP2 holds them now."""
        return local_shards(params)

    def _averaged_tensors(self):
        """FSDP2's padded local shards of the main params, homed by :class:`FSDP2Homer`."""
        homer = FSDP2Homer(self.model, main_params(self.optimizer))
        return homer.tensors, homer

    def _make_grad_sync(self):
        return TorchFSDPGradSync(self.model, self.layout, self.config.grad_sync)

    def _refresh_model_params(self) -> None:
        """The main params are FSDP2's own sharded params: reshard every FSDP module, so that the
        next forward gathers the shards as they are now (after a line point, the restore, a
        converge or a rollback); see :func:`hdet_megatron.fsdp.reshard_all`."""
        super()._refresh_model_params()
        self._after_probe()

    def _after_probe(self) -> None:
        """A forward-only probe leaves modules that do not reshard after forward gathered."""
        reshard_all([m for chunk in self.model for m in _fsdp_modules(chunk)])
