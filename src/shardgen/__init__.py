"""shardgen: deadlock-free text generation with ZeRO-3 sharded models (FSDP2, DeepSpeed).

import shardgen
shardgen.init()
with shardgen.Engine.from_pretrained(path, backend="fsdp2") as engine:
    out = engine.generate(["a prompt"], max_new_tokens=32)

The names below are imported at their first use (PEP 562), so a process that needs none of the
engine (the ``shardgen`` command's parent, its launcher) does not import torch and transformers
for them: each is 1-2 s of CPU per process.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The exit guard (an atexit hook, core/process.py) is registered by ``import shardgen`` itself, as
# a program's own last collectives need it whether or not it ever opens an engine. Stdlib only:
# no torch is imported for it.
from shardgen.core import process as _process  # noqa: F401

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "CollectiveDivergenceError": "shardgen.errors",
    "Completion": "shardgen.generation.requests",
    "Engine": "shardgen.core.engine",
    "EngineClosedError": "shardgen.errors",
    "EngineConfig": "shardgen.config",
    "EngineStats": "shardgen.core.engine",
    "PeerFailedError": "shardgen.errors",
    "PeerStalledError": "shardgen.errors",
    "RendezvousTimeoutError": "shardgen.errors",
    "RolloutBatch": "shardgen.rollout",
    "SamplingParams": "shardgen.config",
    "ScoreBatch": "shardgen.generation.score",
    "ShardgenError": "shardgen.errors",
    "init": "shardgen.core.comm",
    "invariant_numerics": "shardgen.numerics.mode",
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
    "ScoreBatch",
    "ShardgenError",
    "init",
    "invariant_numerics",
]
assert sorted(__all__) == sorted(_EXPORTS)

if TYPE_CHECKING:
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
    from shardgen.generation.score import ScoreBatch
    from shardgen.numerics.mode import invariant_numerics
    from shardgen.rollout import RolloutBatch


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        if name == "rollout":  # the public submodule (shardgen.rollout.sample_seed)
            return importlib.import_module("shardgen.rollout")
        raise AttributeError(f"module 'shardgen' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # found once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS, "rollout"])
