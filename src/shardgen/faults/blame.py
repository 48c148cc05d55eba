"""Naming the rank to blame on this rank: its driver's own failure, and a user thread's bounded
wait that ran out.

- ``attribute``: the driver thread failed. A broken collective is a symptom of a peer that died,
  stalled or left; the driver waits (``attribution_grace``) for liveness to name the cause.
- ``check_wait``: ``close()`` or ``paused()`` waited its bound with no forward anywhere: the ranks
  absent from a column of the last agreed tick are named (and, with ``verdict``, blamed: every
  rank fails, naming the first).

Not collective: a few store operations through ``Liveness`` at most.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from shardgen.errors import PeerFailedError, PeerStalledError, RendezvousTimeoutError
from shardgen.faults.liveness import Liveness, is_comm_error
from shardgen.timeouts import Timeouts


def attribute(
    err: BaseException,
    failed: Callable[[], BaseException | None],
    live: Liveness | None,
    grace: float,
    waiting: Callable[[], None],
) -> BaseException:
    """Blame the right rank for ``err``, the driver's own failure: a broken collective is a symptom;
    wait up to ``grace`` s for liveness to name the cause. ``failed``: the engine's first failure
    so far (a peer's verdict, once liveness read it); ``waiting`` is called before that wait (the
    driver's phase says it). Driver thread; not collective."""
    first = failed()
    if first is not None:
        return first
    if live is None or isinstance(err, (PeerFailedError, PeerStalledError)):
        return err
    if not is_comm_error(err):
        return err
    waiting()
    deadline = time.monotonic() + grace
    while failed() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    first = failed()
    return first if first is not None else err


@dataclass(frozen=True)
class Seen:
    """What a driver last saw, as a user thread's wait reads it (snapshots): when a forward and a
    tick were last agreed (``time.monotonic()``), its phase, and the global ranks the last agreed
    tick names absent in the column the wait is about."""

    last_forward_t: float
    last_tick_t: float
    phase: str
    absent: list[int]


def check_wait(
    seen: Seen,
    called: float,
    limit: float,
    what: str,
    never: str,
    *,
    rank: int,
    live: Liveness | None,
    timeouts: Timeouts,
    idle_sleep_max: float,
    verdict: bool = True,
) -> None:
    """Raise ``RendezvousTimeoutError`` naming ``seen.absent`` once ``what`` has waited ``limit`` s
    with no forward anywhere. Idle time before the call (``called``) does not count. User thread
    (``close()``, ``paused()``), on the driver's snapshots; not collective.

    With ``verdict`` the absent rank becomes the engine's verdict (every rank fails, naming
    it); without, only this call raises and the engine goes on (a pause nobody joined)."""
    now = time.monotonic()
    if now - max(called, seen.last_forward_t) <= limit:
        return
    # The absent ranks come from the last agreed tick. While ticks flow, every rank is alive
    # and that tick is fresh. When they have stopped (a peer stopped, died or is stuck in its
    # driver: the tick and the gathers are collectives), the last tick is stale and would
    # name a rank that has since called close(): the cause is liveness's to name, within a
    # stall verdict plus the heartbeats that carry it. Only past that does this call raise.
    fresh = timeouts.heartbeat * 3 + idle_sleep_max
    if live is not None and now - seen.last_tick_t > fresh:
        since = now - max(called, seen.last_forward_t, seen.last_tick_t)
        if since <= limit + timeouts.attribution_grace:
            return
        raise RendezvousTimeoutError(
            f"rank {rank}: {what} waited {limit:g}s with no work left, and no tick has been "
            f"agreed for {now - seen.last_tick_t:.1f}s (phase {seen.phase}); liveness named no peer"
        )
    absent = seen.absent
    msg = f"rank {rank}: {what} waited {limit:g}s with no work left; rank(s) {absent} never {never}"
    if live is None or not absent or not verdict:
        raise RendezvousTimeoutError(msg)
    raise live.blame_absent(absent[0], msg)  # the verdict: unless a peer's failure came first
