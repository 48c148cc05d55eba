"""Every DeepSpeed detail shardgen depends on that is not public API, in one place.

Checked against DeepSpeed 0.19.8 (docs/DEEPSPEED.md says what each one is for and how it
was found). A DeepSpeed upgrade should touch this module only: private attribute names,
the coordinator's construction, hook re-installation and suspension, gathering and
releasing a list of parameters, the closures through which a user's coordinator and
``zero.Init`` are found, and the environment ``zero.Init`` reads. Nothing here issues a
collective unless its docstring says so.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import os
import re
import sys
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from shardgen.backends.deepspeed.shm import no_shm_op
from shardgen.backends.stationary.layout import hooks_aside
from shardgen.log import get_logger, quiet_deprecated_gathers

log = get_logger()

INSTALL_HINT = "the deepspeed backend needs DeepSpeed: pip install 'shardgen[deepspeed]'"
CHECKED_VERSION = "0.19.8"

_tls = threading.local()
_DS_BUILT = re.compile(r"DeepSpeed \S+ built successfully\s*$")
_patch_lock = threading.Lock()


# ----------------------------------------------------------------------------- environment
def import_deepspeed(device: torch.device):
    """``import deepspeed`` (lazily, with an install hint); on a CPU device select its CPU accelerator."""
    if device.type == "cpu" and "DS_ACCELERATOR" not in os.environ:
        os.environ["DS_ACCELERATOR"] = "cpu"
        log.info("DeepSpeed on its CPU accelerator: the device is cpu, so shardgen set DS_ACCELERATOR=cpu")
    try:
        import deepspeed
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    return deepspeed


def ensure_ds_comm(deepspeed) -> None:
    """Bind DeepSpeed's comm layer to the existing torch.distributed world. Not collective."""
    from deepspeed import comm as ds_comm

    if not dist.is_initialized():
        raise RuntimeError("the deepspeed backend needs torch.distributed initialized (shardgen.init())")
    if not ds_comm.is_initialized():
        # DeepSpeed prints "DeepSpeed <op> built successfully" on every rank here (a bare print of
        # its comm-op loader): dropped; anything else printed meanwhile goes out as it came.
        said = io.StringIO()
        with contextlib.redirect_stdout(said), no_shm_op():
            deepspeed.init_distributed(
                dist_backend=dist.get_backend(), auto_mpi_discovery=False, verbose=False
            )
        rest = [x for x in said.getvalue().splitlines(True) if not _DS_BUILT.match(x)]
        if rest:
            sys.stdout.write("".join(rest))
            sys.stdout.flush()


def ensure_local_rank(device: torch.device) -> None:
    """zero.Init reads os.environ["LOCAL_RANK"] to pick the device it gathers onto; launchers set it."""
    if "LOCAL_RANK" not in os.environ:
        value = str(device.index or 0) if device.type != "cpu" else "0"
        os.environ["LOCAL_RANK"] = value
        log.info("shardgen: LOCAL_RANK not set, using %s for DeepSpeed", value)
    local = int(os.environ["LOCAL_RANK"])
    if device.type != "cpu" and device.index is not None and device.index != local:
        raise ValueError(
            f"DeepSpeed gathers parameters onto {device.type}:{local} (LOCAL_RANK={local}), "
            f"but the engine device is {device}; use device {device.type}:{local}"
        )


def enum_str(value: Any) -> str:
    return str(getattr(value, "value", value))


# ----------------------------------------------------------------------------- zero.Init
def init_class(deepspeed) -> type:
    """``deepspeed.zero.Init``, building in the ``dtype`` it is given whatever the accelerator.

    0.19.8's ``InsertPostInitMethodToModuleSubClasses._set_dtype`` (partition_parameters.py)
    takes an explicit dtype as ``dtype or torch.float16 if accelerator.is_fp16_supported() else
    torch.bfloat16 if ...``, which parses as ``(dtype or fp16) if fp16 else bf16``: where the
    accelerator has no fp16 (DeepSpeed's CPU accelerator on a CPU without AVX512-FP16 /
    AMX-FP16) every dtype, float32 included, becomes bfloat16, and the context's tensor
    constructors cast every parameter to it. Here an explicit dtype is the dtype; without one,
    DeepSpeed decides as before (the config's bf16 / fp16 sections). Not collective.
    """

    class Init(deepspeed.zero.Init):
        def __init__(self, *args: Any, dtype: torch.dtype | None = None, **kwargs: Any) -> None:
            super().__init__(*args, dtype=dtype, **kwargs)
            if dtype is not None and self.dtype != dtype:  # _set_dtype renamed by an upgrade?
                raise RuntimeError(f"zero.Init chose {self.dtype} where shardgen asked for {dtype}")

        def _set_dtype(self, ds_config: Any, dtype: torch.dtype | None) -> None:
            if dtype is None:
                super()._set_dtype(ds_config, dtype)
            else:
                self.dtype = dtype

    return Init


