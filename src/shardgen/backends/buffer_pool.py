"""Gather buffers allocated once and kept across forwards (CPU backends).

Per-layer generation gathers every layer's full weights each forward and frees them after
use. On the CPU each such buffer is a glibc ``malloc``: with glibc's own (dynamic) mmap
threshold, blocks of a few MiB come from the heap, and a freed one is soon split by the
small allocations of the compute in between, so the next gather of the same size takes
fresh memory: measured, a 40-layer Llama's per-rank peak grew to 2-4x its shard within a
few forwards (docs/PERFORMANCE.md, "Allocator"). Fixing the threshold low instead (what the
backends once did, process-wide) unmaps every freed gather, so every forward faults all of
them in again, and it changes every other allocation in the process.

So shardgen's own gathers write into memory it keeps: a :class:`BufferPool` holds the
outputs of FSDP2's unit all-gathers, of the embedding / head row chunks (``chunked.py``)
and of DeepSpeed's bucket gathers (``deepspeed/buckets.py``), and a :class:`StoragePool`
the unsharded FSDP2 parameters that FSDP2 copies out into (``fsdp2/pool.py``). A buffer is
allocated the first time one is needed, reused once nothing refers to it, and kept until
``clear``: the backends empty both pools when a training pause starts and at close, and at
close give the freed heap back (:func:`trim_heap`; not at a pause: the step reuses it). A
steady-state forward allocates no gather memory; the pools hold what one forward has in flight
at once (a decoder layer's gather and its unsharded parameters for FSDP2, two or three buckets
for DeepSpeed).

Gloo's all-gather would still allocate an output-sized temporary per call in its worker
threads (``newLikeFlat``: it gathers into a flat tensor of its own, then copies out), and
glibc's per-thread arenas keep those freed blocks, fragmented by whatever else the thread
allocated: measured on the loading test's 340 MB model at 2 ranks under load, 300-450 MB
of free heap per rank, 200 MB of it resident. So the pooled gathers are written in place
by :func:`gather_in_place` (one broadcast per rank into its slice), which allocates
nothing. Only :func:`gather_in_place` is collective.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import mmap
from typing import Any

import torch
import torch.distributed as dist


class InPlaceGather:
    """The handle of :func:`gather_in_place`: ``wait()`` waits for every broadcast."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> None:
        works, self.works = self.works, []
        for w in works:
            w.wait()


