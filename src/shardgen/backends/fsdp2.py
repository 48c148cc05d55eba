"""The FSDP2 backend: ``fully_shard`` each decoder layer, the embeddings, the head and the root,
on shardgen's own group.

Units (:func:`shard_model`): one per decoder layer, one for the input embeddings and one
for the LM head, whatever their class (one unit for both when they share a tied weight: it
stays one parameter; :func:`vocab_units`), and the root, which then holds only the small
rest (final norm). So nothing big stays gathered between forwards (FSDP2 keeps the root
unit gathered).

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
from shardgen.backends.chunked import (
    ChunkedModules,
    FlatWeight,
    active,
    chunk_budget,
    chunked_modules,
    hook_ids,
    io_embeddings,
    vocab_modules,
)
from shardgen.backends.fsdp2_pool import PooledGathers
from shardgen.backends.pool import BufferPool
from shardgen.backends.replica import Replica
from shardgen.log import get_logger

log = get_logger()


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one.

    HF models name them in ``_no_split_modules`` (LlamaDecoderLayer, GPT2Block, ...);
    otherwise take the largest ``ModuleList`` of same-class modules. A mixture-of-experts
    block lives inside its decoder layer, so all experts are gathered as one unit and
    routing can never change the gather sequence.
    """
    names = set(getattr(model, "_no_split_modules", None) or [])
    found = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    # Only the outermost matches: never wrap a block inside another wrapped block.
    inner = {id(c) for m in found for c in m.modules() if c is not m}
    found = [m for m in found if id(m) not in inner]
    if found:
        return found
    best: list[nn.Module] = []
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > 1 and len({type(c) for c in m}) == 1:
            if sum(p.numel() for p in m.parameters()) > sum(p.numel() for b in best for p in b.parameters()):
                best = list(m)
    return best


def shard_model(model: nn.Module, mesh: Any) -> None:
    """``fully_shard`` ``model`` on ``mesh`` in shardgen's units (see the module docstring); marks it
    as sharded by shardgen. Not collective (FSDP2 records the mesh; gathers start at the first
    forward). Every rank of the mesh calls it on the same model."""
    from torch.distributed.fsdp import fully_shard

    layers = decoder_layers(model)
    if not layers:
        log.warning("no decoder layers found: sharding %s as one unit", type(model).__name__)
    inside = {id(m) for layer in layers for m in layer.modules()}
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    for unit in vocab_units(model, inside):
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    model._shardgen_sharded = True


def vocab_units(model: nn.Module, inside: set[int]) -> list[list[nn.Module]]:
    """The FSDP units of the input embeddings and the LM head, of any class (chunked or not,
    ``chunked.io_embeddings``), outside the decoder layers (``inside``: ids of their modules).

    Each is a unit of its own, but modules sharing a parameter (tied embeddings) are one unit,
    so the weight stays one parameter: FSDP2 refuses a parameter shared between two units.
    A unit whose parameter another module outside it shares (or one module nested in the
    other) stays in the root. Not collective."""
    mods = [m for _, m, _ in io_embeddings(model) if id(m) not in inside and m is not model]
    if len(mods) == 2 and (mods[0] in mods[1].modules() or mods[1] in mods[0].modules()):
        return []  # one inside the other: both stay in the root
    own = {id(m): {id(p) for p in m.parameters()} for m in mods}
    units: list[list[nn.Module]] = []
    for m in mods:
        tied = next((u for u in units if any(own[id(m)] & own[id(o)] for o in u)), None)
        if tied is not None:
            tied.append(m)  # one unit, one parameter
        else:
            units.append([m])
    ours = {id(s) for m in mods for s in m.modules()}
    rest = {id(p) for s in model.modules() if id(s) not in ours for p in s.parameters(recurse=False)}
    return [u for u in units if not any(own[id(m)] & rest for m in u)]


