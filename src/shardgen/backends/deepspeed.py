"""DeepSpeed ZeRO-3 backend: partitioned parameters, gathered on shardgen's private group.

Two ways in
-----------
* **A plain model** (no ZeRO parameters): shardgen partitions it itself, on ``param_group``::

      deepspeed.zero.Init(module=model, data_parallel_group=param_group,
                          config_dict_or_path=cfg, dtype=<model dtype>)
      DeepSpeedZeRoOffload(model, timers=None, ds_config=cfg, dp_process_group=param_group,
                           prefetch_bucket_size=0, max_reuse_distance=0,
                           param_persistence_threshold=0, offload_param_config=..., ...)

  This is what ``deepspeed.initialize`` does for a stage-3 model without an optimizer
  (``DeepSpeedEngine._configure_zero_optimizer`` builds a ``DeepSpeedZeRoOffload``, whose
  ``zero.Init(module=...)`` takes its group from ``mpu.get_data_parallel_group()``, else the
  world), minus the engine and its global state (``groups.mpu``, batch bookkeeping, the
  engine's forward). ``zero.Init(module=...)`` broadcasts every weight from rank 0 of
  ``param_group`` (the only collectives of ``create``) and keeps 1/N of it per rank, on CPU with
  ``offload_param: {device: cpu}``; each parameter records ``param_group`` as its
  ``ds_process_group``, which every later gather reads. ``cfg`` is the user's ``ds_config``
  with stage 3 and the settings below forced (overrides are logged), HF-Trainer ``"auto"``
  values dropped, and ``memory_efficient_linear`` off (else ``zero.Init`` replaces
  ``torch.nn.functional.linear`` process-wide; it only matters for backward). bf16/fp16 in the
  config cast the model first. The model is put in eval mode; buffers move to ``device``.

* **A model the user partitioned** (``deepspeed.initialize`` at stage 3: the engine or its
  ``.module``, with or without ``offload_param``; or a model built under ``zero.Init`` that
  has no engine, for which shardgen installs the hooks): the shards stay where they are and
  shardgen *moves the parameter traffic* to ``param_group``, without any collective. In
  DeepSpeed 0.19.8 every parameter collective goes through
  ``Init.get_partition_dp_group(param)``, i.e. ``param.ds_process_group`` (the coordinator's
  ``all_gather_coalesced``, ``_all_gather``, the ``ZeROOrderedDict`` getter that gathers a
  parameter touched from another module, ``GatheredParameters``), so rebinding
  ``ds_process_group`` on each parameter moves all of them; the ``zero.Init`` object that made
  the parameters (found through their closures) is rebound too, for parameters made later. The
  parameters are released locally first, ``ds_persist`` is cleared, and the coordinator is
  replaced by a fresh one with the settings below (a fresh one: the old one's trace and its
  ``lru_cache``-d release sets were computed with the old settings). MoE blocks that are not
  ZeRO-3 leaves yet are marked and the hooks reinstalled.

  Refused, on every rank and before anything is changed: a group with other ranks or another
  order than ``param_group`` (``ValueError``: shard *i* must stay with rank *i*); hpZ secondary
  partitions (``zero_hpz_partition_size > 1``, gathered on an intra-node group; ``ValueError``);
  a mix of ZeRO and plain parameters (``ValueError``); a DeepSpeedEngine below stage 3
  (``ValueError``); a gather in flight or an open ``GatheredParameters`` (``RuntimeError``);
  hooks whose coordinator cannot be found (``RuntimeError``: pass the engine). Not moved: the
  stage-3 *optimizer*'s ``dp_process_group`` (gradient reductions, overflow checks), so train
  with that engine only outside engine work (``Engine.paused()``); gradient partitioning follows
  ``ds_process_group``, on the same ranks. The model keeps prefetch off after shardgen.

Collective contract (all ranks of ``param_group``, in the same order)
--------------------------------------------------------------------
* ``forward`` / ``shadow_forward``: one forward pass. For each module call, in execution order,
  one all-gather (coalesced; sequential for a single parameter) of that module's own
  parameters (the whole subtree for a ZeRO-3 leaf), on ``param_group``; nothing on any other
  group. The sequence is a function of the module call order only, not of the data nor of the
  rank's history. HF decoders call every module once per forward whatever the batch, and MoE
  blocks are ZeRO-3 leaves, so a 1x1 dummy forward issues exactly the gathers of any real
  forward (tests: recorded ``torch.distributed`` calls of real and shadow forwards are equal,
  also across different histories).
* ``gather_all``: one ``GatheredParameters(all parameters, modifier_rank=None)`` enter: one
  coalesced all-gather. Until ``release_all`` forwards issue no collective at all.
* ``release_all``: the ``GatheredParameters`` exit: local (plus one all-reduce on
  ``param_group`` when the config enables ZeRO sanity checks).
* ``close``: no collective.

Gather order and prefetch: what was found (DeepSpeed 0.19.8 sources, checked by recording)
----------------------------------------------------------------------------------------
The ``PartitionedParameterCoordinator`` records a module trace in one forward (RECORD), uses
it from the next (COMPLETE) and drops it (INVALID) when a forward calls modules in another
order. Stock settings make the collectives of a forward depend on that per-rank state. A
tiny Llama (21 parameterized module calls) through a default ``deepspeed.initialize``, in
successive forwards: ``21 all-gathers + 2 default-group broadcasts``, then ``1 + 6``, then
``0, 0, ...``. The four mechanisms:

1. Prefetch (``stage3_prefetch_bucket_size``, COMPLETE only): upcoming parameters are gathered
   early in trace-ordered buckets (the ``1`` above: the whole tiny model in one bucket).
   Forced to 0.
2. Reuse distance (``stage3_max_reuse_distance``, COMPLETE only): a parameter used again soon
   is not released, so its second use gathers nothing. GPT-2's tied embedding: 16 gathers in
   a RECORD forward, 15 in a COMPLETE one. Forced to 0: always released after each use.
3. Persistence (``stage3_param_persistence_threshold``, default 1e5 elements): small
   parameters stay gathered, but only once the trace is COMPLETE (RECORD/INVALID forwards
   release them); the ``0, 0`` above. Forced to 0 and ``ds_persist`` cleared on user models.
4. Trace checks: ``reset_step`` (a forward pre-hook on the root) calls
   ``assert_ints_same_as_other_ranks`` whenever the trace is not COMPLETE: 2 broadcasts on the
   *default* group in the first forward after a reset and 6 in the next (again after any
   invalidation). On the default group they interleave with a user's ``dist.barrier()``, and
   their number depends on trace state. Skipped for the forwards shardgen runs: the function
   is wrapped once in the coordinator's module and a thread-local switch, set only around
   shardgen's forwards, turns it into a no-op; anybody else's forwards keep the check.

With 1-4 the trace only drives local bookkeeping: every forward gathers each parameterized
module once (21 for the tiny Llama, 16 for GPT-2, in every forward), so ranks with different
histories (real vs shadow forwards, a different number of local forwards while gathered,
RECORD vs COMPLETE trace) still issue identical collectives. Prefetch off costs the overlap
of communication with compute on GPUs; the lockstep invariant is worth more.

Other findings:

* ``GatheredParameters`` alone does not keep parameters across forwards: the module
  post-forward hook releases any available parameter with no active submodule (tiny Llama:
  0 gathers in the first forward after entering, 21 in each one after). ``gather_all`` pins
  every parameter with a sentinel id in ``ds_active_sub_modules`` until ``release_all``.
* A parameter read through another module's attribute during forward (``ZeROOrderedDict``
  getter) is gathered alone and registered as an external parameter of the running module,
  which gathers it from then on. Code path, not data: the same on every rank.
* MoE: ``deepspeed.initialize`` marks Mixtral/Qwen2-MoE/Qwen3-MoE blocks as ZeRO-3 leaves by
  default (``zero_optimization.leaf_module``); shardgen also marks modules whose class name
  looks like an MoE block (``SparseMoe``, ``MoeBlock``, ``MoELayer``, ... or ending in
  ``MoE``/``Moe``) or that have ``experts`` and ``gate``/``router`` children. A leaf gathers
  its whole subtree in its pre-forward hook. Without it, an MoE block whose experts run only
  when routed to makes a shadow forward gather other experts than a real one (gloo aborts:
  "Received data size doesn't match expected size").
* The seed report, reproduced (tests): plain ZeRO-3 + HF ``generate(synced_gpus=True)``,
  rank 0 making 2 calls and rank 1 making 3, then ``dist.barrier()``: rank 0 waits in the
  barrier, rank 1 in generate's per-step ``all_reduce``, forever. ``synced_gpus`` keeps ranks
  together within one call only; shardgen's engine pairs the missing forwards with shadow
  forwards, on its own group.

Limits: DeepSpeed keeps a process-wide module stack for its hooks, so no other DeepSpeed
forward may run in another thread while shardgen's driver runs one.
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
from typing import Any

import torch
import torch.distributed as dist

from ..log import get_logger
from . import ds_pause
from .base import Backend

log = get_logger()

_INSTALL_HINT = "the deepspeed backend needs DeepSpeed: pip install 'shardgen[deepspeed]'"
# A ds_active_sub_modules entry that no module has (module ds_ids are >= 0): while present
# the coordinator never releases the parameter (gather policy ``once``).
_PIN = -0x5EED
# zero_optimization keys that decide whether the gather sequence depends on history.
_LOCKSTEP_ZERO = {
    "stage3_prefetch_bucket_size": 0,
    "stage3_param_persistence_threshold": 0,
    "stage3_max_reuse_distance": 0,
}
_ALIASES = {
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "stage3_max_reuse_distance": "max_reuse_distance",
}
_MOE_NAME_TAGS = ("SparseMoe", "MoeBlock", "MoEBlock", "MoeLayer", "MoELayer", "SparseMoE")

_tls = threading.local()
_patch_lock = threading.Lock()


def _import_deepspeed(device: torch.device):
    if device.type == "cpu" and "DS_ACCELERATOR" not in os.environ:
        os.environ["DS_ACCELERATOR"] = "cpu"
        log.info("shardgen: device is cpu, set DS_ACCELERATOR=cpu for DeepSpeed")
    try:
        import deepspeed
    except ImportError as e:
        raise ImportError(f"{_INSTALL_HINT} ({e})") from e
    return deepspeed


def _install_trace_check_switch() -> None:
    """Wrap the coordinator's cross-rank trace check so shardgen's forwards can skip it."""
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
def _shardgen_forward():
    prev = getattr(_tls, "lockstep", False)
    _tls.lockstep = True
    try:
        with torch.no_grad():
            yield
    finally:
        _tls.lockstep = prev


def _ensure_ds_comm(deepspeed) -> None:
    from deepspeed import comm as ds_comm

    if not dist.is_initialized():
        raise RuntimeError("the deepspeed backend needs torch.distributed initialized (shardgen.init())")
    if not ds_comm.is_initialized():
        deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False, verbose=False)


def _ensure_local_rank(device: torch.device) -> None:
    # zero.Init reads os.environ["LOCAL_RANK"] to pick the device it gathers onto; launchers set it.
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


def _enum_str(value) -> str:
    return str(getattr(value, "value", value))


def _group_ranks(group) -> list[int]:
    return list(dist.get_process_group_ranks(group))


def _is_moe_block(module: torch.nn.Module) -> bool:
    name = type(module).__name__
    if any(tag in name for tag in _MOE_NAME_TAGS) or name.endswith(("MoE", "Moe")):
        return True
    children = dict(module.named_children())
    return "experts" in children and ("gate" in children or "router" in children)


def _mark_moe_leaves(model: torch.nn.Module) -> list[str]:
    """Mark MoE blocks (outermost only) as ZeRO-3 leaf modules; return the newly marked names."""
    from deepspeed.utils import set_z3_leaf_modules, z3_leaf_module

    classes: dict[type, None] = {}
    covered: list[str] = []
    for name, module in model.named_modules():
        if module is model or any(name.startswith(c + ".") for c in covered):
            continue
        if z3_leaf_module(module):
            covered.append(name)
        elif _is_moe_block(module):
            classes[type(module)] = None
            covered.append(name)
    if not classes:
        return []
    before = {id(m) for m in model.modules() if z3_leaf_module(m)}
    marked = set_z3_leaf_modules(model, list(classes), raise_if_not_found=False)
    new = [n for n, m in model.named_modules() if m in marked and id(m) not in before]
    if new:
        log.info(
            "shardgen: ZeRO-3 leaf modules (MoE blocks): %s",
            ", ".join(sorted({type(m).__name__ for m in marked})),
        )
    return new


def _lockstep_config(ds_config: dict | None) -> dict:
    """The ds_config shardgen partitions with: stage 3, settings 1-3 of the module docstring."""
    cfg = copy.deepcopy(ds_config) if ds_config else {}
    zero = dict(cfg.get("zero_optimization") or {})
    # HF Trainer style "auto" values are filled in by the Trainer, not by DeepSpeed: drop them.
    for d in (cfg, zero):
        for k in [k for k, v in d.items() if v == "auto"]:
            del d[k]
    stage = int(zero.get("stage", 3))
    if stage != 3:
        raise ValueError(
            f"the deepspeed backend partitions parameters at ZeRO stage 3; ds_config has stage {stage}"
        )
    zero["stage"] = 3
    for key, value in _LOCKSTEP_ZERO.items():
        for k in (key, _ALIASES[key]):
            if k in zero and zero[k] != value:
                log.warning(
                    "shardgen: overriding zero_optimization.%s=%r with %r (lockstep gathers)",
                    k,
                    zero[k],
                    value,
                )
            zero.pop(k, None)
        zero[key] = value
    if int(zero.get("zero_hpz_partition_size", 1)) > 1:
        raise ValueError(
            "hpZ (zero_hpz_partition_size > 1) gathers on a second group; not supported by shardgen"
        )
    zero["memory_efficient_linear"] = False  # else zero.Init patches F.linear process-wide
    cfg["zero_optimization"] = zero
    if not any(k in cfg for k in ("train_batch_size", "train_micro_batch_size_per_gpu")):
        cfg["train_micro_batch_size_per_gpu"] = 1  # DeepSpeedConfig insists; unused for inference
    return cfg


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


def _find_offload(module: torch.nn.Module):
    """The DeepSpeedZeRoOffload whose hooks drive ``module`` (found through its root pre-hook)."""
    for hook in list(module._forward_pre_hooks.values()):
        for obj in _closure_objects(hook):
            if hasattr(obj, "get_param_coordinator") and getattr(obj, "module", None) is module:
                return obj
    return None


def _find_init(param):
    """The zero.Init object that converted ``param`` (closure of its all_gather_coalesced)."""
    for obj in _closure_objects(getattr(param, "all_gather_coalesced", None)):
        if hasattr(obj, "get_partition_dp_group") and hasattr(obj, "ds_process_group"):
            return obj
    return None


def _lockstep_coordinator(offload, module: torch.nn.Module) -> None:
    """Give ``offload`` a fresh coordinator with settings 1-3 of the module docstring.

    A fresh one, not the old one reconfigured: the old one's trace and its cached release
    sets (an lru_cache keyed on the coordinator) were computed with the old settings.
    """
    import inspect

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


class DeepSpeedBackend(Backend):
    name = "deepspeed"

    def __init__(self, hf_model, module, device, *, offload, param_group, offload_device: str, created: bool):
        super().__init__(hf_model, module, device)
        self.offload = offload
        self.param_group = param_group
        self.offload_device = offload_device
        self.created = created
        self.lockstep = True
        self._gathered_ctx = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(
        cls,
        model: Any,
        *,
        param_group: Any,
        device: torch.device,
        ds_config: dict | None = None,
        **_: Any,
    ) -> DeepSpeedBackend:
        """Partition ``model`` on ``param_group`` (or move a partitioned one there). Collective."""
        device = torch.device(device)
        deepspeed = _import_deepspeed(device)
        _ensure_ds_comm(deepspeed)
        _ensure_local_rank(device)
        _install_trace_check_switch()
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
            return cls._create_partitioned(module, param_group, device, ds_config)
        if n_zero != len(params):
            raise ValueError(f"{len(params) - n_zero} of {len(params)} parameters are not ZeRO-3 parameters")
        if ds_config:
            log.warning("shardgen: ds_config is ignored for a model that DeepSpeed partitioned already")
        return cls._adopt_partitioned(engine, module, param_group, device)

    @classmethod
    def _create_partitioned(cls, model, param_group, device, ds_config) -> DeepSpeedBackend:
        import deepspeed
        from deepspeed.runtime.config import DeepSpeedConfig
        from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
        from deepspeed.utils.z3_leaf_module import apply_zero_leaf_module_config

        cfg = _lockstep_config(ds_config)
        parsed = DeepSpeedConfig(cfg)
        zc = parsed.zero_config
        dtype = next(iter(model.parameters())).dtype
        if parsed.bfloat16_config.enabled:
            dtype = torch.bfloat16
        elif parsed.float16_config.enabled:
            dtype = torch.float16
        model.to(dtype=dtype)
        model.eval()
        apply_zero_leaf_module_config(model, getattr(zc, "leaf_module", None))
        _mark_moe_leaves(model)
        # Buffers (rotary tables, ...) are not partitioned; parameters move to the device one
        # at a time inside zero.Init.
        for sub in model.modules():
            for key, buf in list(sub._buffers.items()):
                if buf is not None:
                    sub._buffers[key] = buf.to(device)

        deepspeed.zero.Init(
            module=model, data_parallel_group=param_group, config_dict_or_path=cfg, dtype=dtype
        )
        offload_cfg = zc.offload_param
        offload = DeepSpeedZeRoOffload(
            model,
            timers=None,
            ds_config=cfg,
            overlap_comm=zc.overlap_comm if zc.overlap_comm is not None else True,
            prefetch_bucket_size=0,
            max_reuse_distance=0,
            max_live_parameters=zc.max_live_parameters,
            param_persistence_threshold=0,
            model_persistence_threshold=zc.model_persistence_threshold,
            dp_process_group=param_group,
            offload_param_config=offload_cfg,
            zero_quantized_weights=zc.zero_quantized_weights,
            zero_quantized_nontrainable_weights=zc.zero_quantized_nontrainable_weights,
        )
        odev = _enum_str(offload_cfg.device) if offload_cfg is not None else "none"
        log.info(
            "shardgen: partitioned the model at ZeRO stage 3 on a private group (offload_param=%s)", odev
        )
        return cls(
            model, model, device, offload=offload, param_group=param_group, offload_device=odev, created=True
        )

    @classmethod
    def _adopt_partitioned(cls, engine, module, param_group, device) -> DeepSpeedBackend:
        from deepspeed.runtime.zero.partition_parameters import (
            DS_Z3_GATHERED_PARAM_CONTEXT_DEPTH_ATTR,
            ZeroParamStatus,
        )

        params = list(module.parameters())
        new_ranks = _group_ranks(param_group)
        old_groups = {id(p.ds_process_group): p.ds_process_group for p in params}
        for group in old_groups.values():
            if group is param_group:
                continue
            old_ranks = _group_ranks(group)
            if old_ranks != new_ranks:
                raise ValueError(
                    f"the model is partitioned over ranks {old_ranks}, but shardgen's parameter group has "
                    f"ranks {new_ranks}; the shards only line up on the same ranks in the same order "
                    "(partition the model on all ranks, or pass the plain model)"
                )
        if any(
            getattr(p, "ds_zero_param_process_group", None) is not None
            or getattr(p, "ds_secondary_tensor", None) is not None
            for p in params
        ):
            raise ValueError(
                "the model uses hpZ secondary partitions (zero_hpz_partition_size > 1), whose gathers "
                "run on a second group that shardgen cannot move; use zero_hpz_partition_size=1"
            )
        my_rank = dist.get_rank(group=param_group)
        odd = [p.ds_id for p in params if getattr(p, "ds_zero_partition_rank", my_rank) != my_rank]
        if odd:
            raise ValueError(f"parameters {odd[:8]} hold the shard of another rank than {my_rank}")
        busy = [p.ds_id for p in params if p.ds_status == ZeroParamStatus.INFLIGHT]
        if busy:
            raise RuntimeError(
                f"parameters {busy[:8]} have a gather in flight; create the backend between forwards"
            )
        if any(getattr(p, DS_Z3_GATHERED_PARAM_CONTEXT_DEPTH_ATTR, 0) > 0 for p in params):
            raise RuntimeError("a GatheredParameters context is open on this model; exit it first")

        offload = None
        if engine is not None:
            opt = engine.optimizer
            offload = (
                opt if hasattr(opt, "get_param_coordinator") else getattr(opt, "parameter_offload", None)
            )
        if offload is None:
            offload = _find_offload(module)
        if offload is None and hasattr(module, "ds_inflight_param_registry"):
            raise RuntimeError(
                "this module has DeepSpeed ZeRO-3 hooks but shardgen cannot find their coordinator; "
                "pass the DeepSpeedEngine returned by deepspeed.initialize instead of a wrapped module"
            )

        # The user's setup, handed back for training steps inside Engine.paused() (ds_pause.py).
        user_setup = None
        if offload is not None:
            inits = list({id(i): i for i in map(_find_init, params) if i is not None}.values())
            user_setup = ds_pause.capture(offload, params, inits)

        # Local only: back to partitioned state, nothing persistent.
        for p in params:
            p.ds_persist = False
        if offload is not None:
            offload.get_param_coordinator().release_and_reset_all(module)
        else:
            avail = [p for p in params if p.ds_status == ZeroParamStatus.AVAILABLE]
            if avail:
                avail[0].partition(param_list=avail)

        # The move (same ranks, same order: every shard keeps its index).
        inits = {}
        for p in params:
            init = _find_init(p)
            if init is not None:
                inits[id(init)] = init
            p.ds_process_group = param_group
        for init in inits.values():
            init.ds_process_group = param_group

        if module.training:
            log.warning("shardgen: the DeepSpeed model is in training mode (dropout on); call model.eval()")
        new_leaves = _mark_moe_leaves(module)
        if offload is None:
            from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

            offload_dev = "none"
            t = getattr(params[0], "ds_tensor", None)
            if t is not None and t.device.type == "cpu" and device.type != "cpu":
                offload_dev = "cpu"
            offload = DeepSpeedZeRoOffload(
                module,
                timers=None,
                ds_config=None,
                prefetch_bucket_size=0,
                max_reuse_distance=0,
                param_persistence_threshold=0,
                dp_process_group=param_group,
            )
        else:
            if new_leaves:
                # Leaves must be known when hooks are installed (children of a leaf get none).
                offload._remove_module_hooks()
                offload.forward_hooks, offload.backward_hooks = [], []
                offload.setup_zero_stage3_hooks()
            offload_dev = "none"
            od = getattr(offload, "offload_device", None)
            if od is not None:
                offload_dev = _enum_str(od)
        _lockstep_coordinator(offload, module)
        if offload is not None and getattr(offload, "dp_process_group", None) is not None:
            offload.dp_process_group = param_group
        log.info(
            "shardgen: moved the parameter traffic of a user-partitioned ZeRO-3 model to a private group"
        )
        backend = cls(
            module,
            module,
            device,
            offload=offload,
            param_group=param_group,
            offload_device=offload_dev,
            created=False,
        )
        backend._user_setup = user_setup
        return backend

    # ------------------------------------------------------------------ forwards
    def forward(self, **inputs: Any) -> Any:
        with _shardgen_forward():
            return self.module(**inputs)

    def shadow_forward(self) -> None:
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        with _shardgen_forward():
            self.module(input_ids=ids, use_cache=False)

    def gather_all(self) -> None:
        import deepspeed

        if self._gathered_ctx is not None:
            return
        params = list(self.module.parameters())
        ctx = deepspeed.zero.GatheredParameters(params, modifier_rank=None)
        with _shardgen_forward():
            ctx.__enter__()
        for p in params:
            p.ds_active_sub_modules.add(_PIN)
        self._gathered_ctx = ctx
        self.lockstep = False

    def release_all(self) -> None:
        if self._gathered_ctx is None:
            return
        ctx, self._gathered_ctx = self._gathered_ctx, None
        for p in self.module.parameters():
            p.ds_active_sub_modules.discard(_PIN)
        with _shardgen_forward():
            ctx.__exit__(None, None, None)
        self.lockstep = True

    # ------------------------------------------------------------------ training pauses
    _user_setup: ds_pause.ZeroSetup | None = None  # a user-partitioned model's own setup
    _gen_setup: ds_pause.ZeroSetup | None = None  # shardgen's, while a pause holds the user's

    def enter_pause(self) -> None:
        """A model from ``deepspeed.initialize`` gets its groups, coordinator (prefetch, reuse),
        persistence back for training. Not collective (local releases)."""
        if self._user_setup is not None and self._gen_setup is None:
            self._gen_setup = ds_pause.switch(self.offload, self.module, self._user_setup)

    def exit_pause(self) -> None:
        """Back to the lockstep setup (the user's, as training left it, is kept for the next pause)."""
        if self._gen_setup is not None:
            self._user_setup = ds_pause.switch(self.offload, self.module, self._gen_setup)
            self._gen_setup = None

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

    def full_param_bytes(self) -> int:
        return sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in self.module.parameters())

    def describe(self) -> dict[str, str]:
        d = super().describe()
        d["zero_stage"] = "3"
        d["offload_param"] = self.offload_device
        d["param_group_size"] = str(dist.get_world_size(group=self.param_group))
        return d

    def close(self) -> None:
        if self._gathered_ctx is not None:
            # Local: drop the pins and the full copies (no sanity-check all-reduce here).
            ctx, self._gathered_ctx = self._gathered_ctx, None
            params = list(self.module.parameters())
            for p in params:
                p.ds_active_sub_modules.discard(_PIN)
            ctx._partition_params(params, has_been_updated=False)
            from deepspeed.runtime.zero.partition_parameters import (
                DS_Z3_GATHERED_PARAM_CONTEXT_DEPTH_ATTR as attr,
            )

            for p in params:
                if hasattr(p, attr):
                    delattr(p, attr)
            self.lockstep = True
