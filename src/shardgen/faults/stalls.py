"""Naming a driver that stopped reaching the tick while its heartbeat still runs.

A heartbeat proves the liveness thread runs, not the driver. Each heartbeat also
carries the driver's position in the collective sequence every rank issues in the
same order (``core/protocol.py``): the tick it is in and how many parameter gathers it
has entered (``GatherCounter``). When no rank has moved for ``stall_timeout`` and
positions differ, the rank furthest behind is the one the others wait for:

- fewest gathers first: a rank that skipped the gathers of a forward and went on to
  the next tick is behind, although its tick count is ahead;
- then the fewest ticks entered: a driver deadlocked between collectives.

Not a stall: a rank inside ``paused()`` (a training step may take long; its peers
wait on the store, not in a collective), a rank still moving (a long forward counts
its gathers and forwards), idle ranks (they keep ticking), closed or departed ranks.
Pure functions over heartbeat records, so the rule is unit-tested without processes.
"""

from __future__ import annotations

from typing import Any

import torch


class GatherCounter:
    """Counts the parameter gathers this rank's forwards enter (a pre-forward hook on each
    sharded unit, run before the backend's own gather hook). Counts only while forwards
    are in lockstep: with gathered weights ranks forward independently."""

    def __init__(self, backend: Any) -> None:
        self.count = 0
        self._backend = backend
        units = backend.units()
        self._hooks = [u.register_forward_pre_hook(self._entered, prepend=True) for u in units]

    def _entered(self, _module: torch.nn.Module, _args: Any) -> None:
        if self._backend.lockstep:
            self.count += 1

    def remove(self) -> None:
        """Take the hooks off the units (at close). A model the user sharded outlives the engine:
        a hook left on it would keep the backend, its groups and their gloo threads alive, and
        run on every later forward, one more per engine opened. Idempotent."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


#: Phases in which a rank may legitimately sit still while its peers wait (or no one waits).
EXEMPT = ("paused", "closed", "failed")


def position(rec: dict[str, Any]) -> tuple[int, int]:
    """(gathers entered, ticks entered): the driver's place in the common collective sequence.
    ``tick`` counts completed ticks; phase ``tick`` means it is inside the next one."""
    return int(rec.get("gathers", 0)), int(rec["tick"]) + int(rec.get("phase") == "tick")


def progress_key(rec: dict[str, Any]) -> tuple[Any, ...]:
    """Changes whenever the driver does anything observable (a tick, a gather, a forward)."""
    return (rec.get("tick"), rec.get("phase"), rec.get("gathers"), rec.get("forwards"))


def find_laggard(
    records: dict[int, dict[str, Any]], frozen_s: dict[int, float], stall_timeout: float
) -> tuple[int, list[int]] | None:
    """(laggard, ranks ahead of it) when every active rank has been frozen for
    ``stall_timeout`` and their positions differ; else None.

    ``records``: the latest heartbeat of every rank (the observer's own included);
    ``frozen_s``: seconds since each rank's ``progress_key`` last changed, on the observer's clock.
    """
    phases = {r: str(rec.get("phase", "")) for r, rec in records.items()}
    if any(p == "paused" for p in phases.values()):
        return None  # a pause may hold peers for a whole training step
    active = [r for r, p in phases.items() if p not in EXEMPT and not p.startswith("left")]
    if len(active) < 2 or any(frozen_s.get(r, 0.0) <= stall_timeout for r in active):
        return None
    pos = {r: position(records[r]) for r in active}
    if len(set(pos.values())) == 1:
        return None  # all in the same collective: nothing to tell them apart
    laggard = min(active, key=lambda r: (pos[r], r))
    ahead = [r for r in active if pos[r] != pos[laggard]]
    return laggard, ahead
