"""shardgen: deadlock-free text generation with ZeRO-3 sharded models (FSDP2, DeepSpeed).

import shardgen
shardgen.init()
with shardgen.Engine.from_pretrained(path, backend="fsdp2") as engine:
    out = engine.generate(["a prompt"], max_new_tokens=32)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names below, for type checkers; at run time they load on first use
    from shardgen.config import EngineConfig, SamplingParams
    from shardgen.core.comm import init
    from shardgen.core.engine import Engine, EngineStats
    from shardgen.errors import (
        CollectiveDivergenceError,
        EngineClosedError,
        PeerFailedError,
        PeerStalledError,
        RendezvousTimeoutError,
        ShardgenError,
    )
    from shardgen.generation.requests import Completion
    from shardgen.rollout import RolloutBatch

__version__ = "0.1.0"

# Public name -> the module that defines it. Loaded on first access (PEP 562), so that the
# ``shardgen`` command's launcher, its --help and its input checks do not import torch and
# transformers (seconds of CPU per process) before they need them.
_EXPORTS = {
    "EngineConfig": "shardgen.config",
    "SamplingParams": "shardgen.config",
    "init": "shardgen.core.comm",
    "Engine": "shardgen.core.engine",
    "EngineStats": "shardgen.core.engine",
    "CollectiveDivergenceError": "shardgen.errors",
    "EngineClosedError": "shardgen.errors",
    "PeerFailedError": "shardgen.errors",
    "PeerStalledError": "shardgen.errors",
    "RendezvousTimeoutError": "shardgen.errors",
    "ShardgenError": "shardgen.errors",
    "Completion": "shardgen.generation.requests",
    "RolloutBatch": "shardgen.rollout",
}

__all__ = [
    "CollectiveDivergenceError",
    "Completion",
    "Engine",
    "EngineClosedError",
    "EngineConfig",
    "EngineStats",
    "PeerFailedError",
    "PeerStalledError",
    "RendezvousTimeoutError",
    "RolloutBatch",
    "SamplingParams",
    "ShardgenError",
    "init",
]
assert sorted(__all__) == sorted(_EXPORTS)


#: Public submodules reached as attributes (``shardgen.rollout.sample_seed``, ``shardgen.toy``).
_SUBMODULES = ("rollout", "toy", "integrations")


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"shardgen.{name}")  # binds the attribute itself
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shardgen' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, *_SUBMODULES})
