"""Where an FSDP2 model's parameters lie, for the weight-stationary mode (``stationary/runner.py``).

FSDP2 shards every parameter along dim 0 (``torch.chunk`` semantics) on the shard group of its
mesh: rank ``r`` of that group holds rows ``[r * c, r * c + c)``, ``c = ceil(d0 / N)``, the last
ranks short or empty. Each ``FSDPParam`` keeps that shard (``sharded_param``) whatever state its
module is in (FSDP2 keeps the root unit unsharded between forwards), so the mode reads shards
from there, never from the module attribute. In a stationary forward FSDP2's own forward hooks
(its unit all-gathers) are set aside; other hooks keep running. FSDP2's private parts are
reached through ``internals.py``. Not collective.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardgen.backends.chunked import hook_ids
from shardgen.backends.fsdp2 import internals as fsdp
from shardgen.backends.stationary.layout import Source, Unsupported, hooks_aside
from shardgen.backends.stationary.shards import FlatShard, dim0_layout


class FSDP2Source(Source):
    """The FSDP2 parameters of ``model`` (sharded by shardgen or by the user) on ``group``."""

    def __init__(self, model: nn.Module, group: Any, device: torch.device) -> None:
        from torch.distributed.fsdp import FSDPModule

        super().__init__(group, dist.get_rank(group), dist.get_world_size(group), device)
        self.params: dict[tuple[int, str], Any] = {}  # (id(module), name) -> FSDPParam
        self.param_dtype: dict[int, Any] = {}  # id(FSDPParam) -> its unit's compute dtype or None
        self.units: list[nn.Module] = []
        handles: list[Any] = []
        for m in model.modules():
            if not isinstance(m, FSDPModule):
                continue
            self.units.append(m)
            handles += fsdp.forward_hook_handles(m)
            for fp, dtype in fsdp.unit_params(m):
                self.param_dtype[id(fp)] = dtype
                for sm, sn in fsdp.param_places(fp):
                    self.params[(id(sm), sn)] = fp
        self.hook_ids = hook_ids(handles)

    def shard(self, module: nn.Module, name: str) -> FlatShard:
        from torch.distributed.tensor import Shard

        fp = self.params.get((id(module), name))
        where = f"{type(module).__name__}.{name}"
        if fp is None:
            raise Unsupported(f"{where} is not managed by FSDP2")
        placement, size, rank, shape, shard_dtype = fsdp.shard_facts(fp)
        if placement != Shard(0):
            raise Unsupported(f"{where} is sharded as {placement}, not along dim 0")
        if size != self.world or rank != self.rank:
            raise Unsupported(f"{where} is sharded over another group than the engine's")
        starts, sizes = dim0_layout(shape, self.world)
        device = self.device
        flat = fsdp.local_shard(fp)

        def local() -> torch.Tensor:
            t = flat()
            return t if t.device == device else t.to(device)

        dtype = self.param_dtype.get(id(fp)) or shard_dtype  # mixed precision: its param_dtype
        return FlatShard(shape, starts, sizes, local, dtype, self.rank, key=id(fp))

    def aside(self) -> contextlib.AbstractContextManager:
        return hooks_aside(self.units, self.hook_ids)
