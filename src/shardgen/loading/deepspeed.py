"""DeepSpeed ZeRO-3 loading: build under ``zero.Init`` on shardgen's group, read each rank's partition.

``deepspeed.zero.Init`` partitions every parameter as soon as its module's ``__init__``
returns; transformers loads this way when an ``HfDeepSpeedConfig`` is alive (then fills
the partitions module by module through ``GatheredParameters(modifier_rank=0)``, i.e. a
full module on every rank and the whole checkpoint read by rank 0). Here:

1. The model is built from its config under ``zero.Init(data_parallel_group=param_group,
   config=<the backend's lockstep config>, dtype=...)``, with weight init off and
   transformers' ``prevent_arange_dtype_change`` (rotary tables keep their fp32
   ``arange``). With ``offload_param: {device: cpu}`` in ``ds_config`` the partitions are
   allocated on the CPU.
2. ``zero.Init`` broadcasts every new parameter from rank 0 before partitioning (so that
   random inits agree): a full tensor per parameter on every rank and one collective per
   parameter. The weights are read from the checkpoint next, so ``internals.load_init_class`` skips
   that broadcast: each parameter is allocated uninitialised, partitioned (this rank's
   slice copied into its partition: the rest of the tensor is never touched, so never
   resident) and freed.
3. Each rank reads its flat range ``[r * P, r * P + P)`` (``P = ceil(numel / N)``, the
   ZeRO partition; the last ones padded) of every parameter straight into ``ds_tensor``
   (``checkpoint.py``); persistent buffers (replicated) are read whole.

The result is a model partitioned on ``param_group`` with no DeepSpeed engine; the
deepspeed backend adopts it (installs the hooks, lockstep coordinator) without moving
anything. Collectives: none (step 2 removed the only ones); every rank of
``param_group`` calls :func:`load_deepspeed` from the engine constructor, same model.
DeepSpeed 0.19.8: the ``zero.Init`` subclass and the method it overrides are in
``backends/deepspeed/internals.py`` (``load_init_class``, over ``init_class``: ``zero.Init``
taking the dtype it is given on every accelerator).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardgen.loading.checkpoint import Checkpoint, checkpoint_names
from shardgen.log import get_logger

log = get_logger()


def load_deepspeed(
    model: nn.Module, src: Any, *, param_group: Any, device: torch.device, ds_config: dict | None
) -> nn.Module:
    """Rebuild the skeleton ``model`` partitioned on ``param_group`` and read this rank's partitions.

    Every rank of ``param_group`` calls it (engine constructor), same model; no collective.
    """
    import torch.distributed as dist
    from transformers.initialization import no_init_weights
    from transformers.integrations.deepspeed import prevent_arange_dtype_change

    from shardgen.backends.deepspeed.internals import (
        ensure_ds_comm,
        ensure_local_rank,
        import_deepspeed,
        load_init_class,
    )
    from shardgen.backends.deepspeed.partition import lockstep_config
    from shardgen.loading.auto import auto_class

    # import_deepspeed first: it selects DeepSpeed's CPU accelerator before any deepspeed
    # module is imported, which would otherwise pick one itself and log a line on every rank.
    deepspeed = import_deepspeed(device)
    from deepspeed.runtime.config import DeepSpeedConfig

    ensure_ds_comm(deepspeed)
    ensure_local_rank(device)
    cfg = lockstep_config(ds_config)
    parsed = DeepSpeedConfig(cfg)
    dtype = src.dtype
    for enabled, want in (
        (parsed.bfloat16_config.enabled, torch.bfloat16),
        (parsed.float16_config.enabled, torch.float16),
    ):
        if enabled and dtype != want:
            log.warning("shardgen: ds_config enables %s: loading in it instead of %s", want, dtype)
            dtype = want
    init = load_init_class(deepspeed)
    with no_init_weights(), prevent_arange_dtype_change():
        with init(data_parallel_group=param_group, config_dict_or_path=cfg, dtype=dtype):
            built = auto_class(model.config).from_config(model.config, dtype=dtype)
            built.tie_weights()  # part of init_weights in transformers 5, which no_init_weights skips
    built.eval()
    built.generation_config = model.generation_config
    built._shardgen_sharded = True  # partitioned by shardgen: its embeddings / head may be chunked
    rank = dist.get_rank(param_group)
    with Checkpoint(src.path, src.computed) as ckpt, torch.no_grad():
        for key, tensor in checkpoint_names(built, ckpt).values():
            if hasattr(tensor, "ds_id"):
                ckpt.check_shape(key, tensor.ds_shape)
                part = tensor.ds_tensor
                size = part.ds_numel
                count = max(0, min(size, tensor.ds_numel - rank * size))
                ckpt.read_flat(key, rank * size, part.narrow(0, 0, count))
            else:  # a persistent buffer: replicated, small
                ckpt.check_shape(key, tensor.shape)
                ckpt.read_flat(key, 0, tensor)
    return built
