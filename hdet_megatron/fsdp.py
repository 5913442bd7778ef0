"""HDET for PyTorch FSDP2 (``fully_shard``) models: the arms are the replicate dim of an HSDP mesh.

With fully sharded data parallelism no rank holds a whole model copy, so an arm cannot be "one
DP rank". HDET therefore needs *hybrid* sharding (HSDP): a 2-D mesh
``init_device_mesh(device, (R, S), mesh_dim_names=("replicate", "shard"))`` where each of the
``R`` replicas shards its own full copy over ``S`` ranks. The arms are the replicate dimension
(``A = R`` by default; ``A`` may be any divisor of ``R``, replica ``r`` then belongs to arm
``r // (R/A)``). Every shard rank of one arm uses the same hyperparameters; converge averages
each rank's *local shards* across the replicate group (ranks at the same shard position hold
the same slice of every parameter), so the converge traffic is ``1/S`` of a model per rank.

Gradient synchronisation (``HDETConfig.grad_sync``):

* ``"global"`` (the paper): FSDP2's own HSDP reduction is kept: reduce-scatter inside the shard
  group, then all-reduce across the replicate group, so all arms apply the same averaged
  gradient with their own learning rates.
* ``"arm"``: the replicate-dimension all-reduce is switched off for the run (every step is a
  fan-out step; arms meet only at converge), so each arm trains on its own gradients and the
  only cross-arm traffic is the converge. Measured on torch 2.13: FSDP2's public
  ``set_requires_all_reduce(False)`` cannot be used for this: it is meant for gradient
  accumulation and keeps the reduce-scattered gradient in an internal accumulator
  (``FSDPParamGroup._partial_reduce_output``) without writing ``param.grad`` (``.grad`` stays
  ``None``). :class:`FSDP2GradSync` instead gives each FSDP parameter group a shard-only mesh
  view (``FSDPMeshInfo``; with several replicas per arm, an HSDP view whose replicate group is
  the arm's replicas), so FSDP2 reduce-scatters (and averages) inside the arm and writes the
  gradients as usual. ``close()`` restores FSDP2's own mesh info.

Entry points:

* :class:`~hdet_megatron.torch_scheduler.HDETOneCycleLR` accepts an FSDP2 model and a
  ``device_mesh`` (inferred from the parameters' DTensors when omitted) and uses
  :class:`FSDPRuntime` for it. A 1-D (pure FSDP) mesh raises :class:`HSDPRequired`.
* :func:`save_checkpoint` / :func:`load_checkpoint`: ``torch.distributed.checkpoint`` (DCP)
  with converge-on-save, the controller and scheduler state, and exact resume on CPU.

Torch only: nothing here imports megatron (see :mod:`hdet_megatron.megatron.fsdp` for
Megatron-Core's ``TorchFullyShardedDataParallel``).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hdet_megatron.averaging import BucketedAverager, Homer
from hdet_megatron.config import HDETConfig
from hdet_megatron.torch_runtime import _Runtime

__all__ = [
    "FSDP2GradSync",
    "FSDP2Homer",
    "FSDPRuntime",
    "FSDPSetupError",
    "HSDPArms",
    "HSDPRequired",
    "PURE_FSDP_EXPLANATION",
    "is_fsdp2_setup",
    "load_checkpoint",
    "local_shards",
    "reshard_all",
    "save_checkpoint",
]

PURE_FSDP_EXPLANATION = (
    "HDET needs hybrid sharding (HSDP) under FSDP: with pure FSDP (a 1-D mesh) every rank holds "
    "only a 1/N slice of each parameter and no group of ranks owns a whole model copy that could "
    "train under its own hyperparameters, so there is nothing to spread and nothing to average. "
    "Build a 2-D mesh whose dim 0 replicates and dim 1 shards, e.g. "
    "init_device_mesh(device, (R, S), mesh_dim_names=('replicate', 'shard')) with R >= 2 arms "
    "each sharding its own copy over S ranks, pass it to fully_shard(..., mesh=mesh) and to "
    "HDETOneCycleLR(..., device_mesh=mesh)"
)


class FSDPSetupError(ValueError):
    """An FSDP2 + HDET setup that cannot work (mesh, placements, arms, model)."""


class HSDPRequired(FSDPSetupError):
    """A pure-FSDP (1-D) mesh: HDET's arms need the replicate dimension of an HSDP mesh."""