def layer_bytes(model: nn.Module) -> int:
    """Full bytes of the largest decoder layer (DTensor sizes are global)."""
    layers = decoder_layers(model)
    return max((sum(p.numel() * p.element_size() for p in m.parameters()) for m in layers), default=0)


def chunk_vocab(
    model: nn.Module, param_group: Any, chunk_bytes: int | None, pool: BufferPool | None = None
) -> ChunkedModules | None:
    """The chunked embeddings / head of a model :func:`shard_model` sharded (None when there are
    none, or ``chunk_bytes == 0``); the chunk size from :func:`chunked.chunk_budget`, the chunks
    gathered into ``pool``. A module is chunked only if every module of its unit is: a head tied
    to an embedding that cannot be chunked is gathered whole with it (the embedding's forward
    unshards their unit). Not collective."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    budget = chunk_budget(chunk_bytes, layer_bytes(model))
    if budget is None:
        return None
    world = dist.get_world_size(param_group)
    weights: dict[str, tuple[nn.Module, FlatWeight]] = {}
    handles: list[Any] = []
    chunkable = {id(m) for _, m in vocab_modules(model)}
    for name, m in vocab_modules(model):
        w = m.weight
        if not isinstance(m, FSDPModule) or not isinstance(w, DTensor):
            continue  # in the root unit (vocab_units)
        if w.placements != (Shard(0),) or w.ndim != 2:
            continue
        if any(id(o) not in chunkable for o in m._get_fsdp_state()._modules):
            continue  # tied to a module gathered whole: the unit is gathered whole
        rows = -(-w.shape[0] // world)  # torch.chunk along dim 0, as FSDP2 shards
        # From the FSDPParam, not the module attribute: an embedding subclass's own forward runs
        # with a stand-in there (lookups.py), and its lookups gather from here meanwhile.
        fp = _fsdp_param(m, "weight")
        local = lambda fp=fp: fp.sharded_param.to_local().reshape(-1)
        weights[name] = (
            m,
            FlatWeight(tuple(w.shape), rows * w.shape[1], local, param_group, w.dtype, budget),
        )
        state = m._get_fsdp_state()
        handles += [state._pre_forward_hook_handle, state._post_forward_hook_handle]
    return chunked_modules(weights, hook_ids(handles), budget, pool)


def _fsdp_param(module: nn.Module, name: str) -> Any:
    """The ``FSDPParam`` of ``module``'s parameter ``name`` (in its unit, shared or not). Local."""
    for pg in module._get_fsdp_state()._fsdp_param_groups:
        for fp in pg.fsdp_params:
            info = fp._module_info
            shared = zip(info.shared_modules, info.shared_param_names, strict=True)
            places = [(info.module, info.param_name), *shared]
            if any(m is module and n == name for m, n in places):
                return fp
    raise AssertionError(f"{type(module).__name__}.{name} is not in its FSDP unit")


def mesh_infos(model: nn.Module) -> list[Any]:
    """The distinct mesh infos (communicators) of every FSDP param group of ``model``."""
    from torch.distributed.fsdp import FSDPModule

    infos: list[Any] = []
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        for pg in m._get_fsdp_state()._fsdp_param_groups:
            for info in (pg.mesh_info, pg.post_forward_mesh_info):
                if info is not None and all(info is not i for i in infos):
                    infos.append(info)
    return infos


def shard_group(model: Any) -> Any | None:
    """The shard group of a model the user wrapped with ``fully_shard`` (the shard dimension of
    an HSDP mesh), or ``None`` for a model without FSDP2 units. Not collective."""
    infos = mesh_infos(model) if isinstance(model, nn.Module) else []
    return infos[0].shard_process_group if infos else None


