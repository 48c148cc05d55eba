"""Public home of the rollout names (``shardgen.rollout.sample_seed``); the code lives in
:mod:`shardgen.generation.rollout`."""

from shardgen.generation.rollout import RolloutBatch, rollout, sample_seed

__all__ = ["RolloutBatch", "rollout", "sample_seed"]
