"""A rank that leaves shardgen's blocks with an exception: its peers learn it at once.

An exception that leaves ``with engine:``, ``paused()`` or the whole process (uncaught) on one
rank means that rank will not run what its peers wait for: the next tick, its part of the
training step, the pause's entry or exit, the closing join. Without a word, the peers would
find out only when their own bound runs out (``stall_timeout`` in ``paused()`` and ``close()``;
the user's process group timeout inside a training step's collectives). So the leaving rank
writes the verdict itself (``verdict.py``: the first verdict stands), naming itself and its
exception in one line; every peer's liveness thread reads it within a heartbeat and fails its
engine with it, so whatever shardgen call the peer waits in (the tick, ``paused()`` entry or
exit, ``close()``) raises ``PeerFailedError`` naming the rank.

A peer blocked inside its own collective (a training step's all-gather or reduce-scatter)
cannot be interrupted by shardgen: that wait is bounded by the process group's timeout, or
ends when the leaving process exits and its connections close (gloo raises at once then).
When that error leaves the peer's ``paused()`` or ``with`` block, it is a symptom: the peer
raises the verdict's ``PeerFailedError`` from it instead, which names the rank that left first.
"""

from __future__ import annotations

from typing import Any

from shardgen.errors import EngineClosedError, ShardgenError
from shardgen.faults import blame
from shardgen.faults.liveness import is_comm_error


def summary(exc: BaseException) -> str:
    """``Type: first line of the message`` (``Type`` alone for an empty one)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def leave(driver: Any, exc: BaseException, where: str, wait: bool = True) -> BaseException:
    """``exc`` is leaving ``where`` on this rank: return what the caller raises instead.

    - shardgen's own errors (a peer's verdict, a bound that ran out) and ``GeneratorExit``: ``exc``;
    - a broken collective: a symptom of a peer that left first. Waits, bounded by
      ``attribution_grace``, for liveness to read the verdict and returns its error; with no
      verdict by then, this rank is the first to know and reports ``exc`` as its own (without
      ``wait``, at exit, nothing is reported: liveness names the cause);
    - anything else is this rank's own failure: it becomes the verdict (unless a peer's came
      first) and fails this rank's engine; ``exc`` is returned, so the user sees their own error.

    User thread (or the interpreter's ``excepthook``). Not collective: a few store operations.
    On one process (no liveness) there is no peer to tell: ``exc``."""
    if isinstance(exc, (GeneratorExit, ShardgenError, EngineClosedError)) or driver.live is None:
        return exc
    shared = driver.shared
    if is_comm_error(exc):
        if shared.failed is None and not wait:
            return exc
        named = blame.attribute(
            exc, lambda: shared.failed, driver.live, driver.timeouts.attribution_grace, lambda: None
        )
        if named is not exc:
            return named
    elif shared.failed is not None:
        return exc
    live = driver.live
    live.report_error(exc, f"{summary(exc)} {where}")
    err = live.verdict.error(driver.rank) if live.verdict is not None else exc
    driver.on_failure(err)  # every open request and wait of this rank ends too
    return exc
