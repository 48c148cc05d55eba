"""Batch-invariant numerics: under the switch, a row's result depends on that row alone.

``EngineConfig(numerics="invariant")`` runs the engine's forwards this way; a trainer wraps
its own forward in ``invariant_numerics()``. See ``ops`` for how, ``mode`` for the switch.
"""

from shardgen.numerics.mode import NUMERICS, InvariantMode, invariant_numerics, unsupported

__all__ = ["NUMERICS", "InvariantMode", "invariant_numerics", "unsupported"]
