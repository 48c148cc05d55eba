"""One stdlib logger for shardgen, with the rank in every line; rank 0 prints by default."""

from __future__ import annotations

import logging
import os

_LOGGER_NAME = "shardgen"


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = os.environ.get("RANK", "0")
        return True


def get_logger() -> logging.Logger:
    """The package logger. Rank 0 logs at INFO, other ranks at WARNING (``SHARDGEN_LOG_ALL=1`` for all)."""
    log = logging.getLogger(_LOGGER_NAME)
    if not getattr(log, "_shardgen_configured", False):
        handler = logging.StreamHandler()
        handler.addFilter(_RankFilter())
        handler.setFormatter(logging.Formatter("[shardgen rank %(rank)s] %(levelname)s %(message)s"))
        log.addHandler(handler)
        log.propagate = False
        everyone = os.environ.get("SHARDGEN_LOG_ALL") == "1"
        level = os.environ.get("SHARDGEN_LOG_LEVEL", "INFO").upper()
        log.setLevel(level if (everyone or os.environ.get("RANK", "0") == "0") else "WARNING")
        log._shardgen_configured = True  # type: ignore[attr-defined]
    return log
