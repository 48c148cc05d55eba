"""shardgen: deadlock-free text generation with ZeRO-3 sharded models (FSDP2, DeepSpeed).

import shardgen
shardgen.init()
with shardgen.Engine.from_pretrained(path, backend="fsdp2") as engine:
    out = engine.generate(["a prompt"], max_new_tokens=32)
"""

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
from shardgen.rollout import RolloutBatch  # binds shardgen.rollout (public: shardgen.rollout.sample_seed)

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
    "ScoreBatch",
    "ShardgenError",
    "init",
]