# ----------------------------------------------------------------------------- trace check switch
def install_trace_check_switch() -> None:
    """Wrap the coordinator's cross-rank trace check so shardgen's forwards can skip it.

    ``reset_step`` calls ``assert_ints_same_as_other_ranks`` (broadcasts on the *default*
    group, a number that depends on trace state); inside ``lockstep_forward`` it is a no-op.
    """
    import deepspeed.runtime.zero.partitioned_param_coordinator as ppc

    with _patch_lock:
        current = ppc.assert_ints_same_as_other_ranks
        if getattr(current, "_shardgen_wrapped", False):
            return

        def assert_ints_same_as_other_ranks(ints, _orig=current):
            if getattr(_tls, "lockstep", False):
                return None  # shardgen: default-group broadcasts would break the lockstep invariant
            return _orig(ints)

        assert_ints_same_as_other_ranks._shardgen_wrapped = True
        ppc.assert_ints_same_as_other_ranks = assert_ints_same_as_other_ranks


@contextlib.contextmanager
def lockstep_forward() -> Iterator[None]:
    """Around every forward shardgen runs (and ``gather_all``): no grad, the trace check switched
    off, and torch's deprecation warning for the ``all_gather_into_tensor`` that DeepSpeed's
    gathers call not shown (this thread)."""
    prev = getattr(_tls, "lockstep", False)
    _tls.lockstep = True
    try:
        with torch.no_grad(), quiet_deprecated_gathers():
            yield
    finally:
        _tls.lockstep = prev


# ----------------------------------------------------------------------------- finding a user's objects
def _closure_objects(fn, depth: int = 3):
    """Objects captured by ``fn``'s closure, looking through decorator wrappers."""
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            obj = cell.cell_contents
        except ValueError:
            continue
        yield obj
        if depth > 1 and callable(obj) and getattr(obj, "__closure__", None):
            yield from _closure_objects(obj, depth - 1)


def find_offload(module: torch.nn.Module):
    """The DeepSpeedZeRoOffload whose hooks drive ``module`` (found through its root pre-hook)."""
    for hook in list(module._forward_pre_hooks.values()):
        for obj in _closure_objects(hook):
            if hasattr(obj, "get_param_coordinator") and getattr(obj, "module", None) is module:
                return obj
    return None


def engine_offload(engine):
    """The DeepSpeedZeRoOffload of a stage-3 DeepSpeedEngine (the optimizer, or its parameter_offload)."""
    opt = engine.optimizer
    return opt if hasattr(opt, "get_param_coordinator") else getattr(opt, "parameter_offload", None)


def find_init(param):
    """The zero.Init object that converted ``param`` (closure of its all_gather_coalesced)."""
    for obj in _closure_objects(getattr(param, "all_gather_coalesced", None)):
        if hasattr(obj, "get_partition_dp_group") and hasattr(obj, "ds_process_group"):
            return obj
    return None


def offload_device(offload, params: list, device: torch.device) -> str:
    """Where the shards live between gathers: 'cpu', 'nvme' or 'none'.

    From the coordinator's owner when it exists; for hooks shardgen installs itself, from
    where the shards are."""
    if offload is not None:
        od = getattr(offload, "offload_device", None)
        return enum_str(od) if od is not None else "none"
    t = getattr(params[0], "ds_tensor", None)
    if t is not None and t.device.type == "cpu" and device.type != "cpu":
        return "cpu"
    return "none"


# ----------------------------------------------------------------------------- parameter state
def has_hpz(params: Iterable) -> bool:
    """True when a parameter has an hpZ secondary partition (gathered on a second group)."""
    return any(
        getattr(p, "ds_zero_param_process_group", None) is not None
        or getattr(p, "ds_secondary_tensor", None) is not None
        for p in params
    )


