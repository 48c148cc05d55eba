"""Where a ZeRO-3 model's parameters lie, for the weight-stationary mode (``backends/stationary``).

DeepSpeed partitions each parameter flat: rank ``r`` of its ``ds_process_group`` holds elements
``[r * P, r * P + P)`` of the flattened parameter in ``ds_tensor`` (``P = ds_tensor.ds_numel``,
the last rank padded), between gathers and whatever DeepSpeed's hooks did. In a stationary
forward DeepSpeed's module hooks are set aside (``internals.hooks_suspended``) and the trace
check is off (``internals.lockstep_forward``), as in shardgen's other forwards; the bucket
plan's hooks do nothing outside its own forwards. Refused (the model then gathers per layer):
NVMe-offloaded partitions (not in ``ds_tensor`` between gathers) and hpZ secondary partitions.
Not collective.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardgen.backends.deepspeed import internals as ds
from shardgen.backends.stationary.layout import Source, Unsupported
from shardgen.backends.stationary.shards import FlatShard, flat_layout


class DeepSpeedSource(Source):
    """The ZeRO-3 parameters of ``root`` (hooks owned by ``offload``) on ``group``."""

    def __init__(self, root: nn.Module, offload: Any, group: Any, device: torch.device, offload_device: str):
        super().__init__(group, dist.get_rank(group), dist.get_world_size(group), device)
        self.root, self.offload, self.offload_device = root, offload, offload_device
        self._ranks = dist.get_process_group_ranks(group)

    def shard(self, module: nn.Module, name: str) -> FlatShard:
        p = module._parameters[name]
        where = f"{type(module).__name__}.{name}"
        if not hasattr(p, "ds_tensor"):
            raise Unsupported(f"{where} is not a ZeRO-3 parameter")
        if self.offload_device == "nvme":
            raise Unsupported("NVMe-offloaded partitions are not in memory between gathers")
        if ds.has_hpz([p]):
            raise Unsupported(f"{where} has an hpZ secondary partition")
        if dist.get_process_group_ranks(p.ds_process_group) != self._ranks:
            raise Unsupported(f"{where} is partitioned over another group than the engine's")
        numel = ds.full_numel(p)
        starts, sizes = flat_layout(numel, int(p.ds_tensor.ds_numel), self.world)
        device = self.device

        def local(p: Any = p) -> torch.Tensor:
            t = p.ds_tensor.reshape(-1)
            return t if t.device == device else t.to(device)

        return FlatShard(
            tuple(int(s) for s in p.ds_shape), starts, sizes, local, p.dtype, self.rank, key=id(p)
        )

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        with ds.lockstep_forward(), ds.hooks_suspended(self.offload, self.root):
            yield
