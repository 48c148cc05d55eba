"""Every FSDP2 detail shardgen depends on that is not public API, in one place.

Checked against torch 2.13. ``fully_shard``, ``FSDPModule`` (``unshard``, ``reshard``) and
``DTensor`` are public; everything below reaches behind them: a unit's ``FSDPState`` and its
param groups, the ``FSDPParam`` of a parameter (its shard, its unsharded outputs), the mesh
infos that name the communicators, the comm context (the last all-gather's buffer, the forward
order kept for the backward's prefetch), the reshard-after-forward settings, and FSDP2's
default all-gather (``torch.distributed.fsdp._fully_shard``). A torch upgrade should touch this
module only. Nothing here issues a collective unless its docstring says so.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn


# ----------------------------------------------------------------------------- units and states
def fsdp_state(unit: nn.Module) -> Any:
    """The ``FSDPState`` of an ``FSDPModule`` (one per unit; shared by the modules of a unit of
    several, e.g. tied embeddings and head)."""
    return unit._get_fsdp_state()


def distinct_states(units: Iterable[nn.Module]) -> list[Any]:
    """The ``FSDPState`` of each unit, each once, in order."""
    return list({id(s): s for s in map(fsdp_state, units)}.values())


def param_groups(unit: nn.Module) -> list[Any]:
    """The ``FSDPParamGroup`` s of a unit (one per unit in practice)."""
    return list(fsdp_state(unit)._fsdp_param_groups)


def unit_modules(unit: nn.Module) -> list[nn.Module]:
    """The modules ``fully_shard`` was called on together with ``unit`` (itself included)."""
    return list(fsdp_state(unit)._modules)


def forward_hook_handles(unit: nn.Module) -> list[Any]:
    """The handles of FSDP2's forward pre- and post-hooks of ``unit`` (its all-gather, reshard)."""
    state = fsdp_state(unit)
    return [state._pre_forward_hook_handle, state._post_forward_hook_handle]


# ----------------------------------------------------------------------------- parameters
def fsdp_param(module: nn.Module, name: str) -> Any:
    """The ``FSDPParam`` of ``module``'s parameter ``name`` (in its unit, shared or not). Local."""
    for pg in param_groups(module):
        for fp in pg.fsdp_params:
            if any(m is module and n == name for m, n in param_places(fp)):
                return fp
    raise AssertionError(f"{type(module).__name__}.{name} is not in its FSDP unit")


def param_places(fp: Any) -> list[tuple[nn.Module, str]]:
    """Every ``(module, attribute name)`` where an ``FSDPParam``'s parameter lives (shared too)."""
    info = fp._module_info
    shared = zip(info.shared_modules, info.shared_param_names, strict=True)
    return [(info.module, info.param_name), *shared]


def unit_params(unit: nn.Module) -> Iterator[tuple[Any, torch.dtype | None]]:
    """Each ``FSDPParam`` of ``unit`` with its unit's compute dtype (mixed precision's
    ``param_dtype``, or None)."""
    state = fsdp_state(unit)
    dtype = getattr(state._mp_policy, "param_dtype", None)
    for pg in state._fsdp_param_groups:
        for fp in pg.fsdp_params:
            yield fp, dtype


def lazy_init(units: Iterable[nn.Module]) -> None:
    """FSDP2's per-param-group lazy init (what ``unshard()`` runs first): it re-reads each
    ``FSDPParam``'s shard from its module, which a ``load_state_dict(assign=True)`` or
    accelerate's loading may have replaced (``sharded_param`` is stale, even meta, until then).
    Idempotent; local."""
    for state in distinct_states(units):
        for pg in state._fsdp_param_groups:
            pg.lazy_init()


def local_shard(fp: Any) -> Callable[[], torch.Tensor]:
    """A function returning this rank's shard of ``fp``, flat (read at each call: FSDP2 keeps it
    in ``sharded_param`` whatever state the module is in)."""
    return lambda: fp.sharded_param.to_local().reshape(-1)


