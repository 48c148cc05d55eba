"""FSDP2's shards gathered into the plain replica with few collectives (``gather="once"``).

Unsharding unit by unit costs one all-gather per FSDP unit plus FSDP2's copy-out and Python
bookkeeping per unit: on a small model that is most of a ``once`` gather (7 units of the toy
model: 20 ms, against 2-5 ms for its bytes). Every shard is a dim-0 ``torch.chunk`` of its
parameter (rank ``r`` holds rows ``[r * c, r * c + c)``), so the shards of many parameters can
travel in one collective: each rank packs its shards, padded to ``c`` rows, into one flat
buffer; one gather (``gather_in_place`` on a CPU, the plain all-gather elsewhere) fills a
``[world, n]`` buffer whose row ``r`` holds rank ``r``'s shards; each parameter's full value is
copied out of its column. The parameters go in module order in chunks of at most ``budget``
bytes gathered (one parameter alone may exceed it), so the peak is the replica plus one chunk,
as with unit-by-unit gathers.

A model whose shards are laid out otherwise (another placement, a shard group other than the
engine's: a 2-D mesh) gets no plan (``plan_whole`` returns None) and is gathered unit by unit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardgen.backends.fsdp2 import internals as fsdp
from shardgen.backends.pool import all_gather_single, gather_in_place
from shardgen.backends.replica import Replica
from shardgen.backends.stationary.shards import dim0_layout


@dataclass(frozen=True)
class _Param:
    name: str  # a name of it in the model (the replica ties the others)
    shard: Any  # () -> this rank's shard, flat
    shape: tuple[int, ...]
    dtype: torch.dtype  # the replica's: the unit's compute dtype (mixed precision) or the shard's
    padded: int  # elements per rank in the packed buffer (c rows)
    sizes: tuple[int, ...]  # elements rank r really holds


@dataclass(frozen=True)
class _Chunk:
    dtype: torch.dtype  # the shards' dtype: what travels
    params: tuple[_Param, ...]
    offsets: tuple[int, ...]  # of each parameter in a rank's packed row
    numel: int  # a rank's packed row


def plan_whole(model: nn.Module, units: list[nn.Module], group: Any, budget: int) -> list[_Chunk] | None:
    """The chunks that gather every FSDP parameter of ``model`` over ``group``, or None when one
    is not a dim-0 shard over ``group`` (then gather unit by unit). Local."""
    from torch.distributed.tensor import Shard

    world, me = dist.get_world_size(group), dist.get_rank(group)
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    params: list[tuple[torch.dtype, _Param]] = []
    seen: set[int] = set()
    for unit in units:
        for fp, compute in fsdp.unit_params(unit):
            if id(fp) in seen:
                continue
            seen.add(id(fp))
            placement, size, rank, shape, shard_dtype = fsdp.shard_facts(fp)
            if placement != Shard(0) or size != world or rank != me or not shape:
                return None
            module, attr = fsdp.param_places(fp)[0]
            prefix = names.get(id(module))
            if prefix is None:
                return None
            _, sizes = dim0_layout(shape, world)
            rest = 1
            for s in shape[1:]:
                rest *= int(s)
            padded = -(-int(shape[0]) // world) * rest
            name = f"{prefix}.{attr}" if prefix else attr
            p = _Param(name, fsdp.local_shard(fp), shape, compute or shard_dtype, padded, tuple(sizes))
            params.append((shard_dtype, p))
    chunks: list[_Chunk] = []
    cur: list[_Param] = []
    cur_dtype: torch.dtype | None = None
    cur_bytes = 0
    for dtype, p in params:
        nbytes = p.padded * world * dtype.itemsize
        if cur and (dtype != cur_dtype or cur_bytes + nbytes > budget):
            chunks.append(_chunk(cur_dtype, cur))
            cur, cur_bytes = [], 0
        cur.append(p)
        cur_dtype = dtype
        cur_bytes += nbytes
    if cur:
        chunks.append(_chunk(cur_dtype, cur))
    return chunks


def _chunk(dtype: Any, params: list[_Param]) -> _Chunk:
    offsets, n = [], 0
    for p in params:
        offsets.append(n)
        n += p.padded
    return _Chunk(dtype, tuple(params), tuple(offsets), n)


def fill(replica: Replica, chunks: list[_Chunk], group: Any, device: torch.device) -> None:
    """Load every planned parameter into ``replica``. Collective on ``group``: one gather per
    chunk (``world`` broadcasts on a CPU), in the plan's order, every rank in the same tick."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    for chunk in chunks:
        out = torch.empty((world, chunk.numel), dtype=chunk.dtype, device=device)
        mine = out[me]
        for p, off in zip(chunk.params, chunk.offsets, strict=True):
            local = p.shard()
            assert local.numel() == p.sizes[me], (p.name, local.numel(), p.sizes, me)
            mine.narrow(0, off, local.numel()).copy_(local)  # the padding rows travel unset
        if device.type == "cpu":
            gather_in_place(out, mine, group).wait()  # gloo's all-gather allocates a temporary
        else:
            all_gather_single()(out.view(-1), mine, group=group)
        for p, off in zip(chunk.params, chunk.offsets, strict=True):
            full = torch.empty(p.shape, dtype=p.dtype, device=device)
            flat = full.view(-1)
            if all(s == p.padded for s in p.sizes):  # rows divide evenly: one strided copy
                flat.view(world, p.padded).copy_(out[:, off : off + p.padded])
            else:
                start = 0
                for r, s in enumerate(p.sizes):
                    flat.narrow(0, start, s).copy_(out[r, off : off + s])
                    start += s
            replica.put(p.name, full)
        del out
