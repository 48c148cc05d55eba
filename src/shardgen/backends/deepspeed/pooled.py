"""DeepSpeed's coalesced all-gather into buffers kept across forwards (CPU, ``buffer_pool.py``): the same
bytes DeepSpeed gathers for a bucket (same group, same output layout, same order), written
in place into a ``buffer_pool.BufferPool`` (``buffer_pool.gather_in_place``: one broadcast per rank, where
gloo's all-gather would allocate a temporary). Checked against DeepSpeed 0.19.8, like
``internals.py``, through which it reaches DeepSpeed's private parts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardgen.backends.buffer_pool import gather_in_place
from shardgen.backends.deepspeed import internals as ds
from shardgen.backends.deepspeed.internals import enum_str, find_init, has_hpz


def gather_async(params: list, pool: Any = None):
    """Start gathering ``params`` (all partitioned): one coalesced all-gather per dtype (one
    per parameter for a single one), on their ``ds_process_group``; returns a handle whose
    ``wait()`` makes them available. With a ``pool`` (``buffer_pool.BufferPool``) and parameters
    :func:`poolable`, the same all-gather (same group, same output size) writes into the
    pool's buffers instead of fresh ones (:class:`PooledGather`). Collective: every rank of
    the group, same order."""
    if pool is not None and poolable(params):
        return PooledGather(params, pool)
    return params[0].all_gather_coalesced(params)


def poolable(params: list) -> bool:
    """Whether :class:`PooledGather` gathers ``params`` exactly as DeepSpeed's coalesced path
    would: one dtype with no communication dtype, shards in memory on the CPU (no NVMe, no
    quantized or hpZ secondary partition), one group of several ranks, and the ``zero.Init``
    fetching by all-gather (not all-reduce). The same answer on every rank of the group."""
    p0 = params[0]
    group, dtype = p0.ds_process_group, p0.ds_tensor.dtype
    init = find_init(p0)
    if init is None or ds.fetches_by_all_reduce(init) or has_hpz(params):
        return False
    if dist.get_world_size(group) < 2:
        return False
    for p in params:
        t = p.ds_tensor
        if p.ds_process_group is not group or t.dtype != dtype or ds.allgather_dtype(p, t) != dtype:
            return False
        if t.device.type != "cpu" or enum_str(getattr(t, "final_location", None)) == "nvme":
            return False
        if hasattr(t, "ds_quant_scale"):
            return False
    return True


class PooledGather:
    """DeepSpeed's coalesced all-gather (``partition_parameters._all_gather_dtype`` and its
    handle's ``wait``, 0.19.8) into buffers of a ``buffer_pool.BufferPool``: the shards, ordered by
    ``ds_id``, are copied into this rank's slice of one flat buffer, gathered in place
    (``buffer_pool.gather_in_place`` on their ``ds_process_group``; DeepSpeed issues one
    ``all_gather_into_tensor`` of the same layout), and
    ``wait`` copies each parameter's pieces into one buffer for the bucket (a single
    parameter is used where it was gathered), sets ``param.data`` to its view and marks it
    available. Releasing (``released``) drops the views; the pool keeps the memory. The gather
    is collective: every rank of the group constructs it, in the same order."""

    def __init__(self, params: list, pool: Any) -> None:
        self.params = sorted(params, key=lambda p: p.ds_id)
        self.pool = pool
        p0 = self.params[0]
        group = p0.ds_process_group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        self.part = sum(p.ds_tensor.ds_numel for p in self.params)
        self.world = world
        ds.mark_inflight(self.params)
        dtype, device = p0.ds_tensor.dtype, p0.ds_tensor.device
        self.flat = pool.take(self.part * world, dtype, device)
        mine = self.flat.narrow(0, self.part * rank, self.part)
        torch.cat([p.ds_tensor.reshape(-1) for p in self.params], out=mine)
        self.work = gather_in_place(self.flat, mine, group)  # no gloo temporary (buffer_pool.py)

    def wait(self) -> None:
        if self.work is None:
            return
        self.work.wait()
        self.work = None
        flat, part = self.flat, self.part
        if len(self.params) == 1:
            p = self.params[0]
            p.data = flat.narrow(0, 0, p.ds_numel).view(p.ds_shape)
            ds.mark_available(p)
            self._viewed = flat  # until ``released``: p.data is a view of it
        else:
            full = self.pool.take(sum(p.ds_numel for p in self.params), flat.dtype, flat.device)
            lo = offset = 0
            for p in self.params:
                shard = p.ds_tensor.ds_numel
                dst = full.narrow(0, lo, p.ds_numel)
                for r in range(self.world):
                    start = r * shard
                    if start < p.ds_numel:
                        n = min(p.ds_numel - start, shard)
                        dst[start : start + n].copy_(flat.narrow(0, r * part + offset, n))
                p.data = dst.view(p.ds_shape)
                ds.mark_available(p)
                lo += p.ds_numel
                offset += shard
            self.pool.release(flat)  # copied out: the next gather may write into it
        self.flat = None

    _viewed: torch.Tensor | None = None

    def released(self, params: list) -> None:
        """``params`` were partitioned again (DeepSpeed's release: their ``data`` emptied). A single
        parameter's buffer, which it viewed, may then serve the next gather at once, though
        gloo's worker can still hold a reference to it (the finished work object, dropped only
        when the worker runs next: under load, after the next gather asked for a buffer)."""
        p0 = self.params[0]
        if self._viewed is not None and any(p is p0 for p in params):
            # Only once the partition really dropped the view (a buffer still viewed is never
            # handed out again: it is freed when its last view goes).
            if p0.data.untyped_storage().data_ptr() != self._viewed.untyped_storage().data_ptr():
                self.pool.release(self._viewed)
            self._viewed = None
