"""Partition a plain model at ZeRO stage 3 on shardgen's private group.

What ``deepspeed.initialize`` does for a stage-3 model without an optimizer, minus the
engine and its global state: ``zero.Init(module=...)`` then a ``DeepSpeedZeRoOffload`` for
the hooks, with the lockstep settings (docs/DEEPSPEED.md, "Gather order and prefetch").
Also the leaf marking that both ways in share (MoE blocks, an encoder-decoder's cross-attention).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from shardgen.backends.deepspeed.internals import enum_str, init_class
from shardgen.backends.parts import cross_attention_blocks, is_moe_block, outermost
from shardgen.log import get_logger

log = get_logger()
__all__ = ["is_moe_block", "lockstep_config", "mark_leaves", "partition"]

# zero_optimization keys that decide whether the gather sequence depends on history.
LOCKSTEP_ZERO = {
    "stage3_prefetch_bucket_size": 0,
    "stage3_param_persistence_threshold": 0,
    "stage3_max_reuse_distance": 0,
}
_ALIASES = {
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "stage3_max_reuse_distance": "max_reuse_distance",
}


def mark_leaves(model: torch.nn.Module) -> list[str]:
    """Mark MoE blocks (outermost only) and an encoder-decoder's cross-attention modules as
    ZeRO-3 leaf modules; return the newly marked names.

    A leaf gathers its whole subtree in its pre-forward hook, so neither routing nor the cross-
    attention's cached keys and values (its key and value projections run at a request's first
    decoder step only) can change the gathers of a forward."""
    from deepspeed.utils import set_z3_leaf_modules, z3_leaf_module
    from deepspeed.utils.z3_leaf_module import set_z3_leaf_modules_by_name

    before = {id(m) for m in model.modules() if z3_leaf_module(m)}
    blocks = outermost(model, lambda m: z3_leaf_module(m) or is_moe_block(m))  # none inside a leaf
    classes = {type(m): None for _, m in blocks if not z3_leaf_module(m)}
    marked = set_z3_leaf_modules(model, list(classes), raise_if_not_found=False) if classes else []
    cross = [n for n, m in cross_attention_blocks(model) if not z3_leaf_module(m)]
    if cross:
        marked += set_z3_leaf_modules_by_name(model, cross)[0]
    new = [n for n, m in model.named_modules() if m in marked and id(m) not in before]
    if new:
        log.info(
            "shardgen: ZeRO-3 leaf modules (MoE blocks, cross-attention): %s",
            ", ".join(sorted({type(m).__name__ for m in marked})),
        )
    return new


def lockstep_config(ds_config: dict | None) -> dict:
    """The ds_config shardgen partitions with: stage 3, prefetch/persistence/reuse off."""
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
    for key, value in LOCKSTEP_ZERO.items():
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


def partition(model: torch.nn.Module, param_group: Any, device: torch.device, ds_config: dict | None):
    """Partition ``model`` in place; return ``(offload, offload_device)``.

    Collective on ``param_group``: every rank calls it with the same model structure;
    ``zero.Init(module=...)`` broadcasts each weight from the group's first rank.
    """
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.utils.z3_leaf_module import apply_zero_leaf_module_config

    cfg = lockstep_config(ds_config)
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
    mark_leaves(model)
    # Buffers (rotary tables, ...) are not partitioned; parameters move to the device one
    # at a time inside zero.Init.
    for sub in model.modules():
        for key, buf in list(sub._buffers.items()):
            if buf is not None:
                sub._buffers[key] = buf.to(device)

    init_class(deepspeed)(module=model, data_parallel_group=param_group, config_dict_or_path=cfg, dtype=dtype)
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
    odev = enum_str(offload_cfg.device) if offload_cfg is not None else "none"
    log.info("shardgen: partitioned the model at ZeRO stage 3 on a private group (offload_param=%s)", odev)
    return offload, odev
