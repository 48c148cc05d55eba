"""Which ranks an engine spans: the user's ``group``, or the shard group the model was sharded on.

With hybrid sharding (FSDP2 on a 2-D (replicate, shard) mesh, a DeepSpeed ZeRO-3 model
partitioned over a data-parallel subgroup) a forward gathers parameters only inside the rank's shard
group, so the lockstep is needed only there: one engine per shard group, each with
its own tick, early stop and liveness, and no rank ever waits on a group it is not in.
Nothing here is a collective.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def engine_ranks(group: Any, model: Any) -> list[int]:
    """The global ranks an engine spans: ``group``'s, else the model's shard group's, else the
    world's; sorted, as ``new_group`` orders the private groups (a rank's index in the list is
    its row in the tick). ``ValueError`` if this rank is not one of them. Not collective."""
    rank = dist.get_rank()
    if group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group returns to non-members
        raise ValueError(f"rank {rank} is not in the engine's group: only the group's ranks construct it")
    if group is None:
        group = model_shard_group(model)
    ranks = sorted(dist.get_process_group_ranks(group)) if group is not None else []
    ranks = ranks or list(range(dist.get_world_size()))
    if rank not in ranks:
        raise ValueError(f"rank {rank} is not in the engine's group {ranks}: only its ranks construct it")
    return ranks


def model_shard_group(model: Any) -> Any | None:
    """The process group ``model``'s parameters are gathered on, if it is not the whole world.

    FSDP2 (``fully_shard`` on a 1-D mesh over a subgroup, or on a 2-D HSDP mesh): the
    shard group of its mesh. DeepSpeed ZeRO-3: the parameters' partition group
    (``ds_process_group``: an ``mpu``'s data-parallel group, or ``zero.Init``'s
    ``data_parallel_group``).
    ``None`` for an unsharded model or one sharded over every rank.
    """
    from shardgen.backends.deepspeed.adopt import partition_group
    from shardgen.backends.fsdp2 import shard_group

    group = shard_group(model)
    if group is None:
        group = partition_group(model)
    if group is None or dist.get_world_size(group) == dist.get_world_size():
        return None
    return group


def replica_group(shard_size: int) -> tuple[Any, int]:
    """(this rank's shard group, its replica index) for world/``shard_size`` replicas of
    consecutive ranks (replica i: ranks i*K .. i*K+K-1); ``(None, 0)`` when K is the world.

    Collective on the world: every rank calls it, in the same order (plain ``new_group`` for
    each replica: torch numbers groups by call count, so every rank makes every group).
    ``ValueError`` with the numbers when K does not divide the world.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if shard_size < 1 or world % shard_size:
        raise ValueError(
            f"--shard-size {shard_size} must divide the world of {world} ranks "
            f"(world / shard size = {world / max(shard_size, 1):g} replicas)"
        )
    if shard_size == world:
        return None, 0
    groups = [dist.new_group(list(range(i, i + shard_size))) for i in range(0, world, shard_size)]
    return groups[rank // shard_size], rank // shard_size