def shard_facts(fp: Any) -> tuple[Any, int | None, int | None, tuple[int, ...], torch.dtype]:
    """``(placement, shard mesh size, this rank in it, full shape, shard dtype)`` of an ``FSDPParam``."""
    info = fp.mesh_info
    shape = tuple(int(s) for s in fp._orig_size)
    size, rank = getattr(info, "shard_mesh_size", None), getattr(info, "shard_mesh_rank", None)
    return fp.fsdp_placement, size, rank, shape, fp.sharded_param.dtype


# ----------------------------------------------------------------------------- communicators
def mesh_infos(model: nn.Module) -> list[Any]:
    """The distinct mesh infos (communicators) of every FSDP param group of ``model``."""
    from torch.distributed.fsdp import FSDPModule

    infos: list[Any] = []
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        for pg in param_groups(m):
            for info in (pg.mesh_info, pg.post_forward_mesh_info):
                if info is not None and all(info is not i for i in infos):
                    infos.append(info)
    return infos


def shard_groups(infos: list[Any]) -> list[tuple[Any, Any, Any]]:
    """``(mesh info, shard group, reduce-scatter group or None)`` of each mesh info. A mesh info
    that does not shard (replicate only) raises ``ValueError``: shardgen cannot move its gathers."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

    for info in infos:
        if not isinstance(info, FSDPMeshInfo):  # HSDPMeshInfo is one
            raise ValueError(
                f"the model is wrapped with {type(info).__name__} (replicate only); shardgen can only "
                "move sharded fully_shard models to its private group: pass the unwrapped model instead"
            )
    return [(i, i.shard_process_group, getattr(i, "reduce_scatter_process_group", None)) for i in infos]


def set_shard_groups(saved: list[tuple[Any, Any, Any]], group: Any | None = None) -> None:
    """Point each mesh info of ``saved`` (:func:`shard_groups`) at ``group``, or with None back at
    the groups ``saved`` names. A reduce-scatter group is moved only where there is one. Local."""
    for info, shard, reduce_scatter in saved:
        info.shard_process_group = shard if group is None else group
        if reduce_scatter is not None:
            info.reduce_scatter_process_group = reduce_scatter if group is None else group


# ----------------------------------------------------------------------------- reshard settings
Settings = list[tuple[Any, str, Any]]  # (object, attribute, value)


def reshard_settings(units: list[nn.Module]) -> Settings:
    """Reshard-after-forward as ``set_reshard_after_forward`` stores it: each FSDP param group's
    post-forward mesh info (None: stay unsharded after forward) and each state's auto flag."""
    out: Settings = []
    for m in units:
        state = fsdp_state(m)
        out.append((state, "_auto_reshard_after_forward", state._auto_reshard_after_forward))
        out.extend(
            (pg, "post_forward_mesh_info", pg.post_forward_mesh_info) for pg in state._fsdp_param_groups
        )
    return out


def apply_settings(settings: Settings) -> None:
    """Put back what :func:`reshard_settings` recorded. Local."""
    for obj, attr, value in settings:
        setattr(obj, attr, value)


# ----------------------------------------------------------------------------- comm context
def drop_gather_buffer(unit: nn.Module) -> torch.Tensor | None:
    """Drop FSDP2's reference to the last all-gather buffer of ``unit``'s comm context, once the
    unit's parameters are unsharded (copy-out done); returns the buffer, or None when none is
    held. Local."""
    ctx = getattr(fsdp_state(unit), "_comm_ctx", None)
    state = getattr(ctx, "all_gather_state", None)
    if state is None:
        return None
    ctx.all_gather_state = None
    return state.all_gather_result.all_gather_output


def forget_forward_order(states: list[Any]) -> None:
    """Clear what FSDP2 records of each forward for the backward's prefetch
    (``post_forward_order``, ``_post_forward_indices``), which it clears only when a backward
    ends. Local."""
    for state in states:
        ctx = getattr(state, "_comm_ctx", None)
        order = getattr(ctx, "post_forward_order", None)
        if order:
            order.clear()
        for pg in getattr(state, "_fsdp_param_groups", ()):
            indices = getattr(pg, "_post_forward_indices", None)
            if indices:
                indices.clear()


