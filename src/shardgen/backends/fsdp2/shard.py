"""How shardgen shards a model with FSDP2, and how it adopts one the user sharded.

Units (:func:`shard_model`): one per decoder layer, one for the input embeddings and one
for the LM head, whatever their class (one unit for both when they share a tied weight: it
stays one parameter; :func:`vocab_units`), and the root, which then holds only the small
rest (final norm). So nothing big stays gathered between forwards (FSDP2 keeps the root
unit gathered). The parts come from ``backends/parts.py``; FSDP2's private parts are reached
through ``internals.py``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from shardgen.backends.buffer_pool import BufferPool
from shardgen.backends.chunked import ChunkedModules, FlatWeight, chunk_budget, chunked_modules, hook_ids
from shardgen.backends.fsdp2 import internals as fsdp
from shardgen.backends.parts import decoder_layers, io_embeddings, largest_layer_bytes, vocab_modules
from shardgen.log import get_logger

log = get_logger()


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
    ``parts.io_embeddings``), outside the decoder layers (``inside``: ids of their modules).

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
    return largest_layer_bytes(model)


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
        if any(id(o) not in chunkable for o in fsdp.unit_modules(m)):
            continue  # tied to a module gathered whole: the unit is gathered whole
        rows = -(-w.shape[0] // world)  # torch.chunk along dim 0, as FSDP2 shards
        # From the FSDPParam, not the module attribute: an embedding subclass's own forward runs
        # with a stand-in there (lookups.py), and its lookups gather from here meanwhile.
        local = fsdp.local_shard(fsdp.fsdp_param(m, "weight"))
        weights[name] = (
            m,
            FlatWeight(tuple(w.shape), rows * w.shape[1], local, param_group, w.dtype, budget),
        )
        handles += fsdp.forward_hook_handles(m)
    return chunked_modules(weights, hook_ids(handles), budget, pool)


def shard_group(model: Any) -> Any | None:
    """The shard group of a model the user wrapped with ``fully_shard`` (the shard dimension of
    an HSDP mesh), or ``None`` for a model without FSDP2 units. Not collective."""
    infos = fsdp.mesh_infos(model) if isinstance(model, nn.Module) else []
    return infos[0].shard_process_group if infos else None


def move_to_group(model: nn.Module, param_group: Any) -> list[tuple[Any, Any, Any]]:
    """Point the all-gathers of a model the user wrapped with ``fully_shard`` at ``param_group``;
    returns the communicators they had (``internals.shard_groups``), to put back for training.

    The shards stay where they are; only the communicator changes, so a user's
    collective on the original group can no longer interleave with engine gathers.
    Needs the same ranks in the same order. Not collective (attribute changes only).
    """
    import torch.distributed as dist

    mine = dist.get_process_group_ranks(param_group)
    # HSDP (a 2-D replicate x shard mesh) gathers on its shard group only; the replicate
    # group serves gradient all-reduces, which generation never issues.
    saved = fsdp.shard_groups(fsdp.mesh_infos(model))
    for _, shard, _ in saved:
        theirs = dist.get_process_group_ranks(shard)
        if theirs != mine:
            raise ValueError(
                f"the model is sharded over ranks {theirs}, shardgen's group spans ranks {mine}: pass the "
                "unwrapped model (shardgen shards it), or leave Engine(group=...) unset (one engine per "
                "shard group)"
            )
    fsdp.set_shard_groups(saved, param_group)
    log.info("moved the gathers of a fully_shard model (%d mesh infos) to the private group", len(saved))
    return saved
