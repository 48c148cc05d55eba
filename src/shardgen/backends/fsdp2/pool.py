"""The FSDP2 backend's gather buffers on a CPU (``buffer_pool.py``): FSDP2's unit all-gathers write into a
:class:`buffer_pool.BufferPool`, and its unsharded parameter storages take memory from a
:class:`pool.StoragePool`, in shardgen's forwards only. A mixin of :class:`fsdp2.FSDP2Backend`
(which gives ``device``, ``module``, ``units()``, ``chunked`` and ``block_bytes()``); FSDP2's
private parts it replaces are reached through ``internals.py``. Nothing here is collective; the
all-gathers stay FSDP2's, in FSDP2's order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from shardgen.backends.buffer_pool import BufferPool, StoragePool, gather_in_place, trim_heap
from shardgen.backends.fsdp2 import internals as fsdp


class PooledGathers:
    """The pools of an FSDP2 backend and the hooks that route its gathers into them."""

    #: On a CPU device: the buffers shardgen's forwards gather into (``buffer_pool.py``), kept across
    #: forwards, emptied when a training pause starts and at close. None on accelerators (torch's
    #: caching allocator keeps FSDP2's buffers there).
    pool: BufferPool | None = None
    #: On a CPU device: the memory of the unsharded parameters in shardgen's forwards, or None.
    storages: StoragePool | None = None
    _untrimmed = False  # pool memory freed (at a pause) and not yet given back (at close)

    _pooled_groups: list[Any] = []  # FSDP param groups whose all-gathers use the pool in our forwards
    _pooled_comm: Any = None

    def use_pool(self) -> None:
        """On a CPU device: gather into pooled memory in shardgen's forwards (``buffer_pool.py``). For the
        duration of each of our forwards only (``_pooled``), the FSDP param groups on FSDP2's
        default all-gather get the same collective writing into a :class:`buffer_pool.BufferPool`, and
        their parameters' unsharded storages take memory from a :class:`pool.StoragePool`
        (FSDP2 resizes them 0 <-> full around each unit's forward); a custom all-gather the
        user set is left alone. Needs FSDP2's comm interface (torch 2.8+); without it, nothing
        is pooled. Local."""
        if self.device.type != "cpu" or self.pool is not None:
            return
        groups = fsdp.default_gather_groups(self.units())
        if groups is None:
            return
        self.pool = BufferPool(self.block_bytes())  # a unit's all-gather: a decoder layer
        # In place (buffer_pool.gather_in_place): gloo's all-gather would allocate a temporary of the
        # output's size.
        self._pooled_comm = fsdp.pooled_all_gather(self.pool, gather_in_place)
        self._pooled_groups = groups
        params = fsdp.group_params(groups)
        if StoragePool.supported() and fsdp.allocation_replaceable(params):
            self.storages = StoragePool()
            self._pooled_params = params

    _pooled_params: list[Any] = []

    def _init_outputs(
        self, fsdp_param: Any, numels: list[int], dtypes: list[torch.dtype], world: int, device: torch.device
    ) -> None:
        """``FSDPParam.init_all_gather_outputs`` in our forwards (a unit's first gather): the
        unsharded outputs on pooled memory from the start, not on fresh blocks freed at reshard."""
        if len(fsdp.gather_outputs(fsdp_param)) > 0:
            return  # already initialized
        outputs = []
        for numel, dtype in zip(numels, dtypes, strict=True):
            t = torch.empty(0, dtype=dtype, device=device)
            self.storages.lend(t.untyped_storage(), numel * world * t.itemsize)
            outputs.append(t.set_(t.untyped_storage(), 0, (numel * world,), (1,)))
        fsdp.set_gather_outputs(fsdp_param, outputs)

    def _lend(self, fsdp_param: Any) -> None:
        """``FSDPParam.alloc_all_gather_outputs`` in our forwards: pooled memory, not a fresh block."""
        for t in fsdp.gather_outputs(fsdp_param):
            storage, nbytes = t.untyped_storage(), t.numel() * t.itemsize
            if storage.nbytes() == 0:
                self.storages.lend(storage, nbytes)
            elif storage.nbytes() != nbytes:
                storage.resize_(nbytes)

    def _take_back(self, fsdp_param: Any) -> None:
        """``FSDPParam.free_unsharded_param`` in our forwards: lent memory back to the pool."""
        for t in fsdp.unsharded_tensors(fsdp_param):
            storage = t.untyped_storage()
            if storage.nbytes() != 0 and not self.storages.take_back(storage):
                storage.resize_(0)

    def size_pool(self) -> None:
        """Every pooled buffer holds a decoder layer's all-gather and a row chunk. Local."""
        if self.pool is not None and self.chunked is not None:
            self.pool.block_bytes = max(self.pool.block_bytes, self.chunked.max_chunk_bytes())

    @contextlib.contextmanager
    def _pooled(self) -> Iterator[None]:
        """Around one of shardgen's forwards: the pooled all-gather in place of FSDP2's default."""
        params = self._pooled_params if self.storages is not None else []
        with (
            fsdp.all_gathers_replaced(self._pooled_groups, self._pooled_comm),
            fsdp.allocation_replaced(params, self._init_outputs, self._lend, self._take_back),
        ):
            yield

    def release_buffers(self, trim: bool = True) -> None:
        """Empty the pools; with ``trim``, give the freed heap back to the OS (``buffer_pool.trim_heap``).
        Local."""
        held = (len(self.pool) if self.pool is not None else 0) + (
            self.storages.nbytes() if self.storages is not None else 0
        )
        if self.pool is not None:
            self.pool.clear()
        if self.storages is not None:
            self.storages.clear()
        self._untrimmed = self._untrimmed or bool(held)  # freed since the last trim
        if trim and self._untrimmed:
            trim_heap()
            self._untrimmed = False