def all_gather_single() -> Any:
    """``dist.all_gather_single`` (torch >= 2.13, which deprecates ``all_gather_into_tensor`` with
    a warning), else ``all_gather_into_tensor``: looked up at each call, as a wrapper installed on
    ``torch.distributed`` later (the collective recorders of the tests) must see it."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_in_place(out: torch.Tensor, inp: torch.Tensor, group: Any) -> InPlaceGather:
    """``all_gather_into_tensor(out, inp, group)`` written in place: rank ``r``'s ``inp`` lands in
    ``out``'s ``r``-th slice of ``inp.numel()`` elements, by one broadcast per rank of ``group``
    from that rank, into that slice (``inp`` may be this rank's own slice of ``out``). Gloo
    broadcasts a contiguous tensor in place, where its all-gather allocates an output-sized
    temporary per call (see the module docstring). The same bytes move; there are ``world``
    collectives instead of one, issued at once (``async_op``) and waited by the handle.
    Collective: every rank of ``group``, same order (broadcasts from rank 0 up)."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    n = inp.numel()
    flat = out.view(-1)
    assert flat.numel() == world * n, (flat.numel(), world, n)
    mine = flat.narrow(0, me * n, n)
    if mine.data_ptr() != inp.data_ptr():
        mine.copy_(inp.reshape(-1))
    src = [dist.get_global_rank(group, r) for r in range(world)]
    works = [
        dist.broadcast(flat.narrow(0, r * n, n), src=src[r], group=group, async_op=True) for r in range(world)
    ]
    return InPlaceGather(works)


def _users(t: torch.Tensor) -> int:
    """References to ``t``'s storage (tensors viewing it, plus its Python storage object)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class BufferPool:
    """Flat buffers by dtype and device, reused across forwards until :meth:`clear`."""

    def __init__(self, block_bytes: int = 0) -> None:
        #: The least a buffer holds: the backend's largest gather (a decoder layer), so that the
        #: first, smaller gathers of a forward (embedding chunks, a norm) do not leave buffers
        #: to be replaced, and every buffer serves every gather.
        self.block_bytes = int(block_bytes)
        # (dtype, device) -> [buffer, its storage's references when only the pool holds it,
        # released by its user (see :meth:`release`)]
        self._bufs: dict[tuple[torch.dtype, torch.device], list[list[Any]]] = {}
        self.allocated = 0  # buffers allocated (tests, logs)
        self.reused = 0  # requests served by a kept buffer

    def take(self, numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements, uninitialized (as ``torch.empty``).

        The smallest kept buffer that is free and holds ``numel`` elements serves it (a view of
        its first ``numel``); failing that, a new buffer of ``numel`` (at least
        ``block_bytes``) is kept, in place of the largest free smaller one if any (so the pool
        converges to as many buffers as one forward uses at once). Free: nothing but the pool
        refers to its storage, or its user said it is done with it (:meth:`release`). A buffer
        still viewed is never handed out twice unless released."""
        numel = int(numel)
        bufs = self._bufs.setdefault((dtype, torch.device(device)), [])
        free = [i for i, (buf, alone, released) in enumerate(bufs) if released or _users(buf) == alone]
        fits = [i for i in free if bufs[i][0].numel() >= numel]
        if fits:
            self.reused += 1
            entry = bufs[min(fits, key=lambda i: bufs[i][0].numel())]
            entry[2] = False
            return entry[0].narrow(0, 0, numel)
        itemsize = torch.empty((), dtype=dtype).element_size()
        buf = torch.empty(max(numel, -(-self.block_bytes // itemsize)), dtype=dtype, device=device)
        entry = [buf, _users(buf), False]
        if free:  # all smaller: the largest is superseded
            bufs[max(free, key=lambda i: bufs[i][0].numel())] = entry
        else:
            bufs.append(entry)
        self.allocated += 1
        return buf.narrow(0, 0, numel)

    def release(self, view: torch.Tensor) -> None:
        """The user of ``view`` (from :meth:`take`) is done with it, though references to it may
        remain: a finished collective's work object, which gloo's worker thread drops only when
        it runs next, holds its output. The buffer may be handed out again at once."""
        ptr = view.untyped_storage().data_ptr()
        for bufs in self._bufs.values():
            for entry in bufs:
                if entry[0].untyped_storage().data_ptr() == ptr:
                    entry[2] = True
                    return

    def nbytes(self) -> int:
        """Bytes the pool holds."""
        return sum(e[0].numel() * e[0].element_size() for bufs in self._bufs.values() for e in bufs)

    def __len__(self) -> int:
        return sum(len(bufs) for bufs in self._bufs.values())

    def clear(self) -> None:
        """Drop every buffer (one still viewed is freed when its last view goes)."""
        self._bufs = {}


class StoragePool:
    """Memory lent to storages that their owner resizes between 0 and a fixed size each forward
    (FSDP2's unsharded parameters), by exact size: :meth:`lend` gives an empty storage the
    memory of a kept block, :meth:`take_back` returns it to the pool, leaving the storage empty
    again (what ``resize_(0)`` would). A storage still holding lent memory at :meth:`clear` keeps
    it (an ordinary block, freed when the storage frees it)."""

    def __init__(self) -> None:
        self._spare: dict[tuple[int, torch.device], list[torch.UntypedStorage]] = {}
        # storage id -> (the storage, the block holding its empty data, the pool key)
        self._lent: dict[int, tuple[Any, Any, tuple[int, torch.device]]] = {}
        self.allocated = 0
        self.reused = 0

    @staticmethod
    def supported() -> bool:
        return hasattr(torch.UntypedStorage, "_swap_data_ptr_")

    def lend(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give the empty ``storage`` ``nbytes`` of pooled memory (uninitialized)."""
        assert storage.nbytes() == 0, "lend to an empty storage only"
        key = (int(nbytes), storage.device)
        spare = self._spare.get(key)
        if spare:
            block = spare.pop()
            self.reused += 1
        else:
            block = torch.empty(int(nbytes), dtype=torch.uint8, device=storage.device).untyped_storage()
            self.allocated += 1
        storage._swap_data_ptr_(block)  # storage: the memory; block: the storage's empty data
        self._lent[storage._cdata] = (storage, block, key)

    def take_back(self, storage: torch.UntypedStorage) -> bool:
        """Return ``storage``'s lent memory to the pool (``storage`` is left empty); False when its
        memory is not lent (the caller frees it as usual)."""
        entry = self._lent.pop(storage._cdata, None)
        if entry is None:
            return False
        _, block, key = entry
        storage._swap_data_ptr_(block)
        self._spare.setdefault(key, []).append(block)
        return True

    def nbytes(self) -> int:
        """Bytes of pooled memory, lent or spare."""
        lent = sum(key[0] for _, _, key in self._lent.values())
        return lent + sum(key[0] * len(v) for key, v in self._spare.items())

    def clear(self) -> None:
        """Drop the spare blocks; lent memory stays with its storage."""
        self._spare = {}
        self._lent = {}


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, looked up once (``find_library`` runs ``ldconfig``); None without glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        trim: Any = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    return trim


def off_heap_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor on its own anonymous memory map, not on the malloc heap: freeing
    it (the last reference gone) unmaps it, so a large scratch buffer freed between tensors that
    stay leaves no hole in the heap to grow around, and needs no ``trim_heap`` (which would also
    hand back the free heap that the next training step reuses: PERFORMANCE section 13). Local."""
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    buf = mmap.mmap(-1, numel * dtype.itemsize)  # the tensor keeps it alive; unmapped with the tensor
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)


def trim_heap() -> bool:
    """Give the process's free heap memory back to the OS now (glibc's ``malloc_trim(0)``). An
    action, not a setting: called at close, after loading, and after each stationary forward on
    the CPU (``stationary/runner.py``: there no weight is gathered, so what a forward frees is its
    exchanges' and activations' temporaries, which glibc's raised mmap threshold otherwise leaves
    on the heap, fragmented: docs/PERFORMANCE.md section 8; about a microsecond when there is
    nothing to give back). Not per per-layer forward: the pools above keep its gathers, and the
    step after a pause reuses the heap. Returns False where there is no glibc."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
