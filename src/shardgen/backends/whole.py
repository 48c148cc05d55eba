"""A replica filled from many parameters' shards per collective (``gather="once"``).

A backend's own gathers come unit by unit (FSDP2: one all-gather per FSDP unit, then its
copy-out; DeepSpeed: one coalesced all-gather per bucket, with its Python bookkeeping per
parameter): on a small model that is most of a ``once`` gather (the toy model on FSDP2: 20 ms
for 7 units, against 4.5 ms here). Both backends leave each rank a contiguous run of every
parameter's flat elements (``stationary/shards.py``: a :class:`FlatShard`), so the shards of
many parameters can travel together: each rank packs its runs, each padded to the longest
rank's, into one row; one gather (``gather_in_place`` on a CPU, the plain all-gather elsewhere)
fills a ``[world, n]`` buffer whose row ``r`` holds rank ``r``'s runs; each parameter's full
value is copied out of its columns into a tensor the replica takes as it is. Parameters go in
module order in chunks of at most ``budget`` bytes gathered (one parameter alone may exceed
it), so the peak is the replica plus one chunk, as with unit-by-unit gathers.

A backend builds the layout from its stationary mode's ``Source`` (``layout`` returns None when one
parameter is not covered: the backend then gathers its own way). Nothing here is collective
except :func:`fill`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardgen.backends.buffer_pool import all_gather_single, gather_in_place, off_heap_empty
from shardgen.backends.replica import Replica
from shardgen.backends.stationary.shards import FlatShard


@dataclass(frozen=True)
class Chunk:
    """Parameters gathered by one collective: their names in the model (the replica ties the
    others), shards, offsets in a rank's packed row, and the row's length."""

    dtype: torch.dtype  # what travels: the forwards' dtype (a cast before the gather, as FSDP2's)
    names: tuple[str, ...]
    shards: tuple[FlatShard, ...]
    offsets: tuple[int, ...]
    numel: int


def layout(
    model: nn.Module, shard: Callable[[nn.Module, str], FlatShard], unsupported: type[Exception], budget: int
) -> list[Chunk] | None:
    """Every parameter of ``model`` (each distinct one once, in module order) through ``shard``
    (a ``Source.shard``), in chunks of at most ``budget`` bytes gathered; None when ``shard``
    raises ``unsupported`` for one. Local."""
    named: list[tuple[str, FlatShard]] = []
    seen: set[Any] = set()
    for prefix, module in model.named_modules():
        for leaf in module._parameters:
            if module._parameters[leaf] is None:
                continue
            try:
                s = shard(module, leaf)
            except unsupported:
                return None
            key = s.key if s.key is not None else id(module._parameters[leaf])
            if key in seen:  # tied: one tensor in the replica
                continue
            seen.add(key)
            named.append((f"{prefix}.{leaf}" if prefix else leaf, s))
    return list(_cut(named, budget))


def _cut(named: Iterable[tuple[str, FlatShard]], budget: int) -> Iterable[Chunk]:
    cur: list[tuple[str, FlatShard]] = []
    nbytes = 0
    for name, s in named:
        size = max(s.sizes) * s.world * s.dtype.itemsize
        if cur and (s.dtype != cur[0][1].dtype or nbytes + size > budget):
            yield _chunk(cur)
            cur, nbytes = [], 0
        cur.append((name, s))
        nbytes += size
    if cur:
        yield _chunk(cur)


def _chunk(named: list[tuple[str, FlatShard]]) -> Chunk:
    offsets, n = [], 0
    for _, s in named:
        offsets.append(n)
        n += max(s.sizes)
    names, shards = zip(*named, strict=True)
    return Chunk(shards[0].dtype, names, shards, tuple(offsets), n)


def fill(replica: Replica, chunks: list[Chunk], group: Any, device: torch.device) -> None:
    """Load every laid-out parameter into ``replica``. Collective on ``group``: one gather per
    chunk (``world`` broadcasts on a CPU), in the layout's order, every rank in the same tick."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    for chunk in chunks:
        if device.type == "cpu":
            # Off the heap: freed between the replica's tensors, a heap buffer left a hole that the
            # next fills grew around (a loaded job's memory: +30 to +52 MB per 1,000 prompts).
            out = off_heap_empty((world, chunk.numel), chunk.dtype)
        else:
            out = torch.empty((world, chunk.numel), dtype=chunk.dtype, device=device)
        mine = out[me]
        for s, off in zip(chunk.shards, chunk.offsets, strict=True):
            n = s.sizes[me]
            if n:
                mine.narrow(0, off, n).copy_(s.local()[:n])  # the padding travels unset
        if world > 1 and device.type == "cpu":
            gather_in_place(out, mine, group).wait()  # gloo's all-gather allocates a temporary
        elif world > 1:
            all_gather_single()(out.view(-1), mine, group=group)
        for name, s, off in zip(chunk.names, chunk.shards, chunk.offsets, strict=True):
            full = torch.empty(s.shape, dtype=s.dtype, device=device)
            flat = full.view(-1)
            pad = max(s.sizes)
            if all(n == pad and a == r * pad for r, (a, n) in enumerate(zip(s.starts, s.sizes, strict=True))):
                flat.view(world, pad).copy_(out[:, off : off + pad])  # runs of equal length: one copy
            else:
                for r, (a, n) in enumerate(zip(s.starts, s.sizes, strict=True)):
                    if n:
                        flat.narrow(0, a, n).copy_(out[r, off : off + n])
            replica.put(name, full)
        del out
