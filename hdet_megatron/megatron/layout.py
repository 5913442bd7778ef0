"""Where this rank sits among HDET's arms, and the process groups that follow from it.

Arms live on the data-parallel dimension only: with DP replicas and A arms, replica ``d`` belongs
to arm ``d // (DP/A)``, and every TP/CP/PP rank of a replica shares its replica's DP rank, so all
shards of one model copy always train with the same hyperparameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from hdet_megatron.megatron import cpu as _cpu  # noqa: F401  (shims before megatron.core)
from hdet_megatron.megatron import mesh as _mesh

from megatron.core import parallel_state


class HDETSetupError(ValueError):
    """An HDET setup that cannot work (process-group layout, optimizer, arguments)."""


def _choose_arms(
    arms: int | None, dp_group_of: dict[int, tuple[int, ...]], expert_groups: list[tuple[int, ...]]
) -> int:
    """The arm count: ``arms``, checked, or with ``None`` the most arms the mesh allows.

    An arm must hold whole expert groups (expert TP x EP ranks of one replica): ranks holding
    different experts of one model must not train under different hyperparameters, and a
    converge must only average copies of the same expert (see :mod:`hdet_megatron.megatron.mesh`).
    """
    dp_size = len(next(iter(dp_group_of.values())))
    divisors = _mesh.divisors(dp_size)
    valid = _mesh.valid_arm_counts(dp_group_of, expert_groups)
    if arms is None:
        if valid[-1] > 1 or dp_size == 1:
            return valid[-1]
        raise HDETSetupError(
            f"HDET cannot place arms on this mesh: every expert-parallel group (expert TP x EP "
            f"ranks {expert_groups[0]}) spans all {dp_size} data-parallel replicas, and an arm must "
            "hold whole expert groups; lower expert_model_parallel_size (or expert_tensor_parallel_size) "
            "or raise the data-parallel size"
        )
    if arms < 1 or dp_size % arms:
        raise HDETSetupError(
            f"HDET arms={arms} must divide the data-parallel size {dp_size}; use one of {divisors}"
        )
    if arms not in valid:
        split = _mesh.split_groups(_mesh.arm_map(dp_group_of, arms), expert_groups)
        raise HDETSetupError(
            f"HDET arms={arms} splits expert-parallel groups (expert TP x EP ranks {split[0]} would "
            "train under different arms and average different experts together); an arm must "
            f"hold whole expert groups: use arms in {valid}"
        )
    return arms


@dataclass(frozen=True)
class ArmLayout:
    """This rank's arm and the groups HDET communicates over."""

    num_arms: int
    """A: number of arms (each arm trains under its own hyperparameter values)."""
    arm: int
    """This rank's arm id in ``[0, A)``."""
    dp_size: int
    """Data-parallel size (model replicas)."""
    dp_rank: int
    """This rank's data-parallel rank."""
    replicas_per_arm: int
    """DP/A: replicas inside one arm (they still all-reduce gradients with each other)."""
    arm_ranks: tuple[int, ...]
    """Global ranks of this arm's replicas at this rank's TP/PP position."""
    cross_arm_ranks: tuple[int, ...]
    """Global ranks holding the same shard in every arm (converge averages over these)."""
    arm_group: dist.ProcessGroup | None
    """Group of :attr:`arm_ranks`."""
    cross_arm_group: dist.ProcessGroup | None
    """Group of :attr:`cross_arm_ranks`."""
    loss_group: dist.ProcessGroup | None
    """Group for the per-window loss reduction: the whole world, so every TP/PP rank computes
    the identical controller update."""
    is_loss_reporter: bool
    """This rank contributes its replica's loss: last pipeline stage, TP rank 0."""
    is_last_stage: bool
    """Last pipeline stage (``forward_backward_func`` returns losses here only)."""
    grad_arm_ranks: tuple[int, ...] = ()
    """This arm's ranks of the dense gradient-reduction group (data parallel with context
    parallel, Megatron DDP's ``dp_cp`` group); equal to :attr:`arm_ranks` without CP."""
    grad_arm_group: dist.ProcessGroup | None = None
    """Group of :attr:`grad_arm_ranks` (``grad_sync="arm"`` reduces dense gradients over it)."""
    expert_arm_ranks: tuple[int, ...] = ()
    """This arm's ranks of the expert-data-parallel group (they hold copies of this rank's
    experts; ``grad_sync="arm"`` reduces expert gradients over them)."""
    expert_arm_group: dist.ProcessGroup | None = None
    """Group of :attr:`expert_arm_ranks`."""
    expert_cross_arm_ranks: tuple[int, ...] = ()
    """Ranks of the expert-data-parallel group at this rank's position in every arm: they hold
    the same experts (and DistOpt shard); converge averages expert main params over these."""
    expert_cross_arm_group: dist.ProcessGroup | None = None
    """Group of :attr:`expert_cross_arm_ranks`."""
    cp_size: int = 1
    """Context-parallel size: CP ranks hold one replica's params and split its sequences."""
    cp_rank: int = 0
    """This rank's context-parallel rank."""

    @property
    def loss_rows(self) -> int:
        """Loss reporters of the run: one per DP replica and CP rank (each CP rank's loss covers
        its own part of the replica's sequences; an arm's loss is the mean over its rows)."""
        return self.dp_size * self.cp_size

    @property
    def loss_row(self) -> int:
        """This rank's row among :attr:`loss_rows` (meaningful on loss reporters)."""
        return self.dp_rank * self.cp_size + self.cp_rank

    @classmethod
    def single(cls) -> ArmLayout:
        """One process, one replica, one arm (no torch.distributed): for a scheduler used
        without a process group."""
        return cls(
            num_arms=1,
            arm=0,
            dp_size=1,
            dp_rank=0,
            replicas_per_arm=1,
            arm_ranks=(0,),
            cross_arm_ranks=(0,),
            arm_group=None,
            cross_arm_group=None,
            loss_group=None,
            is_loss_reporter=True,
            is_last_stage=True,
            grad_arm_ranks=(0,),
            expert_arm_ranks=(0,),
            expert_cross_arm_ranks=(0,),
        )

    @classmethod
    def from_parallel_state(cls, arms: int | None = None, pg_collection=None) -> ArmLayout:
        """Build from Megatron's ``parallel_state`` (or an injected ``ProcessGroupCollection``).

        Collective: every rank of the world must call it, in the same order.
        """
        if not dist.is_initialized():
            raise HDETSetupError("torch.distributed is not initialized; call init_process_group first")
        if pg_collection is not None:
            dp_group, tp_group, pp_group = pg_collection.dp, pg_collection.tp, pg_collection.pp
            cp_size = pg_collection.cp.size() if getattr(pg_collection, "cp", None) else 1
            expert_group = getattr(pg_collection, "tp_ep", None)
            dp_cp_group = getattr(pg_collection, "dp_cp", None) or dp_group
            expert_dp_group = getattr(pg_collection, "expt_dp", None)
        else:
            if not parallel_state.model_parallel_is_initialized():
                raise HDETSetupError(
                    "Megatron's parallel_state is not initialized; call "
                    "parallel_state.initialize_model_parallel(...) before building HDET"
                )
            # DP group without context parallelism: arms are over model replicas.
            dp_group = parallel_state.get_data_parallel_group(with_context_parallel=False)
            tp_group = parallel_state.get_tensor_model_parallel_group()
            pp_group = parallel_state.get_pipeline_model_parallel_group()
            cp_size = parallel_state.get_context_parallel_world_size()
            # The ranks that hold one replica's experts (expert TP x EP) and exchange its tokens.
            expert_group = parallel_state.get_expert_tensor_and_model_parallel_group(check_initialized=False)
            # Megatron DDP's gradient-reduction groups: dense params over DP x CP, expert params
            # over expert-DP (``DistributedDataParallel.__init__``: ``dp_cp_group``, ``expt_dp_group``).
            dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
            expert_dp_group = parallel_state.get_expert_data_parallel_group(check_initialized=False)
        # Context parallelism: CP ranks are like TP ranks (one replica, the same arm and values;
        # arms live on DP without CP), but gradients reduce over DP x CP.
        cp_rank = (
            pg_collection.cp.rank()
            if pg_collection is not None and getattr(pg_collection, "cp", None)
            else parallel_state.get_context_parallel_rank()
            if cp_size > 1
            else 0
        )
        dp_ranks = tuple(dist.get_process_group_ranks(dp_group))
        dp_size = len(dp_ranks)
        dp_rank = dp_ranks.index(dist.get_rank())
        expert_ranks = tuple(dist.get_process_group_ranks(expert_group)) if expert_group is not None else ()
        dp_cp_ranks = tuple(dist.get_process_group_ranks(dp_cp_group))
        # Without expert groups (no MoE initialized) expert params, if any, sync like dense ones.
        expert_dp_ranks = (
            tuple(dist.get_process_group_ranks(expert_dp_group))
            if expert_dp_group is not None
            else dp_cp_ranks
        )

        # Every rank must create every group in the same order: learn every rank's groups first.
        mesh: list = [None] * dist.get_world_size()
        dist.all_gather_object(mesh, (dp_ranks, expert_ranks, dp_cp_ranks, expert_dp_ranks))
        dp_group_of = {r: m[0] for r, m in enumerate(mesh)}
        expert_groups = [m[1] for m in mesh if m[1]]
        num_arms = _choose_arms(arms, dp_group_of, expert_groups)
        per_arm = dp_size // num_arms
        arm = dp_rank // per_arm
        arms_of = _mesh.arm_map(dp_group_of, num_arms)

        def subsets(r: int) -> dict[str, tuple[int, ...]]:
            dp, _, dp_cp, edp = mesh[r]
            try:
                return {
                    "arm": _mesh.arm_subset(arms_of, dp, arms_of[r]),
                    "cross": _mesh.cross_arm_subset(arms_of, dp, r),
                    "grad_arm": _mesh.arm_subset(arms_of, dp_cp, arms_of[r]),
                    "expert_arm": _mesh.arm_subset(arms_of, edp, arms_of[r]),
                    "expert_cross": _mesh.cross_arm_subset(arms_of, edp, r),
                }
            except ValueError as exc:  # an expert-DP group the arms split unevenly
                raise HDETSetupError(
                    f"HDET arms={num_arms} cannot split this mesh's groups evenly: {exc}"
                ) from exc

        every = [subsets(r) for r in range(len(mesh))]
        mine = every[dist.get_rank()]
        groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for ranks in sorted({ranks for s in every for ranks in s.values()}):
            groups[ranks] = dist.new_group(list(ranks))

        is_last_stage = pp_group.rank() == pp_group.size() - 1
        return cls(
            num_arms=num_arms,
            arm=arm,
            dp_size=dp_size,
            dp_rank=dp_rank,
            replicas_per_arm=per_arm,
            arm_ranks=mine["arm"],
            cross_arm_ranks=mine["cross"],
            arm_group=groups[mine["arm"]],
            cross_arm_group=groups[mine["cross"]],
            loss_group=dist.group.WORLD,
            is_loss_reporter=is_last_stage and tp_group.rank() == 0,
            is_last_stage=is_last_stage,
            grad_arm_ranks=mine["grad_arm"],
            grad_arm_group=groups[mine["grad_arm"]],
            expert_arm_ranks=mine["expert_arm"],
            expert_arm_group=groups[mine["expert_arm"]],
            expert_cross_arm_ranks=mine["expert_cross"],
            expert_cross_arm_group=groups[mine["expert_cross"]],
            cp_size=cp_size,
            cp_rank=cp_rank,
        )

    def check_distributed_optimizer(self, num_instances: int) -> None:
        """With Megatron's distributed optimizer every arm must own a full optimizer copy: one
        partial-DistOpt instance per arm, whose dense (DP x CP) and expert (expert-DP) instance
        groups are exactly the arm's ranks of those groups."""
        if num_instances != self.num_arms:
            raise HDETSetupError(
                "HDET with use_distributed_optimizer needs one optimizer instance per arm: set "
                f"num_distributed_optimizer_instances={self.num_arms} (arms) in both "
                "initialize_model_parallel and DistributedDataParallelConfig, found "
                f"{num_instances}"
            )
        instance_ranks = tuple(
            dist.get_process_group_ranks(
                parallel_state.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)
            )
        )
        if instance_ranks != self.grad_arm_ranks:
            raise HDETSetupError(
                f"distributed-optimizer instance ranks {instance_ranks} differ from HDET arm "
                f"ranks {self.grad_arm_ranks}; arms must be contiguous DP blocks"
            )
        expert_instance = parallel_state.get_expert_data_parallel_group(
            check_initialized=False, partial_expert_data_parallel=True
        )
        if expert_instance is not None:
            expert_ranks = tuple(dist.get_process_group_ranks(expert_instance))
            if expert_ranks != self.expert_arm_ranks:
                raise HDETSetupError(
                    f"distributed-optimizer expert instance ranks {expert_ranks} differ from "
                    f"HDET arm {self.arm}'s expert-data-parallel ranks {self.expert_arm_ranks}"
                )
