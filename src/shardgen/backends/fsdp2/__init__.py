"""The FSDP2 backend: ``fully_shard`` each decoder layer, the embeddings, the head and the root,
on shardgen's own group.

Modules: ``shard.py`` (shardgen's units, a user's ``fully_shard`` model moved to shardgen's
group, the chunked embeddings / head), ``pool.py`` (FSDP2's gathers into kept buffers on a
CPU), ``stationary.py`` (FSDP2's layout for the weight-stationary mode) and ``internals.py``
(every FSDP2 detail that is not public API).

Collective contract: ``create`` shards on ``param_group`` (every rank, same order).
Each forward all-gathers every FSDP unit in module call order (root first, then each
layer) and reshards it after use; the embeddings and head of a model shardgen sharded
are gathered in row chunks instead (``chunked.py``: a fixed number of all-gathers on
``param_group`` per module, a function of its shape only). ``shadow_forward`` runs the
same forward on a 1x1 input, so it issues the same all-gathers in the same order as any
real forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardgen.backends.base import Backend
from shardgen.backends.chunked import ChunkedModules, active
from shardgen.backends.fsdp2 import internals as fsdp
from shardgen.backends.fsdp2.internals import mesh_infos
from shardgen.backends.fsdp2.pool import PooledGathers
from shardgen.backends.fsdp2.shard import (
    chunk_vocab,
    layer_bytes,
    move_to_group,
    shard_group,
    shard_model,
    vocab_units,
)
from shardgen.backends.parts import plain_type
from shardgen.backends.replica import Replica
from shardgen.log import get_logger

log = get_logger()

__all__ = [
    "FSDP2Backend",
    "chunk_vocab",
    "layer_bytes",
    "mesh_infos",
    "move_to_group",
    "shard_group",
    "shard_model",
    "vocab_units",
]


class FSDP2Backend(PooledGathers, Backend):
    name = "fsdp2"

    #: The embeddings / head gathered in row chunks in shardgen's forwards (``chunked.py``), or None.
    chunked: ChunkedModules | None = None
    param_group: Any = None

    @classmethod
    def create(
        cls,
        model: Any,
        *,
        param_group: Any,
        device: torch.device,
        chunk_bytes: int | None = None,
        **_: Any,
    ) -> FSDP2Backend:
        """Shard ``model`` with FSDP2 on ``param_group``. Collective on ``param_group``.
        ``chunk_bytes``: the row chunks of the embeddings / head (None: half a decoder layer; 0: whole)."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import FSDPModule

        user_groups = None
        if isinstance(model, FSDPModule) and getattr(model, "_shardgen_sharded", False):
            pass  # sharded by shardgen on param_group already (Engine.from_pretrained, shardgen.loading)
        elif isinstance(model, FSDPModule):
            user_groups = move_to_group(model, param_group)  # put back for training steps (enter_pause)
        else:
            shard_model(model, DeviceMesh.from_group(param_group, device.type))
        backend = cls(model, model, device)
        backend.param_group = param_group
        if user_groups is not None:
            backend._user_groups = user_groups
            backend._private_group = param_group
        backend._user_reshard = backend._reshard_settings()
        backend.use_pool()
        if user_groups is None:  # shardgen's units: the embeddings and the head in row chunks
            backend.chunked = chunk_vocab(model, param_group, chunk_bytes, backend.pool)
            backend.size_pool()
        backend.free_gathers_early()
        return backend

    _in_forward = False
    _free_hooks: list[Any] = []

    def block_bytes(self) -> int:
        """The least every pooled buffer holds: a decoder layer's all-gather (a unit's)."""
        return layer_bytes(self.module)

    def free_gathers_early(self) -> None:
        """On a CPU device: in shardgen's forwards, drop FSDP2's reference to each unit's all-gather
        buffer once the unit's parameters are copied out of it (and hand the buffer back to the
        pool). FSDP2 keeps it until the next unit's gather completes, to overlap copy-out and
        gather on accelerator streams; on the CPU there are none, and it costs a third layer at
        the peak (the previous buffer, this one, and gloo's temporary). Local; the hooks do
        nothing outside shardgen's forwards."""
        if self.device.type != "cpu" or self._free_hooks:
            return

        def drop(module: nn.Module, _args: Any) -> None:
            if self._in_forward:
                buffer = fsdp.drop_gather_buffer(module)  # its parameters are unsharded: copy-out done
                if buffer is not None and self.pool is not None:
                    self.pool.release(buffer)

        self._free_hooks = [u.register_forward_pre_hook(drop) for u in self.units()]  # after FSDP's

    def _per_layer_forward(self, **inputs: Any) -> Any:
        """One forward: the units' all-gathers, the chunked modules' row chunks. Collective on the
        param group while ``lockstep`` (same order on every rank: module call order)."""
        self._in_forward = True
        try:
            with active(self.chunked), self._pooled():
                return self.module(**inputs)
        finally:
            self._in_forward = False
            self._forget_forward_order()

    _states: list[Any] | None = None

    def _forget_forward_order(self) -> None:
        """FSDP2 records every unit's forwards (``post_forward_order``, ``_post_forward_indices``:
        the backward's prefetch order) and forgets them only when a backward ends. Generation runs
        no backward, so they would grow by one entry per unit and forward for as long as the engine
        lives (tests/multirank/test_soak.py counts Python's blocks). Forget them after each of shardgen's
        forwards (no grad: nothing of a backward to come refers to them). Local."""
        if torch.is_grad_enabled():
            return
        if self._states is None:
            self._states = fsdp.distinct_states(self.units())
        fsdp.forget_forward_order(self._states)

    def enable_stationary(self) -> str | None:
        """The weight-stationary mode over FSDP2's dim-0 shards (``backends/stationary``). Local."""
        from shardgen.backends.fsdp2.stationary import FSDP2Source
        from shardgen.backends.stationary import Stationary, Unsupported

        try:
            source = FSDP2Source(self.module, self.param_group, self.device)
            self.stationary = Stationary.create(self.module, source, self.towers)
        except Unsupported as e:
            return str(e)
        return None

    def per_layer_cost(self) -> Any:
        """One all-gather per FSDP unit (the chunked ones: per row chunk), the full weights."""
        from shardgen.backends.stationary import gathered_cost

        n = len(fsdp.distinct_states(self.units()))
        if self.chunked is not None:
            n += sum(self.chunked.describe().values())  # row chunks instead of their units' gathers
            n -= len(fsdp.distinct_states(self.chunked.modules))
        return gathered_cost(n, self.full_param_bytes(), self.param_group.size())

    _user_groups: list[tuple[Any, Any, Any]] = []  # (mesh info, shard group, reduce-scatter group)
    _private_group: Any = None
    _user_reshard: list[tuple[Any, str, Any]] = []  # (object, attribute, value) at create
    _reshard: list[tuple[Any, str, Any]] = []  # the same, as generation left them, during a pause

    def _reshard_settings(self) -> list[tuple[Any, str, Any]]:
        """Reshard-after-forward of every unit as FSDP2 stores it (``internals.reshard_settings``)."""
        return fsdp.reshard_settings(self.units())

    def enter_pause(self) -> None:
        """Training gets the model as the user set it up: their communicators (a user ``fully_shard``
        model) and their reshard-after-forward settings. The pooled gather buffers are freed but
        the heap is not trimmed: the training step in this process reuses that memory at once,
        while a ``malloc_trim`` would hand every free page back and make the step fault them in
        again (1.11-1.16x a step's time on CPU, docs/PERFORMANCE.md section 13). Not collective."""
        self.release_buffers(trim=False)
        self._reshard = self._reshard_settings()
        fsdp.apply_settings(self._user_reshard)
        fsdp.set_shard_groups(self._user_groups)

    def exit_pause(self) -> None:
        """Gathers go back to shardgen's private group. Not collective."""
        fsdp.apply_settings(self._reshard)
        self._reshard = []
        if self._user_groups:
            fsdp.set_shard_groups(self._user_groups, self._private_group)

    def units(self) -> list[nn.Module]:
        from torch.distributed.fsdp import FSDPModule

        return [m for m in self.module.modules() if isinstance(m, FSDPModule)]

    def gather_all(self) -> None:
        """Fill the plain replica (``replica.py``); forwards then run on it (no hooks, no DTensor).
        Dim-0 shards over the param group (shardgen's units, most user models) travel in chunks
        of many parameters (``backends/whole.py``); other layouts unit by unit: unshard it, copy
        its full parameters, reshard it. Collective on the param group: the chunks' gathers,
        else one all-gather per unit in module order; every rank in the same tick."""
        from torch.distributed.tensor import DTensor

        from shardgen.backends.fsdp2.stationary import FSDP2Source

        if self.replica is not None and self.replica.live:
            return
        if self.replica is None:
            self.replica = Replica(self.module, plain_type(self.module), self.device)
        fsdp.lazy_init(self.units())  # shards swapped since (a load_state_dict) are read anew
        budget = max(self.WHOLE_CHUNK_BYTES, self.block_bytes())  # at least a decoder layer's
        if not self._fill_whole(lambda: FSDP2Source(self.module, self.param_group, self.device), budget):
            states: set[int] = set()
            for unit in self.units():
                state = fsdp.fsdp_state(unit)
                if id(state) in states:  # a unit of several modules (tied embeddings and head)
                    continue
                states.add(id(state))
                unit.unshard()
                for name, p in self.module.named_parameters():
                    if not isinstance(p, DTensor) and not self.replica.has(name):
                        self.replica.load(name, p.detach())
                unit.reshard()
        self.replica.finish()
        self.lockstep = False

    def close(self) -> None:
        for h in self._free_hooks:
            h.remove()
        self._free_hooks = []
        self.release_all()
        self.release_buffers()

    def full_param_bytes(self) -> int:
        total = 0
        for p in self.module.parameters():
            shape = getattr(p, "shape", None)  # DTensor: the global shape
            n = 1
            for s in shape or ():
                n *= int(s)
            total += n * p.element_size()
        return total
