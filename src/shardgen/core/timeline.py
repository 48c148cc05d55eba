"""What each rank's driver did over time: ``(t0, t1, kind)`` spans (drawn by :mod:`shardgen.bench.plot`).

Recording is off by default (``EngineConfig(timeline=True)`` turns it on); when on, the driver
appends one tuple per tick phase (a list append: no locks, no I/O), and ``engine.timeline()``
returns the spans, in seconds on this process's ``time.perf_counter()`` clock. Spans of
different ranks are put on one axis by subtracting each rank's own start time, which is
taken right after a collective, so the ranks' origins agree to within that collective's skew.

Kinds: ``prefill``, ``refill`` (a prefill joining a running batch), ``decode`` and ``score`` (a
forward of ``engine.score``): real forwards; ``shadow`` (a forward that only joins the peers'
parameter collectives),
``gather``/``release`` (whole-model gathers of ``gather='once'``), ``tick`` (the tick's
all-reduce: where a rank waits for slower peers), ``idle`` (nobody has work) and ``paused``.
Per-layer gathers happen inside forwards and are not separate spans.
"""

from __future__ import annotations

import time

KINDS = ("prefill", "refill", "decode", "score", "shadow", "gather", "release", "tick", "idle", "paused")
Span = tuple[float, float, str]


class Timeline:
    """One rank's spans. ``add`` is a no-op unless enabled; owned by the thread that records."""

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self.spans: list[Span] = []

    def add(self, t0: float, t1: float, kind: str) -> None:
        if not self.enabled:
            return
        spans = self.spans
        if spans and spans[-1][2] == kind and t0 - spans[-1][1] < 1e-4:
            spans[-1] = (spans[-1][0], t1, kind)  # one span for a run of same-kind ticks (idle)
        else:
            spans.append((t0, t1, kind))

    def since(self, t0: float, kind: str) -> float:
        """Record ``[t0, now)`` as ``kind``; return now (the next span's start)."""
        t1 = time.perf_counter()
        self.add(t0, t1, kind)
        return t1


def totals(spans: list[Span]) -> dict[str, float]:
    """Seconds per kind."""
    out: dict[str, float] = {}
    for t0, t1, kind in spans:
        out[kind] = out.get(kind, 0.0) + (t1 - t0)
    return out
