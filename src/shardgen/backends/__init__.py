"""Backends: local (no sharding), fsdp2 (PyTorch FSDP2), deepspeed (ZeRO-3)."""

from __future__ import annotations

from typing import Any

import torch

from shardgen.backends.base import Backend
from shardgen.config import BACKEND_NAMES as BACKENDS
from shardgen.config import check_backend_name


def make_backend(
    name: str,
    model: Any,
    *,
    param_group: Any,
    device: torch.device,
    options: dict[str, Any] | None = None,
) -> Backend:
    """Build backend ``name`` around ``model``.

    Collective: every rank of ``param_group`` calls it, in the same order, with the
    same ``name`` (sharding issues collectives on ``param_group``). A model from
    ``Engine.from_pretrained`` arrives already loaded into shards on ``param_group``
    (``shardgen.loading.pretrained.materialize``, called by the engine) and is adopted like a
    model the user sharded/partitioned there.
    """
    options = dict(options or {})
    if name == "local":
        from shardgen.backends.local import LocalBackend

        return LocalBackend.create(model, device=device)
    if name == "fsdp2":
        from shardgen.backends.fsdp2 import FSDP2Backend

        return FSDP2Backend.create(model, param_group=param_group, device=device, **options)
    if name == "deepspeed":
        from shardgen.backends.deepspeed import DeepSpeedBackend

        return DeepSpeedBackend.create(model, param_group=param_group, device=device, **options)
    raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")


__all__ = ["Backend", "BACKENDS", "check_backend_name", "make_backend"]