def busy_params(params: list) -> tuple[list[int], bool]:
    """(ds_ids with a gather in flight, whether a GatheredParameters context is open)."""
    from deepspeed.runtime.zero.partition_parameters import (
        DS_Z3_GATHERED_PARAM_CONTEXT_DEPTH_ATTR,
        ZeroParamStatus,
    )

    inflight = [p.ds_id for p in params if p.ds_status == ZeroParamStatus.INFLIGHT]
    open_ctx = any(getattr(p, DS_Z3_GATHERED_PARAM_CONTEXT_DEPTH_ATTR, 0) > 0 for p in params)
    return inflight, open_ctx


def release_everything(offload, module: torch.nn.Module, params: list) -> None:
    """Back to partitioned state with nothing persistent. Local (no collective)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    for p in params:
        p.ds_persist = False
    if offload is not None:
        offload.get_param_coordinator().release_and_reset_all(module)
    else:
        avail = [p for p in params if p.ds_status == ZeroParamStatus.AVAILABLE]
        if avail:
            avail[0].partition(param_list=avail)


def rehome(params: list, param_group) -> None:
    """Point every parameter collective at ``param_group`` (same ranks, same order). Local.

    Every parameter gather reads ``param.ds_process_group``; the zero.Init objects that made
    the parameters are rebound too, for parameters they make later.
    """
    inits = {}
    for p in params:
        init = find_init(p)
        if init is not None:
            inits[id(init)] = init
        p.ds_process_group = param_group
    for init in inits.values():
        init.ds_process_group = param_group


def reinstall_hooks(offload) -> None:
    """Rebuild the module hooks (ZeRO-3 leaves must be known when hooks are installed)."""
    offload._remove_module_hooks()
    offload.forward_hooks, offload.backward_hooks = [], []
    offload.setup_zero_stage3_hooks()


def lockstep_coordinator(offload, module: torch.nn.Module) -> None:
    """Give ``offload`` a fresh coordinator with prefetch, reuse and persistence off.

    A fresh one, not the old one reconfigured: the old one's trace and its cached release
    sets (an lru_cache keyed on the coordinator) were computed with the old settings.
    """
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as PPC

    old = offload.get_param_coordinator()
    registry = getattr(module, "ds_inflight_param_registry", None)
    if registry:
        raise RuntimeError(
            "parameters of this model have gathers in flight; create the backend between forwards"
        )

    def private(name, default=None):
        return getattr(old, f"_PartitionedParameterCoordinator__{name}", default)

    kwargs = dict(
        prefetch_bucket_sz=0,
        max_reuse_distance_in_numel=0,
        max_available_parameters_in_numel=private("max_n_available_params", int(1e9)),
        allgather_stream=private("allgather_stream"),
        inflight_param_registry=registry if registry is not None else private("inflight_param_registry"),
        prefetch_nvme=private("prefetch_nvme", False),
        timers=None,
        zero_quantized_weights=getattr(old, "zero_quantized_weights", False),
        zero_quantized_nontrainable_weights=getattr(old, "zero_quantized_nontrainable_weights", False),
        fast_sharding_for_leaf_module=getattr(old, "fast_sharding_for_leaf_module", False),
    )
    accepted = inspect.signature(PPC.__init__).parameters
    coord = PPC(**{k: v for k, v in kwargs.items() if k in accepted})
    coord.hierarchy = getattr(old, "hierarchy", 0)
    offload.param_coordinator = coord
    offload.persistent_parameters = []
    offload.param_numel_persistence_threshold = 0
    offload._prefetch_bucket_sz = 0
    offload._max_reuse_distance_in_numel = 0


def full_numel(param) -> int:
    """Elements of the unpartitioned parameter."""
    return int(getattr(param, "ds_numel", param.numel()))


# ----------------------------------------------------------------------------- bucket plan (buckets.py)
def in_lockstep_forward() -> bool:
    """True inside ``lockstep_forward`` on this thread (one of shardgen's own forwards)."""
    return bool(getattr(_tls, "lockstep", False))


def unit_params(unit: torch.nn.Module) -> list:
    """The parameters a unit's pre-forward hook fetches (its own, or its subtree for a ZeRO-3 leaf)."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params
    from deepspeed.utils import z3_leaf_module

    return list(dict.fromkeys(iter_params(unit, recurse=z3_leaf_module(unit))))


def unavailable(params: list) -> list:
    """Those of ``params`` that are partitioned (neither gathered nor in flight)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]