def _dtensor_cls():
    from torch.distributed.tensor import DTensor

    return DTensor


def is_fsdp2_setup(optimizer=None, model=None) -> bool:
    """Whether the optimizer's (or the model's) parameters are DTensors (FSDP2 / ``fully_shard``)."""
    try:
        DTensor = _dtensor_cls()
    except ImportError:  # a torch build without torch.distributed
        return False
    tensors: list = []
    if optimizer is not None:
        tensors += [p for g in optimizer.param_groups for p in g["params"]]
    if model is not None:
        tensors += list(model.parameters())
    return any(isinstance(t, DTensor) for t in tensors)


def _find_mesh(tensors: Iterable[torch.Tensor]):
    DTensor = _dtensor_cls()
    for t in tensors:
        if isinstance(t, DTensor):
            return t.device_mesh
    return None


# --------------------------------------------------------------------------------------------
# The arms of an HSDP mesh
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HSDPArms:
    """This rank's place among HDET's arms on a 2-D HSDP mesh (dim 0 replicate, dim 1 shard)."""

    mesh: Any
    """The 2-D ``DeviceMesh`` (replicate, shard) the model was ``fully_shard``-ed over."""
    num_replicas: int
    """R: size of the replicate dimension (full model copies)."""
    num_shards: int
    """S: size of the shard dimension (ranks one copy is sharded over)."""
    replicate_rank: int
    """This rank's replica index in ``[0, R)``."""
    shard_rank: int
    """This rank's shard index in ``[0, S)``."""
    num_arms: int
    """A: number of arms (divides R)."""
    replicas_per_arm: int
    """R/A."""
    arm: int
    """This rank's arm: ``replicate_rank // (R/A)``."""
    replicate_group: Any
    """Ranks at this shard position in every replica (converge averages local shards over it)."""
    shard_group: Any
    """Ranks of this replica (FSDP's reduce-scatter / all-gather group)."""
    arm_replicate_group: Any = None
    """Replicas of this arm at this shard position (only with ``R/A > 1`` and ``grad_sync="arm"``)."""

    @classmethod
    def from_mesh(cls, mesh, arms: int | None = None, *, arm_groups: bool = False) -> HSDPArms:
        """Arms of ``mesh``. Collective over the default group when ``arm_groups`` and R/A > 1
        (it creates the intra-arm replicate groups)."""
        from torch.distributed.device_mesh import DeviceMesh

        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"device_mesh must be a torch DeviceMesh, got {type(mesh).__name__}")
        if mesh.ndim == 1:
            raise HSDPRequired(
                f"the device mesh {tuple(mesh.mesh.shape)} (dims {mesh.mesh_dim_names}) is 1-D "
                f"(pure FSDP). {PURE_FSDP_EXPLANATION}"
            )
        if mesh.ndim != 2:
            raise FSDPSetupError(
                f"HDET expects the 2-D data-parallel mesh (replicate, shard) that fully_shard got, "
                f"found a {mesh.ndim}-D mesh with dims {mesh.mesh_dim_names}; pass the DP submesh, "
                "e.g. world_mesh['replicate', 'shard']"
            )
        names = mesh.mesh_dim_names
        if names is not None and ("shard" in names[0] or "replicate" in names[1]):
            raise FSDPSetupError(
                f"mesh dims {names}: FSDP2's HSDP mesh replicates over dim 0 and shards over dim 1; "
                "build it as (replicate, shard)"
            )
        coord = mesh.get_coordinate()
        if coord is None:
            raise FSDPSetupError("this rank is not part of the device mesh given to HDET")
        num_replicas, num_shards = mesh.size(0), mesh.size(1)
        num_arms = num_replicas if arms is None else arms
        if num_arms < 1 or num_replicas % num_arms:
            raise FSDPSetupError(
                f"HDETConfig.arms={num_arms} must divide the replicate size R={num_replicas} of the "
                f"HSDP mesh (arms are model replicas, not shards); use one of "
                f"{[a for a in range(1, num_replicas + 1) if num_replicas % a == 0]} or arms=None"
            )
        per_arm = num_replicas // num_arms
        arm_group = None
        if arm_groups and per_arm > 1:
            me = dist.get_rank()
            ranks = mesh.mesh.tolist()
            for s in range(num_shards):
                for a in range(num_arms):
                    members = [ranks[r][s] for r in range(a * per_arm, (a + 1) * per_arm)]
                    group = dist.new_group(members)
                    if me in members:
                        arm_group = group
        return cls(
            mesh=mesh,
            num_replicas=num_replicas,
            num_shards=num_shards,
            replicate_rank=coord[0],
            shard_rank=coord[1],
            num_arms=num_arms,
            replicas_per_arm=per_arm,
            arm=coord[0] // per_arm,
            replicate_group=mesh.get_group(0),
            shard_group=mesh.get_group(1),
            arm_replicate_group=arm_group,
        )

    def shard_submesh(self):
        """1-D mesh of this replica's shard ranks (used for per-arm checkpoint entries)."""
        names = self.mesh.mesh_dim_names
        if names is not None:
            return self.mesh[names[1]]
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh.from_group(self.shard_group, self.mesh.device_type)