def move_to_group(model: nn.Module, param_group: Any) -> None:
    """Point the all-gathers of a model the user wrapped with ``fully_shard`` at ``param_group``.

    The shards stay where they are; only the communicator changes, so a user's
    collective on the original group can no longer interleave with engine gathers.
    Needs the same ranks in the same order. Not collective (attribute changes only).
    """
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

    mine = dist.get_process_group_ranks(param_group)
    infos = mesh_infos(model)
    for info in infos:
        # HSDP (a 2-D replicate x shard mesh) gathers on its shard group only; the replicate
        # group serves gradient all-reduces, which generation never issues.
        if not isinstance(info, FSDPMeshInfo):  # HSDPMeshInfo is one
            raise ValueError(
                f"the model is wrapped with {type(info).__name__} (replicate only); shardgen can only "
                "move sharded fully_shard models to its private group: pass the unwrapped model instead"
            )
        theirs = dist.get_process_group_ranks(info.shard_process_group)
        if theirs != mine:
            raise ValueError(
                f"the model is sharded over ranks {theirs}, shardgen's group spans ranks {mine}: pass the "
                "unwrapped model (shardgen shards it), or leave Engine(group=...) unset (one engine per "
                "shard group)"
            )
    for info in infos:
        info.shard_process_group = param_group
        if getattr(info, "reduce_scatter_process_group", None) is not None:
            info.reduce_scatter_process_group = param_group
    log.info("moved the gathers of a fully_shard model (%d mesh infos) to the private group", len(infos))


