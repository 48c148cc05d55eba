"""Where an FSDP2 model's parameters lie, for the weight-stationary mode (``mode.py``).

FSDP2 shards every parameter along dim 0 (``torch.chunk`` semantics) on the shard group of its
mesh: rank ``r`` of that group holds rows ``[r * c, r * c + c)``, ``c = ceil(d0 / N)``, the last
ranks short or empty. Each ``FSDPParam`` keeps that shard (``sharded_param``) whatever state its
module is in (FSDP2 keeps the root unit unsharded between forwards), so the mode reads shards
from there, never from the module attribute. In a stationary forward FSDP2's own forward hooks
(its unit all-gathers) are set aside; other hooks keep running. Not collective.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardgen.backends.stationary.plan import Source, Unsupported, hooks_aside
from shardgen.backends.stationary.shards import FlatShard, dim0_layout


class FSDP2Source(Source):
    """The FSDP2 parameters of ``model`` (sharded by shardgen or by the user) on ``group``."""

    def __init__(self, model: nn.Module, group: Any, device: torch.device) -> None:
        from torch.distributed.fsdp import FSDPModule

        from shardgen.backends.chunked import hook_ids

        super().__init__(group, dist.get_rank(group), dist.get_world_size(group), device)
        self.params: dict[tuple[int, str], Any] = {}  # (id(module), name) -> FSDPParam
        self.param_dtype: dict[int, Any] = {}  # id(FSDPParam) -> its unit's compute dtype or None
        self.units: list[nn.Module] = []
        handles: list[Any] = []
        for m in model.modules():
            if not isinstance(m, FSDPModule):
                continue
            self.units.append(m)
            state = m._get_fsdp_state()
            handles += [state._pre_forward_hook_handle, state._post_forward_hook_handle]
            for pg in state._fsdp_param_groups:
                for fp in pg.fsdp_params:
                    self.param_dtype[id(fp)] = getattr(state._mp_policy, "param_dtype", None)
                    info = fp._module_info
                    self.params[(id(info.module), info.param_name)] = fp
                    for sm, sn in zip(info.shared_modules, info.shared_param_names, strict=True):
                        self.params[(id(sm), sn)] = fp
        self.hook_ids = hook_ids(handles)

    def shard(self, module: nn.Module, name: str) -> FlatShard:
        from torch.distributed.tensor import Shard

        fp = self.params.get((id(module), name))
        where = f"{type(module).__name__}.{name}"
        if fp is None:
            raise Unsupported(f"{where} is not managed by FSDP2")
        if fp.fsdp_placement != Shard(0):
            raise Unsupported(f"{where} is sharded as {fp.fsdp_placement}, not along dim 0")
        info = fp.mesh_info
        if getattr(info, "shard_mesh_size", None) != self.world or info.shard_mesh_rank != self.rank:
            raise Unsupported(f"{where} is sharded over another group than the engine's")
        shape = tuple(int(s) for s in fp._orig_size)
        starts, sizes = dim0_layout(shape, self.world)
        device = self.device

        def local(fp: Any = fp) -> torch.Tensor:
            t = fp.sharded_param.to_local().reshape(-1)
            return t if t.device == device else t.to(device)

        dtype = self.param_dtype.get(id(fp)) or fp.sharded_param.dtype  # mixed precision: its param_dtype
        return FlatShard(shape, starts, sizes, local, dtype, self.rank, key=id(fp))

    def aside(self) -> contextlib.AbstractContextManager:
        return hooks_aside(self.units, self.hook_ids)
