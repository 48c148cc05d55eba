"""shardgen: deadlock-free text generation with ZeRO-3 sharded models (FSDP2, DeepSpeed).

import shardgen
shardgen.init()
with shardgen.Engine.from_pretrained(path, backend="fsdp2") as engine:
    out = engine.generate(["a prompt"], max_new_tokens=32)
"""

from .comm import init
from .config import EngineConfig, SamplingParams
from .engine import Engine, EngineStats
from .errors import (
    CollectiveDivergenceError,
    EngineClosedError,
    PeerFailedError,
    PeerStalledError,
    RendezvousTimeoutError,
    ShardgenError,
)
from .requests import Completion
from .rollout import RolloutBatch

__version__ = "0.1.0"

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
