"""A fixed plan of coalesced gathers for DeepSpeed ZeRO-3 forwards: few, early collectives.

With prefetch, reuse and persistence off (their collectives depend on per-rank trace state),
DeepSpeed's hooks issue one all-gather per parameterized module call: 21 per forward for a
tiny Llama. The plan puts them back together without giving up the lockstep guarantee:

* computed once, from the module structure only: the gathering units (``units``, module
  order) are cut into consecutive buckets of at most ``bucket_bytes`` of full parameters
  (a unit larger than that is a bucket of its own);
* the first time in a forward that a unit of bucket *b* is called, one coalesced all-gather
  of every parameter of bucket *b* that is not available is issued, and (``prefetch``) the
  same for bucket *b+1*, so the next bucket travels while this one computes;
* the gathers go through DeepSpeed's coordinator, which registers them as in flight: each
  module's own hook then waits for its parameters instead of gathering them, and releases
  them after the module runs, as it always does (so at most about two buckets are whole);
* at the end of the forward, anything still in flight is waited for and released.

Collective contract: every gather above is a function of the sequence of module calls of the
forward (which buckets have started, which parameters are available), never of the data, of
trace state or of earlier forwards (nothing survives a forward). HF decoders call the same
modules in the same order in every forward, real or a 1x1 shadow, so every rank issues the
same gathers in the same order, on ``param_group``. The plan is only active inside
shardgen's own forwards (``internals.lockstep_forward``); a user's forwards (training in
``Engine.paused()``) run DeepSpeed's hooks untouched.
"""

from __future__ import annotations

from typing import Any

import torch

from . import internals as ds


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


class BucketPlan:
    """The gather schedule of one model; installs forward hooks on its units and root."""

    def __init__(
        self,
        root: torch.nn.Module,
        units: list[torch.nn.Module],
        offload: Any,
        bucket_bytes: int,
        prefetch: bool = True,
    ) -> None:
        self.offload = offload
        self.prefetch = prefetch
        self.unit_params = [ds.unit_params(u) for u in units]
        sizes = [sum(ds.full_numel(p) * p.element_size() for p in ps) for ps in self.unit_params]
        self.buckets = cut_buckets(sizes, bucket_bytes)
        self.bucket_params: list[list[Any]] = []
        for members in self.buckets:
            seen: dict[int, Any] = {}
            for i in members:
                for p in self.unit_params[i]:
                    seen.setdefault(id(p), p)
            self.bucket_params.append(list(seen.values()))
        self._bucket_of = {id(units[i]): b for b, members in enumerate(self.buckets) for i in members}
        self._started: set[int] = set()  # buckets gathered in this forward (driver thread only)
        self._handles: list[Any] = []
        for unit in units:
            self._handles.append(unit.register_forward_pre_hook(self._pre_unit, prepend=True))
        self._handles.append(root.register_forward_pre_hook(self._start, prepend=True))
        ds.after_reset_hook(offload, root)  # our root hooks run after DeepSpeed's reset_step
        self._handles.append(root.register_forward_hook(self._end))

    def __len__(self) -> int:
        return len(self.buckets)

    # -------------------------------------------------------------------- hooks
    def _start(self, _module, _args) -> None:
        if ds.in_lockstep_forward():
            self._started = set()

    def _pre_unit(self, module, _args) -> None:
        if not ds.in_lockstep_forward():
            return
        b = self._bucket_of[id(module)]
        if b in self._started:
            return
        self._gather(b)
        if self.prefetch and b + 1 < len(self.buckets):
            self._gather(b + 1)

    def _gather(self, b: int) -> None:
        """One coalesced all-gather of bucket ``b``'s unavailable parameters (async; the
        module hooks wait). Collective on the parameters' group, in the same order everywhere."""
        if b in self._started:
            return
        self._started.add(b)
        ds.gather_async(self.offload, self.bucket_params[b])

    def _end(self, _module, _args, _output) -> None:
        if ds.in_lockstep_forward():
            ds.drain_in_flight(self.offload)  # local: these gathers were issued on every rank
            self._started = set()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
