"""Adopt a model the user partitioned at ZeRO stage 3: keep its shards, move its traffic.

A ``deepspeed.initialize`` engine (or its ``.module``), or a model built under ``zero.Init``
with no engine. Every check runs before anything is changed; the move itself is local
(no collective): release to partitioned state, rebind ``ds_process_group`` on every
parameter and on the ``zero.Init`` that made them, fresh lockstep coordinator
(docs/DEEPSPEED.md, "A model the user partitioned").
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardgen.backends.deepspeed import internals as ds
from shardgen.backends.deepspeed.partition import mark_leaves
from shardgen.log import get_logger

log = get_logger()


def partition_group(model: Any) -> Any | None:
    """The group a ZeRO-3 model's parameters are partitioned over (``ds_process_group``: the
    world, or a data-parallel subgroup from an ``mpu`` or ``zero.Init(data_parallel_group=)``);
    ``None`` for a model without ZeRO parameters. Accepts a DeepSpeedEngine. Not collective."""
    module = getattr(model, "module", model)
    for p in module.parameters() if isinstance(module, torch.nn.Module) else ():
        return getattr(p, "ds_process_group", None)
    return None


def check_adoptable(module: torch.nn.Module, param_group: Any) -> list:
    """Refuse what cannot be moved, on every rank alike; return the parameters. Local."""
    params = list(module.parameters())
    new_ranks = list(dist.get_process_group_ranks(param_group))
    old_groups = {id(p.ds_process_group): p.ds_process_group for p in params}
    for group in old_groups.values():
        if group is param_group:
            continue
        old_ranks = list(dist.get_process_group_ranks(group))
        if old_ranks != new_ranks:
            raise ValueError(
                f"the model is partitioned over ranks {old_ranks}, but shardgen's parameter group has "
                f"ranks {new_ranks}; the shards only line up on the same ranks in the same order "
                "(partition the model on all ranks, or pass the plain model)"
            )
    if ds.has_hpz(params):
        raise ValueError(
            "the model uses hpZ secondary partitions (zero_hpz_partition_size > 1), whose gathers "
            "run on a second group that shardgen cannot move; use zero_hpz_partition_size=1"
        )
    my_rank = dist.get_rank(group=param_group)
    odd = [p.ds_id for p in params if getattr(p, "ds_zero_partition_rank", my_rank) != my_rank]
    if odd:
        raise ValueError(f"parameters {odd[:8]} hold the shard of another rank than {my_rank}")
    inflight, open_ctx = ds.busy_params(params)
    if inflight:
        raise RuntimeError(
            f"parameters {inflight[:8]} have a gather in flight; create the backend between forwards"
        )
    if open_ctx:
        raise RuntimeError("a GatheredParameters context is open on this model; exit it first")
    return params


def adopt(engine: Any, module: torch.nn.Module, param_group: Any, device: torch.device):
    """Move a user-partitioned model's parameter traffic to ``param_group``.

    Returns ``(offload, offload_device)``. Not collective: every rank calls it (the checks
    raise alike on every rank), but nothing is sent.
    """
    params = check_adoptable(module, param_group)
    offload = ds.engine_offload(engine) if engine is not None else None
    if offload is None:
        offload = ds.find_offload(module)
    if offload is None and hasattr(module, "ds_inflight_param_registry"):
        raise RuntimeError(
            "this module has DeepSpeed ZeRO-3 hooks but shardgen cannot find their coordinator; "
            "pass the DeepSpeedEngine returned by deepspeed.initialize instead of a wrapped module"
        )

    ds.release_everything(offload, module, params)
    ds.rehome(params, param_group)  # same ranks, same order: every shard keeps its index

    if module.training:
        log.warning("shardgen: the DeepSpeed model is in training mode (dropout on); call model.eval()")
    new_leaves = mark_leaves(module)
    odev = ds.offload_device(offload, params, device)
    if offload is None:
        from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

        offload = DeepSpeedZeRoOffload(
            module,
            timers=None,
            ds_config=None,
            prefetch_bucket_size=0,
            max_reuse_distance=0,
            param_persistence_threshold=0,
            dp_process_group=param_group,
        )
    elif new_leaves:
        ds.reinstall_hooks(offload)
    ds.lockstep_coordinator(offload, module)
    if getattr(offload, "dp_process_group", None) is not None:
        offload.dp_process_group = param_group
    log.info("shardgen: moved the parameter traffic of a user-partitioned ZeRO-3 model to a private group")
    return offload, odev