def release(params: list) -> None:
    """Partition gathered ``params`` again (free the full copies). Local."""
    if params:
        params[0].partition(param_list=params, has_been_updated=False)


@contextlib.contextmanager
def hooks_suspended(offload, root: torch.nn.Module) -> Iterator[None]:
    """Set DeepSpeed's module hooks (fetch/release, backward setup, the root's ``reset_step``)
    aside for the duration: the hook dicts of the affected modules are swapped for copies
    without them, and the originals (which DeepSpeed's handles point at) put back after.
    Other hooks keep their order. Local; the caller's thread only runs forwards meanwhile."""
    handles = [*offload.forward_hooks, *offload.backward_hooks, offload.fwd_pre_hook]
    # Handle ids are unique across every hook dict (one counter), so a set of them names these.
    ids = {h.id for h in handles if h.hooks_dict_ref() is not None}
    with hooks_aside(list(root.modules()), ids):
        yield


# ----------------------------------------------------------------------------- loading (loading/deepspeed.py)
def load_init_class(deepspeed) -> type:
    """:func:`init_class` without the broadcast of every new parameter from rank 0 that
    ``Init._zero_init_param`` issues (so that random inits agree): each parameter is converted
    and partitioned at once, for a checkpoint to overwrite every value. Not collective."""

    class LoadInit(init_class(deepspeed)):
        def _zero_init_param(self, param: torch.nn.Parameter) -> None:
            self._convert_to_deepspeed_param(param)
            param.partition()

    return LoadInit


# ----------------------------------------------------------------------------- pauses (pause.py)
#: DeepSpeedZeRoOffload attributes shardgen changes for generation (:func:`lockstep_coordinator`).
OFFLOAD_ATTRS = (
    "persistent_parameters",
    "param_numel_persistence_threshold",
    "_prefetch_bucket_sz",
    "_max_reuse_distance_in_numel",
    "dp_process_group",
)


def offload_settings(offload) -> tuple[Any, dict[str, Any]]:
    """``(coordinator, {attribute: value})``: what :func:`lockstep_coordinator` replaces in ``offload``."""
    attrs = {a: getattr(offload, a) for a in OFFLOAD_ATTRS if hasattr(offload, a)}
    return offload.get_param_coordinator(), attrs


def set_offload_settings(offload, coordinator: Any, attrs: dict[str, Any]) -> None:
    """Put back what :func:`offload_settings` returned. Local."""
    offload.param_coordinator = coordinator
    for name, value in attrs.items():
        setattr(offload, name, value)


# ----------------------------------------------------------------------------- pooled gathers (pooled.py)
def allgather_dtype(param, shard: torch.Tensor) -> torch.dtype:
    """The dtype DeepSpeed all-gathers ``param``'s ``shard`` in (its communication dtype)."""
    from deepspeed.runtime.zero.partition_parameters import get_allgather_dtype

    return get_allgather_dtype(param, shard)


def fetches_by_all_reduce(init) -> bool:
    """Whether the ``zero.Init`` fetches parameters by all-reduce instead of all-gather."""
    return bool(getattr(init, "use_all_reduce_for_fetch_params", False))


def mark_inflight(params: list) -> None:
    """Mark partitioned ``params`` as being gathered (as DeepSpeed's own gather does); one that is
    not partitioned raises ``RuntimeError`` with its summary."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    for p in params:
        if p.ds_status != ZeroParamStatus.NOT_AVAILABLE:
            raise RuntimeError(p.ds_summary())
        p.ds_status = ZeroParamStatus.INFLIGHT


def mark_available(param) -> None:
    """Mark a gathered parameter as available (its ``data`` holds the full tensor)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    param.ds_status = ZeroParamStatus.AVAILABLE


# ----------------------------------------------------------------------------- benchmarks (bench/methods.py)
@contextlib.contextmanager
def hooks_removed(offload, params: list) -> Iterator[None]:
    """DeepSpeed's module hooks of ``offload`` removed for the duration (forwards neither gather nor
    release), then registered again with a fresh trace. Local."""
    for p in params:
        p.ds_active_sub_modules.clear()
    for hook in offload.forward_hooks + offload.backward_hooks:
        hook.remove()
    offload.forward_hooks, offload.backward_hooks = [], []
    try:
        yield
    finally:
        offload.param_coordinator._invalidate_trace()
        offload._register_deepspeed_module(offload.module)
