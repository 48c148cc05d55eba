"""shardgen's exceptions. User mistakes are ``ValueError``s; these are the distributed failures."""

from __future__ import annotations


class ShardgenError(RuntimeError):
    """Base class of shardgen's distributed failures."""


class CollectiveDivergenceError(ShardgenError):
    """Ranks issued different collective sequences (found by ``debug_collectives``)."""


class PeerFailedError(ShardgenError):
    """A peer rank's engine raised; the message carries its exception type and text."""


class PeerStalledError(ShardgenError):
    """A peer rank stopped sending heartbeats for longer than ``stall_timeout``."""


class RendezvousTimeoutError(ShardgenError):
    """Some ranks never reached a collective point (construction, close) within the timeout."""


class EngineClosedError(RuntimeError):
    """The engine was used after ``close()``."""
