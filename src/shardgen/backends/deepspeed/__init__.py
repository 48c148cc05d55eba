"""DeepSpeed ZeRO-3 backend: partitioned parameters, gathered on shardgen's private group.

Two ways in: a plain model, which shardgen partitions (``partition.py``), or a model the
user partitioned, whose traffic shardgen moves to its group (``adopt.py``). Every
version-pinned DeepSpeed detail lives in ``internals.py``; docs/DEEPSPEED.md says what
shardgen changes in a ZeRO-3 model and why (checked against DeepSpeed 0.19.8).

Collective contract (all ranks of ``param_group``, in the same order):

* ``create``: a plain model: ``zero.Init`` broadcasts every weight from the group's first
  rank; a user-partitioned one: no collective.
* ``forward`` / ``shadow_forward``: a model shardgen partitioned gathers its embeddings and
  head in row chunks (``chunked.py``: a fixed number of all-gathers per module, a function
  of its shape only), then for the other modules: with ``bucket_bytes > 0`` (default), one coalesced
  all-gather per bucket of consecutive modules of a fixed plan (``buckets.py``; on a CPU device
  written as one broadcast per rank into pooled buffers, ``pooled.py``), on accelerators the
  next bucket issued while one computes; with ``bucket_bytes=0``, for each module call in
  execution order one all-gather of that module's own parameters (the whole subtree for a
  ZeRO-3 leaf). Either way, on ``param_group`` and a function of the module call order only
  (DeepSpeed's prefetch, reuse and persistence are off), so a 1x1 dummy forward issues
  exactly the gathers of any real forward.
* ``gather_all``: one coalesced all-gather per bucket (per unit without a plan), copied into
  a plain replica; forwards then issue nothing until ``release_all`` (local: frees it).
* ``close``: no collective.

DeepSpeed is imported lazily, with an install hint, when a backend is created.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardgen.backends.base import Backend
from shardgen.backends.buffer_pool import BufferPool, trim_heap
from shardgen.backends.chunked import (
    ChunkedModules,
    FlatWeight,
    active,
    chunk_budget,
    chunked_modules,
    hook_ids,
)
from shardgen.backends.deepspeed import internals as ds
from shardgen.backends.deepspeed import pause
from shardgen.backends.deepspeed.pooled import gather_async
from shardgen.backends.parts import largest_layer_bytes, vocab_modules
from shardgen.backends.replica import Replica
from shardgen.log import get_logger

log = get_logger()


def default_bucket_bytes(device: torch.device) -> int:
    """4 MiB on CPU (gloo: small buffers measured faster than fewer collectives, see
    docs/PERFORMANCE.md), 64 MiB on accelerators (DeepSpeed-like buckets, prefetched)."""
    return 4 * 2**20 if device.type == "cpu" else 64 * 2**20


class DeepSpeedBackend(Backend):
    name = "deepspeed"
    _untrimmed = False  # pool memory freed (at a pause) and not yet given back (at close)

    def __init__(self, hf_model, module, device, *, offload, param_group, offload_device: str, created: bool):
        super().__init__(hf_model, module, device)
        self.offload = offload  # DeepSpeedZeRoOffload: the hooks and their coordinator
        self.param_group = param_group
        self.offload_device = offload_device
        self.created = created  # True when shardgen partitioned the model itself
        self.lockstep = True
        self.buckets = None  # Buckets: the coalesced gathers of a lockstep forward
        self.chunked: ChunkedModules | None = None  # embeddings / head gathered in row chunks
        # On a CPU device: the buffers shardgen's forwards gather into (``buffer_pool.py``), kept across
        # forwards, emptied when a training pause starts and at close.
        self.pool: BufferPool | None = BufferPool() if self.device.type == "cpu" else None

    def use_buckets(self, bucket_bytes: int, prefetch: bool | None = None) -> None:
        """Gather in a fixed plan of buckets of ``bucket_bytes`` (0: module by module). Every
        rank must call it with the same values before its first forward. ``prefetch`` (gather
        the next bucket while one computes; None: on accelerators, where the transfer runs
        beside the compute, not on CPU, where gloo's thread takes cores from the compute)."""
        if prefetch is None:
            prefetch = self.device.type != "cpu"
        from shardgen.backends.deepspeed.buckets import Buckets

        if self.buckets is not None:
            self.buckets.remove()
            self.buckets = None
        if bucket_bytes > 0:
            skip = {id(m) for m in self.chunked.modules} if self.chunked is not None else set()
            units = [u for u in self.units() if id(u) not in skip]
            self.buckets = Buckets(self.module, units, self.offload, bucket_bytes, prefetch, self.pool)
            n = len(self.buckets)
            log.info(
                "%d modules gathered in %d bucket%s of <= %.1f MB",
                len(self.units()),
                n,
                "" if n == 1 else "s",
                bucket_bytes / 2**20,
            )
        if self.pool is not None:  # every buffer fits the largest bucket and a row chunk
            chunk = self.chunked.max_chunk_bytes() if self.chunked is not None else 0
            self.pool.block_bytes = max(self.buckets.max_bucket_bytes if self.buckets else 0, chunk)

    @classmethod
    def create(
        cls,
        model: Any,
        *,
        param_group: Any,
        device: torch.device,
        ds_config: dict | None = None,
        bucket_bytes: int | None = None,
        prefetch: bool | None = None,
        chunk_bytes: int | None = None,
        **_: Any,
    ) -> DeepSpeedBackend:
        """Partition ``model`` on ``param_group`` (or move a partitioned one there). ``chunk_bytes``:
        the row chunks of the embeddings / head of a model shardgen partitions (None: a decoder
        layer; 0: whole).

        Collective on ``param_group`` for a plain model (every rank, same order); local for a
        model DeepSpeed partitioned already."""
        device = torch.device(device)
        deepspeed = ds.import_deepspeed(device)
        ds.ensure_ds_comm(deepspeed)
        ds.ensure_local_rank(device)
        ds.install_trace_check_switch()
        from deepspeed.runtime.engine import DeepSpeedEngine

        engine = model if isinstance(model, DeepSpeedEngine) else None
        module = engine.module if engine is not None else model
        params = list(module.parameters())
        if not params:
            raise ValueError("the model has no parameters")
        n_zero = sum(hasattr(p, "ds_id") for p in params)
        if engine is not None and engine.zero_optimization_stage() != 3:
            raise ValueError(
                f"the DeepSpeed engine runs ZeRO stage {engine.zero_optimization_stage()}, which does not "
                "partition parameters; use stage 3, or pass the plain model (backend 'deepspeed' shards it)"
            )
        if n_zero == 0:
            from shardgen.backends.deepspeed.partition import partition

            offload, odev = partition(module, param_group, device, ds_config)
            created = True
        else:
            if n_zero != len(params):
                n_plain = len(params) - n_zero
                raise ValueError(f"{n_plain} of {len(params)} parameters are not ZeRO-3 parameters")
            if ds_config:
                log.warning("shardgen: ds_config is ignored for a model that DeepSpeed partitioned already")
            from shardgen.backends.deepspeed.adopt import adopt

            user_setup = pause.capture_user(engine, module)  # handed back in training pauses
            offload, odev = adopt(engine, module, param_group, device)
            created = False
        backend = cls(
            module,
            module,
            device,
            offload=offload,
            param_group=param_group,
            offload_device=odev,
            created=created,
        )
        # Not a user's ZeRO-3 model; NVMe-offloaded partitions are not in ds_tensor between gathers.
        if (created or getattr(module, "_shardgen_sharded", False)) and odev != "nvme":
            backend.chunked = chunk_vocab(module, param_group, chunk_bytes, offload, backend.pool)
        if bucket_bytes is None:
            bucket_bytes = default_bucket_bytes(device)
        backend.use_buckets(bucket_bytes, prefetch)
        if not created:
            backend._user_setup = user_setup
        return backend

    # ------------------------------------------------------------------ forwards
    def _per_layer_forward(self, **inputs: Any) -> Any:
        """One forward: the row chunks of the chunked modules, the plan's buckets (or one gather per
        unit). Collective on the param group while ``lockstep`` (the module contract). In the
        stationary mode (``Backend.forward``) DeepSpeed's hooks are set aside by its source."""
        with ds.lockstep_forward(), active(self.chunked):
            if self.buckets is None:
                return self.module(**inputs)
            with self.buckets.forward():
                return self.module(**inputs)

    def enable_stationary(self) -> str | None:
        """The weight-stationary mode over the flat partitions (``backends/stationary``). Local."""
        from shardgen.backends.deepspeed.stationary import DeepSpeedSource
        from shardgen.backends.stationary import Stationary, Unsupported

        odev = self.offload_device
        source = DeepSpeedSource(self.module, self.offload, self.param_group, self.device, odev)
        try:
            self.stationary = Stationary.create(self.module, source, self.towers)
        except Unsupported as e:
            return str(e)
        return None

    def per_layer_cost(self) -> Any:
        """One coalesced all-gather per bucket (per unit without a plan) and per row chunk."""
        from shardgen.backends.stationary import gathered_cost

        n = len(self.buckets) if self.buckets is not None else len(self.units())
        if self.chunked is not None:
            n += sum(self.chunked.describe().values())
            if self.buckets is None:  # the chunked modules are units too
                n -= len(self.chunked.modules)
        return gathered_cost(n, self.full_param_bytes(), dist.get_world_size(self.param_group))

    # ------------------------------------------------------------------ gather policy once
    def gather_all(self) -> None:
        """Fill the plain replica (``replica.py``); forwards then run on it. Partitions in memory
        over the param group (no NVMe, no hpZ) travel in chunks of many parameters
        (``backends/whole.py``), without DeepSpeed's per-parameter bookkeeping; others chunk by
        chunk through DeepSpeed: its buckets, else one unit at a time. Collective on the
        param group: one gather per chunk, every rank in the same tick and order."""
        from shardgen.backends.deepspeed.stationary import DeepSpeedSource

        if self.replica is not None and self.replica.live:
            return
        if self.replica is None:
            self.replica = Replica(self.module, type(self.module), self.device)
        odev = self.offload_device
        source = lambda: DeepSpeedSource(self.module, self.offload, self.param_group, self.device, odev)  # noqa: E731
        if self._fill_whole(source, self.WHOLE_CHUNK_BYTES):
            self.replica.finish()
            self.lockstep = False
            return
        names = {id(p): n for n, p in self.module.named_parameters()}
        if self.buckets is not None:
            chunks = self.buckets.bucket_params
            if self.chunked is not None:  # in no bucket: gathered whole here
                chunks = chunks + [ds.unit_params(m) for m in self.chunked.modules]
        else:
            chunks = [ds.unit_params(u) for u in self.units()]
        with ds.lockstep_forward():
            for chunk in chunks:
                chunk = [p for p in chunk if not self.replica.has(names[id(p)])]
                todo = ds.unavailable(chunk)
                if todo:
                    gather_async(todo).wait()
                for p in chunk:
                    self.replica.load(names[id(p)], p.data)
                ds.release(todo)
        self.replica.finish()
        self.lockstep = False

    # ------------------------------------------------------------------ introspection
    def units(self) -> list[torch.nn.Module]:
        """Modules whose forward pre-hook gathers: owners of parameters and ZeRO-3 leaves (not
        their children), in module order. Each call of one is one all-gather on the param group."""
        from deepspeed.utils import z3_leaf_module

        out: list[torch.nn.Module] = []
        skip: set[int] = set()
        for m in self.module.modules():
            if id(m) in skip:
                continue
            if z3_leaf_module(m):
                skip.update(id(c) for c in m.modules())
                out.append(m)
            elif any(True for _ in m.parameters(recurse=False)):
                out.append(m)
        return out

    # ------------------------------------------------------------------ training pauses
    _user_setup: pause.ZeroSetup | None = None  # a user-partitioned model's own setup
    _gen_setup: pause.ZeroSetup | None = None  # shardgen's, while a pause holds the user's

    def enter_pause(self) -> None:
        """A model from ``deepspeed.initialize`` gets its own groups, coordinator (prefetch,
        reuse) and persistence back for training (``pause.py``); the pooled gather buffers are
        freed, not trimmed (see ``FSDP2Backend.enter_pause``). Not collective."""
        self.release_buffers(trim=False)
        if self._user_setup is not None and self._gen_setup is None:
            self._gen_setup = pause.switch(self.offload, self.module, self._user_setup)

    def exit_pause(self) -> None:
        """Back to the lockstep setup; the user's, as training left it, is kept for the next pause."""
        if self._gen_setup is not None:
            self._user_setup = pause.switch(self.offload, self.module, self._gen_setup)
            self._gen_setup = None

    def full_param_bytes(self) -> int:
        return sum(ds.full_numel(p) * p.element_size() for p in self.module.parameters())

    def describe(self) -> dict[str, str]:
        d = super().describe()
        d["zero_stage"] = "3"
        d["offload_param"] = self.offload_device
        d["param_group_size"] = str(dist.get_world_size(group=self.param_group))
        return d

    def close(self) -> None:
        """Free the replica and remove the bucket hooks (the model goes back with DeepSpeed's own
        hooks only). Local."""
        if self.buckets is not None:
            self.buckets.remove()
            self.buckets = None
        self.release_all()
        self.release_buffers()

    def release_buffers(self, trim: bool = True) -> None:
        """Empty the pool; with ``trim``, give the freed heap back to the OS (``buffer_pool.trim_heap``).
        Local."""
        if self.pool is not None and len(self.pool):
            self.pool.clear()
            self._untrimmed = True  # freed since the last trim
        if trim and self._untrimmed:
            trim_heap()
            self._untrimmed = False


def chunk_vocab(
    module: torch.nn.Module, param_group: Any, chunk_bytes: int | None, offload: Any, pool: BufferPool | None
) -> ChunkedModules | None:
    """The embeddings / head of a ZeRO-3 model gathered in row chunks of its flat partitions
    (``chunked.py``) into ``pool``, or None (none found, or ``chunk_bytes == 0``); the chunk
    size from ``chunked.chunk_budget``. Not collective."""
    chunk_bytes = chunk_budget(chunk_bytes, largest_layer_bytes(module, ds.full_numel))
    if chunk_bytes is None:
        return None
    weights: dict[str, tuple[torch.nn.Module, FlatWeight]] = {}
    for name, m in vocab_modules(module):
        p = m.weight
        if not hasattr(p, "ds_tensor") or len(p.ds_shape) != 2 or ds.has_hpz([p]):
            continue
        shape = tuple(p.ds_shape)
        local = lambda p=p: p.ds_tensor.reshape(-1)
        weights[name] = (
            m,
            FlatWeight(shape, p.ds_tensor.ds_numel, local, p.ds_process_group, p.dtype, chunk_bytes),
        )
    hooks = hook_ids([*offload.forward_hooks, *offload.backward_hooks])
    return chunked_modules(weights, hooks, chunk_bytes, pool)