def plain_class(model: nn.Module) -> type:
    """The model's own class: ``fully_shard`` swaps in a subclass that mixes in FSDPModule."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


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

        if isinstance(model, FSDPModule) and getattr(model, "_shardgen_sharded", False):
            # Sharded by shardgen on param_group already (Engine.from_pretrained, shardgen.loading).
            backend = cls(model, model, device)
            backend.param_group = param_group
            backend._user_reshard = backend._reshard_settings()
            backend.use_pool()
            backend.chunked = chunk_vocab(model, param_group, chunk_bytes, backend.pool)
            backend.size_pool()
            backend.free_gathers_early()
            return backend
        if isinstance(model, FSDPModule):
            # The user's communicators, put back for training steps (enter_pause).
            saved = [
                (i, i.shard_process_group, getattr(i, "reduce_scatter_process_group", None))
                for i in mesh_infos(model)
            ]
            move_to_group(model, param_group)
            backend = cls(model, model, device)
            backend.param_group = param_group
            backend._user_groups = saved
            backend._private_group = param_group
            backend._user_reshard = backend._reshard_settings()
            backend.use_pool()
            backend.free_gathers_early()
            return backend
        shard_model(model, DeviceMesh.from_group(param_group, device.type))
        backend = cls(model, model, device)
        backend.param_group = param_group
        backend._user_reshard = backend._reshard_settings()
        backend.use_pool()
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
                ctx = getattr(module._get_fsdp_state(), "_comm_ctx", None)
                state = getattr(ctx, "all_gather_state", None)
                if state is not None:  # its parameters are unsharded: copy-out done
                    if self.pool is not None:
                        self.pool.release(state.all_gather_result.all_gather_output)
                    ctx.all_gather_state = None

        self._free_hooks = [u.register_forward_pre_hook(drop) for u in self.units()]  # after FSDP's

    def _gathered_forward(self, **inputs: Any) -> Any:
        """A per-layer forward: the units' all-gathers, the chunked modules' row chunks.
        Collective on the param group while ``lockstep`` (same order on every rank: module call
        order)."""
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
        lives (tests/test_soak.py counts Python's blocks). Forget them after each of shardgen's
        forwards (no grad: nothing of a backward to come refers to them). Local."""
        if torch.is_grad_enabled():
            return
        if self._states is None:
            self._states = list({id(s): s for s in (u._get_fsdp_state() for u in self.units())}.values())
        for state in self._states:
            ctx = getattr(state, "_comm_ctx", None)
            order = getattr(ctx, "post_forward_order", None)
            if order:
                order.clear()
            for pg in getattr(state, "_fsdp_param_groups", ()):
                indices = getattr(pg, "_post_forward_indices", None)
                if indices:
                    indices.clear()

    def enable_stationary(self) -> str | None:
        """The weight-stationary mode over FSDP2's dim-0 shards (``backends/stationary``). Local."""
        from shardgen.backends.stationary import Stationary, Unsupported
        from shardgen.backends.stationary.fsdp2 import FSDP2Source

        try:
            source = FSDP2Source(self.module, self.param_group, self.device)
            self.stationary = Stationary.create(self.module, source)
        except Unsupported as e:
            return str(e)
        return None

    def per_layer_cost(self) -> Any:
        """One all-gather per FSDP unit (the chunked ones: per row chunk), the full weights."""
        from shardgen.backends.stationary import gathered_cost

        n = len({id(u._get_fsdp_state()) for u in self.units()})
        if self.chunked is not None:
            n += sum(self.chunked.describe().values())  # row chunks instead of their units' gathers
            n -= len({id(m._get_fsdp_state()) for m in self.chunked.modules})
        return gathered_cost(n, self.full_param_bytes(), self.param_group.size())

    _user_groups: list[tuple[Any, Any, Any]] = []  # (mesh info, shard group, reduce-scatter group)
    _private_group: Any = None
    _user_reshard: list[tuple[Any, str, Any]] = []  # (object, attribute, value) at create
    _reshard: list[tuple[Any, str, Any]] = []  # the same, as generation left them, during a pause

    def _reshard_settings(self) -> list[tuple[Any, str, Any]]:
        """Reshard-after-forward as ``set_reshard_after_forward`` stores it: each FSDP param group's
        post-forward mesh info (None: stay unsharded after forward) and each state's auto flag."""
        out: list[tuple[Any, str, Any]] = []
        for m in self.units():
            state = m._get_fsdp_state()
            out.append((state, "_auto_reshard_after_forward", state._auto_reshard_after_forward))
            out.extend(
                (pg, "post_forward_mesh_info", pg.post_forward_mesh_info) for pg in state._fsdp_param_groups
            )
        return out

    def enter_pause(self) -> None:
        """Training gets the model as the user set it up: their communicators (a user ``fully_shard``
        model) and their reshard-after-forward settings. The pooled gather buffers are freed but
        the heap is not trimmed: the training step in this process reuses that memory at once,
        while a ``malloc_trim`` would hand every free page back and make the step fault them in
        again (1.11-1.16x a step's time on CPU, docs/PERFORMANCE.md section 6). Not collective."""
        self.release_buffers(trim=False)
        self._reshard = self._reshard_settings()
        for obj, attr, value in self._user_reshard:
            setattr(obj, attr, value)
        for info, shard, reduce_scatter in self._user_groups:
            info.shard_process_group = shard
            if reduce_scatter is not None:
                info.reduce_scatter_process_group = reduce_scatter

    def exit_pause(self) -> None:
        """Gathers go back to shardgen's private group. Not collective."""
        for obj, attr, value in self._reshard:
            setattr(obj, attr, value)
        self._reshard = []
        for info, _, reduce_scatter in self._user_groups:
            info.shard_process_group = self._private_group
            if reduce_scatter is not None:
                info.reduce_scatter_process_group = self._private_group

    def units(self) -> list[nn.Module]:
        from torch.distributed.fsdp import FSDPModule

        return [m for m in self.module.modules() if isinstance(m, FSDPModule)]

    def gather_all(self) -> None:
        """Fill the plain replica (``replica.py``) one FSDP unit at a time: unshard it, copy its
        full parameters, reshard it. Forwards then run on the replica (no hooks, no DTensor).
        Collective on the param group: one all-gather per unit, in module order, every rank
        in the same tick."""
        from torch.distributed.tensor import DTensor

        if self.replica is not None and self.replica.live:
            return
        if self.replica is None:
            self.replica = Replica(self.module, plain_class(self.module), self.device)
        states: set[int] = set()
        for unit in self.units():
            state = unit._get_fsdp_state()
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
