"""The FSDP2 backend's gather buffers on a CPU (``pool.py``): FSDP2's unit all-gathers write into a
:class:`pool.BufferPool`, and its unsharded parameter storages take memory from a
:class:`pool.StoragePool`, in shardgen's forwards only. A mixin of :class:`fsdp2.FSDP2Backend`
(which gives ``device``, ``module``, ``units()``, ``chunked`` and ``block_bytes()``). Nothing here
is collective; the all-gathers stay FSDP2's, in FSDP2's order.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Iterator
from typing import Any

import torch

from shardgen.backends.pool import BufferPool, StoragePool, gather_in_place, trim_heap


def pooled_all_gather(pool: BufferPool) -> Any:
    """FSDP2's default all-gather, its output buffer taken from ``pool`` and written in place
    (``pool.gather_in_place``). Collective when called, as FSDP2 calls it: every rank of the
    unit's group, in module order."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    class PooledAllGather(DefaultAllGather):
        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            numel = 1
            for s in size:
                numel *= int(s)
            return pool.take(numel, dtype, device).view(*(int(s) for s in size))

        def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):  # type: ignore[override]
            # In place (pool.gather_in_place): gloo's all-gather would allocate a temporary of
            # the output's size. Waited here, so FSDP2 sees a finished gather (None: no work).
            gather_in_place(output_tensor, input_tensor, group).wait()
            return None

    return PooledAllGather()


class PooledGathers:
    """The pools of an FSDP2 backend and the hooks that route its gathers into them."""

    #: On a CPU device: the buffers shardgen's forwards gather into (``pool.py``), kept across
    #: forwards, emptied when a training pause starts and at close. None on accelerators (torch's
    #: caching allocator keeps FSDP2's buffers there).
    pool: BufferPool | None = None
    #: On a CPU device: the memory of the unsharded parameters in shardgen's forwards, or None.
    storages: StoragePool | None = None
    _untrimmed = False  # pool memory freed (at a pause) and not yet given back (at close)

    _pooled_groups: list[Any] = []  # FSDP param groups whose all-gathers use the pool in our forwards
    _pooled_comm: Any = None

    def use_pool(self) -> None:
        """On a CPU device: gather into pooled memory in shardgen's forwards (``pool.py``). For the
        duration of each of our forwards only (``_pooled``), the FSDP param groups on FSDP2's
        default all-gather get the same collective writing into a :class:`pool.BufferPool`, and
        their parameters' unsharded storages take memory from a :class:`pool.StoragePool`
        (FSDP2 resizes them 0 <-> full around each unit's forward); a custom all-gather the
        user set is left alone. Needs FSDP2's comm interface (torch 2.8+); without it, nothing
        is pooled. Local."""
        if self.device.type != "cpu" or self.pool is not None:
            return
        try:
            from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather
        except ImportError:
            return
        groups: dict[int, Any] = {}
        for unit in self.units():
            for pg in unit._get_fsdp_state()._fsdp_param_groups:
                if type(getattr(pg, "_all_gather_comm", None)) is DefaultAllGather:
                    groups.setdefault(id(pg), pg)
        self.pool = BufferPool(self.block_bytes())  # a unit's all-gather: a decoder layer
        self._pooled_comm = pooled_all_gather(self.pool)
        self._pooled_groups = list(groups.values())
        params = [fp for pg in self._pooled_groups for fp in pg.fsdp_params]
        hooks = ("init_all_gather_outputs", "alloc_all_gather_outputs", "free_unsharded_param")
        if StoragePool.supported() and all(hasattr(fp, h) for fp in params for h in hooks):
            self.storages = StoragePool()
            self._pooled_params = params

    _pooled_params: list[Any] = []

    def _init_outputs(
        self, fsdp_param: Any, numels: list[int], dtypes: list[torch.dtype], world: int, device: torch.device
    ) -> None:
        """``FSDPParam.init_all_gather_outputs`` in our forwards (a unit's first gather): the
        unsharded outputs on pooled memory from the start, not on fresh blocks freed at reshard."""
        if len(fsdp_param.all_gather_outputs) > 0:
            return  # already initialized
        outputs = []
        for numel, dtype in zip(numels, dtypes, strict=True):
            t = torch.empty(0, dtype=dtype, device=device)
            self.storages.lend(t.untyped_storage(), numel * world * t.itemsize)
            outputs.append(t.set_(t.untyped_storage(), 0, (numel * world,), (1,)))
        fsdp_param.all_gather_outputs = outputs

    def _lend(self, fsdp_param: Any) -> None:
        """``FSDPParam.alloc_all_gather_outputs`` in our forwards: pooled memory, not a fresh block."""
        for t in fsdp_param.all_gather_outputs:
            storage, nbytes = t.untyped_storage(), t.numel() * t.itemsize
            if storage.nbytes() == 0:
                self.storages.lend(storage, nbytes)
            elif storage.nbytes() != nbytes:
                storage.resize_(nbytes)

    def _take_back(self, fsdp_param: Any) -> None:
        """``FSDPParam.free_unsharded_param`` in our forwards: lent memory back to the pool."""
        for t in itertools.chain(fsdp_param.all_gather_outputs, fsdp_param._unsharded_inner_tensors):
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
        saved = [(pg, pg._all_gather_comm) for pg in self._pooled_groups]
        for pg, _ in saved:
            pg._all_gather_comm = self._pooled_comm
        params = self._pooled_params if self.storages is not None else []
        for fp in params:
            fp.init_all_gather_outputs = functools.partial(self._init_outputs, fp)
            fp.alloc_all_gather_outputs = functools.partial(self._lend, fp)
            fp.free_unsharded_param = functools.partial(self._take_back, fp)
        try:
            yield
        finally:
            for pg, comm in saved:
                pg._all_gather_comm = comm
            for fp in params:
                del fp.init_all_gather_outputs, fp.alloc_all_gather_outputs, fp.free_unsharded_param

    def release_buffers(self, trim: bool = True) -> None:
        """Empty the pools; with ``trim``, give the freed heap back to the OS (``pool.trim_heap``).
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
