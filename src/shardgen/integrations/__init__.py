"""Integrations with training libraries (optional dependencies, imported lazily).

- ``shardgen.integrations.trl``: TRL's ``GRPOTrainer`` generating on a shardgen ``Engine``
  (``pip install 'shardgen[trl]'``).
- ``shardgen.integrations.deepspeed``: ``ShardgenRollout``, DeepSpeed's ``RolloutEngine`` (a
  drop-in for ``HybridEngineRollout``) on a shardgen ``Engine`` (``pip install 'shardgen[deepspeed]'``).
"""
