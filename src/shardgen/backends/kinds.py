"""What a model handed to the engine is, and which backends can run it.

Checked at construction, before any collective, so that a mismatch (a ``DeepSpeedEngine`` given
``backend="fsdp2"``) is a ``ValueError`` naming both instead of a failure deep in the first
forward; ``backend=None`` picks the backend from the model. Local, no collective.
"""

from __future__ import annotations

import sys
from typing import Any

#: The kinds of model, as messages name them, and the backends that run each (the first: the
#: one ``backend=None`` picks).
DEEPSPEED_ENGINE = "a DeepSpeedEngine (deepspeed.initialize)"
ZERO3_MODULE = "a ZeRO-3-partitioned module (zero.Init / HfDeepSpeedConfig)"
FSDP2_MODULE = "a module sharded with fully_shard (FSDP2)"
PLAIN = "a plain (unsharded) module"
RUNS_ON: dict[str, tuple[str, ...]] = {
    DEEPSPEED_ENGINE: ("deepspeed",),
    ZERO3_MODULE: ("deepspeed",),
    FSDP2_MODULE: ("fsdp2",),
    PLAIN: ("fsdp2", "deepspeed", "local"),
}


def model_kind(model: Any) -> str:
    """One of the kinds above. Imports neither framework: a DeepSpeed object exists only once
    ``deepspeed`` was imported, an FSDP2 module only once ``fully_shard`` ran."""
    ds_engine = _deepspeed_engine_class()
    if ds_engine is not None and isinstance(model, ds_engine):
        return DEEPSPEED_ENGINE
    params = getattr(model, "parameters", None)
    if callable(params) and any(hasattr(p, "ds_id") for p in params()):
        return ZERO3_MODULE
    from torch.distributed.fsdp import FSDPModule

    modules = getattr(model, "modules", None)
    if callable(modules) and any(isinstance(m, FSDPModule) for m in modules()):
        return FSDP2_MODULE
    return PLAIN


def backend_for(name: str | None, model: Any, *, distributed: bool = True) -> str:
    """The backend to run ``model`` with: ``name``, checked against what the model is, or for
    None the model's own (a plain module: ``fsdp2``, or ``local`` without a process group,
    ``distributed=False``). ``ValueError`` on a mismatch, naming the model's kind and the backend."""
    kind = model_kind(model)
    runs_on = RUNS_ON[kind]
    if name is None:
        return runs_on[0] if distributed or kind != PLAIN else "local"
    if name not in runs_on:
        choices = " or ".join(repr(b) for b in runs_on)
        raise ValueError(
            f"backend={name!r} cannot run the model given: it is {kind}, which runs on backend={choices} "
            f"(or pass backend=None to pick it from the model)"
        )
    return name


def _deepspeed_engine_class() -> type | None:
    if "deepspeed" not in sys.modules:
        return None
    try:
        from deepspeed.runtime.engine import DeepSpeedEngine
    except ImportError:  # a partial or broken install: nothing of it can be in use
        return None
    return DeepSpeedEngine
