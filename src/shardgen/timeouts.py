"""Every wait of an engine, derived in one place from ``stall_timeout`` and ``init_timeout``.

``derive()`` is the only function that turns the two user settings into the numbers the
engine, the driver, liveness and the process groups wait with; they take their value from
the ``Timeouts`` it returns and never read one back from another object.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Timeouts:
    """The waits of one engine (seconds). Built by ``derive()`` only."""

    arrival: float
    """The collective constructor waits this long for every rank before naming the absent ones."""
    heartbeat: float
    """Liveness writes a heartbeat and reads the peers' this often."""
    stall: float
    """A peer whose heartbeat has not changed for this long is stalled; a driver that has not moved
    for this long while its peers wait ahead of it is stuck; store calls blocked this long mean
    the store's host (rank 0) is stopped."""
    store_call: float
    """Liveness's own store connection gives up a get/wait after this long."""
    store_lost: float
    """Store calls failing (connection refused) this long mean the store's host (rank 0) is gone."""
    verdict_linger: float
    """Rank 0, the store's host, waits at most this long at exit for its peers to read the verdict."""
    attribution_grace: float
    """A driver whose collective broke waits this long for liveness to name the rank that caused it:
    longer than a stall verdict plus the heartbeats that carry it."""
    close: float
    """Default bound of ``close()`` with no forward anywhere before it names the ranks that never closed."""
    paused: float
    """Bound of ``paused()`` with no forward anywhere before it names the ranks that never entered."""
    param_group: float
    """Backstop timeout of the parameter group: a gather stuck this long raises even without liveness."""
    control_group: float
    """Backstop timeout of the control group: the tick's all-gather waits in short slices, and the
    pause waits on the store, so only a lost peer can reach it; generous, since idle ranks tick."""


def derive(stall_timeout: float, init_timeout: float) -> Timeouts:
    """The engine's waits from its two settings (both > 0, checked by ``EngineConfig.validate``)."""
    heartbeat = min(1.0, max(0.05, stall_timeout / 10))
    return Timeouts(
        arrival=init_timeout,
        heartbeat=heartbeat,
        stall=stall_timeout,
        store_call=max(0.5, min(stall_timeout / 2, 5.0)),
        store_lost=min(stall_timeout, max(1.0, 3 * heartbeat)),
        verdict_linger=max(2.0, 3 * heartbeat + 1.0),
        attribution_grace=stall_timeout + 2 * heartbeat,
        close=stall_timeout,
        paused=stall_timeout,
        param_group=stall_timeout + 30.0,
        control_group=max(3600.0, 10 * stall_timeout),
    )
