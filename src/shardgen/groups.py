"""Which ranks an engine spans: the user's ``group``, or the shard group the model was sharded on.

With hybrid sharding (FSDP2 on a 2-D (replicate, shard) mesh, DeepSpeed MiCS or a
data-parallel subgroup) a forward gathers parameters only inside the rank's shard
group, so the lockstep is needed only there: one engine per shard group, each with
its own tick, early stop and liveness, and no rank ever waits on a group it is not in.
Nothing here is a collective.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def model_shard_group(model: Any) -> Any | None:
    """The process group ``model``'s parameters are gathered on, if it is not the whole world.

    FSDP2 (``fully_shard`` on a 1-D mesh over a subgroup, or on a 2-D HSDP mesh): the
    shard group of its mesh. DeepSpeed ZeRO-3: the parameters' partition group
    (``ds_process_group``: the MiCS shard group, or an ``mpu``'s data-parallel group).
    ``None`` for an unsharded model or one sharded over every rank.
    """
    group = _fsdp_shard_group(model)
    if group is None:
        group = _deepspeed_partition_group(model)
    if group is None or dist.get_world_size(group) == dist.get_world_size():
        return None
    return group


def _fsdp_shard_group(model: Any) -> Any | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return None
    for m in model.modules() if hasattr(model, "modules") else ():
        if isinstance(m, FSDPModule):
            for pg in m._get_fsdp_state()._fsdp_param_groups:
                return pg.mesh_info.shard_process_group
    return None


def _deepspeed_partition_group(model: Any) -> Any | None:
    module = getattr(model, "module", model)  # a DeepSpeedEngine wraps the HF model
    for p in module.parameters() if hasattr(module, "parameters") else ():
        group = getattr(p, "ds_process_group", None)
        if group is not None:
            return group
        return None
    return None


def describe_ranks(ranks: list[int]) -> str:
    """``ranks [2, 3]`` for a subgroup, ``all N ranks`` for the world (log lines)."""
    if dist.is_initialized() and ranks == list(range(dist.get_world_size())):
        return f"all {len(ranks)} ranks"
    return f"ranks {ranks}"