def _check_dtensor(t, arms: HSDPArms, what: str) -> None:
    from torch.distributed.tensor import Replicate

    if t.device_mesh != arms.mesh:
        if t.device_mesh.ndim == 1:
            raise HSDPRequired(f"{what} is sharded over a 1-D mesh (pure FSDP). {PURE_FSDP_EXPLANATION}")
        raise FSDPSetupError(
            f"{what} lives on mesh {t.device_mesh} but HDET was given {arms.mesh}; "
            "pass the mesh the model was fully_shard-ed over"
        )
    if not isinstance(t.placements[0], Replicate):
        raise FSDPSetupError(
            f"{what} has placements {t.placements}; HDET needs HSDP placements "
            "(Replicate() on the replicate dim 0, Shard on dim 1)"
        )


@torch.no_grad()
def local_shards(tensors: Iterable[torch.Tensor], arms: HSDPArms | None = None) -> list[torch.Tensor]:
    """This rank's local shard of every DTensor (a view sharing its storage; plain tensors are
    taken as they are), deduplicated. With ``arms``, DTensors are checked to be HSDP on its mesh."""
    DTensor = _dtensor_cls()
    out, seen = [], set()
    for i, t in enumerate(tensors):
        if id(t) in seen:
            continue
        seen.add(id(t))
        if isinstance(t, DTensor):
            if arms is not None:
                _check_dtensor(t, arms, f"parameter {i} (shape {tuple(t.shape)})")
            t = t.to_local()
        out.append(t)
    return out


