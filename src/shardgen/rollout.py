"""Public home of the rollout names (``shardgen.rollout.sample_seed``); the code lives in
:mod:`shardgen.generation.rollout`."""

from shardgen.generation.rollout import RolloutBatch, concat, rollout, rollout_iter, sample_seed

__all__ = ["RolloutBatch", "concat", "rollout", "rollout_iter", "sample_seed"]