# ----------------------------------------------------------------------------- pooled gathers (pool.py)
def default_gather_groups(units: list[nn.Module]) -> list[Any] | None:
    """The FSDP param groups of ``units`` on FSDP2's default all-gather (a custom one the user set is
    left out), or None where FSDP2 has no comm interface (torch < 2.8)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather
    except ImportError:
        return None
    groups: dict[int, Any] = {}
    for unit in units:
        for pg in param_groups(unit):
            if type(getattr(pg, "_all_gather_comm", None)) is DefaultAllGather:
                groups.setdefault(id(pg), pg)
    return list(groups.values())


def pooled_all_gather(pool: Any, gather_in_place: Callable[..., Any]) -> Any:
    """FSDP2's default all-gather, its output buffer taken from ``pool`` (``buffer_pool.BufferPool``) and
    written in place by ``gather_in_place(output, input, group)`` (which returns a work object).
    Collective when called, as FSDP2 calls it: every rank of the unit's group, in module order."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    class PooledAllGather(DefaultAllGather):
        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            numel = 1
            for s in size:
                numel *= int(s)
            return pool.take(numel, dtype, device).view(*(int(s) for s in size))

        def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):  # type: ignore[override]
            # Waited here, so FSDP2 sees a finished gather (None: no work).
            gather_in_place(output_tensor, input_tensor, group).wait()
            return None

    return PooledAllGather()


@contextlib.contextmanager
def all_gathers_replaced(groups: list[Any], comm: Any) -> Iterator[None]:
    """``comm`` as the all-gather of each FSDP param group of ``groups`` for the duration. Local."""
    saved = [(pg, pg._all_gather_comm) for pg in groups]
    for pg, _ in saved:
        pg._all_gather_comm = comm
    try:
        yield
    finally:
        for pg, c in saved:
            pg._all_gather_comm = c


_ALLOCATION = ("init_all_gather_outputs", "alloc_all_gather_outputs", "free_unsharded_param")


def group_params(groups: list[Any]) -> list[Any]:
    """The ``FSDPParam`` s of FSDP param groups."""
    return [fp for pg in groups for fp in pg.fsdp_params]


def allocation_replaceable(params: list[Any]) -> bool:
    """Whether every ``FSDPParam`` has the three methods :func:`allocation_replaced` replaces."""
    return all(hasattr(fp, h) for fp in params for h in _ALLOCATION)


@contextlib.contextmanager
def allocation_replaced(
    params: list[Any], init: Callable[..., None], alloc: Callable[[Any], None], free: Callable[[Any], None]
) -> Iterator[None]:
    """For the duration, each ``FSDPParam``'s ``init_all_gather_outputs``,
    ``alloc_all_gather_outputs`` and ``free_unsharded_param`` are ``init``, ``alloc`` and ``free``
    with the ``FSDPParam`` as first argument. Local."""
    for fp in params:
        fp.init_all_gather_outputs = functools.partial(init, fp)
        fp.alloc_all_gather_outputs = functools.partial(alloc, fp)
        fp.free_unsharded_param = functools.partial(free, fp)
    try:
        yield
    finally:
        for fp in params:
            del fp.init_all_gather_outputs, fp.alloc_all_gather_outputs, fp.free_unsharded_param


def gather_outputs(fp: Any) -> list[torch.Tensor]:
    """The all-gather outputs of an ``FSDPParam`` (its unsharded storage)."""
    return list(fp.all_gather_outputs)


def set_gather_outputs(fp: Any, outputs: list[torch.Tensor]) -> None:
    fp.all_gather_outputs = outputs


def unsharded_tensors(fp: Any) -> list[torch.Tensor]:
    """Every tensor holding an ``FSDPParam``'s unsharded data: its all-gather outputs and inner tensors."""
    return [*fp.all_gather_outputs, *fp._unsharded_inner_tensors]