class FSDP2Homer(Homer):
    """Averaged tensors and homing for FSDP2 sharded parameters (torch 2.13 ``FSDPParam``).

    FSDP2 keeps each sharded parameter in a padded 1-D tensor, ``FSDPParam._sharded_param_data``
    (what its all-gather reads, ``FSDPParam.all_gather_inputs``); the DTensor's local tensor
    ``sharded_param._local_tensor`` is a ``narrow`` view of it (padding: dim-0 shards of uneven
    size). A converge averages the padded tensor (the padding is zeros on every rank: FSDP
    creates it with ``new_zeros`` and nothing writes it), with or without homing, so the two
    paths all-reduce the same layout. Homing points both attributes at a view of the averager's
    flat buffer, as ``FSDPParam.reset_sharded_param`` does after ``load_state_dict(assign=True)``
    (a later ``reset_sharded_param`` sees the same storage and keeps it). A parameter not managed
    this way (CPU offload, tensor-subclass extensions, a plain tensor) is averaged as its local
    shard, on the copying path.
    """

    def __init__(self, models, dtensors) -> None:
        self._by_param = {}
        for model in models:
            if model is None:
                continue
            for group in _fsdp_param_groups(model):
                for fp in group.fsdp_params:
                    self._by_param[id(fp.sharded_param)] = fp
        self._by_data: dict[int, Any] = {}
        self._by_view: dict[int, Any] = {}  # id(view the averager keeps) -> its FSDPParam
        self.tensors: list[torch.Tensor] = []
        DTensor = _dtensor_cls()
        for t in dtensors:
            fp = self._by_param.get(id(t))
            data = getattr(fp, "_sharded_param_data", None) if fp is not None else None
            if (
                isinstance(t, DTensor)
                and type(data) is torch.Tensor
                and not getattr(fp, "offload_to_cpu", False)
                and t._local_tensor.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()
                and t._local_tensor.data_ptr() == data.data_ptr()
            ):
                self._by_data[id(data)] = fp
                self.tensors.append(data)
            else:
                self.tensors.append(t.to_local() if isinstance(t, DTensor) else t)

    def reason(self, tensor: torch.Tensor) -> str | None:
        if id(tensor) not in self._by_data:
            return "it is not the padded local shard of an FSDP2 parameter (FSDPParam)"
        if tensor.dtype not in (torch.float32, torch.float64):
            return f"its dtype {tensor.dtype} is averaged in a float32 bucket (the copy is the cast)"
        return None

    def install(self, tensor: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
        fp = self._by_data[id(tensor)]
        self._point(fp, view)
        self._by_view[id(view)] = fp
        return view

    @staticmethod
    def _point(fp, view: torch.Tensor) -> None:
        local = fp.sharded_param._local_tensor
        dim = fp.fsdp_placement.dim
        length = local.size(dim) if local.numel() > 0 else 0
        fp._sharded_param_data = view
        fp.sharded_param._local_tensor = view.view(fp.padded_sharded_param_size).narrow(dim, 0, length)

    def current(self, kept: torch.Tensor) -> torch.Tensor:
        """FSDP2's padded shard as it is now: ``FSDPParam.reset_sharded_param`` (run by
        ``module._apply``, e.g. ``.to()``, and after ``load_state_dict``) gives the parameter new
        padded storage when its local tensor no longer shares ours. The view the averager keeps
        cannot show that (it is always its own view), so compare FSDP's tensor with it."""
        fp = self._by_view.get(id(kept))
        return kept if fp is None else fp._sharded_param_data

    def rehome(self, kept: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
        self._point(self._by_view[id(kept)], view)
        return view


# --------------------------------------------------------------------------------------------
# Gradient synchronisation
# --------------------------------------------------------------------------------------------
def _fsdp_param_groups(model) -> list:
    from torch.distributed.fsdp import FSDPModule

    groups = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            groups.extend(module._get_fsdp_state()._fsdp_param_groups)
    return groups


def fsdp_modules(models) -> list:
    """Every ``fully_shard``-ed module of ``models`` (None entries skipped)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for model in models if model is not None for m in model.modules() if isinstance(m, FSDPModule)]


def reshard_all(modules) -> None:
    """``FSDPModule.reshard()`` on every module of ``modules`` (the call is not recursive).

    A forward without backward leaves a module unsharded when it does not reshard after forward
    (``reshard_after_forward=False``, and FSDP2's root module by default): its gathered params
    stay allocated, and the next ``unshard()`` returns at once (``FSDPParamGroup.unshard``: "if
    self.is_unsharded: return  # no-op"), so a later forward would compute with the values
    gathered before the local shards were overwritten (a line point, a converge). Resharding
    frees them; the next forward gathers the shards as they are now (issue #29 bug 4)."""
    for module in modules:
        module.reshard()


class FSDP2GradSync:
    """Keeps (``global``) or switches off (``arm``) FSDP2's replicate-dimension gradient
    all-reduce on a ``fully_shard``-ed model. Validates that the model is HSDP on ``arms.mesh``."""

    def __init__(self, model, arms: HSDPArms, mode: str) -> None:
        if mode not in ("global", "arm"):
            raise FSDPSetupError(f"grad_sync={mode!r} must be 'global' or 'arm'")
        self.model = model
        self.arms = arms
        self.mode = mode
        self._saved: list[tuple[Any, Any, Any]] = []

    @property
    def installed(self) -> bool:
        return bool(self._saved)

    def _validated_groups(self) -> list:
        from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo

        groups = _fsdp_param_groups(self.model)
        replicate_ranks = dist.get_process_group_ranks(self.arms.replicate_group)
        for group in groups:
            info = group.mesh_info
            if not isinstance(info, HSDPMeshInfo):
                raise HSDPRequired(
                    f"{group!r} is sharded with {type(info).__name__} (no replicate dimension). "
                    f"{PURE_FSDP_EXPLANATION}"
                )
            if dist.get_process_group_ranks(info.replicate_process_group) != replicate_ranks:
                raise FSDPSetupError(
                    f"{group!r} replicates over ranks "
                    f"{dist.get_process_group_ranks(info.replicate_process_group)}, HDET's mesh over "
                    f"{replicate_ranks}; fully_shard the model over the mesh given to HDET"
                )
        return groups

    def install(self) -> None:
        if self.model is None:
            if self.mode == "arm":
                raise FSDPSetupError(
                    "grad_sync='arm' needs the fully_shard-ed model (pass model=...) to switch off "
                    "its replicate-dimension all-reduce"
                )
            return
        groups = self._validated_groups()
        if self.mode == "global" or self.installed:
            return
        if not groups:
            raise FSDPSetupError("grad_sync='arm': the model has no fully_shard-ed modules")
        for group in groups:
            old = group.mesh_info
            new = self._arm_local(old)
            self._saved.append((group, old, group.post_forward_mesh_info))
            group.mesh_info = new
            if group.post_forward_mesh_info is old:
                group.post_forward_mesh_info = new

    def _arm_local(self, info):
        from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

        if self.arms.replicas_per_arm == 1:
            # Shard-only view: FSDP2 reduce-scatters (AVG over S) and skips the all-reduce.
            kwargs = {f.name: getattr(info, f.name) for f in dataclasses.fields(info) if f.init}
            kwargs["replicate_mesh_dim"] = None
            new = FSDPMeshInfo(**kwargs)
            new.reduce_scatter_process_group = info.reduce_scatter_process_group
            return new
        # Several replicas per arm: all-reduce only among them.
        new = copy.copy(info)
        group = self.arms.arm_replicate_group
        if group is None:
            raise FSDPSetupError("internal: HSDPArms was built without arm groups")
        new.replicate_process_group = group
        new.replicate_mesh_size = dist.get_world_size(group)
        new.replicate_mesh_rank = dist.get_rank(group)
        return new

    def uninstall(self) -> None:
        for group, info, post_forward in reversed(self._saved):
            group.mesh_info = info
            group.post_forward_mesh_info = post_forward
        self._saved.clear()


# --------------------------------------------------------------------------------------------
# HDETOneCycleLR's runtime for FSDP2
# --------------------------------------------------------------------------------------------
class FSDPRuntime(_Runtime):
    """:class:`~hdet_megatron.torch_scheduler.HDETOneCycleLR`'s HDET state for FSDP2 models.

    Arms are the replicate dim of ``device_mesh`` (inferred from the DTensor parameters when
    None); losses are reduced over ``process_group`` (default WORLD: every rank of every arm
    reports its own local loss); converge averages the local shards of the optimizer's
    parameters (and ``model``'s) over the replicate group; ``grad_sync="arm"`` switches FSDP2's
    replicate all-reduce off (:class:`FSDP2GradSync`) until :meth:`close`.
    """

    def __init__(
        self, config: HDETConfig, optimizer, model, process_group, device_mesh=None, probe_fn=None
    ) -> None:
        self._optimizer_ref = optimizer
        self._model_ref = model
        self._mesh_arg = device_mesh
        self.grad_sync: FSDP2GradSync | None = None
        self._fsdp_modules = fsdp_modules([model])
        super().__init__(config, optimizer, model, process_group, probe_fn)
        self.grad_sync = FSDP2GradSync(model, self.arms, config.grad_sync)
        self.grad_sync.install()
        # Set by save_checkpoint when it converged at (last_epoch, num_converges).
        self.saved_converge: tuple[int, int] | None = None

    def _init_topology(self, process_group) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise FSDPSetupError("FSDP2 + HDET needs an initialized torch.distributed process group")
        mesh = self._mesh_arg
        if mesh is None:
            tensors = [p for g in self._optimizer_ref.param_groups for p in g["params"]]
            if self._model_ref is not None:
                tensors += list(self._model_ref.parameters())
            mesh = _find_mesh(tensors)
            if mesh is None:
                raise FSDPSetupError("no DTensor parameters found; pass device_mesh=... or an FSDP2 model")
        self.arms = HSDPArms.from_mesh(mesh, self.config.arms, arm_groups=self.config.grad_sync == "arm")
        self.group = process_group
        self.size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        if self.rank < 0:
            raise FSDPSetupError("this rank is not a member of the process_group given to HDETOneCycleLR")
        self.num_arms = self.arms.num_arms
        self.arm = self.arms.arm
        self.ranks_per_arm = self.arms.replicas_per_arm * self.arms.num_shards

    def _init_params(self, optimizer, model) -> None:
        tensors = [p for g in optimizer.param_groups for p in g["params"]]
        if model is not None:
            tensors += list(model.parameters())
        self.dtensors = list({id(t): t for t in tensors}.values())
        # The optimizer's tensors are what it updates (FSDP2 keeps the sharded parameters in
        # their original dtype, so with MixedPrecisionPolicy they are the fp32 masters).
        self.params = local_shards(self.dtensors, self.arms)
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.averager: BucketedAverager | None = None
        if self.arms.num_replicas > 1:
            # Averaged: FSDP2's padded local shards; homed into the averager's buckets unless
            # config.home_main_params is off (FSDP2Homer).
            homer = FSDP2Homer([model], self.dtensors)
            self.averager = BucketedAverager(
                homer.tensors,
                group=self.arms.replicate_group,
                bucket_mb=self.config.bucket_mb,
                home=homer if self.config.home_main_params else False,
            )

    def tensors(self) -> list[torch.Tensor]:
        """The local shards as they are now: FSDP2 replaces a local tensor object when it gives a
        parameter new storage (``reset_sharded_param`` after ``module.to()`` or
        ``load_state_dict(assign=True)``, and the averager's re-homing after that), so a list
        kept from construction would write line points where the model no longer reads."""
        return local_shards(self.dtensors)

    def refresh(self) -> None:
        """Reshard every FSDP module (:func:`reshard_all`): the next forward all-gathers the local
        shards as they are now (a line point, the restored arm, the converged average)."""
        reshard_all(self._fsdp_modules)

    def close(self) -> None:
        if self.grad_sync is not None:
            self.grad_sync.uninstall()


# --------------------------------------------------------------------------------------------
# Checkpoints (torch.distributed.checkpoint)
# --------------------------------------------------------------------------------------------
def _fsdp_runtime(scheduler) -> FSDPRuntime | None:
    rt = getattr(scheduler, "_hdet", None)
    if rt is None:
        return None
    if not isinstance(rt, FSDPRuntime):
        raise FSDPSetupError(
            "save_checkpoint/load_checkpoint here are for FSDP2 models; this HDETOneCycleLR runs "
            "HDET on plain replicas (use its state_dict() with torch.save)"
        )
    return rt


def _reapply_lrs(scheduler) -> None:
    """Recompute this arm's LR (and momentum) for the current step from the scheduler state.

    Per-arm values cannot come from the checkpoint: DCP writes an entry that every rank has
    (the optimizer's param-group ``lr``, the scheduler's ``_last_lr``) from one rank only."""
    scheduler._get_lr_called_within_step = True
    try:
        values = scheduler.get_lr()
    finally:
        scheduler._get_lr_called_within_step = False
    for group, lr in zip(scheduler.optimizer.param_groups, values, strict=True):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


def _per_arm_view(state: Any, arms: HSDPArms, submesh):
    """Same structure, every HSDP DTensor re-expressed on this replica's 1-D shard mesh (sharing
    storage), so that DCP stores each arm's values under the arm's own keys."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(state, dict):
        return {k: _per_arm_view(v, arms, submesh) for k, v in state.items()}
    if isinstance(state, list):
        return [_per_arm_view(v, arms, submesh) for v in state]
    if isinstance(state, DTensor) and state.device_mesh == arms.mesh:
        if not isinstance(state.placements[0], Replicate):
            raise FSDPSetupError(f"unexpected placements {state.placements} in a state dict")
        return DTensor.from_local(
            state.to_local(),
            submesh,
            state.placements[1:],
            run_check=False,
            shape=state.shape,
            stride=state.stride(),
        )
    return state


def _copy_back(original: Any, view: Any) -> None:
    """After a load into :func:`_per_arm_view` entries: make sure the originals hold the values."""
    from torch.distributed.tensor import DTensor

    if isinstance(original, dict):
        for k in original:
            _copy_back(original[k], view[k])
    elif isinstance(original, list):
        for o, v in zip(original, view, strict=True):
            _copy_back(o, v)
    elif isinstance(original, DTensor) and isinstance(view, DTensor) and original is not view:
        dst, src = original.to_local(), view.to_local()
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src)


def _layout(rt: FSDPRuntime | None, scheduler, converge: bool) -> dict:
    if rt is None:
        return {"version": 1, "num_arms": 1, "per_arm_params": False, "per_arm_optim": False}
    mid_window = scheduler.last_epoch % rt.config.period != 0
    return {
        "version": 1,
        "num_arms": rt.num_arms,
        "num_replicas": rt.arms.num_replicas,
        "num_shards": rt.arms.num_shards,
        "step": scheduler.last_epoch,
        # Arms differ at a mid-window save without converge: keep every arm's parameters.
        "per_arm_params": rt.num_arms > 1 and not converge and mid_window,
        # Arm-local gradients give every arm its own optimizer moments.
        "per_arm_optim": rt.num_arms > 1 and rt.config.grad_sync == "arm",
        "converged": converge,
    }


def _rank_table(rt: FSDPRuntime | None) -> torch.Tensor:
    """(world, 2) float64: every rank's window-loss sum and count (per-rank values)."""
    world = dist.get_world_size()
    table = torch.zeros(world, 2, dtype=torch.float64)
    if rt is not None:
        losses = rt.engine.losses
        mine = torch.tensor([float(losses.total()), float(losses.count)], dtype=torch.float64)
        gathered = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(gathered, mine)
        table = torch.stack(gathered)
    return table


def _state(model, optimizer, scheduler, rt, layout: dict, extra) -> tuple[dict, dict, dict]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state: dict = {}
    submesh = rt.arms.shard_submesh() if layout["per_arm_params"] or layout["per_arm_optim"] else None
    if layout["per_arm_params"]:
        state[f"model_arm{rt.arm}"] = _per_arm_view(model_sd, rt.arms, submesh)
    else:
        state["model"] = model_sd
    if layout["per_arm_optim"]:
        state[f"optim_arm{rt.arm}"] = _per_arm_view(optim_sd, rt.arms, submesh)
    else:
        state["optim"] = optim_sd
    if extra is not None:
        state["extra"] = extra
    return state, model_sd, optim_sd


def save_checkpoint(
    checkpoint_id: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    *,
    extra: dict | None = None,
    converge: bool | None = None,
) -> dict:
    """Save an FSDP2 (+ HDET) run with ``torch.distributed.checkpoint``. Collective.

    ``converge`` (default ``hdet.converge_on_save``): at a mid-window save, converge first (the
    controller sees the partial window, the arms are averaged) so the checkpoint holds one
    averaged model; this run and a run resumed from the checkpoint then continue identically,
    and this step's LRs are recomputed with the controller's new scale. Without converge
    mid-window, every arm's parameters are written under its own keys and a resumed run
    continues exactly like the uninterrupted one. With ``grad_sync="arm"`` each arm's optimizer
    state is written separately (the arms' moments differ). Controller, scheduler and every
    rank's window-loss accumulators are included; ``extra`` (tensors or picklable objects) is
    saved as given. Returns the layout written (plain data).
    """
    import torch.distributed.checkpoint as dcp

    rt = _fsdp_runtime(scheduler)
    if rt is not None:
        if converge is None:
            converge = rt.config.converge_on_save
        mid_window = scheduler.last_epoch % rt.config.period != 0
        already = rt.saved_converge == (scheduler.last_epoch, rt.num_converges)
        if converge and mid_window and not already:
            scheduler.converge()
            _reapply_lrs(scheduler)
            rt.saved_converge = (scheduler.last_epoch, rt.num_converges)
    converge = bool(converge)
    layout = _layout(rt, scheduler, converge)
    state, _, _ = _state(model, optimizer, scheduler, rt, layout, extra)
    state["scheduler"] = pickle.dumps(scheduler.state_dict())
    state["hdet_layout"] = pickle.dumps(layout)
    state["hdet_rank_losses"] = _rank_table(rt)
    dcp.save(state, checkpoint_id=checkpoint_id)
    return layout


def load_checkpoint(
    checkpoint_id: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    *,
    extra: dict | None = None,
) -> dict:
    """Load :func:`save_checkpoint` output into a freshly built model/optimizer/scheduler (same
    mesh and HDET config). Collective. ``extra``: a template dict (DCP loads in place).
    Returns the layout that was saved."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    rt = _fsdp_runtime(scheduler)
    layout_blob = {"hdet_layout": b""}
    dcp.load(layout_blob, checkpoint_id=checkpoint_id)
    layout = pickle.loads(layout_blob["hdet_layout"])
    num_arms = rt.num_arms if rt is not None else 1
    if layout["num_arms"] != num_arms:
        raise FSDPSetupError(
            f"checkpoint was written with {layout['num_arms']} arms, this run has {num_arms}; "
            "resume on the same HSDP mesh and HDET config"
        )
    state, model_sd, optim_sd = _state(model, optimizer, scheduler, rt, layout, extra)
    originals = {"model": model_sd, "optim": optim_sd}
    state["scheduler"] = b""
    state["hdet_rank_losses"] = torch.zeros(dist.get_world_size(), 2, dtype=torch.float64)
    dcp.load(state, checkpoint_id=checkpoint_id)
    arm = rt.arm if rt is not None else 0  # per-arm entries exist only with arms (rt set)
    for kind, per_arm in (("model", layout["per_arm_params"]), ("optim", layout["per_arm_optim"])):
        _copy_back(originals[kind], state[f"{kind}_arm{arm}" if per_arm else kind])
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    scheduler.load_state_dict(pickle.loads(state["scheduler"]))
    if rt is not None:
        row = state["hdet_rank_losses"][dist.get_rank()]
        # Keep the window's loss sum in the device accumulator, as an uninterrupted run does.
        rt.engine.losses.load(float(row[0]), int(row[1]))
        if layout.get("converged") and layout["step"] % rt.config.period != 0:
            rt.saved_converge = (scheduler.last_epoch, rt.num_converges)
    _reapply_lrs(scheduler)
    if extra is not None and "extra" in state:
        extra.update(state["extra"])
    return layout
