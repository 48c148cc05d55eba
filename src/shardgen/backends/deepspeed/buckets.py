"""Fixed buckets of coalesced gathers for DeepSpeed ZeRO-3 forwards: few, early collectives.

With prefetch, reuse and persistence off (their collectives depend on per-rank trace state),
DeepSpeed's hooks issue one all-gather per parameterized module call (21 per forward for a
tiny Llama), and their Python bookkeeping costs about as much again per module. In
shardgen's own forwards the buckets replace them:

* computed once, from the module structure only: the gathering units (modules that own
  parameters, ZeRO-3 leaves as a whole; module order) are cut into consecutive buckets of at
  most ``bucket_bytes`` of full parameters (a larger unit is a bucket of its own);
* during the forward DeepSpeed's module hooks are set aside (``internals.hooks_suspended``);
  the buckets' own pre-hook on each unit makes its bucket available: the first time a bucket
  is needed, one coalesced all-gather of its parameters that are not available, and
  (``prefetch``) the same for the next bucket, issued before waiting, so it travels while
  this one computes;
* a bucket is released once each of its units has run (module order and call order differ:
  a Llama layer lists its norms last but calls one first), keeping the parameters that a
  started, unreleased bucket also needs; the end of the forward waits for and
  releases everything left. Nothing survives a forward: every forward starts with all
  parameters partitioned.
* on a CPU device the gathers write into the backend's ``buffer_pool.BufferPool`` (the same
  all-gathers, into buffers kept across forwards: ``pooled.PooledGather``), so a forward
  allocates no gather memory once the first one sized the pool.

Collective contract: the gathers are a function of the sequence of unit calls of the
forward only (which buckets are started or released, which parameters are available, all
reset at each forward), never of the data, of DeepSpeed's trace state or of earlier
forwards. HF decoders call the same modules in the same order in every forward, real or a
1x1 shadow, so every rank issues the same gathers in the same order, on ``param_group``.
Outside shardgen's forwards (a user's training step in ``Engine.paused()``) the buckets'
hooks do nothing and DeepSpeed's own hooks run as installed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from shardgen.backends.deepspeed import internals as ds
from shardgen.backends.deepspeed.pooled import gather_async


def cut_buckets(unit_bytes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Consecutive groups of unit indices, each at most ``bucket_bytes`` (or one oversized unit)."""
    buckets: list[list[int]] = []
    size = 0
    for i, nbytes in enumerate(unit_bytes):
        if buckets and size + nbytes <= bucket_bytes:
            buckets[-1].append(i)
            size += nbytes
        else:
            buckets.append([i])
            size = nbytes
    return buckets


class Buckets:
    """The gather schedule of one model; owns forward hooks on its units."""

    def __init__(
        self,
        root: torch.nn.Module,
        units: list[torch.nn.Module],
        offload: Any,
        bucket_bytes: int,
        prefetch: bool = True,
        pool: Any = None,
    ) -> None:
        self.root = root
        self.offload = offload
        self.prefetch = prefetch
        self.pool = pool  # buffer_pool.BufferPool the gathers write into (CPU), or None
        unit_params = [ds.unit_params(u) for u in units]
        sizes = [sum(ds.full_numel(p) * p.element_size() for p in ps) for ps in unit_params]
        self.buckets = cut_buckets(sizes, bucket_bytes)
        self.bucket_params: list[list[Any]] = []
        for members in self.buckets:
            seen: dict[int, Any] = {}
            for i in members:
                for p in unit_params[i]:
                    seen.setdefault(id(p), p)
            self.bucket_params.append(list(seen.values()))
        self._bucket_ids = [{id(p) for p in ps} for ps in self.bucket_params]
        #: Full bytes of the largest bucket (the pool's buffer size).
        self.max_bucket_bytes = max(
            (sum(ds.full_numel(p) * p.element_size() for p in ps) for ps in self.bucket_params), default=0
        )
        self._bucket_of = {id(units[i]): b for b, members in enumerate(self.buckets) for i in members}
        # Per-forward state (driver thread only): bucket -> gather handle / owned parameters /
        # units not run yet.
        self._active = False
        self._handle: dict[int, Any] = {}
        # Gathers waited for (their bucket available, ``_handle[b]`` None) until the bucket is
        # released: a pooled gather frees its buffer then (``PooledGather.released``).
        self._waited: dict[int, Any] = {}
        self._owned: dict[int, list[Any]] = {}
        self._pending: dict[int, set[int]] = {}
        self._units = units
        self._hooks = [u.register_forward_pre_hook(self._pre_unit) for u in units]
        self._hooks += [u.register_forward_hook(self._post_unit) for u in units]

    def _members(self, b: int) -> list[torch.nn.Module]:
        return [self._units[i] for i in self.buckets[b]]

    def __len__(self) -> int:
        return len(self.buckets)

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Around one of shardgen's forwards: DeepSpeed's hooks set aside, the buckets' active."""
        assert not self._active, "nested bucketed forward"
        with ds.hooks_suspended(self.offload, self.root):
            self._active = True
            try:
                yield
            finally:
                self._active = False
                self._finish()
                self._pending = {}
                self._waited = {}

    # -------------------------------------------------------------------- hooks
    def _pre_unit(self, module, _args) -> None:
        if not self._active:
            return
        b = self._bucket_of[id(module)]
        if b in self._handle and self._handle[b] is None:
            return  # available
        self._start(b)
        if self.prefetch and b + 1 < len(self.buckets):
            self._start(b + 1)
        handle = self._handle[b]
        if handle is not None:
            handle.wait()
            self._waited[b] = handle
            self._handle[b] = None

    def _post_unit(self, module, _args, _output) -> None:
        if not self._active:
            return
        b = self._bucket_of[id(module)]
        pending = self._pending.setdefault(b, {id(m) for m in self._members(b)})
        pending.discard(id(module))
        if not pending and b in self._handle:
            self._release(b)

    # -------------------------------------------------------------------- gathers
    def _start(self, b: int) -> None:
        """Issue bucket ``b``'s gather unless started. Collective on the parameters' group (one
        coalesced all-gather per dtype of its unavailable parameters), same order on every rank."""
        if b in self._handle:
            return
        todo = ds.unavailable(self.bucket_params[b])
        self._owned[b] = todo
        self._handle[b] = gather_async(todo, self.pool) if todo else None

    def _release(self, b: int) -> None:
        """Partition what bucket ``b`` gathered, except what a started bucket still needs. Local."""
        if b not in self._handle:
            return
        handle = self._handle.pop(b)
        if handle is not None:
            handle.wait()
        handle = handle if handle is not None else self._waited.pop(b, None)
        free: list[Any] = []
        for p in self._owned.pop(b):
            heir = next((c for c in self._handle if id(p) in self._bucket_ids[c]), None)
            if heir is None:
                free.append(p)
            else:
                self._owned[heir].append(p)
        ds.release(free)
        if handle is not None and hasattr(handle, "released"):
            handle.released(free)  # a pooled buffer that only ``free`` viewed serves the next gather

    def _finish(self) -> None:
        """End of a forward: wait for and release whatever is left. Local."""
        for b in list(self._handle):
            self._release(b)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
