"""Which arm counts a Megatron mesh can host, and the groups each arm's parameters sync over.

Pure rank arithmetic (no torch.distributed, no megatron): the inputs are rank tuples that
:class:`~hdet_megatron.megatron.layout.ArmLayout` gathers from ``parallel_state`` once.

Arms live on the data-parallel dimension (without context parallelism): the rank at index ``i``
of its DP group belongs to arm ``i // (DP/A)``. Every TP, CP and PP peer of a rank has the same
DP index, so those groups never span arms. Expert parallelism is different: megatron-core 0.19.2
(group order tp-cp-ep-dp-pp, ``initialize_model_parallel``) carves the expert-parallel groups
out of consecutive DP (and CP) ranks, so an EP group can span DP replicas. Its ranks hold
*different* experts of one model replica and exchange tokens in every forward pass: they must
train under one arm's hyperparameters, i.e. an arm must hold whole expert groups
(``get_expert_tensor_and_model_parallel_group``).

A parameter class (dense, expert) is replicated over one group (Megatron DDP's gradient
reduction group: dense ``get_data_parallel_group(with_context_parallel=True)``, expert
``get_expert_data_parallel_group()``). HDET splits that group by arm: the ranks of one arm
(``arm_subset``) and, for converge, the ranks at the same position in every arm
(``cross_arm_subset``: they hold the same tensor, or the same distributed-optimizer shard).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending."""
    return [a for a in range(1, n + 1) if n % a == 0]


def arm_of(rank: int, dp_ranks: Sequence[int], num_arms: int) -> int:
    """Arm of ``rank`` whose data-parallel group (without CP) is ``dp_ranks``."""
    return dp_ranks.index(rank) // (len(dp_ranks) // num_arms)


def arm_map(dp_group_of: Mapping[int, Sequence[int]], num_arms: int) -> dict[int, int]:
    """Global rank -> arm, for every rank in ``dp_group_of`` (rank -> its DP ranks)."""
    return {rank: arm_of(rank, dp, num_arms) for rank, dp in dp_group_of.items()}


def split_groups(arms: Mapping[int, int], groups: Iterable[Sequence[int]]) -> list[tuple[int, ...]]:
    """The groups (sorted, deduplicated) whose ranks fall into more than one arm."""
    return sorted({tuple(g) for g in groups if len({arms[r] for r in g}) > 1})


def valid_arm_counts(
    dp_group_of: Mapping[int, Sequence[int]], whole_groups: Iterable[Sequence[int]]
) -> list[int]:
    """Arm counts that divide DP and keep every group of ``whole_groups`` inside one arm."""
    groups = [tuple(g) for g in whole_groups]
    dp_size = len(next(iter(dp_group_of.values())))
    return [a for a in divisors(dp_size) if not split_groups(arm_map(dp_group_of, a), groups)]


def arm_subset(arms: Mapping[int, int], group: Sequence[int], arm: int) -> tuple[int, ...]:
    """The ranks of ``group`` in ``arm``, in ``group``'s order."""
    return tuple(r for r in group if arms[r] == arm)


def cross_arm_subset(arms: Mapping[int, int], group: Sequence[int], rank: int) -> tuple[int, ...]:
    """The ranks of ``group`` at ``rank``'s position inside their own arm, one per arm (in arm
    order). Raises ValueError when the arms hold different numbers of ``group``'s ranks."""
    by_arm: dict[int, list[int]] = {}
    for r in group:
        by_arm.setdefault(arms[r], []).append(r)
    sizes = {len(v) for v in by_arm.values()}
    if len(sizes) != 1:
        raise ValueError(f"the arms hold unequal parts of group {tuple(group)}: {by_arm}")
    position = by_arm[arms[rank]].index(rank)
    return tuple(by_arm[a][position] for a in sorted(by_arm))
