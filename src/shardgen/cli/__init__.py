"""The ``shardgen`` command (``command``), ``shardgen run`` (``run``), ``shardgen demo`` (``demo``)."""

from shardgen.cli.command import main

__all__ = ["main"]
