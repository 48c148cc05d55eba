"""DeepSpeed's comm layer started without the CPU shared-memory op that shardgen never calls."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator


@contextlib.contextmanager
def no_shm_op() -> Iterator[None]:
    """DeepSpeed's comm layer without its CPU shared-memory all-reduce op, while shardgen starts it.

    On the CPU accelerator, ``TorchBackend.__init__`` JIT-builds ``deepspeed_shm_comm`` (a C++
    op: about 30 s on 2 cores, then a ninja check on every start), used only by
    ``inference_all_reduce`` (DeepSpeed's tensor-parallel inference, ``module_inject``), which a
    ZeRO-3 model never calls; without the op that call falls back to the process group's
    all-reduce. A world whose comm layer the user started (``deepspeed.initialize``) keeps its own.
    DeepSpeed 0.19.8: ``deepspeed.comm.torch.build_shm_op``.
    """
    try:
        ds_torch = importlib.import_module("deepspeed.comm.torch")  # not deepspeed.comm's `torch`
    except ImportError:  # pragma: no cover - another DeepSpeed layout: build as it does
        yield
        return
    build = getattr(ds_torch, "build_shm_op", None)
    if build is None:  # pragma: no cover
        yield
        return
    ds_torch.build_shm_op = lambda: None
    try:
        yield
    finally:
        ds_torch.build_shm_op = build
