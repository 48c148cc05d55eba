"""What the ``Engine`` constructor builds around its driver: the engine's config, resolved against
the model and checked (local, before any collective), and the backend that shards the model
(collective on the parameter group)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardgen import numerics
from shardgen.backends import Backend, check_backend_name, make_backend
from shardgen.backends.kinds import backend_for
from shardgen.backends.towers import encoder_decoder_problem
from shardgen.config import EngineConfig, resolved_speculate
from shardgen.loading.pretrained import materialize, source_of


def engine_config(model: Any, config: EngineConfig | None, overrides: dict[str, Any]) -> EngineConfig:
    """``config`` (default: ``EngineConfig()``) with ``overrides`` on top, its backend resolved for
    ``model`` (None: the model's own), validated, ``speculate`` set where unset; ``ValueError``
    for a setting or a model the engine cannot serve. Local, before any collective: every rank
    raises alike."""
    cfg = (config if config is not None else EngineConfig()).replace(**overrides)
    if cfg.backend is not None:
        check_backend_name(cfg.backend)  # a name first, then what the model can run on
    if source_of(model) is None:  # a from_pretrained skeleton runs on any backend
        picked = backend_for(cfg.backend, model, distributed=dist.is_initialized())
        cfg = cfg.replace(backend=picked)  # None: the model's own
    elif cfg.backend is None:
        cfg = cfg.replace(backend="fsdp2" if dist.is_initialized() else "local")
    cfg.validate()
    cfg = resolved_speculate(cfg)  # (from numerics, which ranks may set apart: on/off is agreed later)
    check_backend_name(cfg.backend)  # before any collective
    problem = encoder_decoder_problem(getattr(model, "module", model))
    if problem is None and cfg.numerics == "invariant":
        why = numerics.unsupported(getattr(model, "module", model))
        problem = None if why is None else f"numerics='invariant' cannot serve this model: {why}"
    if problem is not None:
        raise ValueError(problem)
    return cfg


def build_backend(cfg: EngineConfig, model: Any, *, param_group: Any, device: torch.device) -> Backend:
    """The engine's backend around ``model``, sharded on ``param_group``; a ``from_pretrained``
    skeleton is first loaded straight into shards there (``loading.pretrained.materialize``).

    Collective on ``param_group``: every rank of the engine calls it from the constructor, in
    the same order, with the same settings (see ``make_backend``)."""
    options: dict = {"chunk_bytes": None if cfg.chunk_mb is None else int(cfg.chunk_mb * 2**20)}
    if cfg.backend == "deepspeed":
        mb = cfg.bucket_mb
        options.update(ds_config=cfg.ds_config, bucket_bytes=None if mb is None else int(mb * 2**20))
    if source_of(model) is not None:
        model = materialize(cfg.backend, model, param_group=param_group, device=device, options=options)
    backend = make_backend(cfg.backend, model, param_group=param_group, device=device, options=options)
    if cfg.debug_collectives:
        backend.instrument()
    return backend
