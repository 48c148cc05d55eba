"""One stdlib logger for shardgen, with the rank in every line; what it prints and where.

The logger is ``logging.getLogger("shardgen")``. Its level: a level you set on it yourself
(``logging.getLogger("shardgen").setLevel(logging.INFO)``), else ``SHARDGEN_LOG_LEVEL``
(``debug``, ``info``, ``warning``, ``error``, ``critical``), else ``warning``, as Hugging Face
libraries do; the CLI's ``--log-level`` and ``--quiet`` set it for every rank. Rank 0 prints at
that level; the other ranks print warnings and errors only (``SHARDGEN_LOG_ALL=1``: every rank
at that level).

Third-party warnings that shardgen's own calls trigger (torch 2.13 deprecates
``all_gather_into_tensor``, which DeepSpeed's gathers call) are silenced where shardgen makes
those calls (:func:`quiet_deprecated_gathers`), and nowhere else: the same warning from your
own training step still shows.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import warnings
from collections.abc import Iterator

_LOGGER_NAME = "shardgen"
LEVELS = ("debug", "info", "warning", "error", "critical")
DEFAULT_LEVEL = "warning"


class _RankFilter(logging.Filter):
    """Put the rank in the record; on ranks other than 0, pass warnings and errors only."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = os.environ.get("RANK", "0")
        if record.levelno >= logging.WARNING or record.rank == "0":
            return True
        return os.environ.get("SHARDGEN_LOG_ALL") == "1"


def _env_level() -> tuple[int, str | None]:
    """The level ``SHARDGEN_LOG_LEVEL`` names, and a complaint when it names none."""
    value = os.environ.get("SHARDGEN_LOG_LEVEL", "").strip().lower()
    if not value:
        return getattr(logging, DEFAULT_LEVEL.upper()), None
    if value not in LEVELS:
        return getattr(logging, DEFAULT_LEVEL.upper()), (
            f"SHARDGEN_LOG_LEVEL={value!r} is not a level (one of {', '.join(LEVELS)}); "
            f"logging at {DEFAULT_LEVEL}"
        )
    return getattr(logging, value.upper()), None


def get_logger() -> logging.Logger:
    """The package logger (see the module docstring for its level and which ranks print)."""
    log = logging.getLogger(_LOGGER_NAME)
    if not getattr(log, "_shardgen_configured", False):
        handler = logging.StreamHandler()
        handler.addFilter(_RankFilter())
        handler.setFormatter(logging.Formatter("[shardgen rank %(rank)s] %(levelname)s %(message)s"))
        log.addHandler(handler)
        log.propagate = False
        level, complaint = _env_level()
        if log.level == logging.NOTSET:  # a level the user set before shardgen's import wins
            log.setLevel(level)
        log._shardgen_configured = True  # type: ignore[attr-defined]
        if complaint:
            log.warning("%s", complaint)
    return log


def set_level(level: str) -> None:
    """Log at ``level`` (one of ``LEVELS``) in this process and in the ranks it launches from now
    on (through ``SHARDGEN_LOG_LEVEL``). Raises ``ValueError`` on an unknown level."""
    name = str(level).strip().lower()
    if name not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {level!r}")
    os.environ["SHARDGEN_LOG_LEVEL"] = name
    get_logger().setLevel(getattr(logging, name.upper()))


# ------------------------------------------------------------------ warnings at shardgen's calls

_tls = threading.local()


class _InShardgenCall:
    """The message pattern of a warnings filter that matches only inside
    :func:`quiet_deprecated_gathers`, in the thread that entered it.

    Why not ``warnings.catch_warnings()`` around each call: before Python 3.14 it swaps the
    process-wide filter list (not thread-safe: a user thread's filters set meanwhile are lost),
    and every swap resets each "shown once" registry, so a warning that user code triggers
    every step would print again after each of shardgen's forwards. This filter is installed
    once and costs a thread-local read per warning.
    """

    def __init__(self, pattern: str) -> None:
        self._re = re.compile(pattern)

    def match(self, text: str) -> re.Match | None:
        return self._re.match(text) if getattr(_tls, "depth", 0) else None

    def __repr__(self) -> str:  # as warnings.filters shows it
        return f"<inside shardgen's calls only: {self._re.pattern!r}>"


# torch 2.13: "`torch.distributed.all_gather_into_tensor` is deprecated. Please use
# `torch.distributed.all_gather_single` instead." (DeepSpeed 0.19.8 gathers through it.)
_GATHER_FILTER = (
    "ignore",
    _InShardgenCall(r"`torch\.distributed\.(all_gather_into_tensor|_all_gather_base)` is"),
    FutureWarning,
    None,
    0,
)


@contextlib.contextmanager
def quiet_deprecated_gathers() -> Iterator[None]:
    """Around a call of shardgen's that makes a library gather through a deprecated torch
    collective: that deprecation warning is not shown (in this thread, inside the block only)."""
    filters = warnings.filters
    if not filters or filters[0] is not _GATHER_FILTER:  # first use, or filters added (or dropped) since
        with contextlib.suppress(ValueError):
            filters.remove(_GATHER_FILTER)
        filters.insert(0, _GATHER_FILTER)  # first: a later simplefilter("always"/"error") must not win here
    _tls.depth = getattr(_tls, "depth", 0) + 1
    try:
        yield
    finally:
        _tls.depth -= 1
